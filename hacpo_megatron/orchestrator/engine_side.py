"""Where a run's answers come from, chosen once when the run is built (run.mode): the loop and the weight delivery
then never ask which.

    RayEngines(actors, generation)   engines and a reward actor under Ray (run.mode train and rollout_only): each
                                     step's answers from the engines (RolloutPipeline), each update's weights pushed
                                     to them
    SavedAnswers(folder, G')         run.mode train_only: no Ray, no engine, no reward actor; each step's answers and
                                     rewards as an earlier run saved them (--save-rollouts), nothing to push or
                                     evaluate

Both answer the loop's same five calls: start, held_out (the held-out problems it can answer), answers (the
step-by-step source), deliver (weights to engines) and store_stats (the Ray object store at a step's end).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Iterable, Optional, Union

from hacpo_megatron.orchestrator.lifecycle import RunLifecycle
from hacpo_megatron.orchestrator.ray_runtime import object_store_stats
from hacpo_megatron.orchestrator.rollout_pipeline import GenerationSettings, ReplayedRollouts, RolloutPipeline
from hacpo_megatron.orchestrator.run_agents import RunAgents
from hacpo_megatron.orchestrator.startup import ActorSettings
from hacpo_megatron.orchestrator.weight_delivery import deliver_weights

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from hacpo_megatron.data import PromptSampler


class RayEngines:
    """The agents' rollout engines and the reward actor, as Ray actors."""

    def __init__(self, actors: ActorSettings, generation: GenerationSettings):
        self.actors, self.generation = actors, generation

    def start(self, lifecycle: RunLifecycle, agents: RunAgents, rank: int, output_dir: str) -> Optional[ActorHandle]:
        """Ray, the engine actors (into `agents`) and the reward actor, whose handle this returns (rank 0's)."""
        return lifecycle.start_actors(self.actors, agents, rank, output_dir)

    def held_out(self, eval_set: list, rank: int) -> list:
        return eval_set

    def answers(self, agents: RunAgents, sampler: PromptSampler, reward_actor: Optional[ActorHandle],
                start_step: int) -> RolloutPipeline:
        return RolloutPipeline(self.generation, agents, sampler, reward_actor, start_step)

    def deliver(self, agents: RunAgents, updated: Iterable[int]) -> Dict[int, Dict[str, float]]:
        """Each updated agent's weights to its engine (weight_delivery.py); this rank's figures per agent."""
        return deliver_weights(agents, updated, self.generation.weight_check)

    def store_stats(self) -> Dict[str, float]:
        return object_store_stats()


class SavedAnswers:
    """run.mode train_only: answers and rewards read from `folder`; no engine to start, push to or evaluate with."""

    def __init__(self, folder: str, answers_per_prompt: int):
        self.folder, self.answers_per_prompt = folder, answers_per_prompt  # G', as the saving run's engines gave

    def start(self, lifecycle: RunLifecycle, agents: RunAgents, rank: int, output_dir: str) -> None:
        return None  # no Ray, no actor

    def held_out(self, eval_set: list, rank: int) -> list:
        if eval_set and rank == 0:
            print("run.mode train_only: no held-out evaluation (no engine to answer)", flush=True)
        return []

    def answers(self, agents: RunAgents, sampler: PromptSampler, reward_actor: None,
                start_step: int) -> ReplayedRollouts:
        return ReplayedRollouts(self.folder, agents, sampler, self.answers_per_prompt)

    def deliver(self, agents: RunAgents, updated: Iterable[int]) -> Dict[int, Dict[str, float]]:
        return {k: {"time/weight_sync": 0.0} for k in updated if k in agents.hosted}  # a step's record has the key

    def store_stats(self) -> Dict[str, float]:
        return {}


EngineSide = Union[RayEngines, SavedAnswers]


def engine_side(actors: ActorSettings, generation: GenerationSettings,
                saved_answers: Optional[str]) -> EngineSide:
    """The run's source of answers: the folder `saved_answers` when one is given (--load-rollouts, which preflight
    allows in run.mode train_only and requires there), else engines."""
    if saved_answers:
        return SavedAnswers(saved_answers, generation.answers_per_prompt)
    return RayEngines(actors, generation)
