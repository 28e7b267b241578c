"""Each step's answers and rewards (steps 1-3 of Algorithm 1), generated up to rollout.max_staleness steps ahead.

    pipeline = RolloutPipeline(settings, agents, sampler, reward_actor, start_step)   # settings: GenerationSettings
    work = pipeline.step_rollouts(step, times)   # every rank: prompts, answers, scores, weight versions
    ... train step `step`, push the new weights ...
    pipeline.sampler_state()                     # what a checkpoint keeps of the sampler (in-flight steps undrawn)
    held_out_answers(settings, agents, eval_set, reward_actor, done)  # every rank; figures on rank 0

With k = 0 a step's prompts are drawn and answered when the step begins: the synchronous loop, the paper's
algorithm. With k >= 1 the engines answer steps t+1 .. t+k while the learners train step t
(orchestrator/generation_schedule.py says why each answer's weight version is known without asking the engines); the
learners then correct for the older weights (docs/algorithm.md, "Answers from older weights"). Rank 0 drives the
engines and the reward actor and broadcasts what they return. An engine that died is given the current weights again
and answers its step again, from those weights: its rows are then on-policy (`generated_by` per agent says so).

A checkpoint does not keep answers in flight: a resumed run draws those steps' prompts again (`sampler_state`) and
generates them from the checkpoint's weights, so nothing is trained twice or skipped; its first steps are then
less stale than the uninterrupted run's were (docs/algorithm.md).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import ray
import torch.distributed as dist

from hacpo_megatron.bridge import render_prompts
from hacpo_megatron.orchestrator.actors import call_with_restarts
from hacpo_megatron.orchestrator.generation_schedule import GenerationSchedule, PhaseClock
from hacpo_megatron.orchestrator.run_agents import RunAgents
from hacpo_megatron.orchestrator.weight_delivery import ENGINE_RETRIES, restore_engines
from hacpo_megatron.reporting import HeldOut
from hacpo_megatron.rewards import RewardItem
from hacpo_megatron.rollout.base import EngineWithoutWeights, SamplingParams
from hacpo_megatron.rollout.replay import load_step

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from hacpo_megatron.data import PromptSampler


@dataclass(frozen=True)
class GenerationSettings:
    """What the engines are asked for, resolved once from the config (training/settings.py)."""

    answers_per_prompt: int  # G': rollout.samples_per_prompt (G) x the algorithm's samples multiplier (2G: GSPO x2)
    temperature: float  # rollout.temperature, rollout.top_p
    top_p: float
    max_new_tokens: int  # rollout.max_response_length
    seed: int  # run.seed: each step's and agent's sampling seed derives from it (`sampling`)
    max_staleness: int  # k: rollout.max_staleness
    total_steps: int  # run.total_steps: no step is launched beyond it
    held_out: SamplingParams  # the held-out evaluation's: data.eval_samples, data.eval_greedy, a fixed seed
    weight_check: bool  # --check-weights: compare an engine's weights with the trainer's after each push


def reward_items(prompts: Sequence, rollouts: Sequence) -> List[RewardItem]:
    """One item per completion of rollouts[agent][prompt][sample], in that order, for the reward actor."""
    return [
        RewardItem(data_source=p.data_source, solution_str=c.text, ground_truth=p.ground_truth, extra_info=p.extra_info)
        for agent in rollouts for p, group in zip(prompts, agent) for c in group
    ]


@dataclass
class StepRollouts:
    prompts: list
    prompt_ids: List[List[List[int]]]  # [agent][prompt] token ids, each agent's own rendering
    rollouts: list  # [agent][prompt][sample] Completion
    scores: List[float]
    reward_stats: Dict[str, Any]
    generated_by: List[int]  # per agent: the weight version (training steps done) its answers came from
    metrics: Dict[int, Dict[str, float]]  # per agent, on rank 0: staleness (k >= 1) and the phases' overlap


class RolloutPipeline:
    def __init__(self, settings: GenerationSettings, agents: RunAgents, sampler: PromptSampler,
                 reward_actor: Optional[ActorHandle], start_step: int):
        self.settings, self.agents, self.reward_actor = settings, agents, reward_actor  # reward_actor: rank 0's
        self.sampler = sampler
        self.schedule = GenerationSchedule(max_staleness=settings.max_staleness, total_steps=settings.total_steps,
                                           next_prompts=sampler.next_batch, launch=self._launch,
                                           snapshot=sampler.state_dict)
        self.schedule.start_at(start_step)
        self.clock = PhaseClock()

    def step_rollouts(self, step: int, times: Dict[str, float]) -> StepRollouts:
        """Step `step`'s answers and rewards on every rank (launching the steps up to `step` + k first)."""
        restore_engines(self.agents, self.settings.weight_check)  # an engine Ray restarted since its last push
        self.clock.learners_stop(time.time())  # the previous step's update, push and metrics are done
        self.schedule.launch_up_to(step, trained=step)
        work = self.schedule.take(step)
        prompt_ids = [render_prompts(tok, work.prompts) for tok in self.agents.tokenizers]
        generated_by = [work.generated_by] * len(self.agents.configs)
        metrics: Dict[int, Dict[str, float]] = {k: {} for k in range(len(generated_by))}
        rollouts = self._collect(step, work.handles, prompt_ids, generated_by, times, metrics)
        self.clock.learners_start(time.time())  # the answers are in: scoring them is the learners' side's work
        scores, reward_stats = self._score(step, work.prompts, rollouts, times)
        if self.settings.max_staleness:
            for k, version in enumerate(generated_by):
                metrics[k]["staleness/versions_behind"] = float(step - version)
        return StepRollouts(work.prompts, prompt_ids, rollouts, scores, reward_stats, generated_by, metrics)

    def sampler_state(self) -> Dict[str, Any]:
        """The sampler as it would be had the steps in flight never been drawn (a checkpoint drops them)."""
        in_flight = self.schedule.in_flight()
        return in_flight[0].before if in_flight else self.sampler.state_dict()

    # ------------------------------------------------------------------------------------------------ rank 0
    def _launch(self, step: int, prompts: list) -> Dict[int, Any]:
        """Rank 0: every agent's generation of `step` queued on its engine (Ray futures); elsewhere nothing."""
        if dist.get_rank() != 0:
            return {}
        params = sampling(self.settings, step)
        return {k: self.agents.engines[k].generate_timed.remote(render_prompts(tok, prompts), params(k))
                for k, tok in enumerate(self.agents.tokenizers)}

    def _answers(self, results: Dict[int, Any], metrics: Dict[int, Dict[str, float]]) -> Dict[int, Any]:
        """Rank 0: the answers of `generate_timed` results, their timing recorded in `metrics`."""
        for k, timed in results.items():
            metrics[k].update(self.clock.generation(k, timed))
        return {k: timed.answers for k, timed in results.items()}

    def _collect(self, step: int, handles: Dict[int, Any], prompt_ids, generated_by: List[int],
                 times: Dict[str, float], metrics: Dict[int, Dict[str, float]]) -> list:
        """The answers of `handles`, broadcast from rank 0; an engine that died is given its weights again and
        answers again (then from the current weights, version `step`)."""
        agents, rank = self.agents, dist.get_rank()
        payload: List[Any] = [None]
        if rank == 0:
            t = time.perf_counter()
            results, failed = wait_for_generations(handles)
            times["time/rollout"] = time.perf_counter() - t  # the learners' wait: all of the generation when k = 0
            results = self._answers(results, metrics)
            payload = [([results.get(k) for k in range(len(agents.configs))], failed)]
        dist.broadcast_object_list(payload, src=0)
        rollouts, failed = payload[0]
        for _attempt in range(ENGINE_RETRIES):
            if not failed:
                break  # an engine died: its restarted actor gets the weights again, then the rollout is redone
            if rank == 0:
                print(f"step {step + 1}: the engines of {[agents.names[k] for k in failed]} died while generating: "
                      "pushing their weights to the restarted engines, then generating again", flush=True)
            restore_engines(agents, self.settings.weight_check, restarted=failed)
            for k in failed:
                generated_by[k] = step
            payload = [None]
            if rank == 0:
                params = sampling(self.settings, step)
                redo, failed = wait_for_generations(
                    {k: agents.engines[k].generate_timed.remote(prompt_ids[k], params(k)) for k in failed})
                for k, completions in self._answers(redo, metrics).items():
                    rollouts[k] = completions
                payload = [(rollouts, failed)]
            dist.broadcast_object_list(payload, src=0)
            rollouts, failed = payload[0]
        if failed:
            raise RuntimeError(f"rollout engines of agents {failed} failed {ENGINE_RETRIES + 1} times at step {step}")
        return rollouts

    def _score(self, step: int, prompts: list, rollouts: list, times: Dict[str, float]):
        payload: List[Any] = [None]
        if dist.get_rank() == 0:
            t = time.perf_counter()
            payload = [call_with_restarts(self.reward_actor, "score", reward_items(prompts, rollouts))]
            times["time/reward"] = time.perf_counter() - t
        dist.broadcast_object_list(payload, src=0)
        return payload[0]


