"""Each part of a run is handed the settings it reads, resolved here once from the validated config: the engine
side, the actors and the learner side never see the whole Config. (The agents' models and trainers still take their
config sections: training/agents.py, trainer.py, provider.py; the reporter records the whole config.)

    settings = run_settings(cfg, spec, weight_check=options.weight_check)
    settings.actors       orchestrator/startup.py ActorSettings: the engine and reward actors
    settings.generation   orchestrator/rollout_pipeline.py GenerationSettings: what the engines are asked for
    settings.learners     training/learner_side.py LearnerSettings: steps 5-7
    settings.advantages   step 4: capabilities and advantages (training/loop.py)

G and G': `rollout.samples_per_prompt` is G, the unit a mini-batch counts in (train.mini_batch_size prompts x G
rows: the paper's "consistent number of rollouts per update"); each agent answers every prompt G' = G x the
algorithm's samples multiplier times (2G for GSPO x2, else G): `answers_per_prompt`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from hacpo_megatron.algorithms import AlgorithmSpec, LossParams
from hacpo_megatron.config import Config
from hacpo_megatron.orchestrator.rollout_pipeline import GenerationSettings
from hacpo_megatron.orchestrator.startup import ActorSettings, EngineSpec
from hacpo_megatron.rollout import engine_options
from hacpo_megatron.rollout.base import SamplingParams
from hacpo_megatron.training.learner_side import LearnerSettings


@dataclass(frozen=True)
class AdvantageSettings:
    """Step 4's: algorithm.omega_clamp, algorithm.advantage_eps and reward.range, as the algorithms take them."""

    omega_clamp: Optional[Tuple[float, float]]  # None: no clamp
    eps: float
    reward_range: Optional[Tuple[float, float]]  # None: any finite reward


@dataclass(frozen=True)
class RunSettings:
    answers_per_prompt: int  # G'
    actors: ActorSettings
    generation: GenerationSettings
    learners: LearnerSettings
    advantages: AdvantageSettings


def run_settings(cfg: Config, spec: AlgorithmSpec, *, weight_check: bool) -> RunSettings:
    """Every part's settings from `cfg` (validated by the loader) and the run's algorithm; `weight_check`: the
    launcher's --check-weights."""
    r, G = cfg.rollout, cfg.rollout.samples_per_prompt
    answers_per_prompt = G * spec.samples_multiplier  # G'
    engines = tuple(
        EngineSpec(kind=a.engine, tokenizer=a.tokenizer_source, prompt_format=a.prompt_format, seed=cfg.run.seed + k,
                   options=engine_options(a.engine, model_path=a.init_from, rollout=r,
                                          record_routes=a.moe.routing_replay == "r3"),
                   threads=r.cpu_threads)
        for k, a in enumerate(cfg.agents))
    actors = ActorSettings(run_name=cfg.run.name, engines=engines, reward_function=cfg.reward.function,
                           reward_workers=cfg.reward.num_workers, reward_timeout_s=cfg.reward.timeout_s,
                           weight_transport=r.weight_transport)
    held_out = SamplingParams(n=cfg.data.eval_samples, greedy=cfg.data.eval_greedy, temperature=r.temperature,
                              top_p=r.top_p, max_new_tokens=r.max_response_length, seed=cfg.run.seed + 99_991)
    generation = GenerationSettings(answers_per_prompt=answers_per_prompt, temperature=r.temperature, top_p=r.top_p,
                                    max_new_tokens=r.max_response_length, seed=cfg.run.seed,
                                    max_staleness=r.max_staleness, total_steps=cfg.run.total_steps, held_out=held_out,
                                    weight_check=weight_check)
    engine_clip = spec.loss.own_clip_low(LossParams.from_config(cfg.algorithm, spec)) \
        if r.old_logprobs == "engine" else None
    learners = LearnerSettings(answers_per_prompt=answers_per_prompt, rows_per_update=cfg.train.mini_batch_size * G,
                               engine_logprob_clip=engine_clip, engines_are_behaviour=r.max_staleness > 0)
    a = cfg.algorithm
    advantages = AdvantageSettings(omega_clamp=tuple(a.omega_clamp) if a.omega_clamp is not None else None,
                                   eps=a.advantage_eps,
                                   reward_range=tuple(cfg.reward.range) if cfg.reward.range is not None else None)
    return RunSettings(answers_per_prompt, actors, generation, learners, advantages)
