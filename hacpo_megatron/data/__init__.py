"""Prompt data: files in verl's or a plain schema, built-in synthetic tasks, benchmark files, the sampler.

The config keys ``data.train`` / ``data.eval`` hold a path (.jsonl/.parquet), ``synthetic:<task>`` or
``reasoning_gym:<generator>`` (the optional reasoning-gym package's generators: data/reasoning_gym.py).
"""

from __future__ import annotations

from typing import List

from hacpo_megatron.data.eval_sets import BENCHMARK_FIELDS, load_benchmark
from hacpo_megatron.data.files import DataFormatError
from hacpo_megatron.data.prompts import load_prompt_file
from hacpo_megatron.data.reasoning_gym import SPEC_PREFIX as REASONING_GYM_PREFIX
from hacpo_megatron.data.reasoning_gym import load_reasoning_gym
from hacpo_megatron.data.records import PromptRecord
from hacpo_megatron.data.sampler import PromptSampler
from hacpo_megatron.data.synthetic import SPEC_PREFIX, load_synthetic, target_text


def load_prompts(spec: str, split: str = "train") -> List[PromptRecord]:
    """Prompts named by ``spec``: ``synthetic:<task>[?settings]`` or ``reasoning_gym:<generator>[?settings]``
    (``split`` picks "train" or "eval"), or a .jsonl/.json/.parquet path (a file is one split already; ``split``
    is ignored)."""
    if spec.startswith(SPEC_PREFIX):
        return load_synthetic(spec, split)
    if spec.startswith(REASONING_GYM_PREFIX):
        return load_reasoning_gym(spec, split)
    return load_prompt_file(spec)


__all__ = [
    "BENCHMARK_FIELDS",
    "DataFormatError",
    "PromptRecord",
    "PromptSampler",
    "load_benchmark",
    "load_prompts",
    "load_synthetic",
    "target_text",
]
