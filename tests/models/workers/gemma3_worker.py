"""Gemma 3 (hacpo_megatron/models/gemma3.py) against transformers' Gemma3ForCausalLM, in ONE 2-process torchrun world.

The model is a tiny random Gemma 3 (`CONFIG`: 4 layers, a sliding window of 8 on three of them, 2 KV heads,
query_pre_attn_scalar other than head_dim), read from the HF folder the test wrote. At TP=1 (rank 0), TP=2 and
PP=2 (ranks 0-1), on sequences longer than the window:
  1. the full logits of a batch through megatron's own attention (its sliding-window mask);
  2. response log-probs and the gradients of their sum, one row per sequence (megatron's attention) and with
     responses sharing their prompt's row (the blocked attention: the window counted in positions of each
     sequence, per-row RoPE with both bases);
  3. the weights exported back to HF names.
Then the conversion tools' own functions on the folder: HF -> Megatron at TP=2, that checkpoint compared with
transformers at PP=2 (loaded resharded), Megatron -> HF from it. Each rank saves OUT/rank<r>.pt.

usage: torchrun --nproc_per_node 2 gemma3_worker.py HF_DIR OUT
"""
from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hacpo_megatron.checkpoint.hf_mapping import export_hf_state_dict, load_hf_state_dict_into_model
from hacpo_megatron.config.schema import AgentConfig, ParallelConfig
from hacpo_megatron.models.build import build_agent_model
from hacpo_megatron.models.logprobs import compute_sequence_logprobs
from hacpo_megatron.models.presets import PRESETS
from hacpo_megatron.parallel.groups import create_agent_groups, init_distributed
from tests.models.workers.layouts_worker import kernel_checks, logprob_sum_grads
from tests.models.workers.reference import TEMPERATURE, hf_grads_of_logprob_sum, hf_token_logprobs

TOOLS = Path(__file__).resolve().parents[3] / "tools"
VOCAB = 1000  # padded to 1024 by megatron
# tiny-gemma3 with a small vocabulary and weights twice HF's default spread, so that each mistake (a RoPE base,
# the window, the scale, a norm) moves the logits far beyond the tolerances
CONFIG = dict(PRESETS["tiny-gemma3"], vocab_size=VOCAB, initializer_range=0.04)
WINDOW = CONFIG["sliding_window"]
LAYOUTS = [
    AgentConfig(name="tp1", parallel=ParallelConfig(tensor=1, first_rank=0)),
    AgentConfig(name="tp2", parallel=ParallelConfig(tensor=2, first_rank=0)),
    AgentConfig(name="pp2", parallel=ParallelConfig(pipeline=2, first_rank=0)),
]

# (prompt, response) of 10 to 19 tokens: every one longer than the window of 8; a one-token prompt and response
SEQUENCES = [
    ([11, 12, 13, 14, 15, 16], [17, 18, 19, 20, 21, 22, 23, 24, 25]),
    ([31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42], [43, 44, 45, 46, 47, 48, 49]),
    ([999], [998, 997, 996, 995, 994, 993, 992, 991, 990, 2]),
    ([5, 6, 7, 8, 9, 10, 11, 12, 13], [3]),
    ([100, 200, 300], [400, 500, 600, 700, 800, 900, 901, 902, 903, 904, 905, 906, 907, 908, 909, 910]),
]
# shared-prompt rows (rows of 4 and 3 responses) whose responses reach more than the window past the prompt's
# start, so the blocked attention must drop prompt keys by position
_P1, _P2 = [21, 22, 23, 24, 25, 26, 27], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69]
SHARED_SEQUENCES = [
    (_P1, [30, 31, 32, 33, 34, 35, 36, 37, 38]),
    (_P1, [40]),
    (_P2, [70, 71, 72, 73, 74, 75]),
    (_P1, [30, 31, 50, 51, 52, 53, 54, 55, 56, 57, 58]),
    (_P2, [70, 80, 81]),
    (_P1, [59, 58, 57]),
    (_P2, [2]),
    ([500, 501, 502, 503, 504, 505, 506, 507, 508], [509, 510, 511]),
]


# SHARED_SEQUENCES packed to 36 tokens: the 31-token document of _P1, then _P2's (20) and the last prompt's (12) in
# one row, each past the window; SEQUENCES: rows of 19 + 11 and 10 + 19 tokens
PACKED_TOKENS = 36


