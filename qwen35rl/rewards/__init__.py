"""Reward functions (`data.reward`) and scoring with a hard time limit per call."""
from qwen35rl.rewards.registry import BUILTIN, get_reward_fn
from qwen35rl.rewards.scoring import RewardPool, score_responses

__all__ = ["BUILTIN", "RewardPool", "get_reward_fn", "score_responses"]
