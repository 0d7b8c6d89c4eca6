"""Token-level plumbing of the Megatron engine, pure torch: batch alignment.

Batches arrive left-padded on the prompt side (see runtime.batching); megatron-core's GDN ignores the attention
mask, so padding in front of a sequence would leak into its convolution and recurrent state. `left_align` rolls
every row so its tokens start at column 0 (right padding only, which causal attention and GDN both ignore for the
valid tokens), and `restore` puts per-token values back where the batch had them.

The vocab-parallel log-probs and entropy are `engines.logprob.chunked_logprobs_entropy` with the TP group.
"""
from __future__ import annotations

from dataclasses import dataclass
import torch
from torch import Tensor


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
