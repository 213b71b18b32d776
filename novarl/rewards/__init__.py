"""Rewards: verifiers, math answers, the reward-function registry and the scorer.

Importing the package stays torch-free (`novarl validate` checks registered rewards); the
scorer, which works on completions (torch types), is imported when asked for."""

from novarl.rewards.registry import REWARD_FUNCTIONS, import_reward_fn
from novarl.rewards.verifiers import exact_match

__all__ = ["REWARD_FUNCTIONS", "RewardScorer", "exact_match", "import_reward_fn"]


def __getattr__(name: str):
    if name == "RewardScorer":
        from novarl.rewards.scorer import RewardScorer

        return RewardScorer
    raise AttributeError(f"module 'novarl.rewards' has no attribute '{name}'")