class ReplayedRollouts:
    """run.mode train_only: each step's answers and rewards as an earlier run saved them (--save-rollouts), read
    from `folder` (rollout/replay.py); no engine, no reward actor. The same interface as RolloutPipeline, so the
    loop takes its answers from either without asking which."""

    def __init__(self, folder: str, agents: RunAgents, sampler: PromptSampler, answers_per_prompt: int):
        self.folder, self.agents, self.sampler = folder, agents, sampler
        self.answers_per_prompt = answers_per_prompt  # G', as the saving run's engines gave

    def step_rollouts(self, step: int, times: Dict[str, float]) -> StepRollouts:
        prompts = self.sampler.next_batch()
        prompt_ids = [render_prompts(tok, prompts) for tok in self.agents.tokenizers]
        t = time.perf_counter()
        rollouts, scores, reward_stats = load_step(self.folder, step + 1, self.agents.names, prompts,
                                                   self.answers_per_prompt)
        times.update({"time/rollout": time.perf_counter() - t, "time/reward": 0.0})
        return StepRollouts(prompts, prompt_ids, rollouts, scores, reward_stats,
                            generated_by=[step] * len(rollouts), metrics={})

    def sampler_state(self) -> dict:
        return self.sampler.state_dict()


def held_out_answers(settings: GenerationSettings, agents: RunAgents, eval_set: list,
                     reward_actor: Optional[ActorHandle], done: int) -> Dict[str, HeldOut]:
    """Every agent's answers to each held-out problem (on rank 0; {} elsewhere): the mean score of its answers to
    it (greedy, or k samples with a seed that is the same at every evaluation, so successive evaluations differ by
    the weights only), the share of them cut at the length limit and their tokens. The mean score is the held-out
    accuracy; kept per problem, two evaluations can be compared problem by problem (a paired standard error:
    study/report.py's gain_rows). Collective: an engine that died
    (Ray's memory monitor ends actors when the machine passes 95 % of its memory) is given its weights again by
    its ranks and answers again, as in a training step."""
    rank, params = dist.get_rank(), settings.held_out
    pending = list(range(len(agents.configs)))
    answers: Dict[int, Any] = {}
    for _attempt in range(ENGINE_RETRIES + 1):
        restore_engines(agents, settings.weight_check)  # restarted since their last push: weights again
        failed: List[Any] = [None]
        if rank == 0:
            handles = {k: agents.engines[k].generate.remote(render_prompts(agents.tokenizers[k], eval_set), params)
                       for k in pending}
            results, failed[0] = wait_for_generations(handles)
            answers.update(results)
        dist.broadcast_object_list(failed, src=0)
        pending = failed[0]
        if not pending:
            break
        if rank == 0:
            print(f"evaluation after step {done}: the engines of {[agents.names[k] for k in pending]} died while "
                  "answering: pushing their weights again, then answering again", flush=True)
    if pending:
        raise RuntimeError(f"rollout engines of agents {pending} failed {ENGINE_RETRIES + 1} times in the evaluation "
                           f"after step {done}")
    if rank != 0:
        return {}
    per_problem = {}
    for k in range(len(agents.configs)):
        scores, _ = call_with_restarts(reward_actor, "score", reward_items(eval_set, [answers[k]]))
        per_problem[agents.names[k]] = held_out_of(answers[k], scores)
    return per_problem


