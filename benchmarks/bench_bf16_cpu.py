"""bf16 against fp32 on CPU: one agent's old-log-prob pass and training update, and a bare GEMM, in one run.

    torchrun --nproc_per_node 1 benchmarks/bench_bf16_cpu.py [--model smollm2-135m-instruct] [--threads 2]
             [--sequences 16] [--prompt-length 75] [--response-length 95] [--rounds 2]

The same pretrained weights (a GGUF name or a Hugging Face folder, converted once) built twice through the
project's own path (build_agent_model + AgentTrainer): `train.params_dtype: fp32` and `bf16` (megatron's
mixed precision: bf16 weights and activations, fp32 main weights in the optimizer). Rounds alternate
between the two models, so the machine's load hits both alike; the fastest round of each is kept. The
GEMM of a SmolLM2-shaped MLP projection (2048x576 @ 576x1536) in both dtypes is the physical reference:
how much faster bf16 could be on this CPU. Prints one table; docs/benchmarks.md has the figures.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hacpo_megatron.algorithms.registry import algorithm_spec  # noqa: E402
from hacpo_megatron.checkpoint.gguf_sources import resolve_model_source  # noqa: E402
from hacpo_megatron.checkpoint.hf_io import HFWeights  # noqa: E402
from hacpo_megatron.checkpoint.hf_mapping import load_hf_state_dict_into_model  # noqa: E402
from hacpo_megatron.config.schema import AgentConfig, AlgorithmConfig, Config, ParallelConfig, TrainConfig  # noqa: E402
from hacpo_megatron.models.build import build_agent_model  # noqa: E402
from hacpo_megatron.models.presets import load_hf_config_dict  # noqa: E402
from hacpo_megatron.parallel.groups import create_agent_groups, init_distributed  # noqa: E402
from hacpo_megatron.training.batch import SequenceRow  # noqa: E402
from hacpo_megatron.training.trainer import AgentTrainer  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def gemm_gflops(dtype: torch.dtype, repeats: int = 20) -> float:
    a, b = torch.randn(2048, 576, dtype=dtype), torch.randn(576, 1536, dtype=dtype)
    a @ b  # warm-up (oneDNN picks its kernel)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * 2048 * 576 * 1536 * repeats / (time.perf_counter() - start) / 1e9


def trainer_for(folder: str, dtype: torch.dtype, parallel) -> AgentTrainer:
    hf_config = load_hf_config_dict(folder)
    agent = build_agent_model(hf_config, parallel, seed=1, params_dtype=dtype)
    load_hf_state_dict_into_model(agent.model, HFWeights(folder), hf_config, parallel)
    return AgentTrainer(agent, algorithm_spec(AlgorithmConfig(name="gspo")),
                        Config(train=TrainConfig(lr=1e-6, micro_batch_size=8)))


def rows_for(trainer: AgentTrainer, sequences) -> list:
    lp = trainer.sequence_logprobs(sequences)
    return [SequenceRow(prompt_ids=p, response_ids=r, advantage=1.0 if i % 2 else -1.0,
                        old_seq_logp=float(lp.sums[i] / lp.lengths[i]), is_cross=False, source=0,
                        prompt_index=i // 8, sample_index=i % 8) for i, (p, r) in enumerate(sequences)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--prompt-length", type=int, default=75)
    parser.add_argument("--response-length", type=int, default=95)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    init_distributed()
    folder = str(resolve_model_source(args.model))
    [parallel] = create_agent_groups([AgentConfig(name="a", model=folder, parallel=ParallelConfig(first_rank=0))])
    g = torch.Generator().manual_seed(0)
    vocab = load_hf_config_dict(folder)["vocab_size"]
    sequences = [(torch.randint(3, vocab, (args.prompt_length,), generator=g).tolist(),
                  torch.randint(3, vocab, (args.response_length,), generator=g).tolist())
                 for _ in range(args.sequences)]
    trainers = {name: trainer_for(folder, dtype, parallel) for name, dtype in DTYPES.items()}
    best = {name: {"logprob": float("inf"), "train": float("inf"), "gemm": 0.0} for name in DTYPES}
    for _ in range(args.rounds):
        for name, trainer in trainers.items():
            best[name]["gemm"] = max(best[name]["gemm"], gemm_gflops(DTYPES[name]))
            start = time.perf_counter()
            rows = rows_for(trainer, sequences)
            best[name]["logprob"] = min(best[name]["logprob"], time.perf_counter() - start)
            start = time.perf_counter()
            trainer.train_step([rows])
            best[name]["train"] = min(best[name]["train"], time.perf_counter() - start)
    tokens = args.sequences * (args.prompt_length + args.response_length)
    print(f"{args.model}, {args.sequences} sequences x {args.prompt_length}+{args.response_length} tokens "
          f"({tokens}), {args.threads} threads, best of {args.rounds} interleaved rounds")
    print("| | fp32 | bf16 | bf16 / fp32 time |")
    print("| --- | --- | --- | --- |")
    for what in ("logprob", "train"):
        f, b = best["fp32"][what], best["bf16"][what]
        print(f"| {what} pass, s | {f:.2f} | {b:.2f} | {b / f:.2f} |")
    f, b = best["fp32"]["gemm"], best["bf16"]["gemm"]
    print(f"| GEMM 2048x576 @ 576x1536, GFLOP/s | {f:.0f} | {b:.0f} | {f / b:.2f} |")


if __name__ == "__main__":
    main()
