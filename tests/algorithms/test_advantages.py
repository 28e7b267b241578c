import pytest
import torch

from hacpo_megatron.algorithms import (
    CapabilityTracker,
    batch_capabilities,
    capability_ratios,
    hacpo_advantages,
    modulated_advantages,
    resolve_algorithm,
    step_advantages,
)
from tests.algorithms.reference import ref_advantages, ref_capabilities, ref_omega


def t(x):
    return torch.tensor(x, dtype=torch.float64)


# ---------------------------------------------------------------- capability ratios
def test_capability_ratios_hand_case():
    omega = capability_ratios(t([0.5, 0.25]))
    assert torch.allclose(omega, t([[1.0, 2.0], [0.5, 1.0]]))


def test_capability_ratios_zero_capability_is_floored_then_clamped():
    omega = capability_ratios(t([0.0, 0.5]))
    assert torch.allclose(omega, t([[1.0, 0.1], [10.0, 1.0]]))
    unclamped = capability_ratios(t([0.0, 0.5]), clamp=None)
    assert unclamped[0, 1].item() == pytest.approx(1e-8 / 0.5)
    assert unclamped[1, 0].item() == pytest.approx(0.5 / 1e-8)


@pytest.mark.parametrize("bad", [[-0.1, 0.5], [float("nan"), 0.5], []])
def test_capability_ratios_rejects_bad_capabilities(bad):
    with pytest.raises(ValueError):
        capability_ratios(t(bad))


def test_batch_capabilities_is_mean_reward():
    R = t([[[1, 0], [1, 1]], [[0, 0], [1, 0]]])
    assert torch.allclose(batch_capabilities(R), t([0.75, 0.25]))


def test_capability_tracker_window_and_state_roundtrip():
    tracker = CapabilityTracker(num_agents=2, window=2)
    tracker.update(t([[[1, 1]], [[0, 0]]]))
    P = tracker.update(t([[[0, 0]], [[1, 0]]]))
    assert torch.allclose(P, t([0.5, 0.25]))
    P = tracker.update(t([[[1, 0]], [[1, 1]]]))  # the first step leaves the window
    assert torch.allclose(P, t([0.25, 0.75]))
    restored = CapabilityTracker(num_agents=2, window=2)
    restored.load_state_dict(tracker.state_dict())
    assert torch.equal(restored.capabilities, tracker.capabilities)
    assert torch.equal(restored.update(t([[[1, 1]], [[1, 1]]])), tracker.update(t([[[1, 1]], [[1, 1]]])))
    with pytest.raises(ValueError, match="agents"):
        CapabilityTracker(num_agents=3).load_state_dict(tracker.state_dict())


# ---------------------------------------------------------------- advantages
def test_hacpo_advantages_hand_case_without_guards_firing():
    # one prompt, agent 0 rewards [1, 0], agent 1 rewards [1, 1]; P = [0.5, 1]
    R = t([[[1, 0]], [[1, 1]]])
    omega = capability_ratios(batch_capabilities(R))
    A = hacpo_advantages(R, omega)
    s = 0.5 + 1e-6  # std([1, 0, 1, 1]) = 0.5; mu_0 = (1 + 0.5 * 2) / 4 = 0.5; mu_1 = (2 + 2) / 4 = 1
    assert torch.allclose(A[0, 0, 0], t([0.5, -0.5]) / s)
    assert torch.allclose(A[0, 1, 0], t([0.5, 0.5]) / s)
    assert torch.allclose(A[1, 0, 0], t([0.0, -1.0]) / s)
    assert torch.allclose(A[1, 1, 0], t([0.0, 0.0]))


def test_baseline_above_group_max_falls_back_to_learner_own_mean():
    # prompt 0: agent 0 [1, 1], agent 1 [1, 0]; prompt 1: agent 0 [1, 0], agent 1 [0, 0] -> P = [3/4, 1/4]
    R = t([[[1, 1], [1, 0]], [[1, 0], [0, 0]]])
    omega = capability_ratios(batch_capabilities(R))
    assert omega[0, 1].item() == pytest.approx(3.0)
    A = hacpo_advantages(R, omega)
    s0 = 0.5 + 1e-6  # std([1, 1, 1, 0])
    # mu_0(prompt 0) = (2 + 3 * 1) / 4 = 1.25 > max 1 -> own mean 1
    assert torch.allclose(A[0, 0, 0], t([0.0, 0.0]))
    assert torch.allclose(A[0, 1, 0], t([0.0, -1.0]) / s0)
    # mu_1(prompt 0) = (2/3 + 1) / 4 = 5/12, no guard
    assert torch.allclose(A[1, 0, 0], t([7 / 12, 7 / 12]) / s0)
    # without the guard the baseline stays 1.25
    A_unguarded = hacpo_advantages(R, omega, baseline_above_max_guard=False)
    assert torch.allclose(A_unguarded[0, 0, 0], t([-0.25, -0.25]) / s0)


