"""Policy losses: HACPO (own rows GSPO, other agents' rows exponential IS + stepwise clip), GSPO, GRPO.

One signature for all three, `loss(batch, params) -> (loss, metrics)`: a `PolicyBatch` (the learner's
per-token log-probs `logp` [N, T], the response `mask` [N, T], advantages, old log-probs, which rows are
other agents') and the `LossParams` read once from the config's `algorithm:` section. Each loss computes
what it needs once and reports its own metrics (HACPO: the clip bound it used, the other agents' ratios
as a histogram for the fitted bound).

Aggregation and micro-batches: the HACPO and GSPO losses are the mean over sequences of each
sequence's token-mean loss; GRPO's is the token-mean over all response tokens. When a mini-batch is
split over micro-batches and data-parallel ranks, pass the mini-batch's global count
(`num_global_seqs` / `num_global_tokens`): each call then returns its share, sum_rows / global_count,
and the shares summed over micro-batches and ranks are exactly the global mean (so the data-parallel
gradient reduction must be a sum, not an average).

Sequence-level ratios make every token of a sequence carry the same loss value, so "the token-mean
of the sequence's loss" is that value; its gradient is s * mean_t grad log pi(y_t), as in GSPO.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import torch

from hacpo_megatron.algorithms.checks import check_sequence_batch

# log s is clamped at this value before exp (DESIGN: "log s clamped at 10").
MAX_LOG_SEQ_RATIO = 10.0
# GRPO's token log-ratio is clamped to +-20 before exp, as verl does, to keep exp finite.
MAX_ABS_LOG_TOKEN_RATIO = 20.0

Metrics = Dict[str, Any]  # floats, and HACPO's ratio histogram (a tensor of counts)
# HACPO's metric: how many of the other agents' sequence ratios fall in each bin of LOG_RATIO_EDGES
RATIO_HISTOGRAM = "cross_log_ratio_histogram"


@dataclass(frozen=True)
class LossParams:
    """The policy losses' hyperparameters: the config's `algorithm:` values (their defaults live in the config
    schema) and the algorithm's clip switches, read once per trainer."""

    clip_low: float  # GSPO's clip on own rows: s in [1 - clip_low, 1 + clip_high]
    clip_high: float
    grpo_clip_low: float  # GRPO's token clip
    grpo_clip_high: float
    alpha: float  # exponential importance sampling: sg(s)^alpha
    delta: float  # the cross clip's lower bound starts at 1 - delta ...
    delta_step: float  # ... and rises by delta_step per update of the step
    cross_clip: bool = True  # HACPO's ablation switches (AlgorithmSpec)
    stepwise_clip: bool = True

    @classmethod
    def from_config(cls, algorithm, spec) -> "LossParams":
        """From a config's `algorithm:` section (or anything with its clip fields) and an AlgorithmSpec."""
        fields = ("clip_low", "clip_high", "grpo_clip_low", "grpo_clip_high", "alpha", "delta", "delta_step")
        return cls(**{f: getattr(algorithm, f) for f in fields}, cross_clip=spec.cross_clip,
                   stepwise_clip=spec.stepwise_clip)


@dataclass(frozen=True)
class PolicyBatch:
    """A micro-batch as a policy loss sees it: N responses, each padded to T tokens."""

    logp: torch.Tensor  # [N, T] the learner's log-probs of the response tokens (with gradient)
    mask: torch.Tensor  # [N, T] True on response tokens
    advantages: torch.Tensor  # [N] effective advantages (omega applied on other agents' rows)
    old_seq_logp: torch.Tensor  # [N] own rows: mean old log-prob; other agents' rows: source sum / L_j
    is_cross: torch.Tensor  # [N] bool: another agent's response
    old_token_logp: Optional[torch.Tensor] = None  # [N, T] GRPO's token-level old log-probs
    cross_clip_lower: Optional[float] = None  # HACPO: lo of this update (cross_clip_lower_bound), required
    # the mini-batch's global counts (see above): each call returns its share; None: this batch alone
    num_global_seqs: Optional[float] = None
    num_global_tokens: Optional[float] = None


