"""Faults a test injects into a run, as one plan: engines and the reward actor killed at chosen moments, and a
leak for the soak tool's test. A user's run has none (`NO_FAULTS`); the main job's hidden --kill-* and
--leak-mib-per-step flags build one (hacpo_megatron/entry.py), and the loop and the rollout pipeline call its
hooks by name, each a no-op unless the plan names that moment. Kills act on rank 0, which drives the actors; a
death inside an actor's own call is planted from here (Ray's `__ray_call__`), so no production actor carries a
method for it."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, List, Optional

import numpy as np
import ray
import torch.distributed as dist


def kill_actor(handle: Any) -> None:
    """End the actor's process as a crash would (Ray restarts it)."""
    ray.kill(handle, no_restart=False)
    time.sleep(1.0)


def _exit_process(*_args: Any, **_kwargs: Any) -> None:
    os._exit(1)


def _die_at_next_bucket(engine_actor: Any) -> None:
    """Run inside an EngineActor: the next bucket of weights its engine receives, over any transport but CUDA
    IPC, ends the process in the middle of the update, as the loss of the engine's own process does."""
    engine_actor.engine.update_weights = engine_actor.engine.receive_bucket = _exit_process


def _die_in_next_score(reward_actor: Any) -> None:
    """Run inside the RewardActor: its next scoring call ends the process mid-call."""
    reward_actor.pool.score = _exit_process


@dataclass(frozen=True)
class FaultPlan:
    kill_engine_at_step: Optional[int] = None  # agent 0's engine, as that step's generation is launched
    kill_reward_at_step: Optional[int] = None  # the reward actor, inside that step's scoring call
    kill_engine_in_sync_at_step: Optional[int] = None  # agent 0's engine, amid that step's weight push
    kill_engine_before_step: Optional[int] = None  # agent 0's engine before the step begins, unseen (as Ray's
    # memory monitor ends engines between calls)
    kill_engine_in_eval_at_step: Optional[int] = None  # agent 0's engine, answering the held-out problems after it
    leak_mib_per_step: int = 0  # rank 0 keeps every step's rollouts and this many MiB more alive

    def before_step(self, step: int, agents) -> None:
        if self.kill_engine_before_step == step and dist.get_rank() == 0:
            kill_actor(agents.engines[0])

    def at_generation(self, step: int, agents) -> None:
        """Rank 0, as it launches the step's generation."""
        if self.kill_engine_at_step == step:
            kill_actor(agents.engines[0])

    def before_weight_push(self, step: int, agents) -> None:
        """Rank 0, before the step's updates: agent 0's engine ends itself at the next bucket it receives."""
        if self.kill_engine_in_sync_at_step == step:
            ray.get(agents.engines[0].__ray_call__.remote(_die_at_next_bucket))

    def before_scoring(self, step: int, reward_actor) -> None:
        """Rank 0: the reward actor ends itself inside the scoring call that follows."""
        if self.kill_reward_at_step == step:
            ray.get(reward_actor.__ray_call__.remote(_die_in_next_score))

    def in_evaluation(self, done: int, attempt: int, agents) -> None:
        """Rank 0, the held-out generation after step `done` launched (its first attempt only)."""
        if self.kill_engine_in_eval_at_step == done and attempt == 0:
            kill_actor(agents.engines[0])

    def after_rollouts(self, rollouts) -> None:
        if self.leak_mib_per_step and dist.get_rank() == 0:
            _LEAKED.append((rollouts, np.ones(self.leak_mib_per_step << 20, dtype=np.uint8)))  # every page touched


NO_FAULTS = FaultPlan()
_LEAKED: List[Any] = []  # FaultPlan.leak_mib_per_step: a leak the soak tool's test must find
