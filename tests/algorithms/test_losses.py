import dataclasses
import math
import statistics

import pytest
import torch

from hacpo_megatron.algorithms import (
    LossParams,
    PolicyBatch,
    cross_clip_lower_bound,
    fitted_cross_clip_lower_bound,
    log_ratio_histogram,
    low_var_kl_penalty,
)
from hacpo_megatron.algorithms import losses as policy_losses
from hacpo_megatron.algorithms.registry import resolve_algorithm
from hacpo_megatron.config.schema import AlgorithmConfig
from tests.algorithms.reference import ref_seq_loss


# The tests below call each loss with its tensors and hyperparameters by name; these build the one signature every
# loss has, loss(PolicyBatch, LossParams), with the config schema's defaults (the paper's) for what they leave out.
def _params(spec="hacpo", **overrides) -> LossParams:
    return LossParams.from_config(dataclasses.replace(AlgorithmConfig(), **overrides), resolve_algorithm(spec))


def hacpo_policy_loss(logp, mask, old_seq_logp, advantages, is_cross, *, update_index, cross_clip=True,
                      stepwise_clip=True, fitted_lower=None, num_global_seqs=None, **hyperparameters):
    params = dataclasses.replace(_params(**hyperparameters), cross_clip=cross_clip)
    lower = cross_clip_lower_bound(update_index, params.delta, params.delta_step, stepwise=stepwise_clip,
                                   fitted=fitted_lower)
    batch = PolicyBatch(logp, mask, advantages, old_seq_logp, is_cross, cross_clip_lower=lower,
                        num_global_seqs=num_global_seqs)
    return policy_losses.hacpo_policy_loss(batch, params)


def gspo_policy_loss(logp, mask, old_seq_logp, advantages, *, num_global_seqs=None, **hyperparameters):
    batch = PolicyBatch(logp, mask, advantages, old_seq_logp, torch.zeros(len(logp), dtype=torch.bool),
                        num_global_seqs=num_global_seqs)
    return policy_losses.gspo_policy_loss(batch, _params("gspo", **hyperparameters))


def grpo_policy_loss(logp, mask, old_logp, advantages, *, clip_low=None, clip_high=None, num_global_tokens=None):
    clip = {k: v for k, v in (("grpo_clip_low", clip_low), ("grpo_clip_high", clip_high)) if v is not None}
    batch = PolicyBatch(logp, mask, advantages, torch.zeros(len(logp), dtype=logp.dtype),
                        torch.zeros(len(logp), dtype=torch.bool), old_token_logp=old_logp,
                        num_global_tokens=num_global_tokens)
    return policy_losses.grpo_policy_loss(batch, _params("grpo", **clip))


def random_batch(N=12, T=9, seed=0, dtype=torch.float64, cross_fraction=0.5):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (N,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    logp = -torch.rand(N, T, generator=g, dtype=dtype) * 2.0
    logp = torch.where(mask, logp, torch.full_like(logp, -1e9))  # garbage in padding must not leak
    seq_mean = (logp * mask).sum(-1) / lengths
    old = seq_mean + (torch.rand(N, generator=g, dtype=dtype) - 0.5) * 0.6  # ratios spread around 1
    adv = torch.randn(N, generator=g, dtype=dtype)
    is_cross = torch.rand(N, generator=g) < cross_fraction
    return logp, mask, old, adv, is_cross


# ---------------------------------------------------------------- hand-computed cases
def test_own_row_unclipped_loss_and_gradient():
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, m = hacpo_policy_loss(logp, mask, torch.tensor([-1.5]).double(), torch.tensor([2.0]).double(),
                                torch.tensor([False]), update_index=0)
    assert loss.item() == pytest.approx(-2.0)  # s = 1, loss = -s * A
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-1.0, -1.0]], dtype=torch.float64))  # -A * s / L
    assert m["own_ratio_mean"] == pytest.approx(1.0)
    assert math.isnan(m["cross_ratio_mean"])


def test_own_row_clipped_above_has_no_gradient_for_positive_advantage():
    logp = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.ones(1, 1, dtype=torch.bool)
    old = torch.tensor([-1.01]).double()  # s = e^0.01 > 1 + 4e-4
    loss, m = hacpo_policy_loss(logp, mask, old, torch.tensor([1.0]).double(), torch.tensor([False]), update_index=0)
    assert loss.item() == pytest.approx(-(1 + 4e-4))
    loss.backward()
    assert logp.grad.abs().max().item() == 0.0
    assert m["own_clip_frac_upper"] == 1.0 and m["own_clip_frac_lower"] == 0.0


