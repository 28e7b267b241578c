"""What the one-rank trainer workers share: a world of one rank, the tiny Qwen3 test model's weights,
random sequences, and agents built from those weights."""
from __future__ import annotations

import torch

from hacpo_megatron.checkpoint.hf_mapping import load_hf_state_dict_into_model
from hacpo_megatron.config.schema import AgentConfig, ParallelConfig
from hacpo_megatron.models.build import build_agent_model
from hacpo_megatron.parallel.groups import create_agent_groups, init_distributed
from tests.models.workers.reference import TEST_CONFIGS, hf_model

HF_CONFIG = TEST_CONFIGS["qwen3"]


def one_rank_world():
    """(layout of one agent on rank 0, HF qwen3 weights), after starting the one-rank world."""
    init_distributed()
    [parallel] = create_agent_groups([AgentConfig(name="a", model="x", parallel=ParallelConfig(first_rank=0))])
    weights = {k: v.detach().clone() for k, v in hf_model("qwen3").state_dict().items()}
    return parallel, weights


def random_sequences(count: int, prompt_length: int, response_length: int):
    g = torch.Generator().manual_seed(0)
    vocab = HF_CONFIG["vocab_size"]
    return [(torch.randint(2, vocab, (prompt_length,), generator=g).tolist(),
             torch.randint(2, vocab, (response_length,), generator=g).tolist()) for _ in range(count)]


def qwen3_agent(parallel, weights, dtype=torch.float32):
    """fp32 unless asked otherwise: the equivalence checks' precision, on a GPU too (whose default is bf16)."""
    agent = build_agent_model(HF_CONFIG, parallel, seed=1, params_dtype=dtype)
    load_hf_state_dict_into_model(agent.model, weights, HF_CONFIG, parallel)
    return agent