def test_equal_rewards_give_zero_advantage_for_every_learner():
    R = t([[[1, 1], [1, 0]], [[1, 1], [0, 0]]])  # prompt 0: all four rewards are 1
    omega = capability_ratios(t([0.9, 0.1]), clamp=None)  # a large ratio would push mu far off
    A = hacpo_advantages(R, omega)
    assert torch.equal(A[:, :, 0], torch.zeros_like(A[:, :, 0]))
    assert A[:, :, 1].abs().sum() > 0


def test_single_agent_reduces_to_grpo_advantage():
    torch.manual_seed(0)
    R = torch.randint(0, 2, (1, 5, 8)).double()
    A = hacpo_advantages(R, torch.ones(1, 1, dtype=torch.float64))
    expected = (R[0] - R[0].mean(-1, keepdim=True)) / (R[0].std(-1, keepdim=True) + 1e-6)
    assert torch.allclose(A[0, 0], expected)


def test_plain_joint_mean_baseline_is_the_same_for_every_learner():
    torch.manual_seed(1)
    R = torch.rand(3, 4, 5, dtype=torch.float64)
    omega = capability_ratios(batch_capabilities(R))
    A = hacpo_advantages(R, omega, capability_aware=False)
    group = R.permute(1, 0, 2).reshape(4, 15)
    expected = (R - group.mean(1)[None, :, None]) / (group.std(1)[None, :, None] + 1e-6)
    for k in range(3):
        assert torch.allclose(A[k], expected)


@pytest.mark.parametrize("n,B,G,seed", [(2, 6, 4, 0), (3, 5, 3, 1), (4, 3, 2, 2), (1, 4, 6, 3), (2, 8, 8, 4)])
@pytest.mark.parametrize("binary", [True, False])
def test_advantages_match_reference_on_random_inputs(n, B, G, seed, binary):
    g = torch.Generator().manual_seed(seed)
    R = torch.randint(0, 2, (n, B, G), generator=g).double() if binary else torch.rand(n, B, G, generator=g).double()
    R[0, 0] = 0.0  # make an agent/prompt with zeros and (for n>1) a stronger partner
    P = batch_capabilities(R)
    omega = capability_ratios(P)
    assert torch.allclose(P, t(ref_capabilities(R.tolist())))
    assert torch.allclose(omega, t(ref_omega(P.tolist())))
    for aware in (True, False):
        A = hacpo_advantages(R, omega, capability_aware=aware)
        ref = t(ref_advantages(R.tolist(), omega.tolist(), capability_aware=aware))
        assert torch.allclose(A, ref, atol=1e-9), (aware, (A - ref).abs().max())


def test_agent_with_zero_capability_gives_finite_advantages():
    R = t([[[0, 0, 0], [0, 0, 0]], [[1, 0, 1], [1, 1, 0]]])
    omega = capability_ratios(batch_capabilities(R))
    A = hacpo_advantages(R, omega)
    assert torch.isfinite(A).all()
    # learner 0 (P=0) sees omega[0, 1] = 0.1: its baseline is low, so agent 1's correct answers score high
    assert (A[0, 1][R[1] == 1] > 0).all()
    ref = t(ref_advantages(R.tolist(), omega.tolist()))
    assert torch.allclose(A, ref, atol=1e-9)


def test_modulated_advantages_scale_other_agents_rows_by_source_over_learner():
    torch.manual_seed(2)
    R = torch.randint(0, 2, (3, 4, 4)).double()
    omega = capability_ratios(t([0.2, 0.4, 0.8]))
    A = hacpo_advantages(R, omega)
    M = modulated_advantages(A, omega)
    for k in range(3):
        for j in range(3):
            factor = 1.0 if j == k else omega[j, k].item()
            assert torch.allclose(M[k, j], factor * A[k, j])
    assert torch.equal(modulated_advantages(A, omega, gradient_modulation=False), A)
    assert M[0, 2].abs().sum() >= A[0, 2].abs().sum()  # the weakest learner learns harder from the strongest


