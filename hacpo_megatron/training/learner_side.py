"""Steps 5-7 of Algorithm 1 for the learners this rank hosts, or none, chosen once when the run is built (run.mode):
the loop calls `step` and never asks which.

    Learners(settings)   old log-probs, each hosted learner's rows (own and bridged) and M updates, the new weights
                         pushed
    NoLearners           run.mode rollout_only: the engines answer with the initial weights throughout; nothing is
                         trained, pushed or checkpointed (the step's records hold no learner figures)
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Optional, Union

from hacpo_megatron.algorithms import StepAdvantages
from hacpo_megatron.orchestrator.rollout_pipeline import StepRollouts
from hacpo_megatron.reporting.step_records import mean_over_updates
from hacpo_megatron.training.batch import UpdateSchedule, mini_batches
from hacpo_megatron.training.logprob_passes import agent_logprobs, behaviour_logprobs
from hacpo_megatron.training.step_data import (
    engine_old_logprobs, learner_rows, own_sequences, with_learner_old_logprobs,
)

if TYPE_CHECKING:
    from hacpo_megatron.training.loop import Run


@dataclass(frozen=True)
class LearnerSettings:
    """What steps 5-7 read, resolved once from the config (training/settings.py)."""

    answers_per_prompt: int  # G': each source's answers per prompt
    rows_per_update: int  # train.mini_batch_size prompts x G (rollout.samples_per_prompt) rows
    # rollout.old_logprobs engine: own rows' old log-probs are the engine's once the trainer's pass on the run's first
    # step found them this close (the own rows' lower clip width); None (trainer): the trainer's pass every step
    engine_logprob_clip: Optional[float]
    engines_are_behaviour: bool  # rollout.max_staleness >= 1: answers from older weights, the engines' log-probs


class Learners:
    trains = True  # its steps are checkpointed, and its records hold the learners' figures

    def __init__(self, settings: LearnerSettings):
        self.settings = settings

    def step(self, run: Run, work: StepRollouts, advantages: StepAdvantages, times: Dict[str, float]):
        """Steps 5-7 of step `work`: ({k: engine/trainer log-prob gap}, {k: this rank's figures of hosted learner
        k's update and of its weight push})."""
        settings, spec, agents = self.settings, run.spec, run.agents
        prompts, prompt_ids, rollouts, B = work.prompts, work.prompt_ids, work.rollouts, len(work.prompts)
        # 5. old log-probs of own responses, shared with every rank: the trainer's pass, or the engine's own
        #    (rollout.old_logprobs: engine) once that pass has found them close enough on the run's first step
        t = time.perf_counter()
        old, gaps = behaviour_logprobs(agents, prompt_ids, rollouts, engine_clip=settings.engine_logprob_clip)
        # answers from older weights (rollout.max_staleness >= 1): the engines' log-probs are the behaviour policy
        behaviour = [engine_old_logprobs(r) for r in rollouts] if settings.engines_are_behaviour else None
        reference = {k: agent_logprobs(agents.trainers[k], agents.references[k],
                                       own_sequences(prompt_ids[k], rollouts[k])) for k in agents.references}
        times["time/logprob"] = time.perf_counter() - t

        # 6. each hosted learner: bridge, train
        local: Dict[int, Dict[str, float]] = {}
        for k, trainer in agents.trainers.items():
            t = time.perf_counter()
            rows, bridge_stats = learner_rows(k, prompts=prompts, rollouts=rollouts, old=old,
                                              effective=advantages.effective, trains_on=advantages.trains_on,
                                              tokenizers=agents.tokenizers, prompt_ids=prompt_ids,
                                              ref_token_logp=reference.get(k), behaviour=behaviour)
            if spec.cross_old_logprob == "learner":  # Naive: other agents' rows are rated like own ones
                cross = [(r.prompt_ids, r.response_ids) for r in rows if r.is_cross]
                rows = with_learner_old_logprobs(rows, agent_logprobs(trainer, None, cross))
            t_bridge = time.perf_counter() - t
            t = time.perf_counter()
            schedule = UpdateSchedule(B, settings.answers_per_prompt,
                                      sources=tuple(int(j) for j in advantages.trains_on[k].nonzero()),
                                      rows_per_update=settings.rows_per_update)
            updates = trainer.train_step(mini_batches(rows, schedule))
            local[k] = {**mean_over_updates(updates), **bridge_stats,
                        "time/bridge": t_bridge, "time/train": time.perf_counter() - t}
        # 7. the new weights to the engines (again where an engine died on the way)
        for k, sync in run.engines.deliver(agents, local).items():
            local[k].update(sync)
        return gaps, local


class NoLearners:
    trains = False

    def step(self, run: Run, work: StepRollouts, advantages: StepAdvantages, times: Dict[str, float]):
        return {}, {}


LearnerSide = Union[Learners, NoLearners]


def learner_side(mode: str, settings: LearnerSettings, rank: int) -> LearnerSide:
    """The run's learners, by run.mode (`mode`)."""
    if mode != "rollout_only":
        return Learners(settings)
    if rank == 0:
        print("run.mode rollout_only: no learner; the engines answer with the initial weights throughout", flush=True)
    return NoLearners()
