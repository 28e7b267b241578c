"""Shared-prompt rows change nothing but speed: the same log-probs and the same updates as one row per sequence.

usage: torchrun --nproc_per_node 1 shared_prompts_worker.py OUT.pt

Trainers from the same weights (tiny Qwen3 shape), one world rank, HACPO; one packs a micro-batch's
answers to one prompt into one row (train.share_prompts: true), one gives every sequence its own row, and three pack
sequences end to end to a token budget (train.max_tokens_per_micro_batch) with and without shared prompts, the last
with SDPA's kernels (train.attention: sdpa).
The rows come prompt-interleaved (p0, p1, p2, p0, p1, ...), so packing reorders them, with own and other
agents' answers, advantages of both signs and one of 0. Saves every trainer's old log-probs of the
sequences, their metrics over two steps of two updates, and their parameters.
"""
from __future__ import annotations

import dataclasses
import sys

import torch

from hacpo_megatron.algorithms.registry import algorithm_spec
from hacpo_megatron.config.schema import AlgorithmConfig
from hacpo_megatron.training.batch import SequenceRow
from hacpo_megatron.training.trainer import AgentTrainer
from tests.training.workers.one_rank import one_rank_world, qwen3_agent, random_sequences
from tests.training.workers.trainer_config import trainer_config


# (name, train.share_prompts, train.max_tokens_per_micro_batch, train.attention): one row per sequence, shared
# prompts, and sequences packed end to end to 16 tokens without and with shared prompts, with two kernels
VARIANTS = [("separate", False, None, "local"), ("shared", True, None, "local"), ("packed", False, 16, "local"),
            ("shared_packed", True, 16, "local"), ("shared_packed_sdpa", True, 16, "sdpa")]


def main(out_path: str) -> None:
    parallel, weights = one_rank_world()
    prompts = [p for p, _ in random_sequences(3, 6, 1)]
    answers = [r for _, r in random_sequences(12, 1, 5)]
    answers = [a[: 1 + i % 5] for i, a in enumerate(answers)]  # answer lengths 1 to 5
    sequences = [(prompts[i % 3], answer) for i, answer in enumerate(answers)]  # prompt-interleaved
    advantages = [1.0, -0.5, 0.25, 0.4, 0.0, -1.0, 0.5, -0.25, 1.5, -0.75, 0.3, -0.6]
    report = {}
    for name, share, budget, kernel in VARIANTS:
        agent = dataclasses.replace(qwen3_agent(parallel, weights), attention=kernel)
        trainer = AgentTrainer(agent, algorithm_spec(AlgorithmConfig(name="hacpo")),
                               trainer_config(lr=1e-2, micro_batch_size=5, total_steps=2, share_prompts=share,
                                              max_tokens_per_micro_batch=budget))
        lp = trainer.sequence_logprobs(sequences, max_sequences_per_micro_batch=7)
        rows = [SequenceRow(prompt_ids=p, response_ids=r, advantage=a, is_cross=i % 4 == 3, source=int(i % 4 == 3),
                            old_seq_logp=float(lp.sums[i] / lp.lengths[i]) + (0.05 if i % 4 == 3 else 0.0),
                            prompt_index=i % 3, sample_index=i // 3)
                for i, ((p, r), a) in enumerate(zip(sequences, advantages))]
        metrics = []
        for _ in range(2):
            metrics += trainer.train_step([rows[:7], rows[7:]])
        report[name] = {"share_prompts": trainer.share_prompts, "logprobs": lp, "metrics": metrics,
                        "params": [p.detach().clone() for p in trainer.ddp_model.module.parameters()]}
    torch.save(report, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
