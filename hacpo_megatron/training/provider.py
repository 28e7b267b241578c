"""The main job's model provider: how an agent's Megatron model is built on a rank and given its first weights.

This is the part of a run a user swaps (as Megatron's pretrain_gpt.py swaps its `model_provider`);
hacpo_megatron/entry.py hands it to the loop (a script of yours may hand another one:
examples/hacpo_pretrain_style.py). The first weights are, in this order: a pretrained Hugging Face folder or
agent checkpoint (`init_from`), else a supervised warm-up of a random model on the task (`train.sft_warmup_*`,
cached on disk), else none (random weights).
"""
from __future__ import annotations

from typing import Any, Callable, Dict

import torch
import torch.distributed as dist

from hacpo_megatron.checkpoint.hf_mapping import load_hf_state_dict_into_model
from hacpo_megatron.config import AgentConfig, Config
from hacpo_megatron.models.build import AgentModel, build_agent_model
from hacpo_megatron.parallel.groups import AgentParallel

# train.params_dtype -> the model's parameter dtype (None: bf16 on GPU, fp32 on CPU). With bf16 the optimizer
# keeps fp32 main weights (megatron's mixed precision), on CPU as on GPU.
PARAMS_DTYPES = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16}

# (agent config, its parallel layout, its HF config, seed) -> this rank's AgentModel with initial weights
ModelProvider = Callable[[AgentConfig, AgentParallel, Dict[str, Any], int], AgentModel]


def model_provider(cfg: Config) -> ModelProvider:
    """Returns the function that builds an agent's model on this rank and gives it initial weights."""

    def provide(agent_cfg: AgentConfig, parallel: AgentParallel, hf_config: Dict[str, Any], seed: int) -> AgentModel:
        agent = build_agent_model(hf_config, parallel, seed=seed, params_dtype=PARAMS_DTYPES[cfg.train.params_dtype],
                                  attention=cfg.train.attention)
        state = initial_weights(cfg, agent_cfg, parallel, hf_config, seed)
        if state is not None:
            load_hf_state_dict_into_model(agent.model, state, hf_config, parallel)
        return agent

    return provide


def initial_weights(cfg: Config, agent_cfg: AgentConfig, parallel: AgentParallel, hf_config, seed):
    """Pretrained weights (`init_from`: a Hugging Face folder or an agent checkpoint), else the
    supervised warm-up of a random model (cached on disk), else None (random weights)."""
    if agent_cfg.init_from:  # checked before any work (training/preflight.py): a complete HF folder
        from hacpo_megatron.checkpoint.hf_io import HFWeights

        return HFWeights(agent_cfg.init_from)
    if cfg.train.sft_warmup_steps <= 0:
        return None
    from hacpo_megatron.training.warmup import agent_warmup

    # The agent's first rank trains (or finds the cache); the others then read the cache.
    state = agent_warmup(cfg, agent_cfg, hf_config, seed) if parallel.agent_rank == 0 else None
    dist.barrier(group=parallel.group)
    return state if state is not None else agent_warmup(cfg, agent_cfg, hf_config, seed)
