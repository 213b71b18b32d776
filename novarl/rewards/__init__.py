"""Rewards: verifiers, math answers, the reward-function registry and the scorer."""

from novarl.rewards.registry import REWARD_FUNCTIONS, import_reward_fn
from novarl.rewards.scorer import RewardScorer
from novarl.rewards.verifiers import exact_match

__all__ = ["REWARD_FUNCTIONS", "RewardScorer", "exact_match", "import_reward_fn"]
