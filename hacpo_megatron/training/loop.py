"""Algorithm 1 of the paper across the torchrun world: the loop every rank runs.

    for each step:
      1. sample B prompts                       (every rank: the same seeded sampler)
      2. every agent generates G responses      (rank 0 drives the engine actors, all agents at once)
      3. score all n*B*G responses              (rank 0, reward actor with time limits)
         1-3: orchestrator/rollouts.py; with rollout.max_staleness = k >= 1 for steps t+1..t+k while t trains
      4. capabilities P_k, advantages A~        (every rank, deterministic from the broadcast rewards)
      5. old log-probs of own responses         (each agent on its ranks, shared with every rank)
      6. learner k: own + bridged rows, M updates of the loss     (each agent on its ranks;
                                                                    M from train.mini_batch_size: batch.UpdateSchedule)
      7. push new weights to k's engine         (each agent, from its engine rank)
      8. log; evaluate every K steps; checkpoint

Agents sharing ranks run their phases one after another (time-sharing); agents on disjoint ranks
run theirs at the same time. Rank 0 is the driver of everything that is not per agent.
Debug modes (run.mode): rollout_only skips 5-7; train_only starts no engine and reads 2-3 from the folder
an earlier run wrote with --save-rollouts (rollout/replay.py).
"""
from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import numpy as np
import ray
import torch
import torch.distributed as dist

from hacpo_megatron.algorithms import CapabilityTracker, step_advantages
from hacpo_megatron.algorithms.registry import algorithm_spec
from hacpo_megatron.bridge import load_tokenizer, render_prompts
from hacpo_megatron.config import Config, config_to_dict, dump_config
from hacpo_megatron.data import PromptSampler, load_prompts
from hacpo_megatron.models.build import AgentModel
from hacpo_megatron.models.presets import load_hf_config_dict
from hacpo_megatron.orchestrator.preemption import Preempted, PreemptionGuard
from hacpo_megatron.orchestrator.ray_runtime import RayRuntime, object_store_stats
from hacpo_megatron.orchestrator.rollouts import RolloutPipeline, held_out_scores, kill_actor
from hacpo_megatron.orchestrator.startup import start_actors
from hacpo_megatron.orchestrator.weight_delivery import (
    push_all_weights, push_weights, resend_to_lost_engines, restore_restarted_engines,
)
from hacpo_megatron.parallel.groups import AgentParallel, create_agent_groups, init_distributed
from hacpo_megatron.parallel.layout import required_world_size
from hacpo_megatron.reporting.records import REQUIRED_KEYS
from hacpo_megatron.rollout.replay import load_step, save_step
from hacpo_megatron.rollout.weight_sync import engine_rank
from hacpo_megatron.training import checkpointing
from hacpo_megatron.training.batch import UpdateSchedule, mini_batches
from hacpo_megatron.training.preflight import check_device, check_inputs
from hacpo_megatron.training.provider import ModelProvider
from hacpo_megatron.training.step_data import (
    OldLogProbs, check_engine_logprobs, drop_overlong_prompts, engine_old_logprobs, learner_rows, own_sequences,
    rewards_tensor, rollout_stats, with_learner_old_logprobs,
)
from hacpo_megatron.training.trainer import AgentTrainer, time_gemm_peaks_in_turn


@dataclass
class RunOptions:
    output_dir: str
    resume: bool = False
    ray_address: Optional[str] = None
    kill_engine_at_step: Optional[int] = None  # fault injection for tests: kill agent 0's engine once
    kill_reward_at_step: Optional[int] = None  # ... or the reward actor, once
    kill_engine_in_sync_at_step: Optional[int] = None  # ... or agent 0's engine amid that step's weight push
    kill_engine_before_step: Optional[int] = None  # ... or before the step begins, unseen (as Ray's memory monitor)
    kill_engine_in_eval_at_step: Optional[int] = None  # ... or while it answers the held-out problems after that step
    weight_check: bool = False  # verify engine weights after every sync
    leak_mib_per_step: int = 0  # tests of tools/soak.py: rank 0 keeps every step's rollouts and this much more alive
    save_rollouts: Optional[str] = None  # write every step's answers and rewards here (rollout/replay.py)
    load_rollouts: Optional[str] = None  # run.mode train_only: read them from here instead of any engine