@pytest.mark.parametrize(
    "rewards,message",
    [
        (torch.tensor([[[float("nan"), 1.0]]]), "non-finite"),
        (torch.tensor([[[float("inf"), 1.0]]]), "non-finite"),
        (torch.tensor([[[1.5, 1.0]]]), "outside the allowed range"),
        (torch.tensor([[[-0.5, 1.0]]]), "outside the allowed range"),
        (torch.tensor([[1.0, 1.0]]), "shape"),
        (torch.tensor([[[1.0]]]), "at least 2 responses"),
    ],
)
def test_bad_rewards_are_rejected_with_a_clear_error(rewards, message):
    with pytest.raises(ValueError, match=message):
        hacpo_advantages(rewards, torch.ones(1, 1))


def test_reward_range_can_be_widened_for_other_reward_functions():
    R = t([[[-1.0, 2.0, 0.5]]])
    A = hacpo_advantages(R, torch.ones(1, 1, dtype=torch.float64), reward_range=None)
    assert torch.isfinite(A).all()
    # By hand, A = (R - mu) / (sigma + eps) (advantages.py, paper Eq. 2), one agent so omega = [[1]]:
    # mu = (-1 + 2 + 0.5) / 3 = 0.5 (no guard applies: 0.5 <= max R = 2, and the rewards differ);
    # sigma, Bessel-corrected: deviations -1.5, 1.5, 0 -> (2.25 + 2.25 + 0) / (3 - 1) = 2.25 -> sigma = 1.5
    # (the population std would be sqrt(1.5) = 1.22); eps = 1e-6 -> A = [-1.5, 1.5, 0] / 1.500001
    assert torch.allclose(A, t([[[[-1.5, 1.5, 0.0]]]]) / (1.5 + 1e-6), rtol=1e-12, atol=0)
    # a range that holds these rewards gives the same advantages as no range at all
    assert torch.equal(hacpo_advantages(R, torch.ones(1, 1, dtype=torch.float64), reward_range=(-1.0, 2.0)), A)


# ---------------------------------------------------------------- step-level composition
def test_step_advantages_for_single_agent_baselines_use_own_groups_only():
    torch.manual_seed(3)
    R = torch.randint(0, 2, (2, 3, 4)).double()
    for name in ("gspo", "grpo", "gspo_x2"):
        out = step_advantages(R, batch_capabilities(R), resolve_algorithm(name))
        assert torch.equal(out.trains_on, torch.eye(2, dtype=torch.bool))
        for k in range(2):
            expected = hacpo_advantages(R[k : k + 1], torch.ones(1, 1, dtype=torch.float64))[0, 0]
            assert torch.allclose(out.effective[k, k], expected)


def test_step_advantages_naive_and_hacpo_differ_only_by_their_switches():
    torch.manual_seed(4)
    R = torch.randint(0, 2, (2, 4, 4)).double()
    P = t([0.3, 0.6])
    hacpo = step_advantages(R, P, resolve_algorithm("hacpo"))
    omega = capability_ratios(P)
    assert torch.allclose(hacpo.effective, modulated_advantages(hacpo_advantages(R, omega), omega))
    naive = step_advantages(R, P, resolve_algorithm("naive"))
    assert torch.allclose(naive.effective, hacpo_advantages(R, omega, capability_aware=False))
    no_adv = step_advantages(R, P, resolve_algorithm("hacpo", capability_aware_advantage=False))
    assert torch.allclose(no_adv.effective,
                          modulated_advantages(hacpo_advantages(R, omega, capability_aware=False), omega))


def test_resolve_algorithm_rejects_unknown_names_and_misapplied_switches():
    with pytest.raises(ValueError, match="unknown algorithm"):
        resolve_algorithm("ppo")
    with pytest.raises(ValueError, match="do not apply"):
        resolve_algorithm("gspo", stepwise_clip=False)
    assert resolve_algorithm("hacpo", cross_clip=False).cross_clip is False