def test_cross_row_exponential_is_and_stepwise_clip():
    mask = torch.ones(1, 2, dtype=torch.bool)
    s = math.exp(-0.1)  # mean log pi = -1.1, source mean = -1.0
    logp = torch.tensor([[-1.0, -1.2]], dtype=torch.float64, requires_grad=True)
    loss, m = hacpo_policy_loss(logp, mask, torch.tensor([-1.0]).double(), torch.tensor([0.5]).double(),
                                torch.tensor([True]), update_index=0, alpha=2.0)
    assert loss.item() == pytest.approx(-s * s**2 * 0.5)  # s inside [0.8, 1]
    loss.backward()
    # d/dlogp_t of -s * sg(s)^2 * A = -A * sg(s)^2 * s / L
    assert torch.allclose(logp.grad, torch.full((1, 2), -0.5 * s**3 / 2, dtype=torch.float64))
    assert m["cross_ratio_mean"] == pytest.approx(s)
    assert m["cross_clip_lower_bound"] == pytest.approx(0.8)
    assert m["cross_positive_frac"] == m["cross_positive_inside_frac"] == 1.0  # a good answer that moves the learner

    # at m = 5 the lower bound is 0.8 + 5 * 0.025 = 0.925 > s: clipped, no gradient
    logp.grad = None
    loss, m = hacpo_policy_loss(logp, mask, torch.tensor([-1.0]).double(), torch.tensor([0.5]).double(),
                                torch.tensor([True]), update_index=5, alpha=2.0)
    assert loss.item() == pytest.approx(-0.925 * s**2 * 0.5)
    loss.backward()
    assert logp.grad.abs().max().item() == 0.0
    assert m["cross_clip_frac_lower"] == 1.0
    assert m["cross_positive_frac"] == 1.0 and m["cross_positive_inside_frac"] == 0.0  # a good answer, clipped away


def test_cross_ratio_above_one_is_capped_at_one():
    mask = torch.ones(1, 1, dtype=torch.bool)
    logp = torch.tensor([[-0.5]], dtype=torch.float64)
    loss, m = hacpo_policy_loss(logp, mask, torch.tensor([-1.0]).double(), torch.tensor([1.0]).double(),
                                torch.tensor([True]), update_index=0, alpha=1.0)
    s = math.exp(0.5)
    assert loss.item() == pytest.approx(-1.0 * s * 1.0)
    assert m["cross_clip_frac_upper"] == 1.0


def test_cross_clip_lower_bound_schedule():
    assert cross_clip_lower_bound(0, 0.2, 0.025) == pytest.approx(0.8)
    assert cross_clip_lower_bound(3, 0.2, 0.025) == pytest.approx(0.875)
    assert cross_clip_lower_bound(100, 0.2, 0.025) == 1.0
    assert cross_clip_lower_bound(7, 0.2, 0.025, stepwise=False) == pytest.approx(0.8)
    with pytest.raises(ValueError):
        cross_clip_lower_bound(-1, 0.2, 0.025)


def test_each_loss_says_what_it_needs_and_computes_its_own_cross_bound():
    """The trainer asks the loss, never the algorithm's name: its bound per update, token-level old log-probs,
    the fit of the bound, and the clip the engine's log-probs must agree within."""
    hacpo, naive, grpo = (resolve_algorithm(name).loss for name in ("hacpo", "naive", "grpo"))
    params = _params("hacpo", delta=0.2, delta_step=0.025)
    assert [hacpo.cross_clip_lower(m, params) for m in range(4)] == pytest.approx([0.8, 0.825, 0.85, 0.875])
    constant = dataclasses.replace(params, stepwise_clip=False)
    assert hacpo.cross_clip_lower(3, constant) == pytest.approx(0.8)
    assert hacpo.cross_clip_lower(3, params, fitted=0.5) == 0.5 and hacpo.cross_clip_lower(0, params, 0.9) == 0.8
    assert naive.cross_clip_lower(0, params) is None and grpo.cross_clip_lower(2, params) is None
    assert hacpo.fits_cross_clip(params, 0.5) and not hacpo.fits_cross_clip(params, None)
    assert not hacpo.fits_cross_clip(dataclasses.replace(params, cross_clip=False), 0.5)
    assert not naive.fits_cross_clip(params, 0.5)
    assert grpo.per_token_old_logp and not hacpo.per_token_old_logp and not naive.per_token_old_logp
    clips = _params("grpo", clip_low=3e-4, grpo_clip_low=0.2)
    assert grpo.own_clip_low(clips) == 0.2 and naive.own_clip_low(clips) == 3e-4
    # the stepwise switch reaches the loss's parameters from the algorithm's spec
    ablated = LossParams.from_config(AlgorithmConfig(), resolve_algorithm("hacpo", stepwise_clip=False))
    assert not ablated.stepwise_clip and hacpo.cross_clip_lower(2, ablated) == pytest.approx(0.8)


