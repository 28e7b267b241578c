"""The run config an AgentTrainer reads, for the trainer workers: keys of `train:` and `algorithm:` by name, and
`run.total_steps`, `rollout.temperature`; the schema's defaults for the rest (the trainer has none of its own)."""
from __future__ import annotations

import dataclasses

from hacpo_megatron.config.schema import AlgorithmConfig, Config, RolloutConfig, RunConfig, TrainConfig


def trainer_config(*, total_steps: int = 1, temperature: float = 1.0, **keys) -> Config:
    sections = {"train": TrainConfig(), "algorithm": AlgorithmConfig()}
    for key, value in keys.items():
        [name] = [n for n, section in sections.items() if key in {f.name for f in dataclasses.fields(section)}]
        sections[name] = dataclasses.replace(sections[name], **{key: value})
    return Config(train=sections["train"], algorithm=sections["algorithm"], run=RunConfig(total_steps=total_steps),
                  rollout=RolloutConfig(temperature=temperature))
