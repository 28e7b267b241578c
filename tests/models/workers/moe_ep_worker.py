"""Expert parallelism per agent (issue 52, item 2): the same tiny Qwen3-MoE agent at EP 1 and at EP > 1, on the same
ranks. One torchrun world of 2 or 4 ranks (gloo, CPU).

usage: torchrun --nproc_per_node N moe_ep_worker.py OUT_DIR      (N = 2 or 4)

Layouts, every one on all N ranks (data parallelism N): EP 1, EP 2 and, with 4 ranks, EP 4 (expert-DP N / EP). Each
loads the same random transformers Qwen3-MoE weights (tests/models/test_moe.py: 8 experts, top-2, 2 layers) and:

- pushes them to an embedded engine on its engine rank, check mode on (every expert from the rank that holds it);
- runs a forward pass of its own tokens on each rank, of a shape of its own (the EP ranks exchange unequal token
  counts), and keeps the logits;
- runs the trainer's log-prob pass (`agent_logprobs`: each replica a share, gathered) over 5 sequences (unequal
  shares) and over 1 (every replica but one has none: filler micro-batches alone);
- makes one GSPO update of 5 rows in micro-batches of 1 (unequal shares: the replicas with fewer run fillers), with
  the load-balancing loss on (coefficient 0.1) and gradient clipping at 1, then a second update of 1 row (one replica
  computes, the others run a filler); the gradients of the first and the weights after each are exported by HF name.

Every rank writes OUT_DIR/rank{r}.pt: per layout its place in the grids, its groups' ranks, its DDP buffers' groups,
its logits and their distance to transformers', the passes' log-probs, the updates' figures, and (rank 0) the
exported gradients and weights and (the engine rank) the weight check.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict, List

import torch
import torch.distributed as dist

from hacpo_megatron.algorithms.registry import algorithm_spec
from hacpo_megatron.checkpoint.hf_io import expected_hf_tensor_names
from hacpo_megatron.checkpoint.hf_mapping import export_hf_state_dict, load_hf_state_dict_into_model
from hacpo_megatron.config.schema import AgentConfig, AlgorithmConfig, MoEConfig, ParallelConfig
from hacpo_megatron.models.build import build_agent_model
from hacpo_megatron.parallel.groups import create_agent_groups, init_distributed
from hacpo_megatron.rollout.embedded import EmbeddedEngine
from hacpo_megatron.rollout.weight_sync import engine_rank, sync_weights
from hacpo_megatron.training.batch import SequenceRow
from hacpo_megatron.training.logprob_passes import agent_logprobs
from hacpo_megatron.training.trainer import AgentTrainer
from tests.models.test_moe import VOCAB, random_hf_model, tiny_config
from tests.training.workers.trainer_config import trainer_config


def layouts(world: int) -> Dict[str, ParallelConfig]:
    out = {"ep1": ParallelConfig(data=world, first_rank=0), "ep2": ParallelConfig(data=world, expert=2, first_rank=0)}
    if world >= 4:
        out["ep4"] = ParallelConfig(data=world, expert=4, first_rank=0)
    return out


def sequences(count: int, seed: int) -> List[tuple]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(2, VOCAB, (4 + i % 3,), generator=g).tolist(),
             torch.randint(2, VOCAB, (3 + 2 * i,), generator=g).tolist()) for i in range(count)]


def hf_token_logprobs(hf, seqs) -> List[torch.Tensor]:
    out = []
    with torch.no_grad():
        for prompt, response in seqs:
            logits = hf(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].float()
            out.append(logits.log_softmax(-1).gather(-1, torch.tensor(response)[:, None])[:, 0])
    return out


def rows_of(seqs, old) -> List[SequenceRow]:
    """Own rows, advantages +-1 (and one 0.5), old log-probs the pass's (ratio 1)."""
    return [SequenceRow(prompt_ids=p, response_ids=r, advantage=(1.0, -1.0, 0.5)[i % 3], is_cross=False, source=0,
                        prompt_index=i, old_seq_logp=sum(old[i]) / len(old[i])) for i, (p, r) in enumerate(seqs)]


def group_ranks(group) -> List[int]:
    return sorted(dist.get_process_group_ranks(group))