@pytest.mark.parametrize("name", ["hacpo", "gspo", "grpo"])
def test_every_metric_a_loss_reports_is_one_the_trainer_reduces(name):
    """The trainer sums POLICY_METRICS (times their row counts) and ROW_COUNTS over micro-batches and replicas; a
    metric outside them would vanish from metrics.jsonl without a word."""
    logp, mask, old, adv, is_cross = random_batch()
    batch = PolicyBatch(logp, mask, adv, old, is_cross if name == "hacpo" else torch.zeros_like(is_cross),
                        old_token_logp=logp.detach() - 0.01, cross_clip_lower=0.8)
    _, metrics = policy_losses.POLICY_LOSSES[name](batch, _params(name))
    reported = set(metrics) - {policy_losses.RATIO_HISTOGRAM, "cross_clip_lower_bound", "num_tokens"}
    assert reported <= set(policy_losses.POLICY_METRICS) | set(policy_losses.ROW_COUNTS)
    assert {"own_ratio_mean", "num_own"} <= reported
    assert set(policy_losses.POLICY_METRICS.values()) <= set(policy_losses.ROW_COUNTS)


def test_fitted_cross_clip_bound_by_hand():
    """Ratios 0.1, 0.3, 0.55, 0.9, 1.2 (log -2.303, -1.204, -0.598, -0.105, 0.182) in bins of log s 0.05 wide from
    -12: bins 193, 215, 228, 237 and the last (s >= 1). The median (q 0.5: the third of five) lies in bin 228,
    [-0.60, -0.55): the bound is e^-0.60 = 0.5488, just below 0.55; q 0.2 gives the first ratio's bin
    [-2.35, -2.30): e^-2.35; q 0.9 reaches the last bin: 1, and the paper's 0.8 stays."""
    s = torch.tensor([0.1, 0.3, 0.55, 0.9, 1.2])
    counts = log_ratio_histogram(s)
    assert counts.sum() == 5 and counts.nonzero().flatten().tolist() == [193, 215, 228, 237, 240]
    assert fitted_cross_clip_lower_bound(counts, 0.5) == pytest.approx(math.exp(-0.60))
    assert fitted_cross_clip_lower_bound(counts, 0.2) == pytest.approx(math.exp(-2.35))
    assert fitted_cross_clip_lower_bound(counts, 0.9) == 1.0
    # two more at log s -0.673, -0.654 (bin 226): the 4th of 7 (0.52) is in bin 226, [-0.70, -0.65)
    assert fitted_cross_clip_lower_bound(counts + log_ratio_histogram(torch.tensor([0.51, 0.52])), 0.5) == (
        pytest.approx(math.exp(-0.70)))
    assert fitted_cross_clip_lower_bound(torch.zeros(241), 0.5) is None  # nothing measured: no fit
    assert log_ratio_histogram(torch.tensor([1e-9]))[0] == 1  # far below the range: the first bin
    # the bound: the lower of the paper's and the fitted one
    assert cross_clip_lower_bound(0, 0.2, 0.025, fitted=math.exp(-0.60)) == pytest.approx(math.exp(-0.60))
    assert cross_clip_lower_bound(0, 0.2, 0.025, fitted=1.0) == pytest.approx(0.8)
    with pytest.raises(ValueError):
        fitted_cross_clip_lower_bound(counts, 1.0)


