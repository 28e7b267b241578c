"""Algorithms by name: HACPO, its baselines, and its ablations, as switches over one code path.

|name   |shares rollouts|advantage baseline    |omega|loss on other agents' rows|their old log-prob |M (paper)   |
|-------|---------------|----------------------|-----|--------------------------|-------------------|------------|
|hacpo  |yes            |capability-aware      |yes  |exp. IS + stepwise clip   |source's sum / L_j |n*B/mini = 4|
|naive  |yes            |plain joint-group mean|no   |same GSPO loss as own rows|learner's own (old)|n*B/mini = 4|
|gspo   |no             |own group (GRPO-style)|-    |-                         |-                  |B/mini = 2  |
|gspo_x2|no, 2G samples |own group             |-    |-                         |-                  |2B/mini = 4 |
|grpo   |no, token-level ratio loss                                             |-                  |B/mini = 2  |

M, the updates per step, follows from every update seeing `train.mini_batch_size` x G responses
(training/batch.py: UpdateSchedule); the paper's B = 128, mini-batch 64, G = 8 give the last column.

Naive's old log-prob of another agent's response (the paper does not say): the learner's own, taken
before the step's updates like that of its own responses. "Naive" treats shared responses like own
ones; in verl, where the paper's runs were made, appending the shared responses to a learner's batch
gives exactly this, since verl computes every row's old log-prob with the learner's actor. The other
reading, the source's sum / L_j inside GSPO's +-3e-4 clip, makes almost every such ratio leave the
clip range at once (the two policies differ by far more than 3e-4 per token), so those rows would
either carry no gradient (clipped side) or an unbounded one: an importance-weighting variant, not the
naive baseline. It stays available as `algorithm.cross_old_logprob: source`.

Ablations of HACPO are switches on `hacpo`: capability_aware_advantage=False ("-Adv"),
gradient_modulation=False ("-omega"), cross_clip=False, stepwise_clip=False, and the alpha sweep.
`cross_old_logprob` applies to both shared-rollout algorithms.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple, Optional, Tuple

import torch

from hacpo_megatron.algorithms.advantages import hacpo_advantages, modulated_advantages
from hacpo_megatron.algorithms.capability import capability_ratios
from hacpo_megatron.algorithms.losses import POLICY_LOSSES, PolicyLoss


@dataclass(frozen=True)
class AlgorithmSpec:
    name: str
    policy_loss: str  # key of POLICY_LOSSES
    share_rollouts: bool  # learners also train on other agents' responses
    capability_aware_advantage: bool = True
    gradient_modulation: bool = True
    cross_clip: bool = True
    stepwise_clip: bool = True
    samples_multiplier: int = 1  # GSPO x2: 2G samples per prompt (and so twice the updates)
    cross_old_logprob: str = "source"  # other agents' rows: "source" (sum / L_j) or "learner" (its own old)

    @property
    def loss(self) -> PolicyLoss:
        """Its policy loss, with what the loss needs from the trainer (algorithms/losses.py: PolicyLoss)."""
        return POLICY_LOSSES[self.policy_loss]


ALGORITHMS = {
    "hacpo": AlgorithmSpec("hacpo", policy_loss="hacpo", share_rollouts=True),
    "naive": AlgorithmSpec("naive", policy_loss="gspo", share_rollouts=True, capability_aware_advantage=False,
                           gradient_modulation=False, cross_old_logprob="learner"),
    "gspo": AlgorithmSpec("gspo", policy_loss="gspo", share_rollouts=False),
    "gspo_x2": AlgorithmSpec("gspo_x2", policy_loss="gspo", share_rollouts=False, samples_multiplier=2),
    "grpo": AlgorithmSpec("grpo", policy_loss="grpo", share_rollouts=False),
}

ABLATION_SWITCHES = ("capability_aware_advantage", "gradient_modulation", "cross_clip", "stepwise_clip")
CROSS_OLD_LOGPROB = ("source", "learner")


def resolve_algorithm(name: str, cross_old_logprob: Optional[str] = None, **switches: Optional[bool]) -> AlgorithmSpec:
    """The spec of `name` with ablation switches applied (a switch set to None keeps the default).

    Switches only change HACPO (`cross_old_logprob`: HACPO and Naive); setting one on an algorithm
    it does not apply to is an error, so a config never silently runs something other than it says.
    """
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; choose one of {sorted(ALGORITHMS)}")
    spec = ALGORITHMS[name]
    changes = {k: v for k, v in switches.items() if v is not None}
    unknown = set(changes) - set(ABLATION_SWITCHES)
    if unknown:
        raise ValueError(f"unknown algorithm switches {sorted(unknown)}; known: {list(ABLATION_SWITCHES)}")
    if name != "hacpo":
        differing = {k: v for k, v in changes.items() if getattr(spec, k) != v}
        if differing:
            raise ValueError(f"switches {sorted(differing)} are HACPO ablations and do not apply to {name!r}")
    if cross_old_logprob is not None:
        if cross_old_logprob not in CROSS_OLD_LOGPROB:
            raise ValueError(f"cross_old_logprob must be one of {list(CROSS_OLD_LOGPROB)}, got {cross_old_logprob!r}")
        if not spec.share_rollouts and cross_old_logprob != spec.cross_old_logprob:
            raise ValueError(f"cross_old_logprob applies to algorithms that share rollouts, not to {name!r}")
        changes["cross_old_logprob"] = cross_old_logprob
    return dataclasses.replace(spec, **changes)


def algorithm_spec(algorithm_config) -> AlgorithmSpec:
    """The spec a config's `algorithm:` section asks for (name, ablation switches, cross_old_logprob)."""
    return resolve_algorithm(algorithm_config.name, cross_old_logprob=algorithm_config.cross_old_logprob,
                             **{k: getattr(algorithm_config, k) for k in ABLATION_SWITCHES})


