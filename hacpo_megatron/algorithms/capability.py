"""Agent capabilities P_k and capability ratios omega[k, j] = P_k / P_j (paper Eq. 3).

P_k is the mean reward of agent k over the step's batch, optionally averaged over the last W steps
(W = 1 is the paper; the authors' code used 5). Pure torch; no processes, no Megatron.
"""
from __future__ import annotations

from collections import deque
from typing import Optional, Sequence, Tuple

import torch

from hacpo_megatron.algorithms.checks import check_rewards

CAPABILITY_FLOOR = 1e-8


def batch_capabilities(rewards: torch.Tensor, *,
                       reward_range: Optional[Tuple[float, float]] = (0.0, 1.0)) -> torch.Tensor:
    """P_k of one step: the mean of rewards[k] over all prompts and samples. rewards: [n, B, G] -> [n]."""
    check_rewards(rewards, reward_range=reward_range)
    return rewards.to(torch.float64).mean(dim=(1, 2))


def capability_ratios(P: torch.Tensor, clamp: Optional[Tuple[float, float]] = (0.1, 10.0)) -> torch.Tensor:
    """omega[k, j] = P[k] / P[j] with P floored at 1e-8, clamped to `clamp` (None disables clamping).

    omega[k, j] > 1 means agent k is stronger than agent j. The diagonal is exactly 1.
    """
    if P.dim() != 1 or P.numel() == 0:
        raise ValueError(f"capability_ratios: P must be a non-empty 1-D tensor, got shape {tuple(P.shape)}")
    if not torch.isfinite(P).all():
        raise ValueError(f"capability_ratios: P has non-finite values: {P.tolist()}")
    if (P < 0).any():
        raise ValueError(f"capability_ratios: capabilities must be >= 0, got {P.tolist()}")
    floored = P.clamp(min=CAPABILITY_FLOOR)
    omega = floored[:, None] / floored[None, :]
    if clamp is not None:
        low, high = clamp
        if not (0 < low <= 1 <= high):
            raise ValueError(f"capability_ratios: clamp must satisfy 0 < low <= 1 <= high, got {clamp}")
        omega = omega.clamp(min=low, max=high)
    return omega


class CapabilityTracker:
    """P_k as the mean of the per-step capabilities over the last `window` steps.

    `update(rewards)` takes the step's rewards [n, B, G] and returns the windowed P [n] (float64).
    Its state (the window's history) goes into checkpoints so that a resumed run continues exactly.
    """

    def __init__(self, num_agents: int, window: int = 1, *, reward_range: Optional[Tuple[float, float]] = (0.0, 1.0)):
        if num_agents < 1:
            raise ValueError(f"CapabilityTracker: num_agents must be >= 1, got {num_agents}")
        if window < 1:
            raise ValueError(f"CapabilityTracker: window must be >= 1, got {window}")
        self.num_agents = num_agents
        self.window = window
        self.reward_range = reward_range
        self._history: deque = deque(maxlen=window)

    def update(self, rewards: torch.Tensor) -> torch.Tensor:
        if rewards.dim() != 3 or rewards.shape[0] != self.num_agents:
            raise ValueError(
                f"CapabilityTracker.update: rewards must be [n={self.num_agents}, B, G], got {tuple(rewards.shape)}"
            )
        self._history.append(batch_capabilities(rewards, reward_range=self.reward_range))
        return self.capabilities

    @property
    def capabilities(self) -> torch.Tensor:
        if not self._history:
            raise RuntimeError("CapabilityTracker: no step recorded yet")
        return torch.stack(list(self._history)).mean(dim=0)

    def state_dict(self) -> dict:
        return {
            "num_agents": self.num_agents,
            "window": self.window,
            "history": [p.tolist() for p in self._history],
        }

    def load_state_dict(self, state: dict) -> None:
        if state["num_agents"] != self.num_agents:
            raise ValueError(
                f"CapabilityTracker: checkpoint has {state['num_agents']} agents, this run has {self.num_agents}"
            )
        history: Sequence = state["history"]
        self._history = deque(
            (torch.tensor(p, dtype=torch.float64) for p in history[-self.window :]), maxlen=self.window
        )
