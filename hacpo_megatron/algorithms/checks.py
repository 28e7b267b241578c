"""Input checks shared by the algorithm functions: bad numbers fail loudly, naming what is wrong."""
from __future__ import annotations

from typing import Optional, Tuple

import torch


def check_rewards(rewards: torch.Tensor, *, reward_range: Optional[Tuple[float, float]] = (0.0, 1.0)) -> None:
    """Rewards must be a finite [n, B, G] tensor inside `reward_range` (None: any finite value).

    Capabilities are mean rewards and enter ratios P_k / P_j, so the default range is [0, 1]
    (verifiable rewards); a plug-in reward with another range must say so in the config.
    """
    if rewards.dim() != 3:
        raise ValueError(f"rewards must have shape [n_agents, B, G], got {tuple(rewards.shape)}")
    if rewards.numel() == 0:
        raise ValueError(f"rewards must not be empty, got shape {tuple(rewards.shape)}")
    if not torch.is_floating_point(rewards):
        raise ValueError(f"rewards must be a floating-point tensor, got {rewards.dtype}")
    bad = ~torch.isfinite(rewards)
    if bad.any():
        index = tuple(bad.nonzero()[0].tolist())
        raise ValueError(f"rewards contain non-finite values, first at [agent, prompt, sample] = {index}")
    if reward_range is not None:
        low, high = reward_range
        outside = (rewards < low) | (rewards > high)
        if outside.any():
            index = tuple(outside.nonzero()[0].tolist())
            raise ValueError(
                f"reward {rewards[index].item()} at [agent, prompt, sample] = {index} is outside the "
                f"allowed range [{low}, {high}] (reward.range in the config)"
            )


def check_sequence_batch(logp: torch.Tensor, mask: torch.Tensor, **per_row: torch.Tensor) -> None:
    """logp and mask are [N, T]; every per-row tensor is [N]; every row has at least one response token."""
    if logp.dim() != 2:
        raise ValueError(f"logp must be [N, T], got {tuple(logp.shape)}")
    if mask.shape != logp.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} differs from logp shape {tuple(logp.shape)}")
    for name, tensor in per_row.items():
        if tensor.shape != (logp.shape[0],):
            raise ValueError(f"{name} must be [N={logp.shape[0]}], got {tuple(tensor.shape)}")
        if torch.is_floating_point(tensor) and not torch.isfinite(tensor).all():
            raise ValueError(f"{name} contains non-finite values")
    lengths = mask.sum(dim=-1)
    if (lengths <= 0).any():
        rows = (lengths <= 0).nonzero().flatten().tolist()
        raise ValueError(f"empty responses (no response token in the mask) at rows {rows[:10]}")