def test_a_fitted_bound_lets_a_distant_answer_through():
    """s = e^-0.5 = 0.61 is below the paper's 0.8 (no gradient); with a fitted bound 0.5488 it is inside."""
    mask = torch.ones(1, 2, dtype=torch.bool)
    s = math.exp(-0.5)
    for fitted, inside in ((None, False), (math.exp(-0.60), True)):
        logp = torch.tensor([[-1.4, -1.6]], dtype=torch.float64, requires_grad=True)
        loss, m = hacpo_policy_loss(logp, mask, torch.tensor([-1.0]).double(), torch.tensor([0.5]).double(),
                                    torch.tensor([True]), update_index=0, alpha=1.0, fitted_lower=fitted)
        loss.backward()
        assert m["cross_clip_lower_bound"] == pytest.approx(0.8 if fitted is None else fitted)
        assert m["cross_positive_inside_frac"] == float(inside)
        if inside:  # -s * sg(s) * A: d/dlogp_t = -A * s^2 / L
            assert torch.allclose(logp.grad, torch.full((1, 2), -0.5 * s**2 / 2, dtype=torch.float64))
        else:
            assert logp.grad.abs().max().item() == 0.0


def test_log_ratio_is_clamped_at_ten():
    mask = torch.ones(2, 1, dtype=torch.bool)
    logp = torch.tensor([[0.0], [0.0]], dtype=torch.float64)
    old = torch.tensor([-50.0, -50.0], dtype=torch.float64)
    loss, m = hacpo_policy_loss(logp, mask, old, torch.tensor([-1.0, -1.0]).double(),
                                torch.tensor([False, True]), update_index=0, alpha=0.0)
    assert math.isfinite(loss.item())
    assert m["own_ratio_mean"] == pytest.approx(math.exp(10.0))


# ---------------------------------------------------------------- random inputs vs the reference
@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("m,alpha", [(0, 1.0), (3, 0.0), (9, 3.0)])
def test_hacpo_loss_matches_reference(seed, m, alpha):
    logp, mask, old, adv, is_cross = random_batch(seed=seed)
    loss, metrics = hacpo_policy_loss(logp, mask, old, adv, is_cross, update_index=m, alpha=alpha)
    per_seq = [
        ref_seq_loss(logp[r][mask[r]].tolist(), old[r].item(), adv[r].item(), bool(is_cross[r]), m, alpha=alpha)
        for r in range(logp.shape[0])
    ]
    assert loss.item() == pytest.approx(sum(per_seq) / len(per_seq), rel=1e-10, abs=1e-12)
    assert metrics["num_own"] + metrics["num_cross"] == logp.shape[0]


def _reference_loss_autograd(logp, mask, old, adv, is_cross, m, alpha, eps_low=3e-4, eps_high=4e-4, delta=0.2,
                             step=0.025):
    """Per-sequence loop in float64 autograd: an independent way to the same gradient."""
    total = 0.0
    for r in range(logp.shape[0]):
        tokens = logp[r][mask[r]]
        s = torch.exp(torch.clamp(tokens.mean() - old[r], max=10.0))
        if is_cross[r]:
            lo = min(1.0, 1 - delta + m * step)
            total = total - torch.clamp(s, lo, 1.0) * s.detach() ** alpha * adv[r]
        else:
            total = total - torch.min(s * adv[r], torch.clamp(s, 1 - eps_low, 1 + eps_high) * adv[r])
    return total / logp.shape[0]


@pytest.mark.parametrize("seed", range(4))
def test_hacpo_gradients_match_float64_autograd_reference(seed):
    logp, mask, old, adv, is_cross = random_batch(seed=seed)
    # push some own ratios inside the narrow GSPO band so both branches carry gradient
    old = torch.where(torch.arange(len(old)) % 3 == 0, (torch.where(mask, logp, 0).sum(-1) / mask.sum(-1)), old)
    ours = logp.clone().float().requires_grad_(True)
    loss, _ = hacpo_policy_loss(ours, mask, old.float(), adv.float(), is_cross, update_index=2, alpha=1.5)
    loss.backward()
    ref = logp.clone().requires_grad_(True)
    _reference_loss_autograd(ref, mask, old, adv, is_cross, 2, 1.5).backward()
    assert ref.grad.abs().sum() > 0
    assert torch.allclose(ours.grad.double(), ref.grad, atol=1e-6)


