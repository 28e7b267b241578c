"""Zero-advantage rows left out of an update change nothing: the same update with every row computed.

usage: torchrun --nproc_per_node 1 skip_worker.py OUT.pt

Two trainers from the same weights (tiny Qwen3 shape), one world rank; the same HACPO mini-batches of own
and cross rows, half of them with advantage 0. One trainer runs the update as it is (those rows skipped),
the other with batch.rows_with_gradient replaced by "every row". Saves both trainers' parameters after two
steps of two updates, and both metric lists.
"""
from __future__ import annotations

import sys

import torch

from hacpo_megatron.algorithms.registry import algorithm_spec
from hacpo_megatron.config.schema import AlgorithmConfig
from hacpo_megatron.training import trainer as trainer_module
from hacpo_megatron.training.batch import SequenceRow
from hacpo_megatron.training.trainer import AgentTrainer
from tests.training.workers.one_rank import one_rank_world, qwen3_agent, random_sequences
from tests.training.workers.trainer_config import trainer_config


def main(out_path: str) -> None:
    parallel, weights = one_rank_world()
    sequences = random_sequences(12, 5, 7)
    advantages = [1.0, 0.0, -0.5, 0.0, 0.0, 0.75, 0.0, -1.0, 0.0, 0.25, 0.0, 0.0]
    report = {}
    for name, skip in (("skipping", True), ("computing_all", False)):
        agent = qwen3_agent(parallel, weights)
        trainer = AgentTrainer(agent, algorithm_spec(AlgorithmConfig(name="hacpo")),
                               trainer_config(lr=1e-2, micro_batch_size=4, total_steps=2))
        if not skip:
            trainer_module.rows_with_gradient = lambda rows, kl_coef: list(rows)
        lp = trainer.sequence_logprobs(sequences)  # cross rows' source log-probs 0.05 above: ratio e^-0.05, in the clip
        rows = [SequenceRow(prompt_ids=p, response_ids=r, advantage=a, is_cross=i % 3 == 2, source=int(i % 3 == 2),
                            old_seq_logp=float(lp.sums[i] / lp.lengths[i]) + (0.05 if i % 3 == 2 else 0.0),
                            prompt_index=i // 4, sample_index=i % 4)
                for i, ((p, r), a) in enumerate(zip(sequences, advantages))]
        metrics = []
        for _ in range(2):
            metrics += trainer.train_step([rows[:6], rows[6:]])
        report[name] = {"params": [p.detach().clone() for p in trainer.ddp_model.module.parameters()],
                        "metrics": metrics}
    torch.save(report, out_path)


if __name__ == "__main__":
    main(sys.argv[1])