def masked_row_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of each row over its response tokens: [N, T] -> [N]. Padding values never leak in."""
    kept = torch.where(mask.bool(), values, torch.zeros_like(values))
    return kept.sum(dim=-1) / mask.to(values.dtype).sum(dim=-1)


def sequence_ratio(logp: torch.Tensor, mask: torch.Tensor, old_seq_logp: torch.Tensor) -> torch.Tensor:
    """s = exp(min(mean_t log pi(y_t) - old_seq_logp, 10)): the GSPO/HACPO sequence importance ratio."""
    log_ratio = masked_row_mean(logp, mask) - old_seq_logp.to(logp.dtype)
    return torch.exp(log_ratio.clamp(max=MAX_LOG_SEQ_RATIO))


def cross_clip_lower_bound(update_index: int, delta: float, delta_step: float, stepwise: bool = True,
                           fitted: Optional[float] = None) -> float:
    """lo_m = min(1, 1 - delta + m * delta_step); without the stepwise schedule lo = 1 - delta.

    `fitted` (beyond the paper, `algorithm.cross_clip_fit_quantile`; docs/algorithm.md): a bound fitted to
    the pair's measured ratios; the clip then starts at whichever is lower, so the paper's window is only
    ever widened downward, never narrowed."""
    if update_index < 0:
        raise ValueError(f"update_index must be >= 0, got {update_index}")
    paper = min(1.0, 1.0 - delta + update_index * delta_step) if stepwise else 1.0 - delta
    return paper if fitted is None else min(paper, fitted)


# Bins of log s for the fitted cross-clip bound: 0.05 wide (5 % steps of s) from s = e^-12 up to s = 1; the
# first bin also takes everything below, the last (index len - 1) every s >= 1. A fixed histogram sums over
# micro-batches and data-parallel replicas like every other metric, so the fit does not depend on the layout.
LOG_RATIO_EDGES = torch.linspace(-12.0, 0.0, 241, dtype=torch.float64)


def log_ratio_histogram(s: torch.Tensor) -> torch.Tensor:
    """How many ratios fall in each bin of LOG_RATIO_EDGES (float64 counts, len(LOG_RATIO_EDGES) bins), on s's
    device."""
    log_s = torch.log(s.detach().double().clamp_min(1e-300))
    bins = (torch.bucketize(log_s, LOG_RATIO_EDGES.to(log_s.device), right=True) - 1).clamp(0, len(LOG_RATIO_EDGES) - 1)
    return torch.bincount(bins, minlength=len(LOG_RATIO_EDGES)).double()  # on s's device: no copy to the host


def fitted_cross_clip_lower_bound(counts: torch.Tensor, quantile: float) -> Optional[float]:
    """The q-quantile of the counted ratios, rounded down to its bin's lower edge (at most 5 % below it):
    the bound that lets the top 1 - q of them (up to s = 1) through. None when nothing was counted."""
    if not 0.0 < quantile < 1.0:
        raise ValueError(f"quantile must be in (0, 1), got {quantile}")
    total = float(counts.sum())
    if total <= 0:
        return None
    first = int(torch.searchsorted(torch.cumsum(counts.double(), 0),
                                   torch.tensor(quantile * total, dtype=torch.float64)))
    return math.exp(float(LOG_RATIO_EDGES[min(first, len(LOG_RATIO_EDGES) - 1)]))


def _own_sequence_losses(s: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float) -> torch.Tensor:
    """-min(s * A, clip(s, 1 - eps_low, 1 + eps_high) * A) per row."""
    clipped = s.clamp(min=1.0 - clip_low, max=1.0 + clip_high)
    return torch.maximum(-s * advantages, -clipped * advantages)


def _cross_sequence_losses(
    s: torch.Tensor, advantages: torch.Tensor, *, lower: float, alpha: float, cross_clip: bool
) -> torch.Tensor:
    """-clip(s, lo_m, 1) * sg(s)^alpha * A per row (exponential importance sampling, paper Eq. 6-7)."""
    clipped = s.clamp(min=lower, max=1.0) if cross_clip else s
    return -clipped * s.detach().pow(alpha) * advantages


def _denominator(count: Optional[float], local: int, name: str) -> float:
    if count is None:
        return float(local)
    if count <= 0:
        raise ValueError(f"{name} must be positive, got {count}")
    return float(count)


def _fraction(flags: torch.Tensor) -> torch.Tensor:
    return flags.float().mean() if flags.numel() else torch.tensor(float("nan"))


def _mean(values: torch.Tensor) -> torch.Tensor:
    return values.float().mean() if values.numel() else torch.tensor(float("nan"))


def _to_floats(metrics: Dict[str, object]) -> Metrics:
    """One device-to-host copy for all metrics (NaN where a metric has no rows)."""
    device = next((v.device for v in metrics.values() if torch.is_tensor(v)), torch.device("cpu"))
    values = [torch.as_tensor(v, dtype=torch.float32, device=device).detach().reshape(()) for v in metrics.values()]
    return dict(zip(metrics, torch.stack(values).cpu().tolist()))


def _check_clip(clip_low: float, clip_high: float) -> None:
    if not (0 <= clip_low < 1) or clip_high < 0:
        raise ValueError(f"clip range needs 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")


def hacpo_policy_loss(batch: PolicyBatch, params: LossParams) -> Tuple[torch.Tensor, Metrics]:
    """The HACPO loss of one learner on a mini-batch of own and other agents' rows.

    Own rows (is_cross False): GSPO, s = exp(mean log pi_k - old_seq_logp), loss -min(sA, clip(s)A).
    Other agents' rows: s = exp(mean over the L_k learner tokens of log pi_k - source sum / L_j),
    loss -clip(s, lo_m, 1) * sg(s)^alpha * A, with lo_m = `batch.cross_clip_lower`, the bound of this update
    (`cross_clip_lower_bound`: min(1, 1 - delta + m * delta_step), or a fitted one, beyond the paper).
    Switch: `cross_clip=False` (no cross clip ablation); the stepwise one (constant lo = 1 - delta when off) is
    in the bound the batch carries.
    """
    logp, mask, is_cross, lower = batch.logp, batch.mask, batch.is_cross.bool(), batch.cross_clip_lower
    check_sequence_batch(logp, mask, old_seq_logp=batch.old_seq_logp, advantages=batch.advantages, is_cross=is_cross)
    _check_clip(params.clip_low, params.clip_high)
    if params.alpha < 0:
        raise ValueError(f"alpha must be >= 0, got {params.alpha}")
    if not (0 < params.delta < 1):
        raise ValueError(f"delta must be in (0, 1), got {params.delta}")
    if lower is None:
        raise ValueError("HACPO needs the batch's cross_clip_lower (cross_clip_lower_bound of its update)")
    advantages = batch.advantages.to(logp.dtype)

    s = sequence_ratio(logp, mask, batch.old_seq_logp)
    own_losses = _own_sequence_losses(s, advantages, params.clip_low, params.clip_high)
    cross_losses = _cross_sequence_losses(s, advantages, lower=lower, alpha=params.alpha, cross_clip=params.cross_clip)
    per_row = torch.where(is_cross, cross_losses, own_losses)
    loss = per_row.sum() / _denominator(batch.num_global_seqs, logp.shape[0], "num_global_seqs")

    with torch.no_grad():
        s_own, s_cross = s[~is_cross], s[is_cross]
        # another agent's answers that the learner should move toward (above its baseline: with 0/1 rewards, the
        # right ones) and, of those, the ones whose ratio lets the gradient through the clip
        positive = advantages[is_cross] > 0
        passes = (s_cross >= lower) & (s_cross <= 1.0) if params.cross_clip else torch.ones_like(positive)
        metrics = {
            "own_ratio_mean": _mean(s_own),
            "cross_ratio_mean": _mean(s_cross),
            "own_clip_frac_lower": _fraction(s_own < 1.0 - params.clip_low),
            "own_clip_frac_upper": _fraction(s_own > 1.0 + params.clip_high),
            "cross_clip_frac_lower": _fraction(s_cross < lower) if params.cross_clip else 0.0,
            "cross_clip_frac_upper": _fraction(s_cross > 1.0) if params.cross_clip else 0.0,
            "cross_positive_frac": _fraction(positive),
            "cross_positive_inside_frac": _fraction(positive & passes),
            "cross_clip_lower_bound": lower,
            "num_own": float(s_own.numel()),
            "num_cross": float(s_cross.numel()),
        }
        histogram = log_ratio_histogram(s_cross)
    return loss, {**_to_floats(metrics), RATIO_HISTOGRAM: histogram}


def gspo_policy_loss(batch: PolicyBatch, params: LossParams) -> Tuple[torch.Tensor, Metrics]:
    """GSPO: sequence ratio, -min(sA, clip(s, 1 - eps_low, 1 + eps_high)A), mean over sequences. Every row is
    taken as the learner's own (Naive's other agents' rows too)."""
    logp, mask = batch.logp, batch.mask
    check_sequence_batch(logp, mask, old_seq_logp=batch.old_seq_logp, advantages=batch.advantages)
    _check_clip(params.clip_low, params.clip_high)
    s = sequence_ratio(logp, mask, batch.old_seq_logp)
    per_row = _own_sequence_losses(s, batch.advantages.to(logp.dtype), params.clip_low, params.clip_high)
    loss = per_row.sum() / _denominator(batch.num_global_seqs, logp.shape[0], "num_global_seqs")
    with torch.no_grad():
        metrics = {
            "own_ratio_mean": _mean(s),
            "own_clip_frac_lower": _fraction(s < 1.0 - params.clip_low),
            "own_clip_frac_upper": _fraction(s > 1.0 + params.clip_high),
            "num_own": float(s.numel()),
        }
    return loss, _to_floats(metrics)


