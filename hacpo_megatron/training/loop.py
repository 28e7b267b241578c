"""Algorithm 1 of the paper across the torchrun world: the loop every rank runs.

    for each step:
      1. sample B prompts                       (every rank: the same seeded sampler)
      2. every agent generates G responses      (rank 0 drives the engine actors, all agents at once)
      3. score all n*B*G responses              (rank 0, reward actor with time limits)
         1-3: orchestrator/rollout_pipeline.py; with rollout.max_staleness = k >= 1 for steps t+1..t+k while t trains
      4. capabilities P_k, advantages A~        (every rank, deterministic from the broadcast rewards)
      5. old log-probs of own responses         (each agent on its ranks, shared with every rank)
      6. learner k: own + bridged rows, M updates of the loss     (each agent on its ranks;
                                                                    M from train.mini_batch_size: batch.UpdateSchedule)
      7. push new weights to k's engine         (each agent, from its engine rank)
      8. log; evaluate every K steps; checkpoint

Agents sharing ranks run their phases one after another (time-sharing); agents on disjoint ranks
run theirs at the same time. Rank 0 is the driver of everything that is not per agent.
Debug modes (run.mode) are parts chosen once when the run is built, so the steps below never ask which: the
learner side (training/learner_side.py: none in rollout_only, which skips 5-7) and the engine side
(orchestrator/engine_side.py: none in train_only, which reads 2-3 from the folder an earlier run wrote with
--save-rollouts, rollout/replay.py).
"""
from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Union

import numpy as np
import torch
import torch.distributed as dist

from hacpo_megatron.algorithms import AlgorithmSpec, CapabilityTracker, step_advantages
from hacpo_megatron.algorithms.registry import algorithm_spec
from hacpo_megatron.config import Config, config_to_dict, dump_config
from hacpo_megatron.data import PromptSampler
from hacpo_megatron.orchestrator.engine_side import EngineSide, engine_side
from hacpo_megatron.orchestrator.lifecycle import RunLifecycle
from hacpo_megatron.orchestrator.preemption import Preempted
from hacpo_megatron.orchestrator.rollout_pipeline import ReplayedRollouts, RolloutPipeline, held_out_answers
from hacpo_megatron.parallel.groups import AgentParallel, init_distributed
from hacpo_megatron.parallel.layout import required_world_size
from hacpo_megatron.reporting.step_records import step_records
from hacpo_megatron.rollout.replay import save_step
from hacpo_megatron.rollout.weight_sync import engine_rank
from hacpo_megatron.training import run_checkpoints
from hacpo_megatron.training.agents import Agents, build_agents
from hacpo_megatron.training.learner_side import LearnerSide, learner_side
from hacpo_megatron.training.preflight import check_device, check_inputs
from hacpo_megatron.training.provider import ModelProvider
from hacpo_megatron.training.settings import RunSettings, run_settings
from hacpo_megatron.training.step_data import load_prompt_sets, rewards_tensor, rollout_stats
from hacpo_megatron.training.trainer import time_gemm_peaks_in_turn


@dataclass
class RunOptions:
    output_dir: str
    resume: bool = False
    ray_address: Optional[str] = None
    weight_check: bool = False  # verify engine weights after every sync
    save_rollouts: Optional[str] = None  # write every step's answers and rewards here (rollout/replay.py)
    load_rollouts: Optional[str] = None  # run.mode train_only: read them from here instead of any engine


@dataclass
class Run:
    """What every step of a run reads: the algorithm, this rank's agents, the engine side (engines, or in run.mode
    train_only none), the source of each step's answers (the engines' RolloutPipeline, or ReplayedRollouts), the
    learner side (none in run.mode rollout_only), the capability tracker, the run's options and settings (G', each
    agent's answers per prompt, and step 4's: training/settings.py)."""

    spec: AlgorithmSpec
    agents: Agents
    engines: EngineSide  # orchestrator/engine_side.py: RayEngines, or SavedAnswers (train_only)
    answers: Union[RolloutPipeline, ReplayedRollouts]  # each step's answers: from the engines, or as saved
    learners: LearnerSide  # training/learner_side.py: Learners, or NoLearners (rollout_only)
    tracker: CapabilityTracker
    options: RunOptions
    settings: RunSettings


