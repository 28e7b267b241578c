"""Routing replay at DP 2 and at EP 2 (issue 52, item 4): the old-log-prob pass's routes reach the replica whose update
takes the row; at EP 2 the routes are laid out on each rank's own tokens before the all-to-all sends them to their
experts. One 2-rank world (gloo, CPU).

usage: torchrun --nproc_per_node 2 moe_replay_worker.py OUT.pt

The same tiny random Qwen3-MoE weights at DP 1 (rank 0 alone), DP 2 and DP 2 x EP 2 (ranks 0-1), 5 sequences (the
replicas' shares of the pass and of the update are unequal: at EP 2 the one with fewer runs filler micro-batches)
and routes forced at random, far from the model's own (`FORCED`):

- r3: the engine's routes given on every rank; the pass (`agent_logprobs`, each replica a share, gathered) and one
  GSPO update of the 5 rows in micro-batches of 1, reversed, so that each replica's update takes rows another
  replica's pass computed. Kept: how many sequences the RouteReplay holds after the pass, the routes the pass
  recorded (gathered), its log-probs, the first update's largest |log ratio| per row;
- r3 with the prompt routes of sequences 0 and 1 swapped (`SWAPPED`): the pass's routes and log-probs (EP 2 only);
- r2 (EP 2 only): each replica forces the routes of its own share of the pass only, which the pass records; the
  update's rows meet the other replicas' only through the pass's gather. The first update's |log ratio|; and the
  same update after a pass without the gather (`trainer.sequence_logprobs` of the share alone), which must miss.

Rank 0 saves every rank's report, with the sequences and routes, to OUT.pt.
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

LAYOUTS = {"dp1": ParallelConfig(data=1, first_rank=0), "dp2": ParallelConfig(data=2, first_rank=0),
           "ep2": ParallelConfig(data=2, expert=2, first_rank=0)}
_g = torch.Generator().manual_seed(0)
SEQUENCES = [(torch.randint(2, VOCAB, (5,), generator=_g).tolist(),
              torch.randint(2, VOCAB, (length,), generator=_g).tolist()) for length in (3, 5, 7, 9, 4)]
FORCED = random_routes(SEQUENCES, seed=9)
SWAPPED = [torch.cat([FORCED[1][:5], FORCED[0][5:]]), torch.cat([FORCED[0][:5], FORCED[1][5:]])] + FORCED[2:]


def trainer_of(parallel, hf_config, state, mode: str) -> AgentTrainer:
    agent = build_agent_model(hf_config, parallel, seed=1, params_dtype=torch.float32)
    load_hf_state_dict_into_model(agent.model, state, hf_config, parallel)
    return AgentTrainer(agent, algorithm_spec(AlgorithmConfig(name="gspo")),
                        trainer_config(lr=1e-3, grad_clip=0.0, micro_batch_size=1), moe=MoEConfig(routing_replay=mode))


def first_update_log_ratio(trainer: AgentTrainer, old) -> float:
    """The largest |log ratio| per row of one update of every sequence (advantages +-1, old log-probs `old`), the
    rows reversed: each replica's share of the update is not its share of the pass."""
    rows = [SequenceRow(prompt_ids=p, response_ids=r, advantage=1.0 if i % 2 else -1.0, is_cross=False, source=0,
                        prompt_index=i, old_seq_logp=sum(old[i]) / len(old[i]))
            for i, (p, r) in enumerate(SEQUENCES)]
    spy = trainer.policy_loss = LogProbSpy(trainer.policy_loss)
    trainer.train_step([rows[::-1]])
    return torch.cat(spy.log_ratios).abs().max().item()


def r3_pass(trainer: AgentTrainer, routes) -> dict:
    """The engine's `routes` given, the pass: its log-probs, how many sequences' routes are held after it, and the
    routes it recorded (what the routers took, gathered over the replicas: the last `keep` of the pass; the ones held
    would be the engine's even if the pass recorded nothing)."""
    trainer.begin_step_routes(SEQUENCES, routes)
    replay, recorded = trainer.route_replay, []
    replay.keep = lambda sequences, taken: (recorded.append(list(taken)), type(replay).keep(replay, sequences, taken))
    try:
        old = agent_logprobs(trainer, None, SEQUENCES)
    finally:
        del replay.keep
    return {"kept": len(replay), "old": old, "recorded": recorded[-1]}


def run_layout(name: str, parallel, hf_config, state) -> dict:
    trainer = trainer_of(parallel, hf_config, state, "r3")
    report = r3_pass(trainer, FORCED)
    report["log_ratio_max"] = first_update_log_ratio(trainer, report["old"])
    if name != "ep2":
        return report
    report["swapped"] = r3_pass(trainer_of(parallel, hf_config, state, "r3"), SWAPPED)

    share = slice(parallel.dp_rank, None, parallel.dp_size)  # this replica's sequences in the pass
    r2 = trainer_of(parallel, hf_config, state, "r2")
    r2.begin_step_routes(SEQUENCES, FORCED)  # r2 keeps none of these: it forgets the last step's routes
    r2.route_replay.keep(SEQUENCES[share], FORCED[share])  # what this replica's pass takes (forced)
    old = agent_logprobs(r2, None, SEQUENCES)
    report["r2"] = {"kept": len(r2.route_replay), "log_ratio_max": first_update_log_ratio(r2, old)}
    ungathered = trainer_of(parallel, hf_config, state, "r2")
    ungathered.begin_step_routes()
    ungathered.route_replay.keep(SEQUENCES[share], FORCED[share])
    ungathered.sequence_logprobs(SEQUENCES[share])  # the pass without agent_logprobs' gather
    report["r2_ungathered"] = {"kept": len(ungathered.route_replay),
                               "log_ratio_max": first_update_log_ratio(ungathered, old)}
    return report


def run_layouts(layouts: Dict[str, ParallelConfig]) -> Dict[str, dict]:
    groups = create_agent_groups([AgentConfig(name=n, model="x", parallel=p) for n, p in layouts.items()])
    hf_config = tiny_config().to_dict()
    state = random_hf_model(tiny_config(), seed=7).state_dict()
    return {name: run_layout(name, parallel, hf_config, state)
            for name, parallel in zip(layouts, groups) if parallel.is_member}


def main(out_path: str) -> None:
    init_distributed()
    torch.set_num_threads(1)
    report = run_layouts(LAYOUTS)
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, report)
    if torch.distributed.get_rank() == 0:
        torch.save({"sequences": SEQUENCES, "forced": FORCED, "swapped": SWAPPED, "ranks": gathered}, out_path)
    torch.distributed.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
