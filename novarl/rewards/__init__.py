"""Rewards: verifiers and the reward-function registry."""

from novarl.rewards.registry import REWARD_FUNCTIONS, RewardScorer, import_reward_fn
from novarl.rewards.verifiers import exact_match

__all__ = ["REWARD_FUNCTIONS", "RewardScorer", "exact_match", "import_reward_fn"]
