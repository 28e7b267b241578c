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
from hacpo_megatron.checkpoint.hf_mapping import load_hf_state_dict_into_model
from hacpo_megatron.config.schema import AgentConfig, AlgorithmConfig, ParallelConfig
from hacpo_megatron.models.build import build_agent_model
from hacpo_megatron.parallel.groups import create_agent_groups, init_distributed
from hacpo_megatron.training import trainer as trainer_module
from hacpo_megatron.training.batch import SequenceRow
from hacpo_megatron.training.trainer import AgentTrainer, TrainHyperparams
from tests.models.workers.reference import TEST_CONFIGS, hf_model


def main(out_path: str) -> None:
    init_distributed()
    hf_config = TEST_CONFIGS["qwen3"]
    [parallel] = create_agent_groups([AgentConfig(name="a", model="x", parallel=ParallelConfig(first_rank=0))])
    weights = {k: v.detach().clone() for k, v in hf_model("qwen3").state_dict().items()}
    g = torch.Generator().manual_seed(0)
    vocab = hf_config["vocab_size"]
    sequences = [(torch.randint(2, vocab, (5,), generator=g).tolist(), torch.randint(2, vocab, (7,), generator=g).tolist())
                 for _ in range(12)]
    advantages = [1.0, 0.0, -0.5, 0.0, 0.0, 0.75, 0.0, -1.0, 0.0, 0.25, 0.0, 0.0]
    report = {}
    for name, skip in (("skipping", True), ("computing_all", False)):
        agent = build_agent_model(hf_config, parallel, seed=1)
        load_hf_state_dict_into_model(agent.model, weights, hf_config, parallel)
        trainer = AgentTrainer(agent, algorithm_spec(AlgorithmConfig(name="hacpo")),
                               TrainHyperparams(lr=1e-2, micro_batch_size=4, total_steps=2))
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