class StepAdvantages(NamedTuple):
    omega: torch.Tensor  # [n, n] capability ratios (ones when rollouts are not shared)
    effective: torch.Tensor  # [n, n, B, G] effective advantage of learner k on agent j's responses
    trains_on: torch.Tensor  # [n, n] bool: learner k trains on agent j's responses


def step_advantages(
    rewards: torch.Tensor,
    capabilities: torch.Tensor,
    spec: AlgorithmSpec,
    *,
    omega_clamp: Optional[Tuple[float, float]] = (0.1, 10.0),
    eps: float = 1e-6,
    reward_range: Optional[Tuple[float, float]] = (0.0, 1.0),
) -> StepAdvantages:
    """Every learner's effective advantages for one step (Algorithm 1, lines computing A and A~).

    Shared-rollout algorithms use the joint group of all n*G responses; single-agent ones normalise
    each agent within its own G responses (GRPO/GSPO), and learner k trains on its own rows only.
    """
    n = rewards.shape[0]
    if spec.share_rollouts:
        omega = capability_ratios(capabilities, clamp=omega_clamp)
        A = hacpo_advantages(rewards, omega, capability_aware=spec.capability_aware_advantage, eps=eps,
                             reward_range=reward_range)
        effective = modulated_advantages(A, omega, gradient_modulation=spec.gradient_modulation)
        trains_on = torch.ones(n, n, dtype=torch.bool)
        return StepAdvantages(omega, effective, trains_on)

    omega = torch.ones(n, n, dtype=torch.float64)
    effective = torch.zeros((n, n) + tuple(rewards.shape[1:]), dtype=rewards.dtype)
    for k in range(n):
        own = hacpo_advantages(rewards[k : k + 1], omega[:1, :1], capability_aware=False, eps=eps,
                               reward_range=reward_range)
        effective[k, k] = own[0, 0]
    return StepAdvantages(omega, effective, torch.eye(n, dtype=torch.bool))
