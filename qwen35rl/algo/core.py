"""GRPO math: group-relative advantages, PPO clip loss with dual clip, KL penalties and loss aggregation.

Everything here is a pure function of tensors. Per-token tensors are [B, T] with a response `mask` [B, T]
(bool or 0/1); positions outside the mask never contribute, whatever values they hold.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_KINDS = ("kl", "mse", "low_var_kl", "abs")
_KL_ALIASES = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}
_LOG_RATIO_CLAMP = 20.0
_K3_CLAMP = 10.0


# ------------------------------------------------------------------------------------------------- masked ops
def _zero_outside(x: Tensor, mask: Tensor) -> Tensor:
    # `where`, not multiplication: garbage (inf/nan) at padded positions must not leak into sums.
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    x = _zero_outside(x, mask)
    return x.sum() if dim is None else x.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Mean over masked positions; 0 where nothing is masked in (instead of nan)."""
    count = mask.to(x.dtype).sum() if dim is None else mask.to(x.dtype).sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


# -------------------------------------------------------------------------------------------------- advantage
def grpo_advantages(scores: Tensor, group_index: Tensor, norm_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Outcome advantage per response: (s - mean_group) / (std_group + eps), or s - mean_group (Dr.GRPO).

    `group_index` [N] (long) names each response's prompt; ids need not be contiguous. The std is Bessel-corrected
    (N-1); a group of one response uses mean 0 and std 1 so its advantage is its raw score.
    """
    scores = scores.float()
    if scores.shape != group_index.shape or scores.dim() != 1:
        raise ValueError(f"scores {tuple(scores.shape)} and group_index {tuple(group_index.shape)} must be [N]")
    _, inverse = torch.unique(group_index, return_inverse=True)
    num_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    count = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, inverse, torch.ones_like(scores))
    total = torch.zeros_like(count).index_add_(0, inverse, scores)
    mean = total / count
    sq_dev = torch.zeros_like(count).index_add_(0, inverse, (scores - mean[inverse]) ** 2)
    std = torch.sqrt(sq_dev / (count - 1).clamp(min=1))
    single = count == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    centred = scores - mean[inverse]
    return centred / (std[inverse] + eps) if norm_by_std else centred


# ------------------------------------------------------------------------------------------------ policy loss
def policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float = 3.0,
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """PPO clipped surrogate with asymmetric clip range and dual clip for negative advantages.

    Returns the per-token loss [B, T] (0 outside `mask`) and per-token float indicators [B, T] for the metrics:
    `clipfrac` (the clipped term won), `clipfrac_lower` (the dual clip bound -A*c won) and `approx_kl` (-delta).
    Aggregate them with `masked_mean` / `agg_loss`.
    """
    if clip_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (got {clip_c})")
    advantages = advantages.to(log_probs.dtype)
    delta = torch.clamp(log_probs - old_log_probs, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(delta)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    dual_bound = -advantages * clip_c
    negative = advantages < 0
    loss = torch.where(negative, torch.minimum(loss_ppo, dual_bound), loss_ppo)
    stats = {
        "clipfrac": (loss_clipped > loss_unclipped).float(),
        "clipfrac_lower": (negative & (loss_ppo > dual_bound)).float(),
        "approx_kl": (-delta).detach().float(),
    }
    stats = {k: _zero_outside(v, mask) for k, v in stats.items()}
    return _zero_outside(loss, mask), stats


# ---------------------------------------------------------------------------------------------------------- KL
def kl_penalty(log_probs: Tensor, ref_log_probs: Tensor, kind: str = "low_var_kl") -> Tensor:
    """Per-token KL estimate of the policy against the reference from sampled-token log-probs.

    kl (k1): delta; mse (k2): delta^2 / 2; abs: |delta|; low_var_kl (k3): exp(u) - u - 1 with
    u = clamp(-delta, -20, 20), clamped to [-10, 10]. delta = logp - logp_ref.
    """
    kind = _KL_ALIASES.get(kind, kind)
    delta = log_probs - ref_log_probs
    if kind == "kl":
        return delta
    if kind == "mse":
        return 0.5 * delta.square()
    if kind == "abs":
        return delta.abs()
    if kind == "low_var_kl":
        u = torch.clamp(-delta, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        return torch.clamp(torch.exp(u) - u - 1.0, -_K3_CLAMP, _K3_CLAMP)
    raise ValueError(f"algorithm.kl_loss_type={kind!r}: expected one of {', '.join(KL_KINDS)}")


# ------------------------------------------------------------------------------------------------- aggregation
def agg_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str = "token-mean",
    *,
    global_tokens: float,
    global_seqs: float,
    dp_size: int,
    norm_const: Optional[float] = None,
) -> Tensor:
    """This micro batch's share of the mini-batch loss.

    `global_tokens` / `global_seqs` count valid tokens / sequences of the whole mini batch over all DP ranks.
    Summing the returned scalars over a rank's micro batches and then averaging gradients over `dp_size` ranks
    (what DDP / FSDP / Megatron do) yields exactly the mode's definition over the global mini batch:
      token-mean:              sum(L) / global_tokens
      seq-mean-token-sum:      sum_seq sum_t L / global_seqs
      seq-mean-token-mean:     sum_seq mean_t L / global_seqs
      seq-mean-token-sum-norm: sum(L) / (global_seqs * norm_const)
    hence the factor dp_size, which undoes the gradient average.
    """
    if mode == "token-mean":
        local, denom = masked_sum(loss_mat, mask), global_tokens
    elif mode == "seq-mean-token-sum":
        local, denom = masked_sum(loss_mat, mask), global_seqs
    elif mode == "seq-mean-token-mean":
        local, denom = masked_mean(loss_mat, mask, dim=-1).sum(), global_seqs
    elif mode == "seq-mean-token-sum-norm":
        if norm_const is None:
            raise ValueError("seq-mean-token-sum-norm needs norm_const (algorithm.loss_scale_factor or the max response length)")
        local, denom = masked_sum(loss_mat, mask), global_seqs * norm_const
    else:
        raise ValueError(f"algorithm.loss_agg_mode={mode!r}: expected one of {', '.join(LOSS_AGG_MODES)}")
    denom = float(denom)
    # an all-padding mini batch has nothing to normalise: its (zero) loss stays zero instead of nan
    return local * (dp_size / denom) if denom > 0 else local * 0.0


def agg_settings(algo: Any, max_response_length: int, *, global_tokens: float, global_seqs: float, dp_size: int,
                 norm_const: Optional[float] = None) -> Dict[str, Any]:
    """The `agg_loss` keyword arguments of a mini batch: the configured mode and the global normalisers
    (seq-mean-token-sum-norm divides by `algorithm.loss_scale_factor`, else the max response length)."""
    if norm_const is None:
        norm_const = algo.loss_scale_factor or max_response_length
    return dict(mode=algo.loss_agg_mode, global_tokens=global_tokens, global_seqs=global_seqs, dp_size=dp_size,
                norm_const=float(norm_const))


ACTOR_SUMS = ("pg", "kl", "entropy", "nonfinite", "clipfrac", "approx_kl", "clipfrac_lower", "tokens", "logprob_diff")
"""What `actor_loss` returns per micro batch for the metrics, in this order (summed over micro batches and ranks),
followed by one more entry, GAP_MAX, that combines by max (`add_actor_sums`) and stays per rank."""
GAP_MAX = len(ACTOR_SUMS)


def actor_loss(log_probs: Tensor, entropy: Tensor, old_log_probs: Optional[Tensor], ref_log_probs: Optional[Tensor],
               advantages: Tensor, mask: Tensor, algo: Any, agg: Dict[str, Any],
               rollout_log_probs: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """The actor loss of one micro batch, pg + kl_loss_coef * KL - entropy_coef * entropy, each term aggregated by
    `agg_loss(**agg)`; and a float64 vector of ACTOR_SUMS + GAP_MAX for the metrics. Without old log-probs (one
    on-policy update) the ratio is 1 and the clip never acts, as the definition gives; that update's pass is then
    the trainer's view of the policy that generated the batch, so with the rollout engine's `rollout_log_probs` it
    measures their gap (|trainer - rollout| per token: sum and max) at no extra forward."""
    old = old_log_probs if old_log_probs is not None else log_probs.detach()
    pg_mat, stats = policy_loss(log_probs, old, advantages, mask, algo.clip_ratio_low, algo.clip_ratio_high,
                                algo.clip_ratio_c)
    pg = agg_loss(pg_mat, mask, **agg)
    loss = pg
    kl = torch.zeros((), device=log_probs.device, dtype=pg.dtype)
    if algo.use_kl_loss:
        if ref_log_probs is None:
            raise ValueError("algorithm.use_kl_loss needs ref_log_probs in every micro batch")
        kl = agg_loss(kl_penalty(log_probs, ref_log_probs, algo.kl_loss_type), mask, **agg)
        loss = loss + float(algo.kl_loss_coef) * kl
    entropy_grad = float(algo.entropy_coef) != 0.0
    ent = agg_loss(entropy if entropy_grad else entropy.detach(), mask, **agg)
    if entropy_grad:
        loss = loss - float(algo.entropy_coef) * ent
    sums = torch.stack([pg.detach(), kl.detach(), ent.detach(), (~torch.isfinite(loss.detach())).to(pg.dtype),
                        masked_sum(stats["clipfrac"], mask), masked_sum(stats["approx_kl"], mask),
                        masked_sum(stats["clipfrac_lower"], mask), mask.sum().to(pg.dtype)]).detach()
    gap = torch.zeros(2, device=log_probs.device, dtype=pg.dtype)
    if rollout_log_probs is not None:
        diff = _zero_outside((log_probs.detach().float() - rollout_log_probs.float()).abs(), mask)
        gap = torch.stack([diff.sum(), diff.max() if diff.numel() else diff.sum()]).to(pg.dtype)
    return loss, torch.cat([sums, gap]).to(torch.float64)


def add_actor_sums(total: Tensor, micro: Tensor) -> Tensor:
    """Micro batch sums of `actor_loss` accumulated: ACTOR_SUMS add, GAP_MAX takes the max."""
    return torch.cat([total[:GAP_MAX] + micro[:GAP_MAX], torch.maximum(total[GAP_MAX:], micro[GAP_MAX:])])


def actor_metrics(sums: Tensor, dp_size: int, rollout_gap: bool = False) -> Dict[str, float]:
    """Metrics from ACTOR_SUMS reduced over micro batches and data-parallel ranks (GAP_MAX: this rank's). The
    aggregated losses are dp_size times each rank's share (agg_loss undoes the gradient average); the rest are
    token means. With `rollout_gap` (the update had the rollout engine's log-probs) also the trainer / rollout
    log-prob gap: the mean over the mini batch, this rank's max (the driver takes the max over ranks)."""
    s = dict(zip(ACTOR_SUMS, (float(x) for x in sums)))
    tokens = max(s["tokens"], 1.0)
    gap = {}
    if rollout_gap:
        gap = {"rollout/logprob_diff_mean": s["logprob_diff"] / tokens, "rollout/logprob_diff_max": float(sums[GAP_MAX])}
    return {
        **gap,
        "actor/pg_loss": s["pg"] / dp_size,
        "actor/kl_loss": s["kl"] / dp_size,
        "actor/entropy": s["entropy"] / dp_size,
        "actor/pg_clipfrac": s["clipfrac"] / tokens,
        "actor/ppo_kl": s["approx_kl"] / tokens,
        "actor/pg_clipfrac_lower": s["clipfrac_lower"] / tokens,
    }


def local_batch_counts(mask: Tensor) -> Tuple[float, float]:
    """(valid tokens, sequences with at least one valid token) of one rank's share; all-reduce both to get the
    `global_tokens` / `global_seqs` of `agg_loss`."""
    tokens = mask.to(torch.float64).sum(dim=-1)
    return float(tokens.sum().item()), float((tokens > 0).sum().item())


# ------------------------------------------------------------------------------------ reference log-prob / entropy
def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """log softmax(logits)[label] in fp32; logits [..., V], labels [...]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, labels.unsqueeze(-1).long()).squeeze(-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim in fp32: logsumexp(z) - sum(p * z)."""
    logits = logits.float()
    p = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (p * logits).sum(dim=-1)
