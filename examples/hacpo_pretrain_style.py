"""HACPO training with a model provider of your own, in the style of Megatron's pretrain_gpt.py.

    python -m hacpo_megatron.launch --entry examples/hacpo_pretrain_style.py [--config FILE] [--set KEY=VALUE ...]
    torchrun --nproc_per_node=N examples/hacpo_pretrain_style.py [--config FILE] [...]      # on a cluster

The package's own program (`torchrun -m hacpo_megatron.entry`, what `python -m hacpo_megatron.launch` starts by
default) is this file with the package's provider. Like pretrain_gpt.py, this file names the part a user swaps, how
an agent's model is provided (built, then given its initial weights; start from hacpo_megatron/training/provider.py),
and hands it to the library's loop (Algorithm 1 of the paper, hacpo_megatron/training/loop.py, through
hacpo_megatron/entry.py). The forward step and the loss are the library's (models/logprobs.py: vocab-parallel
log-probs; algorithms/losses.py: the HACPO objective). N is the number of ranks the config's agents need
(`python -m hacpo_megatron.config --config FILE --print-world-size`).
"""
import sys

from hacpo_megatron.entry import main
from hacpo_megatron.training.provider import model_provider  # replace with your own: cfg -> ModelProvider

if __name__ == "__main__":
    sys.exit(main(model_provider))