@pytest.mark.parametrize("splits", [[12], [5, 7], [1, 4, 3, 4]])
def test_micro_batches_and_dp_ranks_sum_to_the_global_mean(splits):
    logp, mask, old, adv, is_cross = random_batch(seed=7)
    full = logp.clone().requires_grad_(True)
    full_loss, _ = hacpo_policy_loss(full, mask, old, adv, is_cross, update_index=1)
    full_loss.backward()
    parts = logp.clone().requires_grad_(True)
    total, start = 0.0, 0
    for size in splits:  # each chunk is a micro-batch on some rank; the sum is what DP all-reduce-sum gives
        sl = slice(start, start + size)
        part_loss, _ = hacpo_policy_loss(parts[sl], mask[sl], old[sl], adv[sl], is_cross[sl], update_index=1,
                                         num_global_seqs=12)
        part_loss.backward()
        total += part_loss.item()
        start += size
    assert total == pytest.approx(full_loss.item(), rel=1e-12)
    assert torch.allclose(parts.grad, full.grad, atol=1e-14)


def test_single_agent_hacpo_equals_gspo():
    logp, mask, old, adv, _ = random_batch(seed=3)
    own = torch.zeros(len(adv), dtype=torch.bool)
    a, _ = hacpo_policy_loss(logp, mask, old, adv, own, update_index=4)
    b, _ = gspo_policy_loss(logp, mask, old, adv)
    assert a.item() == pytest.approx(b.item(), rel=1e-12)


def test_ablation_switches_change_the_cross_loss():
    logp, mask, old, adv, is_cross = random_batch(seed=5, cross_fraction=1.0)
    base, _ = hacpo_policy_loss(logp, mask, old, adv, is_cross, update_index=3)
    no_clip, _ = hacpo_policy_loss(logp, mask, old, adv, is_cross, update_index=3, cross_clip=False)
    no_step, m = hacpo_policy_loss(logp, mask, old, adv, is_cross, update_index=3, stepwise_clip=False)
    # against the float64 reference: at update m = 3 the stepwise bound is min(1, 1 - 0.2 + 3 * 0.025) = 0.875;
    # without the stepwise schedule it stays at 1 - delta = 0.8, the reference's bound with delta_step 0
    N = logp.shape[0]
    rows = [(logp[r][mask[r]].tolist(), old[r].item(), adv[r].item(), bool(is_cross[r])) for r in range(N)]
    assert no_step.item() == pytest.approx(sum(ref_seq_loss(*row, 3, delta_step=0.0) for row in rows) / N,
                                           rel=1e-10)
    assert base.item() == pytest.approx(sum(ref_seq_loss(*row, 3) for row in rows) / N, rel=1e-10)
    s = torch.exp((torch.where(mask, logp, 0).sum(-1) / mask.sum(-1)) - old)
    assert no_clip.item() == pytest.approx((-(s * s * adv)).mean().item(), rel=1e-10)
    assert m["cross_clip_lower_bound"] == pytest.approx(0.8)
    assert len({round(base.item(), 12), round(no_clip.item(), 12), round(no_step.item(), 12)}) == 3


def test_one_token_responses():
    logp, mask, old, adv, is_cross = random_batch(N=6, T=1, seed=11)
    loss, _ = hacpo_policy_loss(logp, mask, old, adv, is_cross, update_index=0)
    ref = [ref_seq_loss([logp[r, 0].item()], old[r].item(), adv[r].item(), bool(is_cross[r]), 0) for r in range(6)]
    assert loss.item() == pytest.approx(sum(ref) / 6, rel=1e-10)


# ---------------------------------------------------------------- GRPO
def test_grpo_loss_matches_token_level_reference():
    logp, mask, _, adv, _ = random_batch(seed=9)
    g = torch.Generator().manual_seed(1)
    old = logp + (torch.rand(logp.shape, generator=g, dtype=torch.float64) - 0.5) * 0.8
    loss, metrics = grpo_policy_loss(logp, mask, old, adv)
    total, count, ratios = 0.0, 0, []
    for r in range(logp.shape[0]):
        for tkn in range(logp.shape[1]):
            if mask[r, tkn]:
                ratio = math.exp(logp[r, tkn].item() - old[r, tkn].item())
                a = adv[r].item()
                total += -min(ratio * a, min(max(ratio, 0.8), 1.28) * a)
                count += 1
                ratios.append(ratio)
    assert loss.item() == pytest.approx(total / count, rel=1e-10)
    assert 0.0 < metrics["own_clip_frac_lower"] + metrics["own_clip_frac_upper"] < 1.0
    # the metrics, each side of the clip on its own (over response tokens only; the metrics are float32)
    below, above = sum(x < 0.8 for x in ratios), sum(x > 1.28 for x in ratios)
    assert below > 0 and above > 0  # both sides occur, so a swap of the two shows
    assert metrics["own_clip_frac_lower"] == pytest.approx(below / count, rel=1e-6)
    assert metrics["own_clip_frac_upper"] == pytest.approx(above / count, rel=1e-6)
    assert metrics["own_ratio_mean"] == pytest.approx(sum(ratios) / count, rel=1e-6)
    assert (metrics["num_tokens"], metrics["num_own"]) == (count, logp.shape[0])