@dataclass
class Agents:
    """This rank's view of the agents: configs and tokenizers of all, models and trainers of its own."""

    configs: list
    parallel: List[AgentParallel]
    hf_configs: List[Dict[str, Any]]
    tokenizers: list
    trainers: Dict[int, AgentTrainer] = field(default_factory=dict)
    models: Dict[int, AgentModel] = field(default_factory=dict)  # run.mode rollout_only: weights, no learner
    references: Dict[int, AgentModel] = field(default_factory=dict)
    engines: Dict[int, Any] = field(default_factory=dict)  # EngineActor handles (rank 0 and engine ranks)
    senders: Dict[int, Any] = field(default_factory=dict)  # weight transport to k's engine (k's engine rank)
    engine_logprobs_checked: bool = False  # rollout.old_logprobs=engine: the trainer's pass has vouched for them
    engines_running: bool = True  # False in run.mode train_only: no engine, no weight push (weight_delivery.py)

    @property
    def names(self) -> List[str]:
        return [a.name for a in self.configs]

    @property
    def hosted(self) -> List[int]:
        """The agents this rank holds a part of (as a learner, or as weights only in rollout_only)."""
        return sorted({*self.trainers, *self.models})

    def policy(self, k: int):
        """Agent k's GPTModel on this rank: the weights its engine is given."""
        return self.trainers[k].ddp_model.module if k in self.trainers else self.models[k].model


def run_hacpo(cfg: Config, options: RunOptions, model_provider: ModelProvider) -> None:
    check_inputs(cfg, output_dir=options.output_dir, resume=options.resume,  # InputError before any work
                 save_rollouts=options.save_rollouts, load_rollouts=options.load_rollouts)
    check_device(cfg)
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    if cfg.train.cpu_threads and not torch.cuda.is_available():
        torch.set_num_threads(cfg.train.cpu_threads)
    needed = required_world_size(cfg.agents)
    if world != needed:
        raise SystemExit(f"the config's agents need {needed} processes (torchrun --nproc_per_node={needed}), "
                         f"got {world}")
    spec = algorithm_spec(cfg.algorithm)
    n, B = len(cfg.agents), cfg.data.prompt_batch_size
    G = cfg.rollout.samples_per_prompt * spec.samples_multiplier
    if rank == 0:
        os.makedirs(options.output_dir, exist_ok=True)
        dump_config(cfg, os.path.join(options.output_dir, "config.yaml"))
    _seed_everything(cfg.run.seed)

    agents = Agents(configs=list(cfg.agents), parallel=create_agent_groups(cfg.agents),
                    hf_configs=[load_hf_config_dict(a.model) for a in cfg.agents],
                    tokenizers=[load_tokenizer(_tokenizer_name(a), a.prompt_format) for a in cfg.agents])
    for k, (agent_cfg, parallel) in enumerate(zip(cfg.agents, agents.parallel)):
        if parallel.is_member:
            model = model_provider(agent_cfg, parallel, agents.hf_configs[k], cfg.run.seed + k)
            if cfg.run.mode == "rollout_only":
                agents.models[k] = model  # its engine's weights; no learner (no optimizer, no update)
                continue
            agents.trainers[k] = AgentTrainer(model, spec, cfg, lr=agent_cfg.lr)
            if cfg.algorithm.kl_coef > 0:
                agents.references[k] = model_provider(agent_cfg, parallel, agents.hf_configs[k], cfg.run.seed + k)

    checkpointing.save_tokenizers(options.output_dir, agents)
    if rank == 0 and cfg.run.mode == "rollout_only":
        print("run.mode rollout_only: no learner; the engines answer with the initial weights throughout", flush=True)
    runtime, reward_actor = None, None
    agents.engines_running = cfg.run.mode != "train_only"  # train_only: answers and rewards from --load-rollouts
    if agents.engines_running:
        runtime = RayRuntime.connect(options.ray_address)
        agents.engines, agents.senders, reward_actor = start_actors(
            cfg, agents.parallel, agents.hf_configs, [_tokenizer_name(a) for a in cfg.agents], rank, options.output_dir)
    train_set, eval_set = _load_data(cfg, agents, options)
    if not agents.engines_running and eval_set:
        eval_set = []  # no engine to answer the held-out problems
        if rank == 0:
            print("run.mode train_only: no held-out evaluation (no engine to answer)", flush=True)
    sampler = PromptSampler(train_set, B, seed=cfg.run.seed, shuffle=cfg.data.shuffle)
    tracker = CapabilityTracker(n, cfg.algorithm.capability_window, reward_range=_reward_range(cfg))

    start_step = 0
    if options.resume:
        start_step = checkpointing.load_latest(options.output_dir, agents, tracker, sampler)
    push_all_weights(agents, options.weight_check)
    time_gemm_peaks_in_turn(list(agents.trainers.values()))  # perf/mfu's denominator, engines loaded and idle

    pipeline = (RolloutPipeline(cfg, agents, sampler, reward_actor, G, options, start_step)
                if agents.engines_running else None)
    reporter = _reporter(cfg, agents, options, start_step) if rank == 0 else None
    if start_step == 0 and cfg.data.eval_every and eval_set:
        scores = held_out_scores(cfg, agents, eval_set, reward_actor, options, done=0)  # collective
        if rank == 0:
            reporter.log_held_out(0, scores)
    finished = False
    preemption = PreemptionGuard.install()
    try:
        for step in range(start_step, cfg.run.total_steps):
            records = _hacpo_step(step, cfg, spec, agents, sampler, pipeline, tracker, options, G)
            if rank == 0:
                reporter.log_step(step + 1, records)
            done = step + 1
            if cfg.data.eval_every and eval_set and (done % cfg.data.eval_every == 0 or done == cfg.run.total_steps):
                scores = held_out_scores(cfg, agents, eval_set, reward_actor, options, done)  # collective
                if rank == 0:
                    reporter.log_held_out(done, scores)
            stop = preemption.stop_requested()  # collective: a signal to any rank ends the run here
            keeps = cfg.run.mode != "rollout_only"  # rollout_only learns nothing: no checkpoint to keep
            if keeps and (stop or _checkpoint_due(cfg, done)):
                checkpointing.save(options.output_dir, done, agents, tracker,
                                   pipeline.sampler_state() if pipeline else sampler.state_dict(),
                                   keep_last=cfg.checkpoint.keep_last)
            if stop:
                raise Preempted(preemption.signal_name, done,
                                checkpointing.step_folder(options.output_dir, done) if keeps else None)
        finished = True
    except Preempted:
        finished = True  # every rank stopped at the same step boundary, its checkpoint written: an orderly end
        raise
    finally:
        preemption.uninstall()
        if reporter is not None:
            reporter.close(failed=not finished)
        if finished:  # an orderly end: the others leave Ray first, then rank 0 stops it
            if rank == 0 and reward_actor is not None:
                ray.get(reward_actor.close.remote())
            dist.barrier()
            if rank != 0 and runtime is not None:
                runtime.shutdown()
            dist.barrier()
        # After an error no collective may run (the other ranks may be anywhere): leave Ray and
        # let the exception end this process, so that torchrun stops the others.
        if (rank == 0 or not finished) and runtime is not None:
            runtime.shutdown()


