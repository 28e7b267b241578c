"""Agent-capability-aware advantages (paper Eq. 2) and gradient modulation (paper Eq. 4).

Shapes: rewards R[j, b, i] is [n, B, G] (agent j, prompt b, sample i); omega[k, j] is [n, n];
advantages A[k, j, b, i] is [n, n, B, G]: learner k's advantage of agent j's response i to prompt b.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from hacpo_megatron.algorithms.checks import check_rewards


def hacpo_advantages(
    rewards: torch.Tensor,
    omega: torch.Tensor,
    capability_aware: bool = True,
    eps: float = 1e-6,
    *,
    equal_rewards_guard: bool = True,
    baseline_above_max_guard: bool = True,
    reward_range: Optional[Tuple[float, float]] = (0.0, 1.0),
) -> torch.Tensor:
    """A[k, j, b, i] = (R[j, b, i] - mu_k(b)) / (sigma(b) + eps), before gradient modulation.

    mu_k(b) = 1/(nG) * sum_j sum_i omega[k, j] * R[j, b, i]   (capability-aware baseline), or the
    plain mean of the n*G rewards of prompt b when `capability_aware` is False (the "-Adv" ablation
    and the Naive baseline). sigma(b) is the Bessel-corrected std of the n*G raw rewards of prompt b.

    Guards (the authors' code; on by default):
      * all n*G rewards of a prompt equal -> mu is their plain mean, so A = 0 for that prompt;
      * mu_k(b) above the largest reward of the group -> mu_k(b) is the mean of learner k's own G rewards.
    With n = 1 this is exactly GRPO's group-normalised advantage.
    """
    check_rewards(rewards, reward_range=reward_range)
    n, B, G = rewards.shape
    if n * G < 2:
        raise ValueError(f"a group needs at least 2 responses for a standard deviation, got n={n}, G={G}")
    if omega.shape != (n, n):
        raise ValueError(f"omega must be [n, n] = [{n}, {n}], got {tuple(omega.shape)}")
    if not torch.isfinite(omega).all() or (omega <= 0).any():
        raise ValueError("omega must be finite and positive")

    R = rewards.to(torch.float64)
    group = R.permute(1, 0, 2).reshape(B, n * G)  # [B, nG]: the joint group of prompt b
    plain_mean = group.mean(dim=1)  # [B]
    sigma = group.std(dim=1, unbiased=True)  # [B]

    if capability_aware:
        # mu[k, b] = 1/(nG) sum_j omega[k, j] * sum_i R[j, b, i]
        mu = torch.einsum("kj,jb->kb", omega.to(torch.float64), R.sum(dim=2)) / (n * G)
    else:
        mu = plain_mean.expand(n, B).clone()

    if baseline_above_max_guard:
        own_mean = R.mean(dim=2)  # [k, b]: learner k's own G rewards
        group_max = group.max(dim=1).values  # [B]
        mu = torch.where(mu > group_max[None, :], own_mean, mu)
    if equal_rewards_guard:
        all_equal = (group == group[:, :1]).all(dim=1)  # [B]
        mu = torch.where(all_equal[None, :], plain_mean[None, :].expand(n, B), mu)

    # A[k, j, b, i] = (R[j, b, i] - mu[k, b]) / (sigma[b] + eps)
    A = (R[None, :, :, :] - mu[:, None, :, None]) / (sigma[None, None, :, None] + eps)
    return A.to(rewards.dtype)


def modulated_advantages(advantages: torch.Tensor, omega: torch.Tensor,
                         gradient_modulation: bool = True) -> torch.Tensor:
    """Effective advantages: learner k scales agent j's rows by omega[j, k] (source over learner).

    A~[k, j] = A[k, j] for j == k and omega[j, k] * A[k, j] otherwise (omega[k, k] = 1, so the
    diagonal needs no special case). `gradient_modulation=False` is the "no omega modulation" ablation.
    """
    n = omega.shape[0]
    if advantages.dim() != 4 or advantages.shape[:2] != (n, n):
        raise ValueError(f"advantages must be [n, n, B, G] with n={n}, got {tuple(advantages.shape)}")
    if not gradient_modulation:
        return advantages
    scale = omega.transpose(0, 1).clone()  # scale[k, j] = omega[j, k]
    scale.fill_diagonal_(1.0)
    return advantages * scale.to(advantages.dtype)[:, :, None, None]
