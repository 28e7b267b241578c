"""Mixed precision on CPU (train.params_dtype: bf16), in a world of one rank.

usage: torchrun --nproc_per_node 1 bf16_worker.py OUT.json

The same HF weights (tiny Qwen3 shape) built at fp32 and at bf16; the same three GSPO updates on the same
rows. Writes, for the test to judge: log-prob gaps bf16 vs fp32 before training, the parameter and
optimizer dtypes, whether every bf16 parameter equals its fp32 main weight rounded to bf16 after the
updates, and both loss trajectories.
"""
from __future__ import annotations

import json
import sys

import torch

from hacpo_megatron.algorithms.registry import algorithm_spec
from hacpo_megatron.config.schema import AlgorithmConfig
from hacpo_megatron.training.batch import SequenceRow
from hacpo_megatron.training.trainer import AgentTrainer
from tests.training.workers.one_rank import one_rank_world, qwen3_agent, random_sequences
from tests.training.workers.trainer_config import trainer_config

UPDATES = 3


def rows_for(trainer, sequences, advantages):
    lp = trainer.sequence_logprobs(sequences)
    return [SequenceRow(prompt_ids=p, response_ids=r, advantage=a, old_seq_logp=float(lp.sums[i] / lp.lengths[i]),
                        is_cross=False, source=0, prompt_index=i // 4, sample_index=i % 4)
            for i, ((p, r), a) in enumerate(zip(sequences, advantages))]


def main(out_path: str) -> None:
    parallel, weights = one_rank_world()
    sequences = random_sequences(8, 6, 10)
    advantages = [1.0, -1.0] * 4
    report = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        agent = qwen3_agent(parallel, weights, dtype)
        # Every update is on-policy (old log-probs taken just before it, same dtype): ratio 1, no clipping.
        trainer = AgentTrainer(agent, algorithm_spec(AlgorithmConfig(name="gspo")),
                               trainer_config(lr=1e-3, micro_batch_size=3, total_steps=UPDATES))
        token_logp = trainer.sequence_logprobs(sequences).token_logprobs
        losses = []
        for _ in range(UPDATES):
            lp = trainer.sequence_logprobs(sequences)
            objective = sum(a * float(lp.sums[i] / lp.lengths[i]) for i, a in enumerate(advantages)) / len(advantages)
            losses.append(-objective)
            rows = rows_for(trainer, sequences, advantages)
            trainer.train_step([rows])
        params = [p for p in trainer.ddp_model.module.parameters()]
        main_params = [getattr(p, "main_param", p) for p in params]
        report[name] = {
            "token_logp": token_logp.tolist(), "surrogate": losses,
            "param_dtypes": sorted({str(p.dtype) for p in params}),
            "main_param_dtypes": sorted({str(m.dtype) for m in main_params}),
            "params_are_rounded_main": all(torch.equal(p.data, m.data.to(p.dtype))
                                           for p, m in zip(params, main_params)),
            # fp32 main weights hold updates smaller than a bf16 step: some differ from their bf16 copy
            "main_holds_more_than_bf16": any(not torch.equal(m.data, p.data.float())
                                             for p, m in zip(params, main_params)),
        }
    with open(out_path, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1])
