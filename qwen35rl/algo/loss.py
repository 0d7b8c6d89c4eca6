"""The loss a train engine minimises, handed to `TrainEngine.train_mini_batch` by the caller: the engine runs the
forward, backward and optimizer passes and knows nothing of the algorithm's settings.

Per micro batch the engine calls `loss_fn(inputs, scale)` and gets the loss and a float64 vector of statistics; it
folds them over its micro batches (`combine`, from `zeros`) and data-parallel ranks (`reduce`), skips the optimizer
step when `nonfinite` says so, and reports `metrics`.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import Tensor

from qwen35rl.algo.core import ACTOR_SUMS, GAP_MAX, actor_loss, actor_metrics, add_actor_sums, agg_settings


@dataclass(frozen=True)
class LossScale:
    """What a micro batch's loss is a share of (`core.agg_loss`'s normalisers): the valid tokens and sequences of
    the whole mini batch over all data-parallel ranks, the ranks the gradients are averaged over, and the divisor
    of seq-mean-token-sum-norm (None: the loss function's default)."""

    global_tokens: float
    global_seqs: float
    dp_size: int
    norm_const: Optional[float] = None


@dataclass
class LossInputs:
    """One micro batch's per-token tensors [B, T] on the engine's device: the policy's log-probs and entropy (with
    their gradients) and the batch's response mask, advantages and log-probs of the other policies."""

    log_probs: Tensor
    entropy: Tensor
    mask: Tensor
    advantages: Tensor
    old_log_probs: Optional[Tensor] = None
    ref_log_probs: Optional[Tensor] = None
    rollout_log_probs: Optional[Tensor] = None


class TrainLoss(abc.ABC):
    """A loss function as the train engines call it (see the module's docstring)."""

    @abc.abstractmethod
    def __call__(self, inputs: LossInputs, scale: LossScale) -> Tuple[Tensor, Tensor]:
        """(the scalar to back-propagate, this micro batch's statistics)."""

    @abc.abstractmethod
    def zeros(self, device: Any) -> Tensor:
        """The statistics before any micro batch (also what a pipeline stage without the loss holds)."""

    @abc.abstractmethod
    def combine(self, total: Tensor, stats: Tensor) -> Tensor:
        """`total` with one more micro batch's statistics folded in."""

    @abc.abstractmethod
    def reduce(self, stats: Tensor, sum_over_dp: Callable[[Tensor], Tensor]) -> Tensor:
        """A rank's statistics combined over the data-parallel ranks with the engine's collective `sum_over_dp`."""

    @abc.abstractmethod
    def nonfinite(self, stats: Tensor) -> bool:
        """Whether the mini batch's loss was not finite somewhere (the engine then skips the optimizer step)."""

    @abc.abstractmethod
    def metrics(self, stats: Tensor, dp_size: int, rollout_gap: bool) -> Dict[str, float]:
        """Named metrics of the reduced statistics; `rollout_gap`: the micro batches carried rollout log-probs."""


class ActorLoss(TrainLoss):
    """GRPO's actor loss (`core.actor_loss`: clipped policy loss, KL and entropy terms, aggregated by the configured
    `loss_agg_mode`) under the `algorithm` settings; seq-mean-token-sum-norm divides by `loss_scale_factor`, else
    `max_response_length`, unless the scale names its own divisor. Statistics: `core.ACTOR_SUMS` + GAP_MAX."""

    def __init__(self, algo: Any, max_response_length: int):
        self.algo, self.max_response_length = algo, max_response_length

    @classmethod
    def from_config(cls, cfg: Any) -> "ActorLoss":
        """The loss of a run config (`algorithm`, `data.max_response_length`)."""
        return cls(cfg.algorithm, cfg.data.max_response_length)

    def __call__(self, inputs: LossInputs, scale: LossScale) -> Tuple[Tensor, Tensor]:
        agg = agg_settings(self.algo, self.max_response_length, global_tokens=scale.global_tokens,
                           global_seqs=scale.global_seqs, dp_size=scale.dp_size, norm_const=scale.norm_const)
        return actor_loss(inputs.log_probs, inputs.entropy, inputs.old_log_probs, inputs.ref_log_probs,
                          inputs.advantages, inputs.mask, self.algo, agg, inputs.rollout_log_probs)

    def zeros(self, device: Any) -> Tensor:
        return torch.zeros(GAP_MAX + 1, dtype=torch.float64, device=device)

    def combine(self, total: Tensor, stats: Tensor) -> Tensor:
        return add_actor_sums(total, stats)

    def reduce(self, stats: Tensor, sum_over_dp: Callable[[Tensor], Tensor]) -> Tensor:
        summed = sum_over_dp(stats[:GAP_MAX])
        return torch.cat([summed, stats[GAP_MAX:].to(summed.device)])  # the gap's max stays per rank

    def nonfinite(self, stats: Tensor) -> bool:
        return bool(stats[ACTOR_SUMS.index("nonfinite")] > 0)

    def metrics(self, stats: Tensor, dp_size: int, rollout_gap: bool) -> Dict[str, float]:
        return actor_metrics(stats, dp_size, rollout_gap)