def grpo_policy_loss(batch: PolicyBatch, params: LossParams) -> Tuple[torch.Tensor, Metrics]:
    """GRPO (DAPO clip-higher): token ratio r_t, -min(r_t A, clip(r_t) A), token-mean over all tokens."""
    logp, mask, old_logp = batch.logp, batch.mask, batch.old_token_logp
    clip_low, clip_high = params.grpo_clip_low, params.grpo_clip_high
    check_sequence_batch(logp, mask, advantages=batch.advantages)
    if old_logp is None or old_logp.shape != logp.shape:
        shape = None if old_logp is None else tuple(old_logp.shape)
        raise ValueError(f"GRPO needs old_token_logp [N, T] like logp, got {shape}")
    _check_clip(clip_low, clip_high)
    valid = mask.bool()
    log_ratio = torch.where(valid, logp - old_logp.to(logp.dtype), torch.zeros_like(logp))
    r = torch.exp(log_ratio.clamp(-MAX_ABS_LOG_TOKEN_RATIO, MAX_ABS_LOG_TOKEN_RATIO))
    A = batch.advantages.to(logp.dtype)[:, None]
    clipped = r.clamp(min=1.0 - clip_low, max=1.0 + clip_high)
    per_token = torch.maximum(-r * A, -clipped * A)
    total_tokens = int(valid.sum().item())
    loss = torch.where(valid, per_token, torch.zeros_like(per_token)).sum() / _denominator(
        batch.num_global_tokens, total_tokens, "num_global_tokens"
    )
    with torch.no_grad():
        r_valid = r[valid]
        metrics = {
            "own_ratio_mean": _mean(r_valid),
            "own_clip_frac_lower": _fraction(r_valid < 1.0 - clip_low),
            "own_clip_frac_upper": _fraction(r_valid > 1.0 + clip_high),
            "num_own": float(logp.shape[0]),
            "num_tokens": float(total_tokens),
        }
    return loss, _to_floats(metrics)


