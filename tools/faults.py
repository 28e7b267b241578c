"""The main job with faults planted at named moments: what the reliability tests and the soak tool run in place of
the package's own torchrun program, so that the package carries no fault machinery.

    HACPO_FAULTS="kill_engine_at_step=1,kill_reward_at_step=2" \\
        python -m hacpo_megatron.launch --entry tools/faults.py --config ... [the main job's arguments]

Every rank runs this file under torchrun: it reads the plan from HACPO_FAULTS (unset or empty: no fault, the main
job exactly), wraps the few functions of the package at whose moments a fault lands, and hands over to
hacpo_megatron.entry.main. Steps count from 0, as the loop's do. The faults, each once:

    kill_engine_before_step=S      agent 0's engine ended before step S begins, unseen (as Ray's memory monitor
                                   ends engines between calls): the step finds it dead
    kill_engine_at_step=S          agent 0's engine ended as step S's generation is launched
    kill_engine_in_sync_at_step=S  agent 0's engine ends itself at the first bucket of weights of step S's push
    kill_reward_at_step=S          the reward actor ends itself inside step S's scoring call
    kill_engine_in_eval_at_step=D  agent 0's engine ended while it answers the held-out problems after D steps
    leak_mib_per_step=N            rank 0 keeps every step's answers and N MiB more alive (tools/soak.py's test)

Kills act from rank 0, which drives the actors; a death inside an actor's own call is planted in the actor through
Ray's `__ray_call__`, so no actor of the package has a method for it.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, fields
from typing import Any, List, Optional

FAULTS_ENV = "HACPO_FAULTS"


@dataclass(frozen=True)
class FaultPlan:
    kill_engine_before_step: Optional[int] = None
    kill_engine_at_step: Optional[int] = None
    kill_engine_in_sync_at_step: Optional[int] = None
    kill_reward_at_step: Optional[int] = None
    kill_engine_in_eval_at_step: Optional[int] = None
    leak_mib_per_step: Optional[int] = None

    @classmethod
    def parse(cls, text: str) -> "FaultPlan":
        """`name=N,name=N`; an unknown name or a value that is not a whole number is an error."""
        names = {f.name for f in fields(cls)}
        values = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, _, value = item.partition("=")
            if name not in names or not value.strip().lstrip("-").isdigit():
                raise ValueError(f"{FAULTS_ENV}: {item!r} is not NAME=N with NAME one of {sorted(names)}")
            values[name] = int(value)
        return cls(**values)

    def text(self) -> str:
        """The plan as HACPO_FAULTS holds it."""
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self) if getattr(self, f.name) is not None)

    def first_step(self) -> Optional[int]:
        """The step of the plan's first fault (a leak is not one)."""
        steps = [getattr(self, f.name) for f in fields(self) if f.name != "leak_mib_per_step"]
        return min((s for s in steps if s is not None), default=None)


LEAKED: List[Any] = []  # leak_mib_per_step: what rank 0 keeps alive


def _kill(handle: Any) -> None:
    """End the actor's process as a crash would (Ray restarts it)."""
    import ray

    ray.kill(handle, no_restart=False)
    time.sleep(1.0)


def _exit_process(*_args: Any, **_kwargs: Any) -> None:
    os._exit(1)


def _die_at_next_bucket(engine_actor: Any) -> None:
    """Run inside an EngineActor: the next bucket of weights its engine receives, over any transport but CUDA IPC,
    ends the process in the middle of the update, as the loss of the engine's own process does."""
    engine_actor.engine.update_weights = engine_actor.engine.receive_bucket = _exit_process


def _die_in_next_score(reward_actor: Any) -> None:
    """Run inside the RewardActor: its next scoring call ends the process mid-call."""
    reward_actor.pool.score = _exit_process


def _on_rank_0() -> bool:
    import torch.distributed as dist

    return dist.get_rank() == 0


def install(plan: FaultPlan) -> None:
    """Wrap the package's functions at the plan's moments (in this process: every rank calls this)."""
    import numpy as np
    import ray

    from hacpo_megatron.orchestrator import rollout_pipeline
    from hacpo_megatron.training import loop

    Pipeline = rollout_pipeline.RolloutPipeline
    step_of_run, launch, collect, score = loop._hacpo_step, Pipeline._launch, Pipeline._collect, Pipeline._score
    held_out, wait = loop.held_out_answers, rollout_pipeline.wait_for_generations
    evaluating: dict = {}  # the planned evaluation's agents, until its engine has been killed once

    def hacpo_step(run, step):
        if plan.kill_engine_before_step == step and _on_rank_0():
            _kill(run.agents.engines[0])
        return step_of_run(run, step)

    def launch_generation(self, step, prompts):
        if plan.kill_engine_at_step == step and _on_rank_0():
            _kill(self.agents.engines[0])
        return launch(self, step, prompts)

    def collect_answers(self, step, *args, **kwargs):
        if plan.kill_engine_in_sync_at_step == step and _on_rank_0():
            # queued behind the engine's generation (an actor runs one call at a time); the step's push follows
            ray.get(self.agents.engines[0].__ray_call__.remote(_die_at_next_bucket))
        return collect(self, step, *args, **kwargs)

    def score_answers(self, step, prompts, rollouts, times):
        if plan.kill_reward_at_step == step and _on_rank_0():
            ray.get(self.reward_actor.__ray_call__.remote(_die_in_next_score))
        return score(self, step, prompts, rollouts, times)

    def held_out_answers(settings, agents, eval_set, reward_actor, done):
        if plan.kill_engine_in_eval_at_step == done:
            evaluating["agents"] = agents
        try:
            return held_out(settings, agents, eval_set, reward_actor, done)
        finally:
            evaluating.clear()

    def wait_for_generations(handles):
        """Rank 0 waits here for the answers it launched; in the planned evaluation, agent 0's engine is lost
        while it answers, at the first wait only (the answering again after it is not disturbed)."""
        if evaluating:
            _kill(evaluating.pop("agents").engines[0])
        return wait(handles)

    def step_rollouts(self, step, times):
        work = pipeline_step_rollouts(self, step, times)
        if plan.leak_mib_per_step and _on_rank_0():
            LEAKED.append((work.rollouts, np.ones(plan.leak_mib_per_step << 20, dtype=np.uint8)))  # every page
        return work

    pipeline_step_rollouts = Pipeline.step_rollouts
    loop._hacpo_step = hacpo_step
    loop.held_out_answers = held_out_answers
    rollout_pipeline.wait_for_generations = wait_for_generations
    Pipeline._launch, Pipeline._collect, Pipeline._score = launch_generation, collect_answers, score_answers
    Pipeline.step_rollouts = step_rollouts


def main() -> int:
    plan = FaultPlan.parse(os.environ.get(FAULTS_ENV, ""))
    install(plan)
    from hacpo_megatron.entry import main as run_main

    return run_main()


if __name__ == "__main__":
    sys.exit(main())