def test_gspo_loss_and_metrics_match_the_reference():
    """GSPO on its own (HACPO's own rows share its code, so HACPO == GSPO alone would pass a GSPO bug in both)."""
    logp, mask, old, adv, _ = random_batch(seed=8)
    # a few ratios inside GSPO's narrow band [1 - 3e-4, 1 + 4e-4], the rest spread around 1 on both sides
    old = torch.where(torch.arange(len(old)) % 4 == 0, (torch.where(mask, logp, 0).sum(-1) / mask.sum(-1)), old)
    loss, metrics = gspo_policy_loss(logp, mask, old, adv)
    N = logp.shape[0]
    per_seq = [ref_seq_loss(logp[r][mask[r]].tolist(), old[r].item(), adv[r].item(), False, 0) for r in range(N)]
    assert loss.item() == pytest.approx(sum(per_seq) / N, rel=1e-10, abs=1e-12)
    s = [math.exp(statistics.fmean(logp[r][mask[r]].tolist()) - old[r].item()) for r in range(N)]
    below, above = sum(x < 1 - 3e-4 for x in s), sum(x > 1 + 4e-4 for x in s)
    assert below > 0 and above > 0 and below + above < N
    assert metrics["own_clip_frac_lower"] == pytest.approx(below / N, rel=1e-6)
    assert metrics["own_clip_frac_upper"] == pytest.approx(above / N, rel=1e-6)
    assert metrics["own_ratio_mean"] == pytest.approx(statistics.fmean(s), rel=1e-6)
    assert metrics["num_own"] == N


def test_grpo_micro_batches_with_global_token_count():
    logp, mask, _, adv, _ = random_batch(seed=10)
    old = logp.detach() - 0.05
    full, _ = grpo_policy_loss(logp, mask, old, adv)
    tokens = int(mask.sum())
    parts = sum(grpo_policy_loss(logp[s], mask[s], old[s], adv[s], num_global_tokens=tokens)[0].item()
                for s in (slice(0, 5), slice(5, 12)))
    assert parts == pytest.approx(full.item(), rel=1e-12)


# ---------------------------------------------------------------- KL and input checks
def test_low_var_kl_is_zero_at_the_reference_and_positive_elsewhere():
    logp, mask, _, _, _ = random_batch(seed=12)
    assert low_var_kl_penalty(logp, logp.clone(), mask).item() == pytest.approx(0.0, abs=1e-12)
    assert low_var_kl_penalty(logp, logp - 0.3, mask).item() > 0


