"""HACPO training entry, in the style of Megatron's pretrain_gpt.py.

    torchrun --nproc_per_node=N examples/hacpo_pretrain_style.py [--config FILE] [--set KEY=VALUE ...]
             [--output-dir DIR] [--resume] [--ray-address ADDR]

N is the number of ranks the config's agents need (`python -m hacpo_megatron.config --config FILE
--print-world-size`); `python -m hacpo_megatron.launch` (what `make run` calls) checks every input,
works N out and starts torchrun. Without --config it runs configs/default.yaml: two
tiny heterogeneous agents on synthetic math, on a laptop-sized CPU machine.

Like pretrain_gpt.py, this file names the part a user swaps, how an agent's model is provided (built, then
given its initial weights; the default: hacpo_megatron/training/provider.py), and hands it to the library's
loop (Algorithm 1 of the paper, hacpo_megatron/training/loop.py, through hacpo_megatron/entry.py). The forward
step and the loss are the library's (models/logprobs.py: vocab-parallel log-probs; algorithms/losses.py: the
HACPO objective).
"""
import sys

from hacpo_megatron.entry import main
from hacpo_megatron.training.provider import model_provider

if __name__ == "__main__":
    sys.exit(main(model_provider))
