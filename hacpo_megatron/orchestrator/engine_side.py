"""Where a run's answers come from, chosen once when the run is built (run.mode): the loop and the weight delivery
then never ask which.

    RayEngines(weight_check)   engines and a reward actor under Ray (run.mode train and rollout_only): each step's
                               answers from the engines (RolloutPipeline), each update's weights pushed to them
    SavedAnswers(folder)       run.mode train_only: no Ray, no engine, no reward actor; each step's answers and
                               rewards as an earlier run saved them (--save-rollouts), nothing to push or evaluate

Both answer the loop's same five calls: start, held_out (the held-out problems it can answer), answers (the
step-by-step source), deliver (weights to engines) and store_stats (the Ray object store at a step's end).
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List

from hacpo_megatron.config.schema import Config
from hacpo_megatron.orchestrator.ray_runtime import object_store_stats
from hacpo_megatron.orchestrator.rollout_pipeline import ReplayedRollouts, RolloutPipeline
from hacpo_megatron.orchestrator.run_agents import RunAgents
from hacpo_megatron.orchestrator.weight_delivery import deliver_weights


class RayEngines:
    """The agents' rollout engines and the reward actor, as Ray actors."""

    def __init__(self, weight_check: bool):
        self.weight_check = weight_check  # compare an engine's weights with the trainer's after each push

    def start(self, lifecycle: Any, cfg: Config, agents: RunAgents, rank: int, output_dir: str) -> Any:
        """Ray, the engine actors (into `agents`) and the reward actor, whose handle this returns."""
        return lifecycle.start_actors(cfg, agents, [a.tokenizer_source for a in cfg.agents], rank, output_dir)

    def held_out(self, eval_set: list, rank: int) -> list:
        return eval_set

    def answers(self, cfg: Config, agents: RunAgents, sampler: Any, reward_actor: Any, G: int,
                start_step: int) -> RolloutPipeline:
        return RolloutPipeline(cfg, agents, sampler, reward_actor, G, self.weight_check, start_step)

    def deliver(self, agents: RunAgents, updated: Iterable[int]) -> Dict[int, Dict[str, float]]:
        """Each updated agent's weights to its engine (weight_delivery.py); this rank's figures per agent."""
        return deliver_weights(agents, updated, self.weight_check)

    def store_stats(self) -> Dict[str, float]:
        return object_store_stats()


class SavedAnswers:
    """run.mode train_only: answers and rewards read from `folder`; no engine to start, push to or evaluate with."""

    def __init__(self, folder: str):
        self.folder = folder

    def start(self, lifecycle: Any, cfg: Config, agents: RunAgents, rank: int, output_dir: str) -> None:
        return None  # no Ray, no actor

    def held_out(self, eval_set: list, rank: int) -> List[Any]:
        if eval_set and rank == 0:
            print("run.mode train_only: no held-out evaluation (no engine to answer)", flush=True)
        return []

    def answers(self, cfg: Config, agents: RunAgents, sampler: Any, reward_actor: Any, G: int,
                start_step: int) -> ReplayedRollouts:
        return ReplayedRollouts(self.folder, agents, sampler, G)

    def deliver(self, agents: RunAgents, updated: Iterable[int]) -> Dict[int, Dict[str, float]]:
        return {k: {"time/weight_sync": 0.0} for k in updated if k in agents.hosted}  # a step's record has the key

    def store_stats(self) -> Dict[str, float]:
        return {}


def engine_side(cfg: Config, weight_check: bool, load_rollouts: str) -> Any:
    """The run's source of answers, by run.mode."""
    return SavedAnswers(load_rollouts) if cfg.run.mode == "train_only" else RayEngines(weight_check)