# ---------------------------------------------------------------------------------------- one step
def _hacpo_step(step, cfg, spec, agents: Agents, sampler, pipeline, tracker, options, G) -> List[Dict[str, float]]:
    rank, n = dist.get_rank(), len(agents.configs)
    times: Dict[str, float] = {}
    t_step = time.perf_counter()
    if rank == 0 and options.kill_engine_before_step == step:
        kill_actor(agents.engines[0])
    restore_restarted_engines(agents, options.weight_check)  # an engine Ray restarted since its last push

    # 1-3. prompts, rollouts and rewards (run.mode train_only: as saved by an earlier run)
    if pipeline is not None:
        work = pipeline.step_rollouts(step, times)
        prompts, prompt_ids, rollouts, scores, reward_stats = (work.prompts, work.prompt_ids, work.rollouts,
                                                                work.scores, work.reward_stats)
        pipeline_metrics = work.metrics
    else:
        prompts = sampler.next_batch()
        prompt_ids = [render_prompts(tok, prompts) for tok in agents.tokenizers]
        t = time.perf_counter()
        rollouts, scores, reward_stats = load_step(options.load_rollouts, step + 1, agents.names, prompts, G)
        times.update({"time/rollout": time.perf_counter() - t, "time/reward": 0.0})
        pipeline_metrics = {}
    B = len(prompts)
    if options.save_rollouts and rank == 0:
        save_step(options.save_rollouts, step + 1, agents.names, prompts, rollouts, scores, reward_stats)
    if options.leak_mib_per_step and rank == 0:
        _LEAKED.append((rollouts, np.ones(options.leak_mib_per_step << 20, dtype=np.uint8)))  # every page touched
    rewards = rewards_tensor(scores, n, B, G)

    # 4. capabilities and advantages
    capabilities = tracker.update(rewards)
    advantages = step_advantages(rewards, capabilities, spec, omega_clamp=_omega_clamp(cfg),
                                 eps=cfg.algorithm.advantage_eps, reward_range=_reward_range(cfg))

    # 5-7. old log-probs, then each hosted learner: bridge, train, push weights (run.mode rollout_only: none)
    gaps, local = {}, {}
    if cfg.run.mode != "rollout_only":
        gaps, local = _train_learners(cfg, spec, agents, prompts, prompt_ids, rollouts, advantages, options, B, G,
                                      times)

    # 8. metrics: each agent's output rank reports; rank 0 assembles one record per agent
    reported = [None] * dist.get_world_size()
    dist.all_gather_object(reported, {k: _reportable(m, agents.parallel[k]) for k, m in local.items()})
    if rank != 0:
        return []
    per_agent: Dict[int, Dict[str, float]] = {k: {} for k in range(n)}
    for part in reported:
        for k, m in part.items():
            per_agent[k].update(m)
    records = []
    untrained = {key: float("nan") for key in REQUIRED_KEYS} if cfg.run.mode == "rollout_only" else {}
    store = object_store_stats() if agents.engines_running else {}  # at the step's end: back to its baseline?
    for k in range(n):
        record = {**untrained, "step": step + 1, "agent": agents.names[k], "reward_mean": float(rewards[k].mean()),
                  **gaps.get(k, {}), **pipeline_metrics.get(k, {}),
                  "capability": float(capabilities[k]), **per_agent[k], **rollout_stats(rollouts[k]),
                  **{f"omega_from/{agents.names[j]}": float(advantages.omega[j, k]) for j in range(n) if j != k},
                  **{f"reward/{key}": float(v) for key, v in reward_stats.items() if isinstance(v, (int, float))},
                  **store, **{key: v for key, v in times.items()}}
        record["time/step"] = time.perf_counter() - t_step
        records.append(record)
    return records


