"""This rank's view of the agents in a run: configs and tokenizers of all, models, trainers and engines of its own."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List

from hacpo_megatron.algorithms import AlgorithmSpec
from hacpo_megatron.bridge import load_tokenizer
from hacpo_megatron.config import Config
from hacpo_megatron.models.build import AgentModel
from hacpo_megatron.models.presets import load_hf_config_dict
from hacpo_megatron.parallel.groups import AgentParallel, create_agent_groups
from hacpo_megatron.training.provider import ModelProvider
from hacpo_megatron.training.trainer import AgentTrainer


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


def build_agents(cfg: Config, spec: AlgorithmSpec, model_provider: ModelProvider) -> Agents:
    """Every agent's config, HF config and tokenizer; on its own ranks, its model from `model_provider`, with a
    trainer (and a frozen reference model when algorithm.kl_coef > 0), or the weights alone in run.mode rollout_only."""
    agents = Agents(configs=list(cfg.agents), parallel=create_agent_groups(cfg.agents),
                    hf_configs=[load_hf_config_dict(a.model) for a in cfg.agents],
                    tokenizers=[load_tokenizer(a.tokenizer_source, a.prompt_format) for a in cfg.agents])
    for k, (agent_cfg, parallel) in enumerate(zip(cfg.agents, agents.parallel)):
        if parallel.is_member:
            seed = init_seed(cfg, k)
            model = model_provider(agent_cfg, parallel, agents.hf_configs[k], seed)
            if cfg.run.mode == "rollout_only":
                agents.models[k] = model  # its engine's weights; no learner (no optimizer, no update)
                continue
            agents.trainers[k] = AgentTrainer(model, spec, cfg, lr=agent_cfg.lr, moe=agent_cfg.moe)
            if cfg.algorithm.kl_coef > 0:
                agents.references[k] = model_provider(agent_cfg, parallel, agents.hf_configs[k], seed)
    return agents


def init_seed(cfg: Config, k: int) -> int:
    """Seed of agent k's random initialisation and warm-up: run.seed + its index, or + the index of the agent its
    `same_init_as` names (then both start from the same weights, and the same warm-up passes through both states)."""
    names = [a.name for a in cfg.agents]
    same_as = cfg.agents[k].same_init_as
    return cfg.run.seed + (names.index(same_as) if same_as else k)
