"""Routing replay at DP 2 (issue 52, item 4): the old-log-prob pass's routes reach the replica whose update takes the
row. One 2-rank world (gloo, CPU).

usage: torchrun --nproc_per_node 2 moe_replay_worker.py OUT.pt

The same tiny random Qwen3-MoE weights at DP 1 (rank 0 alone) and DP 2 (ranks 0-1), routing_replay r3 with routes
forced at random (far from the model's own): the pass (`agent_logprobs`, each replica a share, gathered) and one GSPO
update of 4 rows in micro-batches of 1, whose data-parallel shares are not the pass's. Every rank saves how many
sequences its RouteReplay holds after the pass and the first update's largest |log ratio| per row (0 up to fp32
noise when every row met its routes; far from 0 when a replica routed its rows live).
"""
from __future__ import annotations

import sys
from typing import Dict

import torch

from hacpo_megatron.algorithms.registry import algorithm_spec
from hacpo_megatron.checkpoint.hf_mapping import load_hf_state_dict_into_model
from hacpo_megatron.config.schema import AgentConfig, AlgorithmConfig, MoEConfig, ParallelConfig
from hacpo_megatron.models.build import build_agent_model
from hacpo_megatron.parallel.groups import create_agent_groups, init_distributed
from hacpo_megatron.training.batch import SequenceRow
from hacpo_megatron.training.logprob_passes import agent_logprobs
from hacpo_megatron.training.trainer import AgentTrainer
from tests.models.test_moe import VOCAB, LogProbSpy, random_hf_model, random_routes, tiny_config
from tests.training.workers.trainer_config import trainer_config

LAYOUTS = {"dp1": ParallelConfig(data=1, first_rank=0), "dp2": ParallelConfig(data=2, first_rank=0)}


def run_layouts(layouts: Dict[str, ParallelConfig]) -> Dict[str, dict]:
    groups = create_agent_groups([AgentConfig(name=n, model="x", parallel=p) for n, p in layouts.items()])
    hf_config = tiny_config().to_dict()
    state = random_hf_model(tiny_config(), seed=7).state_dict()
    g = torch.Generator().manual_seed(0)
    sequences = [(torch.randint(2, VOCAB, (5,), generator=g).tolist(),
                  torch.randint(2, VOCAB, (length,), generator=g).tolist()) for length in (3, 5, 7, 9)]
    report = {}
    for name, parallel in zip(layouts, groups):
        if not parallel.is_member:
            continue
        agent = build_agent_model(hf_config, parallel, seed=1, params_dtype=torch.float32)
        load_hf_state_dict_into_model(agent.model, state, hf_config, parallel)
        trainer = AgentTrainer(agent, algorithm_spec(AlgorithmConfig(name="gspo")),
                               trainer_config(lr=1e-3, grad_clip=0.0, micro_batch_size=1),
                               moe=MoEConfig(routing_replay="r3"))
        trainer.begin_step_routes(sequences, random_routes(sequences, seed=9))
        old = agent_logprobs(trainer, None, sequences)
        kept = len(trainer.route_replay)
        rows = [SequenceRow(prompt_ids=p, response_ids=r, advantage=1.0 if i % 2 else -1.0, is_cross=False, source=0,
                            prompt_index=i, old_seq_logp=sum(old[i]) / len(old[i]))
                for i, (p, r) in enumerate(sequences)]
        spy = trainer.policy_loss = LogProbSpy(trainer.policy_loss)
        trainer.train_step([rows[::-1]])
        report[name] = {"kept": kept, "log_ratio_max": torch.cat(spy.log_ratios).abs().max().item()}
    return report


def main(out_path: str) -> None:
    init_distributed()
    torch.set_num_threads(1)
    report = run_layouts(LAYOUTS)
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, report)
    if torch.distributed.get_rank() == 0:
        torch.save(gathered, out_path)
    torch.distributed.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
