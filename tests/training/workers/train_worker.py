"""Training-step checks in one 2-rank world (gloo, CPU).

usage: torchrun --nproc_per_node 2 train_worker.py CONFIG.yaml OUT_DIR

Part 1, layouts: the same HF weights (the config's first agent) at TP=1 (rank 0 alone), TP=2, DP=2
and PP=2; one HACPO update on a fixed batch; every layout's gradients (HF names) and loss must equal
TP=1's, and so must the loss over three steps.

Part 2, agents: every agent of CONFIG (any number, any layout on ranks 0-1) trains on its own and
the other agents' responses for a few steps; the HACPO surrogate -mean(A * mean log pi) on that batch
must go down for each. Adding an agent is a change of CONFIG only.

Part 3, KL: with kl_coef > 0 at TP=1 and at DP=2, micro-batches of 3 rows that mix own and other
agents' rows, and some bridged rows dropped: the first update's loss minus that of the same update
without KL, and the logged `kl`, against a float64 k3 KL over the own rows of that mini-batch.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from hacpo_megatron.algorithms import batch_capabilities, resolve_algorithm, step_advantages
from hacpo_megatron.checkpoint.hf_mapping import export_hf_state_dict, load_hf_state_dict_into_model
from hacpo_megatron.config import load_config
from hacpo_megatron.config.schema import AgentConfig, ParallelConfig
from hacpo_megatron.models.build import build_agent_model
from hacpo_megatron.models.presets import load_hf_config_dict
from hacpo_megatron.parallel.groups import create_agent_groups, init_distributed
from hacpo_megatron.rollout.embedded import hf_model_from_config
from hacpo_megatron.training.batch import SequenceRow, UpdateSchedule, mini_batches
from hacpo_megatron.training.trainer import AgentTrainer
from tests.training.workers.trainer_config import trainer_config

B, G = 4, 2


def toy_responses(seed: int, vocab: int):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, vocab, (int(n),), generator=g).tolist() for n in torch.randint(2, 6, (B,), generator=g)]
    responses = [[torch.randint(2, vocab, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
                  for _ in range(G)] for _ in range(B)]
    return prompts, responses


def learner_rows(k, prompts, responses, old_means, effective, trains_on):
    rows = []
    for j in range(len(responses)):
        if not trains_on[k, j]:
            continue
        for b in range(B):
            for i in range(G):
                rows.append(SequenceRow(prompt_ids=prompts[b], response_ids=responses[j][b][i],
                                        advantage=float(effective[k, j, b, i]), old_seq_logp=old_means[j][b * G + i],
                                        is_cross=j != k, source=j, prompt_index=b, sample_index=i))
    return rows


def schedule_for(k, trains_on, mini_batch_size):
    """The loop's schedule: mini_batch_size prompts x G responses per update."""
    sources = tuple(j for j in range(trains_on.shape[1]) if trains_on[k, j])
    return UpdateSchedule(B, G, sources, rows_per_update=mini_batch_size * G)


def flat(responses_j, prompts):
    return [(prompts[b], responses_j[b][i]) for b in range(B) for i in range(G)]


def seq_means(trainer, sequences):
    lp = trainer.sequence_logprobs(sequences)
    return (lp.sums / lp.lengths).tolist()