def checked_weight_push(agent, hf, hf_config, parallel) -> dict:
    """The agent's weights pushed to an embedded engine (other random weights) on its engine rank, check mode on:
    on that rank {"push": what the check found}, the engine must end up with exactly the trainer's weights."""
    engine = None
    if dist.get_rank() == engine_rank(parallel):
        engine = EmbeddedEngine(random_hf_model(hf.config, seed=5), None, eos_token_ids=[1], pad_token_id=0)
    metrics = sync_weights(agent.model, hf_config, parallel, engine, check=True)
    if engine is None:
        return {}
    return {"push": dict(equal=metrics.check.equal, max_abs_diff=metrics.check.max_abs_diff,
                         missing=list(metrics.check.missing), unsent=list(metrics.check.unsent),
                         tensors=metrics.tensors, expected=len(expected_hf_tensor_names(agent.arch)))}


def run_layout(parallel, hf, hf_config) -> dict:
    rank = dist.get_rank()
    pg = parallel.pg_collection
    report = {"place": dict(ep_rank=parallel.ep_rank, expert_dp_rank=parallel.expert_dp_rank, dp_rank=parallel.dp_rank),
              "groups": {name: group_ranks(getattr(pg, name)) for name in ("ep", "expt_dp", "tp_ep", "tp_ep_pp", "dp")}}
    agent = build_agent_model(hf_config, parallel, seed=1, params_dtype=torch.float32)
    load_hf_state_dict_into_model(agent.model, hf.state_dict(), hf_config, parallel)
    report["dispatcher"] = agent.config.moe_token_dispatcher_type
    report["local_experts"] = [list(layer.mlp.local_expert_indices) for layer in agent.model.decoder.layers]

    report.update(checked_weight_push(agent, hf, hf_config, parallel))

    # a forward pass of this rank's own tokens, a shape of its own
    tokens = torch.randint(0, VOCAB, (1 + rank % 2, 6 + 3 * rank), generator=torch.Generator().manual_seed(10 + rank))
    device = next(agent.model.parameters()).device
    positions = torch.arange(tokens.shape[1], device=device).expand(tokens.shape)
    agent.model.eval()
    with torch.no_grad():
        logits = agent.model(tokens.to(device), positions, attention_mask=None)[..., :VOCAB].cpu()
        reference = hf(tokens).logits
    agent.model.train()
    report["logits"] = logits
    report["logits_vs_hf"] = (logits - reference).abs().max().item()

    trainer = AgentTrainer(agent, algorithm_spec(AlgorithmConfig(name="gspo")),
                           trainer_config(lr=1e-2, grad_clip=1.0, adam_eps=1e-3, micro_batch_size=1),
                           moe=MoEConfig(aux_loss_coeff=0.1))
    ddp = trainer.ddp_model
    report["ddp_groups"] = {"dense": [group_ranks(b.data_parallel_group) for b in ddp.buffers],
                            "expert": [group_ranks(b.data_parallel_group) for b in ddp.expert_parallel_buffers]}
    report["optimizers"] = len(getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]))

    # the log-prob passes: unequal shares, then shares all empty but one
    five, one = sequences(5, seed=0), sequences(1, seed=1)
    old = agent_logprobs(trainer, None, five)
    report["pass"] = [torch.tensor(t) for t in old]
    report["pass_one"] = [torch.tensor(t) for t in agent_logprobs(trainer, None, one)]
    report["pass_vs_hf"] = max((torch.tensor(t) - r).abs().max().item()
                               for t, r in zip(old + agent_logprobs(trainer, None, one),
                                               hf_token_logprobs(hf, five) + hf_token_logprobs(hf, one)))

    rows = rows_of(five, old)
    [first] = trainer.train_step([rows])
    report["figures"] = [first]
    report["grads"] = export_hf_state_dict(ddp.module, hf_config, parallel, tensor_of=lambda p: p.main_grad.detach())
    report["weights_1"] = export_hf_state_dict(ddp.module, hf_config, parallel)
    one_old = agent_logprobs(trainer, None, one)
    [second] = trainer.train_step([rows_of(one, one_old)])
    report["figures"].append(second)
    report["weights_2"] = export_hf_state_dict(ddp.module, hf_config, parallel)
    return report


def main(out_dir: str) -> None:
    init_distributed()
    torch.set_num_threads(1)
    world = dist.get_world_size()
    chosen = layouts(world)
    groups = create_agent_groups([AgentConfig(name=n, model="x", parallel=p) for n, p in chosen.items()])
    hf_config = tiny_config().to_dict()
    hf = random_hf_model(tiny_config(), seed=7)
    report = {name: run_layout(parallel, hf, hf_config) for name, parallel in zip(chosen, groups)}
    torch.save(report, Path(out_dir) / f"rank{dist.get_rank()}.pt")
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