def load_tool(name: str):
    """A command-line tool's module (tools/ is no package)."""
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def hf_reference(hf_dir: Path):
    """The folder's model in float32 (every rank reads the same weights)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)


def logit_tokens() -> torch.Tensor:
    """3 rows of 20 random tokens: 2.5 windows."""
    return torch.randint(0, VOCAB, (3, 20), generator=torch.Generator().manual_seed(5))


def layout_checks(parallel, hf, hf_state: dict, compare) -> dict:
    """Everything at one layout, on this rank (a member of it)."""
    start = time.time()
    agent = build_agent_model(CONFIG, parallel, seed=1, params_dtype=torch.float32)  # fp32 on a GPU too
    load_hf_state_dict_into_model(agent.model, hf_state, CONFIG, parallel)
    entry = {"logits": compare.megatron_logits(agent, logit_tokens())}  # None off the last stage's TP rank 0
    entry["logprobs"] = compute_sequence_logprobs(agent, SEQUENCES, temperature=TEMPERATURE,
                                                  max_sequences_per_micro_batch=2)
    entry["shared_logprobs"] = compute_sequence_logprobs(agent, SHARED_SEQUENCES, temperature=TEMPERATURE,
                                                         max_sequences_per_micro_batch=5, share_prompts=True)
    entry["exported"] = export_hf_state_dict(agent.model, CONFIG, parallel)
    logprob_sum_grads(agent, SEQUENCES)
    entry["grads"] = export_hf_state_dict(agent.model, CONFIG, parallel, tensor_of=lambda p: p.grad)
    logprob_sum_grads(agent, SHARED_SEQUENCES, share_prompts=True)
    entry["shared_grads"] = export_hf_state_dict(agent.model, CONFIG, parallel, tensor_of=lambda p: p.grad)
    entry["kernels"] = kernel_checks(agent, SEQUENCES, SHARED_SEQUENCES, PACKED_TOKENS, lambda: export_hf_state_dict(
        agent.model, CONFIG, parallel, tensor_of=lambda p: p.grad))
    entry["seconds"] = time.time() - start
    return entry


def conversion_checks(hf_dir: Path, out: Path, tools: dict) -> dict:
    """The tools' functions, collective over the world: HF -> Megatron (TP=2), compare at PP=2, Megatron -> HF."""
    start = time.time()
    tools["convert_hf_to_megatron"].convert_hf_to_megatron(str(hf_dir), str(out / "tp2"), tensor_parallel=2)
    difference = tools["compare_hf_megatron"].compare_hf_megatron(str(hf_dir), str(out / "tp2"), pipeline_parallel=2,
                                                                  seq_length=20, batch_size=3)
    tools["convert_megatron_to_hf"].convert_megatron_to_hf(str(out / "tp2"), str(out / "hf_from_tp2"))
    return {"compare_tp2_checkpoint_at_pp2": difference, "seconds": time.time() - start}


def main(hf_dir: Path, out: Path) -> None:
    import faulthandler

    faulthandler.dump_traceback_later(240, exit=True)  # a hang shows where, instead of a silent timeout
    init_distributed()
    rank = dist.get_rank()
    layouts = create_agent_groups(LAYOUTS)
    tools = {name: load_tool(name) for name in ("convert_hf_to_megatron", "compare_hf_megatron",
                                                "convert_megatron_to_hf")}
    hf = hf_reference(hf_dir)
    hf_state = {name: tensor.detach().clone() for name, tensor in hf.state_dict().items()}
    results = {"hf_state": hf_state}
    if rank == 0:  # the references, once
        with torch.no_grad():
            results["hf_logits"] = hf(logit_tokens()).logits
        results["hf_logprobs"] = [t.detach() for t in hf_token_logprobs(hf, SEQUENCES)]
        results["hf_grads"] = hf_grads_of_logprob_sum(hf, SEQUENCES)
        results["hf_shared_logprobs"] = [t.detach() for t in hf_token_logprobs(hf, SHARED_SEQUENCES)]
        results["hf_shared_grads"] = hf_grads_of_logprob_sum(hf, SHARED_SEQUENCES)
    for parallel in layouts:
        if parallel.is_member:
            results[parallel.name] = layout_checks(parallel, hf, hf_state, tools["compare_hf_megatron"])
    results["conversion"] = conversion_checks(hf_dir, out, tools)
    torch.save(results, out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