def _train_learners(cfg, spec, agents: Agents, prompts, prompt_ids, rollouts, advantages, options, B, G, times):
    """Steps 5-7: ({k: engine/trainer log-prob gap}, {k: this rank's figures of hosted learner k's update})."""
    # 5. old log-probs of own responses, shared with every rank: the trainer's pass, or the engine's own
    #    (rollout.old_logprobs: engine) once that pass has found them close enough on the run's first step
    t = time.perf_counter()
    old, gaps = _behaviour_logprobs(cfg, spec, agents, prompt_ids, rollouts)
    # answers from older weights (rollout.max_staleness >= 1): the engines' log-probs are the behaviour policy
    behaviour = [engine_old_logprobs(r) for r in rollouts] if cfg.rollout.max_staleness else None
    reference = {k: _agent_logprobs(agents.trainers[k], agents.references[k], own_sequences(prompt_ids[k], rollouts[k]))
                 for k in agents.references}
    times["time/logprob"] = time.perf_counter() - t

    # 6-7. each hosted learner: bridge, train, push weights
    local: Dict[int, Dict[str, float]] = {}
    for k, trainer in agents.trainers.items():
        t = time.perf_counter()
        rows, bridge_stats = learner_rows(k, prompts=prompts, rollouts=rollouts, old=old,
                                          effective=advantages.effective, trains_on=advantages.trains_on,
                                          tokenizers=agents.tokenizers, prompt_ids=prompt_ids,
                                          ref_token_logp=reference.get(k), behaviour=behaviour)
        if spec.cross_old_logprob == "learner":  # Naive: other agents' rows are rated like own ones
            cross = [(r.prompt_ids, r.response_ids) for r in rows if r.is_cross]
            rows = with_learner_old_logprobs(rows, _agent_logprobs(trainer, None, cross))
        t_bridge = time.perf_counter() - t
        t = time.perf_counter()
        schedule = UpdateSchedule(B, G, sources=tuple(int(j) for j in advantages.trains_on[k].nonzero()),
                                  rows_per_update=cfg.train.mini_batch_size * cfg.rollout.samples_per_prompt)
        updates = trainer.train_step(mini_batches(rows, schedule))
        t_train = time.perf_counter() - t
        t = time.perf_counter()
        sync = push_weights(agents, k, options.weight_check)
        local[k] = {**_mean_over_updates(updates), **bridge_stats, **sync,
                    "time/bridge": t_bridge, "time/train": t_train, "time/weight_sync": time.perf_counter() - t}
    resend_to_lost_engines(agents, options.weight_check, local)  # an engine that died amid its push: sent again
    return gaps, local


