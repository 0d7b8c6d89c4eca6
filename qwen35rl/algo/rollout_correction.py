"""Off-policy correction of stale rollouts: truncated importance weights of the proximal over the behaviour policy.

With algorithm.max_staleness=k the rollout engines sample from a policy up to k versions old, the behaviour policy
(its per-token log-probs come back as RolloutBatch.rollout_log_probs). The trainer's old log-probs are the proximal
policy, the current weights before the update, and the denominator of the PPO ratio. Decoupled PPO (AReaL's
decoupled loss; verl's rollout correction `rollout_is` outside bypass mode) multiplies each token's policy-gradient
term by a truncated importance weight, C = algorithm.rollout_is_threshold:

    token:    w_t = min(pi_old(y_t) / pi_behaviour(y_t), C)
    sequence: w   = min(prod_t pi_old(y_t) / pi_behaviour(y_t), C), the same weight for every token of the response

The PPO surrogate of `core.policy_loss` is positively homogeneous in the advantage: for w > 0 the clip and the dual
clip pick the same branch for A and w * A, so w * loss(A) = loss(w * A). `fold` therefore puts the weights into
per-token advantages and neither engine's loss changes. The KL and entropy terms are not reweighted.
"""
from __future__ import annotations

import math
from itertools import chain
from typing import Dict, List, Sequence, Tuple, Union

import torch

from qwen35rl.algo.core import _LOG_RATIO_CLAMP

MODES = ("token", "sequence", "off")

_PREFIX = "rollout_corr/"
METRICS = tuple(_PREFIX + name for name in (
    "rollout_is_mean", "rollout_is_max", "rollout_is_min", "rollout_is_ratio_fraction_high",
    "rollout_is_eff_sample_size", "log_ratio_abs_mean"))
"""The step metrics of `is_weights`; the names follow verl's rollout correction (rollout_corr/rollout_is_*)."""


def is_weights(old: Sequence[Sequence[float]], behaviour: Sequence[Sequence[float]], mode: str,
               threshold: float) -> Tuple[List[List[float]], Dict[str, float]]:
    """Per-token truncated IS weights of each response and their step metrics.

    `old`: the trainer's per-token log-probs (proximal policy); `behaviour`: the rollout engine's, same shapes.
    `mode` is token, sequence or off (off: all weights 1 and no metrics); resolve algorithm.rollout_is=auto with
    `qwen35rl.config.capabilities.rollout_is_mode` first. The log ratio (summed over the response in sequence mode)
    is computed in float64 and clamped to +-20 before exp, so weights are finite and strictly positive (which the
    fold into advantages needs) whatever the log-probs.

    Metrics, over tokens in token mode and over responses (with at least one token) in sequence mode:
      rollout_corr/rollout_is_mean                 mean of the applied (truncated) weights
      rollout_corr/rollout_is_max, _min            largest / smallest ratio before truncation
      rollout_corr/rollout_is_ratio_fraction_high  share whose ratio exceeds the cap (truncated)
      rollout_corr/rollout_is_eff_sample_size      normalised ESS of the applied weights, (sum w)^2 / (N sum w^2)
      rollout_corr/log_ratio_abs_mean              mean |log pi_old - log pi_behaviour| per token, the mismatch
                                                   (the same quantity as rollout/logprob_diff_mean)
    """
    if mode not in MODES:
        raise ValueError(f"algorithm.rollout_is={mode!r}: expected one of {', '.join(MODES)} "
                         f"(auto resolves through qwen35rl.config.capabilities.rollout_is_mode)")
    if len(old) != len(behaviour):
        raise ValueError(f"{len(old)} responses of old log-probs but {len(behaviour)} of rollout log-probs")
    lengths = [len(row) for row in old]
    for i, (a, b) in enumerate(zip(old, behaviour)):
        if len(a) != len(b):
            raise ValueError(f"response {i}: {len(a)} old log-probs but {len(b)} rollout log-probs")
    if mode == "off":
        return [[1.0] * n for n in lengths], {}
    threshold = float(threshold)
    if not (math.isfinite(threshold) and threshold > 1.0):
        raise ValueError(f"algorithm.rollout_is_threshold={threshold:g}: the truncation cap must be finite and > 1")

    log_ratio = (torch.tensor(list(chain.from_iterable(old)), dtype=torch.float64)
                 - torch.tensor(list(chain.from_iterable(behaviour)), dtype=torch.float64))
    if mode == "token":
        unit_log = log_ratio
    else:
        rows = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.long))
        unit_log = torch.zeros(len(lengths), dtype=torch.float64).index_add_(0, rows, log_ratio)
    ratio = torch.exp(unit_log.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
    weight = ratio.clamp(max=threshold)
    per_token = weight if mode == "token" else weight[rows]
    weights = [piece.tolist() for piece in per_token.split(lengths)]

    if mode == "sequence":
        nonempty = torch.tensor(lengths, dtype=torch.long) > 0
        unit_log, ratio, weight = unit_log[nonempty], ratio[nonempty], weight[nonempty]
    if weight.numel() == 0:
        return weights, {}
    n = weight.numel()
    total, squares = float(weight.sum()), float(weight.square().sum())
    values = (total / n, float(ratio.max()), float(ratio.min()),
              float((unit_log > math.log(threshold)).to(torch.float64).mean()),
              total * total / (n * squares) if squares > 0 else 0.0,
              float(log_ratio.abs().mean()))
    return weights, dict(zip(METRICS, values))


def fold(advantages: Sequence[Union[float, Sequence[float]]], weights: Sequence[Sequence[float]]) -> List[List[float]]:
    """Per-token advantages w_t * A: each response's advantage (one float, or one per token) times its weights."""
    if len(advantages) != len(weights):
        raise ValueError(f"{len(advantages)} advantages for {len(weights)} responses of IS weights")
    out = []
    for i, (adv, w) in enumerate(zip(advantages, weights)):
        if isinstance(adv, (list, tuple)):
            if len(adv) != len(w):
                raise ValueError(f"advantages[{i}] has {len(adv)} values for {len(w)} IS weights")
            out.append([float(a) * x for a, x in zip(adv, w)])
        else:
            out.append([float(adv) * x for x in w])
    return out
