"""An MoE agent in pipeline stages (issue 52): the same tiny Qwen3-MoE agent at PP 1 and at PP 2, both at EP 2, in one
4-rank torchrun world (gloo, CPU).

usage: torchrun --nproc_per_node 4 moe_pp_worker.py OUT.pt

Layouts: `pp1` DP 2 x EP 2 on ranks 0-1 (the reference), `pp2` PP 2 x DP 2 x EP 2 on ranks 0-3 (stage 0: ranks 0-1,
layer 0; stage 1: ranks 2-3, layer 1). Each loads the same random transformers Qwen3-MoE weights (tests/models/
test_moe.py: 8 experts, top-2, 2 layers) and, with routing replay r3 and the load-balancing loss on (0.1):

- pushes them to an embedded engine on its engine rank, check mode on (each stage's experts from their owners);
- runs the trainer's log-prob pass (`agent_logprobs`) over 5 sequences with nothing to replay: live routes;
- a new step: the engine's routes of the 5 sequences given for the whole model (`FORCED`, at random, far from the
  model's own), the pass again (each stage keeps and imposes its own layer's routes), then one GSPO update of the 5
  rows in micro-batches of 1 (unequal shares: the replica with fewer runs a filler), gradients clipped at 1.

Kept per rank: its place, its stage's layers and local experts, the routes its RouteReplay holds after the r3 pass,
the passes' log-probs, the update's figures (router metrics summed over the stages) and its first |log ratio|; rank
0 also the exported gradients and weights, the engine rank the weight check. Rank 0 saves every rank's report.
"""
from __future__ import annotations

import sys
from typing import Dict

import torch
import torch.distributed as dist

from hacpo_megatron.algorithms.registry import algorithm_spec
from hacpo_megatron.checkpoint.hf_mapping import export_hf_state_dict, load_hf_state_dict_into_model
from hacpo_megatron.config.schema import AgentConfig, AlgorithmConfig, MoEConfig, ParallelConfig
from hacpo_megatron.models.build import build_agent_model
from hacpo_megatron.parallel.groups import create_agent_groups, init_distributed
from hacpo_megatron.training.batch import SequenceRow
from hacpo_megatron.training.logprob_passes import agent_logprobs
from hacpo_megatron.training.trainer import AgentTrainer
from tests.models.test_moe import VOCAB, LogProbSpy, random_hf_model, random_routes, tiny_config
from tests.models.workers.moe_ep_worker import checked_weight_push
from tests.training.workers.trainer_config import trainer_config

LAYOUTS = {"pp1": ParallelConfig(data=2, expert=2, first_rank=0),
           "pp2": ParallelConfig(data=2, pipeline=2, expert=2, first_rank=0)}
_g = torch.Generator().manual_seed(0)
SEQUENCES = [(torch.randint(2, VOCAB, (5,), generator=_g).tolist(),
              torch.randint(2, VOCAB, (length,), generator=_g).tolist()) for length in (3, 5, 7, 9, 4)]
FORCED = random_routes(SEQUENCES, seed=9)  # [tokens, 2 layers, 2]


def run_layout(parallel, hf, hf_config) -> dict:
    agent = build_agent_model(hf_config, parallel, seed=1, params_dtype=torch.float32)
    load_hf_state_dict_into_model(agent.model, hf.state_dict(), hf_config, parallel)
    layers = agent.model.decoder.layers
    report = {"place": dict(pp_rank=parallel.pp_rank, dp_rank=parallel.dp_rank, ep_rank=parallel.ep_rank),
              "layers": [layer.layer_number - 1 for layer in layers],
              "local_experts": [list(layer.mlp.local_expert_indices) for layer in layers]}

    report.update(checked_weight_push(agent, hf, hf_config, parallel))

    trainer = AgentTrainer(agent, algorithm_spec(AlgorithmConfig(name="gspo")),
                           trainer_config(lr=1e-2, grad_clip=1.0, adam_eps=1e-3, micro_batch_size=1),
                           moe=MoEConfig(aux_loss_coeff=0.1, routing_replay="r3"))
    trainer.begin_step_routes()  # nothing to replay: live routes
    report["live"] = [torch.tensor(t) for t in agent_logprobs(trainer, None, SEQUENCES)]

    trainer.begin_step_routes(SEQUENCES, FORCED)  # the engine's routes, every layer of the model
    old = agent_logprobs(trainer, None, SEQUENCES)
    report["forced"] = [torch.tensor(t) for t in old]
    report["kept"] = [trainer.route_replay.routes_of(p, r) for p, r in SEQUENCES]

    rows = [SequenceRow(prompt_ids=p, response_ids=r, advantage=(1.0, -1.0, 0.5)[i % 3], is_cross=False, source=0,
                        prompt_index=i, old_seq_logp=sum(old[i]) / len(old[i])) for i, (p, r) in enumerate(SEQUENCES)]
    spy = trainer.policy_loss = LogProbSpy(trainer.policy_loss)
    [figures] = trainer.train_step([rows[::-1]])  # each replica's share of the update is not its share of the pass
    report["figures"] = figures
    report["log_ratio_max"] = torch.cat(spy.log_ratios).abs().max().item() if spy.log_ratios else None
    ddp = trainer.ddp_model
    report["grads"] = export_hf_state_dict(ddp.module, hf_config, parallel, tensor_of=lambda p: p.main_grad.detach())
    report["weights"] = export_hf_state_dict(ddp.module, hf_config, parallel)
    return report


def main(out_path: str) -> None:
    init_distributed()
    torch.set_num_threads(1)
    groups = create_agent_groups([AgentConfig(name=n, model="x", parallel=p) for n, p in LAYOUTS.items()])
    hf_config = tiny_config().to_dict()
    hf = random_hf_model(tiny_config(), seed=7)
    report: Dict[str, dict] = {name: run_layout(parallel, hf, hf_config)
                               for name, parallel in zip(LAYOUTS, groups) if parallel.is_member}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, report)
    if dist.get_rank() == 0:
        torch.save({"sequences": SEQUENCES, "forced": FORCED, "ranks": gathered}, out_path)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
