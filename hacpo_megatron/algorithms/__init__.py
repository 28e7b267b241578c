"""The HACPO algorithm as pure functions on tensors. Imports no Megatron, no Ray, no processes."""
from hacpo_megatron.algorithms.advantages import hacpo_advantages, modulated_advantages
from hacpo_megatron.algorithms.capability import CapabilityTracker, batch_capabilities, capability_ratios
from hacpo_megatron.algorithms.losses import (
    RATIO_HISTOGRAM,
    LossParams,
    PolicyBatch,
    cross_clip_lower_bound,
    fitted_cross_clip_lower_bound,
    grpo_policy_loss,
    gspo_policy_loss,
    hacpo_policy_loss,
    log_ratio_histogram,
    low_var_kl_penalty,
    masked_row_mean,
    sequence_ratio,
)
from hacpo_megatron.algorithms.registry import (
    ALGORITHMS,
    POLICY_LOSSES,
    AlgorithmSpec,
    StepAdvantages,
    resolve_algorithm,
    step_advantages,
)

__all__ = [
    "ALGORITHMS",
    "POLICY_LOSSES",
    "RATIO_HISTOGRAM",
    "AlgorithmSpec",
    "CapabilityTracker",
    "LossParams",
    "PolicyBatch",
    "StepAdvantages",
    "batch_capabilities",
    "capability_ratios",
    "cross_clip_lower_bound",
    "fitted_cross_clip_lower_bound",
    "log_ratio_histogram",
    "grpo_policy_loss",
    "gspo_policy_loss",
    "hacpo_advantages",
    "hacpo_policy_loss",
    "low_var_kl_penalty",
    "masked_row_mean",
    "modulated_advantages",
    "resolve_algorithm",
    "sequence_ratio",
    "step_advantages",
]
