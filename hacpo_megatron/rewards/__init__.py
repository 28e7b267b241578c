"""Rewards: the math-verify default, plug-ins by dotted path, and a worker pool that scores under time limits."""

from hacpo_megatron.rewards.math_verify import compute_score
from hacpo_megatron.rewards.pool import RewardItem, RewardPool, score_batch
from hacpo_megatron.rewards.registry import RewardFunctionError, load_reward_function

__all__ = ["compute_score", "RewardItem", "RewardPool", "score_batch", "RewardFunctionError", "load_reward_function"]
