"""Token-level plumbing of the Megatron engine, pure torch (+ torch.distributed): batch alignment and the
vocab-parallel log-prob / entropy.

Batches arrive left-padded on the prompt side (see runtime.batching); megatron-core's GDN ignores the attention
mask, so padding in front of a sequence would leak into its convolution and recurrent state. `left_align` rolls
every row so its tokens start at column 0 (right padding only, which causal attention and GDN both ignore for the
valid tokens), and `restore` puts per-token values back where the batch had them.

With tensor parallelism the logits of a token are spread over TP ranks (each holds a slice of the vocabulary);
`vocab_parallel_logprobs` reduces max / sum-exp / target logit over the TP group and differentiates through
those reductions, a chunk of tokens at a time (the backward recomputes each chunk's fp32 softmax).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.checkpoint import checkpoint


# ------------------------------------------------------------------------------------------------- alignment
@dataclass
class Aligned:
    """A batch with every row's tokens moved to the front. `shift[b]`: leading pads removed from row b."""

    input_ids: Tensor
    valid: Tensor
    """[B, T] bool: real tokens (a prefix of every row)."""
    shift: Tensor

    def take(self, x: Tensor) -> Tensor:
        """A per-token tensor of the original layout [B, T, ...] in the aligned layout."""
        return _roll_rows(x, self.shift)

    def restore(self, x: Tensor) -> Tensor:
        """A per-token tensor of the aligned layout back in the original layout (inverse of `take`)."""
        return _roll_rows(x, -self.shift)


def _roll_rows(x: Tensor, shift: Tensor) -> Tensor:
    t = x.shape[1]
    idx = (torch.arange(t, device=x.device)[None, :] + shift.to(x.device)[:, None]) % t
    idx = idx.view(*idx.shape, *([1] * (x.dim() - 2))).expand_as(x)
    return torch.gather(x, 1, idx)


def left_align(input_ids: Tensor, attention_mask: Tensor, pad_token_id: int = 0) -> Aligned:
    """Roll each row left by its leading padding. Rows must hold one contiguous run of valid tokens."""
    valid = attention_mask.bool()
    lengths = valid.sum(1)
    shift = torch.where(lengths > 0, valid.long().argmax(1), torch.zeros_like(lengths))
    aligned_valid = torch.arange(valid.shape[1], device=valid.device)[None, :] < lengths[:, None]
    if not torch.equal(_roll_rows(valid, shift), aligned_valid):
        raise ValueError("every row's attention_mask must be one contiguous run of ones (padding only at the ends)")
    ids = torch.where(aligned_valid, _roll_rows(input_ids, shift), torch.full_like(input_ids, pad_token_id))
    return Aligned(ids, aligned_valid, shift)


def pad_columns(x: Tensor, multiple: int, value=0) -> Tensor:
    """Right-pad dim 1 to a multiple of `multiple` (sequence parallelism splits the sequence over TP ranks)."""
    extra = (-x.shape[1]) % multiple
    if not extra:
        return x
    pad = x.new_full((x.shape[0], extra, *x.shape[2:]), value)
    return torch.cat([x, pad], dim=1)


# -------------------------------------------------------------------------------------- vocab-parallel logprob
class _AllReduce(torch.autograd.Function):
    """Sum over the group in forward; the gradient of a sum reaches each rank's part unchanged."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        x = x.clone()
        if group is not None:
            dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


def _all_reduce_sum(x: Tensor, group) -> Tensor:
    return _AllReduce.apply(x, group)


def _chunk_stats(logits: Tensor, labels: Tensor, vocab_start: int, group, temperature: float, with_entropy: bool):
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    zmax = z.detach().max(-1, keepdim=True).values
    if group is not None:
        dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
    e = torch.exp(z - zmax)
    sum_e = _all_reduce_sum(e.sum(-1), group)
    lse = zmax.squeeze(-1) + torch.log(sum_e)
    local = labels - vocab_start
    inside = (local >= 0) & (local < z.shape[-1])
    target = torch.where(inside, z.gather(-1, local.clamp(0, z.shape[-1] - 1).unsqueeze(-1)).squeeze(-1),
                         torch.zeros((), dtype=z.dtype, device=z.device))
    logp = _all_reduce_sum(target, group) - lse
    if not with_entropy:
        return logp, None
    # H = lse - E_p[z] with E_p[z] = sum(e * z) / sum(e)
    mean_z = _all_reduce_sum((e * z).sum(-1), group) / sum_e
    return logp, lse - mean_z


def vocab_parallel_logprobs(logits: Tensor, labels: Tensor, group=None, temperature: float = 1.0,
                            with_entropy: bool = False, chunk_tokens: int = 1024) -> Tuple[Tensor, Optional[Tensor]]:
    """log softmax(logits / T)[label] and the entropy of softmax(logits / T), fp32, for logits [..., V_local]
    holding this TP rank's contiguous vocabulary slice (rank r owns [r * V_local, (r + 1) * V_local)). `group`:
    the TP group (None: the whole vocabulary is here). Differentiable in `logits`; every TP rank returns the same
    values. Tokens go `chunk_tokens` at a time so fp32 intermediates stay one chunk large."""
    if temperature <= 0:
        raise ValueError(f"temperature must be positive for log-probs (got {temperature})")
    lead = labels.shape
    flat, lab = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1).long()
    rank = dist.get_rank(group) if group is not None else 0
    start = rank * flat.shape[-1]
    logps, ents = [], []
    for s in range(0, flat.shape[0], chunk_tokens):
        args = (flat[s:s + chunk_tokens], lab[s:s + chunk_tokens], start, group, float(temperature), with_entropy)
        if flat.requires_grad:
            lp, ent = checkpoint(_chunk_stats, *args, use_reentrant=False)
        else:
            lp, ent = _chunk_stats(*args)
        logps.append(lp)
        ents.append(ent)
    logp = torch.cat(logps).reshape(lead)
    return logp, (torch.cat(ents).reshape(lead) if with_entropy else None)