def held_out_of(groups: Sequence[Sequence[Any]], scores: Sequence[float]) -> HeldOut:
    """An agent's answers to the held-out problems (groups[problem][answer], Completions) and their scores (in
    the same order, flat) -> per problem: mean score, share cut at the length limit, mean tokens."""
    sizes = {len(group) for group in groups}
    if len(sizes) != 1 or len(scores) != len(groups) * len(groups[0]):
        raise ValueError(f"held-out answers: {len(scores)} scores for groups of sizes {sorted(sizes)}")

    def means(values: Sequence[float]) -> List[float]:
        return np.asarray(values, dtype=np.float64).reshape(len(groups), -1).mean(1).tolist()

    flat = [c for group in groups for c in group]
    return HeldOut(means(scores), means([c.truncated for c in flat]), means([len(c.token_ids) for c in flat]))


def wait_for_generations(handles: Dict[int, Any]):
    """({agent: its answers}, [agents whose engine died while generating, or restarted just before])."""
    results, failed = {}, []
    for k, future in handles.items():
        try:
            results[k] = ray.get(future)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, EngineWithoutWeights):
            failed.append(k)
    return results, failed


def sampling(settings: GenerationSettings, step: int) -> Callable[[int], SamplingParams]:
    """Per-agent sampling parameters, G' answers per prompt; the seed depends only on (run seed, step, agent):
    resumable."""
    def for_agent(k: int) -> SamplingParams:
        return SamplingParams(n=settings.answers_per_prompt, temperature=settings.temperature, top_p=settings.top_p,
                              max_new_tokens=settings.max_new_tokens,
                              seed=(settings.seed * 1_000_003 + step * 1_009 + k) % (2**31))
    return for_agent