# The metrics a policy loss reports, each a mean over the rows of its kind, and the count it is a mean over. Every
# learner's record carries all of them (NaN where a loss has no such rows): a loss returns the ones it has, and the
# trainer sums each times its count over micro-batches and replicas, then divides by the summed count.
POLICY_METRICS: Mapping[str, str] = {
    "own_ratio_mean": "num_own", "own_clip_frac_lower": "num_own", "own_clip_frac_upper": "num_own",
    "cross_ratio_mean": "num_cross",
    # the other agents' rows below / above the cross clip; with a positive advantage; and those that also pass
    # the clip (the other agents' good answers that moved the learner)
    "cross_clip_frac_lower": "num_cross", "cross_clip_frac_upper": "num_cross", "cross_positive_frac": "num_cross",
    "cross_positive_inside_frac": "num_cross",
}
ROW_COUNTS = ("num_own", "num_cross")


@dataclass(frozen=True)
class PolicyLoss:
    """A policy loss and what it needs from the trainer, which calls it knowing neither its name nor its metrics.

    `fn(batch, params) -> (loss, metrics)`: metrics are POLICY_METRICS means and ROW_COUNTS over the batch's
    rows (HACPO's also its ratio histogram). `per_token_old_logp`: the batch must carry each row's per-token old
    log-probs. `cross_rows`: the loss tells other agents' rows apart (HACPO; Naive's GSPO takes them as own) and
    clips them, with the bound `cross_clip_lower` computes from the loss's own parameters."""

    fn: Callable[[PolicyBatch, LossParams], Tuple[torch.Tensor, Metrics]]
    per_token_old_logp: bool = False
    cross_rows: bool = False

    def __call__(self, batch: PolicyBatch, params: LossParams) -> Tuple[torch.Tensor, Metrics]:
        return self.fn(batch, params)

    def cross_clip_lower(self, update_index: int, params: LossParams,
                         fitted: Optional[float] = None) -> Optional[float]:
        """The cross clip's lower bound for update m of a step (None for a loss without one): the paper's
        stepwise bound, or the bound fitted to the learner's last step where lower (cross_clip_fit_quantile)."""
        if not self.cross_rows:
            return None
        return cross_clip_lower_bound(update_index, params.delta, params.delta_step, stepwise=params.stepwise_clip,
                                      fitted=fitted)

    def fits_cross_clip(self, params: LossParams, quantile: Optional[float]) -> bool:
        """Whether the learner counts the other agents' ratios to fit the next step's bound (beyond the paper)."""
        return quantile is not None and self.cross_rows and params.cross_clip

    def own_clip_low(self, params: LossParams) -> float:
        """The lower clip width on own rows: how close engine and trainer log-probs must agree to stand in."""
        return params.grpo_clip_low if self.per_token_old_logp else params.clip_low


POLICY_LOSSES: Dict[str, PolicyLoss] = {
    "hacpo": PolicyLoss(hacpo_policy_loss, cross_rows=True),
    "gspo": PolicyLoss(gspo_policy_loss),
    "grpo": PolicyLoss(grpo_policy_loss, per_token_old_logp=True),
}


def low_var_kl_penalty(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    num_global_seqs: Optional[float] = None,
) -> torch.Tensor:
    """k3 ("low-var") KL to a frozen reference, per-sequence token-mean, summed / num_global_seqs.

    kl_t = exp(ref - logp) - (ref - logp) - 1, clamped to [-10, 10] as verl does. Add
    `kl_coef * low_var_kl_penalty(...)` over own rows to the policy loss (the authors used 0.001).
    """
    check_sequence_batch(logp, mask)
    diff = (ref_logp.to(logp.dtype) - logp).clamp(-20.0, 20.0)
    kl = (torch.exp(diff) - diff - 1.0).clamp(-10.0, 10.0)
    per_row = masked_row_mean(kl, mask)
    return per_row.sum() / _denominator(num_global_seqs, logp.shape[0], "num_global_seqs")
