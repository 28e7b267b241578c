"""The rollout engine interface: generate G samples per prompt, take new weights, free memory.

Every engine (embedded transformers, vLLM, SGLang) returns the same `Completion` records, so the
orchestrator, the bridge and the trainer never know which engine produced a response.

Log-probs: `Completion.logprobs[t]` is log softmax(logits_t / temperature)[y_t] under the engine's
weights, the same quantity the trainer computes (`models/logprobs.py` divides logits by the
sampling temperature too). top-p only decides which tokens may be drawn; it does not renormalise
the reported log-probs, as in vLLM's processed-logprob mode without top-p renormalisation.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Literal, Optional, Sequence, Tuple

import torch

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # samples per prompt (G)
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    seed: Optional[int] = None  # same seed, same weights, same prompts -> same samples

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.temperature <= 0:
            raise ValueError(f"SamplingParams.temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class Completion:
    token_ids: List[int]  # response tokens, including the end-of-sequence token when it stopped
    text: str  # decoded response, special tokens skipped
    logprobs: List[float]  # one per token in token_ids
    finish_reason: FinishReason

    @property
    def truncated(self) -> bool:
        """Cut at max_new_tokens before the model ended its answer."""
        return self.finish_reason == "length"

    @property
    def logprob_sum(self) -> float:
        return float(sum(self.logprobs))


@dataclass
class WeightCheck:
    """Result of comparing an engine's weights with the trainer's (the weight-sync check mode)."""

    equal: bool
    max_abs_diff: float
    mismatched: List[str] = field(default_factory=list)
    missing: List[str] = field(default_factory=list)


class RolloutEngine(abc.ABC):
    """One agent's generator. Prompts are token ids already rendered with the agent's chat template."""

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> List[List[Completion]]:
        """For each prompt, `params.n` completions."""

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Load new weights given as (Hugging Face name, full tensor) pairs, bucket by bucket."""

    @abc.abstractmethod
    def check_weights(self, named_tensors: Iterable[Tuple[str, torch.Tensor]], atol: float = 0.0) -> WeightCheck:
        """Compare the engine's weights with the given ones (equality within atol)."""

    def release_memory(self) -> None:
        """Free what the engine can (KV cache, weights on GPU) while the trainer runs. Default: nothing."""

    def resume_memory(self) -> None:
        """Undo release_memory before the next generate. Default: nothing."""

    def shutdown(self) -> None:
        """Stop background processes; the engine is unusable afterwards."""


def compare_state(
    own: Dict[str, torch.Tensor], named_tensors: Iterable[Tuple[str, torch.Tensor]], atol: float = 0.0
) -> WeightCheck:
    """Shared implementation of the check mode for engines that can read their weights by HF name."""
    worst, mismatched, missing = 0.0, [], []
    for name, tensor in named_tensors:
        mine = own.get(name)
        if mine is None:
            missing.append(name)
            continue
        if mine.shape != tensor.shape:
            mismatched.append(f"{name}: shape {tuple(mine.shape)} vs {tuple(tensor.shape)}")
            continue
        diff = (mine.detach().float().cpu() - tensor.detach().float().cpu()).abs().max().item() if mine.numel() else 0.0
        worst = max(worst, diff)
        if diff > atol:
            mismatched.append(f"{name}: max |diff| {diff:.3e}")
    return WeightCheck(not mismatched and not missing, worst, mismatched, missing)