def _reportable(metrics: Dict[str, float], parallel: AgentParallel) -> Dict[str, float]:
    """What this rank reports of an agent's step: its output rank the step's figures, its engine
    rank (another stage when PP > 1) what went to the engine, other ranks nothing."""
    def reports(key: str) -> bool:
        return parallel.rank == engine_rank(parallel) if key.startswith("weight_sync/") else parallel.agent_rank == 0

    return {key: v for key, v in metrics.items() if reports(key)}


def _engine_trainer_logprob_gap(completions, old: OldLogProbs) -> Dict[str, float]:
    """|engine log-prob - trainer log-prob| of the sampled tokens, largest and mean: ~0 when the engine
    samples from the trainer's weights at the trainer's temperature (a broken weight sync shows here)."""
    flat = [c for group in completions for c in group]
    gaps = [abs(a - b) for c, tokens in zip(flat, old.tokens) for a, b in zip(c.logprobs, tokens)]
    return {"rollout/logprob_diff_max": max(gaps), "rollout/logprob_diff_mean": float(np.mean(gaps))}


# Per-update values whose mean over a step says nothing: the step's record shows the last update's, or the largest.
LAST_UPDATE_KEYS = ("cross_clip_lower_bound", "update_index")
LARGEST_OVER_UPDATES_KEYS = ("micro_batch_tokens_max",)


def _mean_over_updates(updates: List[Dict[str, float]]) -> Dict[str, float]:
    keys = dict.fromkeys(key for u in updates for key in u)
    values = {key: [u.get(key, float("nan")) for u in updates] for key in keys}
    out = {key: float(np.nanmean(v)) if any(np.isfinite(v)) else float("nan") for key, v in values.items()}
    out.update({key: float(updates[-1].get(key, float("nan"))) for key in LAST_UPDATE_KEYS if key in keys})
    out.update({key: float(np.nanmax(values[key])) for key in LARGEST_OVER_UPDATES_KEYS
                if key in keys and any(np.isfinite(values[key]))})
    out["num_updates"] = float(len(updates))
    return out


# ---------------------------------------------------------------------------------------- phases
def _behaviour_logprobs(cfg: Config, spec, agents: Agents, prompt_ids, rollouts):
    """Every agent's old log-probs, and {k: engine/trainer gap} on the steps that ran the trainer's pass."""
    if cfg.rollout.old_logprobs == "engine" and agents.engine_logprobs_checked:
        return [engine_old_logprobs(r) for r in rollouts], {}
    old = _old_logprobs(agents, prompt_ids, rollouts)
    gaps = {k: _engine_trainer_logprob_gap(rollouts[k], old[k]) for k in range(len(old))}
    if cfg.rollout.old_logprobs == "engine":
        clip = cfg.algorithm.grpo_clip_low if spec.policy_loss == "grpo" else cfg.algorithm.clip_low
        check_engine_logprobs({agents.names[k]: gap for k, gap in gaps.items()}, clip=clip)
        agents.engine_logprobs_checked = True
    return old, gaps


def _old_logprobs(agents: Agents, prompt_ids, rollouts) -> List[OldLogProbs]:
    local = {}
    for k, trainer in agents.trainers.items():
        result = _agent_logprobs(trainer, None, own_sequences(prompt_ids[k], rollouts[k]))
        if agents.parallel[k].agent_rank == 0:
            local[k] = result
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    merged = {k: v for part in gathered for k, v in part.items()}
    return [OldLogProbs(sums=[sum(t) for t in merged[k]], lengths=[len(t) for t in merged[k]], tokens=merged[k])
            for k in range(len(agents.configs))]