def run_hacpo(cfg: Config, options: RunOptions, model_provider: ModelProvider) -> None:
    check_inputs(cfg, output_dir=options.output_dir, resume=options.resume,  # InputError before any work
                 save_rollouts=options.save_rollouts, load_rollouts=options.load_rollouts)
    check_device(cfg.run.device)
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    if cfg.train.cpu_threads and not torch.cuda.is_available():
        torch.set_num_threads(cfg.train.cpu_threads)
    needed = required_world_size(cfg.agents)
    if world != needed:
        raise SystemExit(f"the config's agents need {needed} processes (torchrun --nproc_per_node={needed}), "
                         f"got {world}")
    # verified; each agent's optimizer state loadable at its layout
    resume_from = run_checkpoints.choose_checkpoint(options.output_dir, cfg.agents) if options.resume else None
    spec = algorithm_spec(cfg.algorithm)
    settings = run_settings(cfg, spec, weight_check=options.weight_check)  # each part's, resolved once
    n, B = len(cfg.agents), cfg.data.prompt_batch_size
    if rank == 0:
        os.makedirs(options.output_dir, exist_ok=True)
        dump_config(cfg, os.path.join(options.output_dir, "config.yaml"))
    _seed_everything(cfg.run.seed)

    agents = build_agents(cfg, spec, model_provider)
    run_checkpoints.save_tokenizers(options.output_dir, agents)
    engines = engine_side(settings.actors, settings.generation,
                          saved_answers=options.load_rollouts)  # none in train_only
    learners = learner_side(cfg.run.mode, settings.learners, rank)  # none in rollout_only
    with RunLifecycle(options.ray_address) as lifecycle:  # Ray, the reporter, the signal handlers: ended at exit
        reward_actor = engines.start(lifecycle, agents, rank, options.output_dir)
        train_set, eval_set = load_prompt_sets(cfg.data, cfg.rollout.max_prompt_length, agents.tokenizers,
                                               options.output_dir)
        eval_set = engines.held_out(eval_set, rank)  # none without engines to answer
        sampler = PromptSampler(train_set, B, seed=cfg.run.seed, shuffle=cfg.data.shuffle)
        tracker = CapabilityTracker(n, cfg.algorithm.capability_window, reward_range=settings.advantages.reward_range)

        start_step = 0
        if resume_from:
            start_step = run_checkpoints.load_checkpoint(resume_from, options.output_dir, agents, tracker, sampler)
        engines.deliver(agents, agents.hosted)  # the trainers' weights, at the start or the checkpoint's
        time_gemm_peaks_in_turn(list(agents.trainers.values()))  # perf/mfu's denominator, engines loaded and idle

        answers = engines.answers(agents, sampler, reward_actor, start_step)
        run = Run(spec, agents, engines, answers, learners, tracker, options, settings)
        reporter = lifecycle.reporting(_reporter(cfg, agents, options, start_step)) if rank == 0 else None
        if start_step == 0 and cfg.data.eval_every and eval_set:
            held_out = held_out_answers(settings.generation, agents, eval_set, reward_actor, done=0)  # collective
            if rank == 0:
                reporter.log_held_out(0, held_out)
        preemption = lifecycle.watch_signals()
        for step in range(start_step, cfg.run.total_steps):
            records = _hacpo_step(run, step)
            if rank == 0:
                reporter.log_step(step + 1, records)
            done = step + 1
            if cfg.data.eval_every and eval_set and (done % cfg.data.eval_every == 0 or done == cfg.run.total_steps):
                held_out = held_out_answers(settings.generation, agents, eval_set, reward_actor, done)  # collective
                if rank == 0:
                    reporter.log_held_out(done, held_out)
            stop = preemption.stop_requested()  # collective: a signal to any rank ends the run here
            saved = None  # nothing learnt (learners.trains false), nothing to keep
            if learners.trains and (stop or _checkpoint_due(cfg, done)):
                saved = run_checkpoints.save(options.output_dir, done, agents, tracker, answers.sampler_state(),
                                             keep_last=cfg.checkpoint.keep_last)
            if stop:
                raise Preempted(preemption.signal_name, done, saved)


# ---------------------------------------------------------------------------------------- one step
def _hacpo_step(run: Run, step: int) -> List[Dict[str, float]]:
    agents, options = run.agents, run.options
    rank, n = dist.get_rank(), len(agents.configs)
    times: Dict[str, float] = {}
    t_step = time.perf_counter()

    # 1-3. prompts, rollouts and rewards (run.mode train_only: as saved by an earlier run)
    work = run.answers.step_rollouts(step, times)  # from the engines, or as an earlier run saved them (train_only)
    prompts, rollouts, scores, reward_stats = work.prompts, work.rollouts, work.scores, work.reward_stats
    B = len(prompts)
    if options.save_rollouts and rank == 0:
        save_step(options.save_rollouts, step + 1, agents.names, prompts, rollouts, scores, reward_stats)
    rewards = rewards_tensor(scores, n, B, run.settings.answers_per_prompt)

    # 4. capabilities and advantages
    capabilities = run.tracker.update(rewards)
    a = run.settings.advantages  # algorithm.omega_clamp, algorithm.advantage_eps, reward.range
    advantages = step_advantages(rewards, capabilities, run.spec, omega_clamp=a.omega_clamp, eps=a.eps,
                                 reward_range=a.reward_range)

    # 5-7. old log-probs, then each hosted learner: bridge, train; push weights (training/learner_side.py)
    gaps, local = run.learners.step(run, work, advantages, times)

    # 8. metrics: each agent's output rank reports; rank 0 assembles one record per agent
    reported = [None] * dist.get_world_size()
    dist.all_gather_object(reported, {k: _reportable(m, agents.parallel[k]) for k, m in local.items()})
    if rank != 0:
        return []
    per_agent: Dict[int, Dict[str, float]] = {k: {} for k in range(n)}
    for part in reported:
        for k, m in part.items():
            per_agent[k].update(m)
    store = run.engines.store_stats()  # at the step's end: back to its baseline?
    return step_records(step + 1, agents.names, rewards, capabilities, advantages.omega, reward_stats,
                        before_capability=[{**gaps.get(k, {}), **work.metrics.get(k, {})} for k in range(n)],
                        after_capability=[{**per_agent[k], **rollout_stats(rollouts[k])} for k in range(n)],
                        shared={**store, **times}, started=t_step, untrained=not run.learners.trains)


def _reportable(metrics: Dict[str, float], parallel: AgentParallel) -> Dict[str, float]:
    """What this rank reports of an agent's step: its output rank the step's figures, its engine
    rank (another stage when PP > 1) what went to the engine, other ranks nothing."""
    def reports(key: str) -> bool:
        return parallel.rank == engine_rank(parallel) if key.startswith("weight_sync/") else parallel.agent_rank == 0

    return {key: v for key, v in metrics.items() if reports(key)}


# ---------------------------------------------------------------------------------------- set-up
def _checkpoint_due(cfg: Config, done: int) -> bool:
    every = cfg.checkpoint.save_every
    if every < 0:
        return False  # never (a preemption signal still saves)
    return bool(every and done % every == 0) or done == cfg.run.total_steps


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


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
