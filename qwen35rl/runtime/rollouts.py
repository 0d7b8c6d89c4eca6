"""One step's responses on the driver: prompt-major groups of n, their scores and shaped rewards, group
selection for dynamic sampling, and the data metrics of grpo.md."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import torch

from qwen35rl.runtime.batching import Sequences


@dataclass
class RolloutBatch:
    """Responses grouped by prompt: rows [g*n, (g+1)*n) are the n samples of prompt g."""

    n: int
    examples: List[Any]
    """The prompt of each group (PromptExample)."""
    prompt_ids: List[List[int]]
    """Per response (the group's prompt, repeated)."""
    response_ids: List[List[int]]
    rollout_log_probs: List[List[float]]
    finish_reasons: List[str]
    scores: List[float] = field(default_factory=list)
    """Reward function output per response."""
    rewards: List[float] = field(default_factory=list)
    """Scores after shaping (overlong penalty; in-reward KL is subtracted later, once ref log-probs exist)."""

    # ------------------------------------------------------------------------------------------------ groups
    @property
    def num_groups(self) -> int:
        return len(self.examples)

    def __len__(self) -> int:
        return len(self.response_ids)

    @property
    def group_index(self) -> torch.Tensor:
        return torch.arange(self.num_groups).repeat_interleave(self.n)

    def response_examples(self) -> List[Any]:
        return [ex for ex in self.examples for _ in range(self.n)]

    def select_groups(self, groups: Sequence[int]) -> "RolloutBatch":
        rows = [g * self.n + j for g in groups for j in range(self.n)]

        def pick(x: List[Any]) -> List[Any]:
            return [x[r] for r in rows] if x else []

        return RolloutBatch(self.n, [self.examples[g] for g in groups], pick(self.prompt_ids), pick(self.response_ids),
                            pick(self.rollout_log_probs), pick(self.finish_reasons), pick(self.scores),
                            pick(self.rewards))

    @staticmethod
    def concat(parts: Sequence["RolloutBatch"]) -> "RolloutBatch":
        parts = [p for p in parts if p is not None]
        out = RolloutBatch(parts[0].n, [], [], [], [], [], [], [])
        for p in parts:
            for name in ("examples", "prompt_ids", "response_ids", "rollout_log_probs", "finish_reasons", "scores",
                         "rewards"):
                getattr(out, name).extend(getattr(p, name))
        return out

    # ------------------------------------------------------------------------------------------------- views
    def sequences(self) -> Sequences:
        images = None
        if any(ex.images for ex in self.examples):
            images = [list(ex.images or []) for ex in self.response_examples()]
        return Sequences(prompt_ids=self.prompt_ids, response_ids=self.response_ids, images=images)

    def response_lengths(self) -> torch.Tensor:
        return torch.tensor([len(r) for r in self.response_ids], dtype=torch.float32)


def _stats(prefix: str, x: torch.Tensor, weights: Optional[torch.Tensor] = None) -> Dict[str, float]:
    if x.numel() == 0:
        return {}
    mean = (x * weights).sum() / weights.sum().clamp(min=1) if weights is not None else x.mean()
    return {f"{prefix}/mean": float(mean), f"{prefix}/max": float(x.max()), f"{prefix}/min": float(x.min())}


def data_metrics(batch: RolloutBatch, rewards: torch.Tensor, advantages: torch.Tensor,
                 max_response_length: int) -> Dict[str, float]:
    """critic/score, critic/rewards, critic/advantages (token-weighted, as each response token carries its
    response's advantage), response_length/* with clip_ratio (share that hit the length limit), prompt_length/*."""
    lengths = batch.response_lengths()
    metrics: Dict[str, float] = {}
    metrics.update(_stats("critic/score", torch.tensor(batch.scores, dtype=torch.float32)))
    metrics.update(_stats("critic/rewards", rewards.float()))
    metrics.update(_stats("critic/advantages", advantages.float(), weights=lengths))
    metrics.update(_stats("response_length", lengths))
    metrics["response_length/clip_ratio"] = float(
        sum(1 for r, ln in zip(batch.finish_reasons, lengths.tolist()) if r == "length" or ln >= max_response_length)
        / max(len(batch), 1))
    metrics.update(_stats("prompt_length", torch.tensor([len(p) for p in batch.prompt_ids], dtype=torch.float32)))
    return metrics


def logprob_diff_metrics(rollout: Sequence[Sequence[float]], trainer: Sequence[Sequence[float]]) -> Dict[str, float]:
    """|rollout engine log-prob - trainer log-prob| per response token, mean and max over the batch: near zero
    when the rollout engine samples from the policy being trained (a failed weight sync shows up here first)."""
    diffs = [abs(a - b) for ra, rb in zip(rollout, trainer) for a, b in zip(ra, rb)]
    if not diffs:
        return {}
    return {"rollout/logprob_diff_mean": float(sum(diffs) / len(diffs)), "rollout/logprob_diff_max": float(max(diffs))}