def part_layouts(hf_config, out):
    layouts = {"tp1": ParallelConfig(tensor=1, first_rank=0), "tp2": ParallelConfig(tensor=2, first_rank=0),
               "dp2": ParallelConfig(data=2, first_rank=0), "pp2": ParallelConfig(pipeline=2, first_rank=0)}
    agents = [AgentConfig(name=n, model="x", parallel=p) for n, p in layouts.items()]
    groups = create_agent_groups(agents)
    hf = hf_model_from_config(hf_config, seed=3)
    state = hf.state_dict()
    vocab = hf_config["vocab_size"]
    prompts, own = toy_responses(0, vocab)
    _, other = toy_responses(1, vocab)
    rewards = torch.tensor([[[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 1.0]],
                            [[1.0, 1.0], [1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]])
    spec = resolve_algorithm("hacpo")
    adv = step_advantages(rewards, batch_capabilities(rewards), spec)
    # the fitted cross-clip bound on: its ratio counts must sum over micro-batches, replicas and stages alike
    run_cfg = trainer_config(lr=1e-3, grad_clip=0.0, micro_batch_size=3, temperature=0.7, total_steps=3,
                             clip_low=0.2, clip_high=0.2, cross_clip_fit_quantile=0.5)
    report = {}
    for name, parallel in zip(layouts, groups):
        if not parallel.is_member:
            continue
        agent = build_agent_model(hf_config, parallel, params_dtype=torch.float32)
        load_hf_state_dict_into_model(agent.model, state, hf_config, parallel)
        trainer = AgentTrainer(agent, spec, run_cfg)
        # the "other agent" is the same weights here: its old means are what matters for the loss
        # old log-probs fixed at step 0, so later steps see ratios away from 1 and clipping at work
        old = [seq_means(trainer, flat(own, prompts)), seq_means(trainer, flat(other, prompts))]
        old[1] = [m - 0.1 for m in old[1]]  # a source policy that differs from the learner's
        rows = learner_rows(0, prompts, [own, other], old, adv.effective, adv.trains_on)
        batches = mini_batches(rows, schedule_for(0, adv.trains_on, mini_batch_size=B))  # 2 updates of 2 prompts
        losses, grads = [], None
        for step in range(3):
            metrics = trainer.train_step(batches)
            losses.extend(m["loss"] for m in metrics)
            if step == 0:
                grads = export_hf_state_dict(agent.model, hf_config, parallel,
                                             tensor_of=lambda p: p.main_grad.detach())
        if parallel.agent_rank == 0:  # the agent's first rank holds the gathered tensors
            report[name] = {"losses": losses, "metrics": metrics[0], "fitted_bound": trainer.cross_clip_fitted,
                            "ratios_counted": float(trainer._step_ratio_histogram.sum())}
            torch.save(grads, out / f"grads_{name}.pt")
    return report


def part_agents(cfg, out):
    groups = create_agent_groups(cfg.agents)
    configs = [load_hf_config_dict(a.model) for a in cfg.agents]
    vocab = min(c["vocab_size"] for c in configs)
    n = len(cfg.agents)
    prompts, _ = toy_responses(10, vocab)
    responses = [toy_responses(20 + j, vocab)[1] for j in range(n)]
    rewards = (torch.rand(n, B, G, generator=torch.Generator().manual_seed(5)) < 0.5).float()
    rewards[0, 0] = torch.tensor([1.0, 0.0])  # no all-equal batch
    spec = resolve_algorithm(cfg.algorithm.name)
    adv = step_advantages(rewards, batch_capabilities(rewards), spec)
    trainers = {}
    for k, (agent_cfg, parallel) in enumerate(zip(cfg.agents, groups)):
        if parallel.is_member:
            agent = build_agent_model(configs[k], parallel, seed=cfg.run.seed + k, params_dtype=torch.float32)
            run_cfg = trainer_config(lr=agent_cfg.lr or cfg.train.lr, micro_batch_size=cfg.train.micro_batch_size,
                                     total_steps=4, alpha=cfg.algorithm.alpha, delta=cfg.algorithm.delta,
                                     delta_step=cfg.algorithm.delta_step)
            trainers[k] = AgentTrainer(agent, spec, run_cfg)
    # every rank hosts every agent here (all on ranks 0-1), so sources' old log-probs are local
    report = {}
    for k, trainer in trainers.items():
        objective = []
        for step in range(5):
            old = [seq_means(trainers[j], flat(responses[j], prompts)) if j in trainers else None for j in range(n)]
            rows = learner_rows(k, prompts, responses, old, adv.effective, adv.trains_on)
            means = seq_means(trainer, [(r.prompt_ids, r.response_ids) for r in rows])
            objective.append(-sum(r.advantage * m for r, m in zip(rows, means)) / len(rows))
            if step < 4:
                metrics = trainer.train_step(mini_batches(rows, schedule_for(k, adv.trains_on,
                                                                             cfg.train.mini_batch_size)))
        report[cfg.agents[k].name] = {"objective": objective, "num_rows": len(rows), "rank_metrics": metrics,
                                      "num_updates": len(metrics), "num_cross": sum(m["num_cross"] for m in metrics),
                                      "num_own": sum(m["num_own"] for m in metrics)}
    return report


def k3_reference(own_rows, token_logp, kl_sequences):
    """float64: mean over own rows of each row's token-mean exp(ref - logp) - (ref - logp) - 1."""
    total = 0.0
    for row in own_rows:
        current = torch.tensor(token_logp[kl_sequences.index((row.prompt_ids, row.response_ids))], dtype=torch.float64)
        diff = torch.tensor(row.ref_token_logp, dtype=torch.float64) - current
        total += float((torch.exp(diff) - diff - 1.0).mean())
    return total / len(own_rows)


def part_kl(hf_config, out, kl_coef=0.5):
    layouts = {"tp1": ParallelConfig(tensor=1, first_rank=0), "dp2": ParallelConfig(data=2, first_rank=0)}
    groups = create_agent_groups([AgentConfig(name=n, model="x", parallel=p) for n, p in layouts.items()])
    hf = hf_model_from_config(hf_config, seed=4)
    vocab = hf_config["vocab_size"]
    prompts, own = toy_responses(30, vocab)
    _, other = toy_responses(31, vocab)
    rewards = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 1.0]],
                            [[1.0, 1.0], [1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]])
    spec = resolve_algorithm("hacpo")
    adv = step_advantages(rewards, batch_capabilities(rewards), spec)
    report = {}
    for name, parallel in zip(layouts, groups):
        if not parallel.is_member:
            continue
        trainers = {}
        for coef in (0.0, kl_coef):
            agent = build_agent_model(hf_config, parallel, params_dtype=torch.float32)
            load_hf_state_dict_into_model(agent.model, hf.state_dict(), hf_config, parallel)
            trainers[coef] = AgentTrainer(agent, spec, trainer_config(lr=1e-3, grad_clip=0.0, micro_batch_size=3,
                                                                      total_steps=1, kl_coef=coef))
        sequences = flat(own, prompts) + flat(other, prompts)
        result = trainers[0.0].sequence_logprobs(sequences)
        token_logp = [result.token_logprobs[i, : int(result.lengths[i])].tolist() for i in range(len(sequences))]
        means = [sum(t) / len(t) for t in token_logp]
        rows = learner_rows(0, prompts, [own, other], [means[: B * G], [m - 0.1 for m in means[B * G:]]],
                            adv.effective, adv.trains_on)
        # a reference policy away from the current one; two bridged answers dropped (one of prompt 0)
        rows = [dataclasses.replace(r, ref_token_logp=[x - 0.3 * ((t % 3) - 1) for t, x in enumerate(token_logp[
                    sequences.index((r.prompt_ids, r.response_ids))])]) if not r.is_cross else r
                for r in rows if not (r.is_cross and (r.prompt_index, r.sample_index) in ((0, 1), (3, 0)))]
        batches = mini_batches(rows, schedule_for(0, adv.trains_on, mini_batch_size=4))  # 2 prompts per update
        first = {coef: trainer.train_step(batches)[0] for coef, trainer in trainers.items()}
        own_rows = [r for r in batches[0] if not r.is_cross]
        mixed = [sum(r.is_cross for r in batches[0][i:i + 3]) for i in range(0, len(batches[0]), 3)]
        report[name] = {"loss_difference": first[kl_coef]["loss"] - first[0.0]["loss"],
                        "kl_logged": first[kl_coef]["kl"],
                        "kl_reference": k3_reference(own_rows, token_logp, sequences), "kl_coef": kl_coef,
                        "micro_batch_cross_counts": mixed, "first_update_rows": len(batches[0])}
    return report


def main(config_path: str, out: Path) -> None:
    import faulthandler
    import os
    if os.environ.get("HACPO_DEBUG_HANG"):
        faulthandler.dump_traceback_later(float(os.environ["HACPO_DEBUG_HANG"]), exit=True)
    init_distributed()
    rank = dist.get_rank()
    cfg = load_config(config_path)
    first = load_hf_config_dict(cfg.agents[0].model)
    report = {"layouts": part_layouts(first, out), "agents": part_agents(cfg, out), "kl": part_kl(first, out)}
    (out / f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