def _agent_logprobs(trainer: AgentTrainer, model: Optional[AgentModel], sequences) -> List[List[float]]:
    """Per-token log-probs of `sequences`, each data-parallel replica a share, gathered over DP."""
    parallel = trainer.parallel
    mine = sequences[parallel.dp_rank::parallel.dp_size]
    if model is None:
        result = trainer.sequence_logprobs(mine)
    else:  # a frozen reference model of the same layout
        from hacpo_megatron.models.logprobs import compute_sequence_logprobs

        result = compute_sequence_logprobs(model, mine, temperature=trainer.temperature,
                                           max_sequences_per_micro_batch=trainer.train.micro_batch_size,
                                           max_tokens_per_micro_batch=trainer.train.max_tokens_per_micro_batch,
                                           share_prompts=trainer.share_prompts)
    tokens = [result.token_logprobs[i, : int(result.lengths[i])].tolist() for i in range(len(mine))]
    if parallel.dp_size == 1:
        return tokens
    shares = [None] * parallel.dp_size
    dist.all_gather_object(shares, tokens, group=parallel.dp_group)
    out = [None] * len(sequences)
    for r, share in enumerate(shares):
        out[r::parallel.dp_size] = share
    return out


# ---------------------------------------------------------------------------------------- set-up
def _load_data(cfg: Config, agents: Agents, options: RunOptions):
    """Training and held-out prompts; those longer than rollout.max_prompt_length for any agent are left
    out and counted (the log, run_info.json and the summary say how many)."""
    splits = {"train": load_prompts(cfg.data.train, "train"),
              "eval": load_prompts(cfg.data.eval, "eval")[: cfg.data.eval_max_prompts] if cfg.data.eval else []}
    skipped = {}
    for split, prompts in splits.items():
        splits[split], skipped[split] = drop_overlong_prompts(prompts, agents.tokenizers, cfg.rollout.max_prompt_length)
        if prompts and not splits[split]:
            raise SystemExit(f"all {len(prompts)} {split} prompts of {getattr(cfg.data, split)} are longer than "
                             f"rollout.max_prompt_length={cfg.rollout.max_prompt_length} tokens")
    if dist.get_rank() == 0:
        if any(skipped.values()):
            print(f"skipped prompts longer than rollout.max_prompt_length={cfg.rollout.max_prompt_length} tokens: "
                  f"{skipped['train']} of {cfg.data.train}, {skipped['eval']} of {cfg.data.eval}", flush=True)
        from hacpo_megatron.reporting import update_run_info

        update_run_info(options.output_dir, {"prompts": {
            split: {"used": len(splits[split]), "skipped_overlong": skipped[split]} for split in splits}})
    return splits["train"], splits["eval"]


def _checkpoint_due(cfg: Config, done: int) -> bool:
    every = cfg.checkpoint.save_every
    if every < 0:
        return False  # never (a preemption signal still saves)
    return bool(every and done % every == 0) or done == cfg.run.total_steps


_LEAKED: List[Any] = []  # RunOptions.leak_mib_per_step: a leak the soak tool's test must find


def _reporter(cfg: Config, agents: Agents, options: RunOptions, start_step: int):
    from hacpo_megatron.reporting import RunReporter
    from hacpo_megatron.reporting.trackers import flat_params

    # Records are numbered by completed steps (1-based); a resumed run keeps those up to its
    # checkpoint's step and rewrites anything logged after it (steps the crash made it redo).
    keep_before = start_step + 1 if options.resume else 0
    log = cfg.logging
    return RunReporter(options.output_dir, agents.names, total_steps=cfg.run.total_steps, trackers=log.trackers,
                       plots=log.plots, progress_bar=log.progress_bar, start_step=keep_before, project=log.project,
                       run_name=cfg.run.name, params=flat_params(config_to_dict(cfg)),
                       mlflow_tracking_uri=log.mlflow_tracking_uri)


def _tokenizer_name(agent_cfg) -> str:
    """A built-in tokenizer name or a folder: `tokenizer`, else the weights' or the model's folder."""
    return agent_cfg.tokenizer or agent_cfg.init_from or agent_cfg.model


def _reward_range(cfg: Config):
    return tuple(cfg.reward.range) if cfg.reward.range is not None else None


def _omega_clamp(cfg: Config):
    return tuple(cfg.algorithm.omega_clamp) if cfg.algorithm.omega_clamp is not None else None


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