def test_low_var_kl_by_hand_is_the_k3_estimator_per_sequence_token_mean():
    """k3(t) = exp(ref - logp) - (ref - logp) - 1, each sequence's token-mean, then the mean over sequences. The
    zero-and-positive test above passes k3 with ref and logp swapped (also >= 0, also 0 at the reference) and a
    token-mean over the whole batch; these numbers tell all three apart."""
    mask = torch.tensor([[True, True], [True, False]])
    logp = torch.tensor([[-1.0, -2.0], [-1.0, -1e9]], dtype=torch.float64)  # padding garbage must not leak
    ref = torch.tensor([[-1.5, -2.0], [-0.7, 100.0]], dtype=torch.float64)
    # row 0: ref - logp = -0.5, 0 -> k3 = e^-0.5 + 0.5 - 1 = 0.1065307, 0 -> token-mean 0.0532653
    # row 1: ref - logp = 0.3     -> k3 = e^0.3 - 0.3 - 1 = 0.0498588
    row0 = (math.exp(-0.5) + 0.5 - 1) / 2
    row1 = math.exp(0.3) - 0.3 - 1
    assert low_var_kl_penalty(logp, ref, mask).item() == pytest.approx((row0 + row1) / 2, rel=1e-12)
    # (swapped: (e^0.5 - 1.5) / 2 = 0.0744 for row 0; one token-mean over 3 tokens: 0.0521 against 0.0516)
    # each call's share of a mini-batch of 4 sequences: sum over its rows / 4
    assert low_var_kl_penalty(logp, ref, mask, num_global_seqs=4).item() == pytest.approx((row0 + row1) / 4, rel=1e-12)
    # the gradient of k3 in logp_t is (1 - exp(ref - logp_t)) / L: row 0's first token (1 - e^-0.5) / 2 / 2 rows
    logp.requires_grad_(True)
    low_var_kl_penalty(logp, ref, mask).backward()
    expected = torch.tensor([[(1 - math.exp(-0.5)) / 4, 0.0], [(1 - math.exp(0.3)) / 2, 0.0]], dtype=torch.float64)
    assert torch.allclose(logp.grad, expected, rtol=1e-12, atol=1e-15)


def test_low_var_kl_is_clamped_at_ten_per_token_as_verl_does():
    # ref - logp = +30 is clamped to 20 first (e^20 - 21 = 4.9e8), then k3 to 10; -30: e^-20 + 19 -> 10 as well
    mask = torch.ones(2, 1, dtype=torch.bool)
    logp = torch.tensor([[-40.0], [-1.0]], dtype=torch.float64)
    ref = torch.tensor([[-10.0], [-31.0]], dtype=torch.float64)
    assert low_var_kl_penalty(logp, ref, mask).item() == 10.0


def test_empty_response_rows_are_rejected():
    logp, mask, old, adv, is_cross = random_batch(seed=0)
    mask[3] = False
    with pytest.raises(ValueError, match="empty responses .* rows \\[3\\]"):
        hacpo_policy_loss(logp, mask, old, adv, is_cross, update_index=0)


@pytest.mark.parametrize(
    "kwargs,message",
    [({"alpha": -1.0}, "alpha"), ({"delta": 1.0}, "delta"), ({"delta": 0.0}, "delta"),
     ({"update_index": -1}, "update_index")],
)
def test_bad_hyperparameters_are_rejected(kwargs, message):
    logp, mask, old, adv, is_cross = random_batch(seed=0)
    call = {"update_index": 0, **kwargs}
    with pytest.raises(ValueError, match=message):
        hacpo_policy_loss(logp, mask, old, adv, is_cross, **call)


def test_shape_mismatch_and_nonfinite_advantages_are_rejected():
    logp, mask, old, adv, is_cross = random_batch(seed=0)
    with pytest.raises(ValueError, match="advantages"):
        hacpo_policy_loss(logp, mask, old, adv[:-1], is_cross, update_index=0)
    adv[0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        hacpo_policy_loss(logp, mask, old, adv, is_cross, update_index=0)


def test_positive_cross_rows_inside_the_clip_are_counted_apart_from_the_others():
    # five other-agent rows and one own row: ratios below, inside (twice), at 1 and above the clip [0.8, 1]
    mask = torch.ones(6, 1, dtype=torch.bool)
    ratios = torch.tensor([0.5, 0.85, 0.9, 1.0, 1.5, 0.9], dtype=torch.float64)
    advantages = torch.tensor([1.0, 1.0, -1.0, 0.5, 2.0, 1.0], dtype=torch.float64)
    is_cross = torch.tensor([True, True, True, True, True, False])
    _, m = hacpo_policy_loss(ratios.log()[:, None], mask, torch.zeros(6, dtype=torch.float64), advantages, is_cross,
                             update_index=0)
    assert m["cross_positive_frac"] == pytest.approx(4 / 5)  # the own row and the negative one do not count
    assert m["cross_positive_inside_frac"] == pytest.approx(2 / 5)  # 0.85 and 1.0: below and above carry no gradient
    _, m = hacpo_policy_loss(ratios.log()[:, None], mask, torch.zeros(6, dtype=torch.float64), advantages, is_cross,
                             update_index=0, cross_clip=False)
    assert m["cross_positive_inside_frac"] == pytest.approx(4 / 5)  # no clip: every one moves the learner
