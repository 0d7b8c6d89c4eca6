"""Causal attention over packed sequences (several documents in one row) without an [N, N] mask.

With `attention_mask=None` and position ids that restart at 0 for each document, transformers finds the documents
and builds a block-diagonal [1, 1, N, N] mask for `sdpa`. A mask keeps sdpa off its flash kernel, so the row of N
tokens costs N^2 scores: with 16 documents of 768 tokens, 16 times the attention work of the documents alone.

The implementation registered here under `NAME` takes the documents from the packed call's `cu_seq_lens_q` (or,
without it, from the restarting position ids, as transformers does) and attends within each one:
- CUDA, half precision, a torch whose `torch.nn.attention.varlen.varlen_attn` takes `window_size` and `scale`: one
  varlen flash kernel over the row; causal is `window_size=(-1, 0)` (left unbounded, nothing to the right), which
  that function turns into the flash kernel's `is_causal=True` with the same window;
- elsewhere: transformers' `sdpa_attention_forward` once per document, without mask, so with `is_causal=True`
  (its GQA handling included): what each document computes alone.
Its mask function (same name in transformers' mask registry) returns None for calls in the packed form (one row, no
padding mask, no cache offset), so no [N, N] mask is built; every other call gets transformers' sdpa mask, and its
attention goes to transformers' sdpa unchanged (padded batches, generation).
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from qwen35rl.engines.packed_gdn import cu_seqlens_from_seq_idx

NAME = "qwen35rl_packed_sdpa"
SDPA = "sdpa"
FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256


# ------------------------------------------------------------------------------------------ documents
def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> Optional[torch.Tensor]:
    """Document boundaries of one packed row from its position ids ([T] or [1, T]): a document starts wherever the
    position does not follow the previous one by 1 (transformers' `find_packed_sequence_indices` rule). None for a
    single document."""
    pos = position_ids.reshape(-1)
    starts_new = pos[1:] - pos[:-1] != 1
    if not bool(starts_new.any()):
        return None
    seq_idx = torch.cat([starts_new.new_zeros(1, dtype=torch.long), starts_new.long().cumsum(0)])
    return cu_seqlens_from_seq_idx(seq_idx)


def packed_documents(query: torch.Tensor, key: torch.Tensor, attention_mask: Optional[torch.Tensor],
                     kwargs: Dict[str, Any]) -> Optional[torch.Tensor]:
    """cu_seqlens ([docs + 1], from 0 to T) of a packed call: one row, no mask, as many keys as queries, documents in
    `cu_seq_lens_q` or restarting `position_ids` (reading those waits for the device once per layer; the engine passes
    `cu_seq_lens_q`). None for every other call."""
    if attention_mask is not None or query.shape[0] != 1 or query.shape[2] != key.shape[2]:
        return None
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        return cu
    position_ids = kwargs.get("position_ids")
    if position_ids is None or query.shape[2] < 2 or position_ids.shape[-1] != query.shape[2]:
        return None
    return cu_seqlens_from_position_ids(position_ids)


# ------------------------------------------------------------------------------------------ kernels
@functools.lru_cache(maxsize=None)
def varlen_api() -> Optional[Tuple[Callable, bool]]:
    """(torch's `varlen_attn`, whether it takes `enable_gqa`), or None where torch has none whose causal mask and
    scale this module can set: it needs the `window_size` form (window (-1, 0) is causal) and `scale`; the older
    form (`is_causal`, no scale) is not used."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" not in params or "scale" not in params:
        return None
    return varlen_attn, "enable_gqa" in params


def uses_varlen(query: torch.Tensor, dropout: float) -> bool:
    """Whether a packed call on these queries runs torch's varlen flash kernel (else one sdpa per document)."""
    return (query.is_cuda and query.dtype in FLASH_DTYPES and query.shape[-1] <= FLASH_MAX_HEAD_DIM
            and dropout == 0.0 and varlen_api() is not None)


def _varlen_attention(query, key, value, cu: torch.Tensor, max_len: int, scaling: Optional[float]) -> torch.Tensor:
    varlen_attn, takes_gqa = varlen_api()
    groups = query.shape[1] // key.shape[1]
    gqa = {}
    if groups > 1 and takes_gqa:
        gqa = {"enable_gqa": True}
    elif groups > 1:  # an API without enable_gqa checks nothing: give it one key/value head per query head
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    # [1, H, T, D] -> [T, H, D]; the flash kernel wants the head dim contiguous
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
    cu = cu.to(device=query.device, dtype=torch.int32)
    out = varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scaling, window_size=(-1, 0), **gqa)
    return out.unsqueeze(0)  # [1, T, H, D]


def _per_document_sdpa(module: nn.Module, query, key, value, cu: torch.Tensor, dropout: float,
                       scaling: Optional[float]) -> torch.Tensor:
    sdpa = ALL_ATTENTION_FUNCTIONS[SDPA]
    bounds = cu.tolist()
    if bounds[0] != 0 or bounds[-1] != query.shape[2]:
        raise ValueError(f"{NAME}: cu_seq_lens_q {bounds} must run from 0 to the row length {query.shape[2]}")
    outs = [sdpa(module, query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], None, dropout=dropout,
                 scaling=scaling, is_causal=True)[0]
            for s, e in zip(bounds[:-1], bounds[1:]) if e > s]
    return torch.cat(outs, dim=1)  # [1, T, H, D]


# ------------------------------------------------------------------------------------------ transformers hooks
def packed_sdpa_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                  attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                                  scaling: Optional[float] = None, **kwargs) -> Tuple[torch.Tensor, None]:
    """transformers attention interface: query [B, H, T, D], key/value [B, H_kv, S, D] -> ([B, T, H, D], None).
    Packed calls attend causally within each document; the rest is transformers' sdpa as is."""
    cu = packed_documents(query, key, attention_mask, kwargs)
    if cu is None:
        return ALL_ATTENTION_FUNCTIONS[SDPA](module, query, key, value, attention_mask, dropout=dropout,
                                             scaling=scaling, **kwargs)
    causal = kwargs.get("is_causal")
    if causal is None:
        causal = getattr(module, "is_causal", True)
    if not causal:
        raise ValueError(f"{NAME}: packed documents are supported for causal attention only")
    if uses_varlen(query, dropout):
        max_len = kwargs.get("max_length_q")
        if max_len is None:
            max_len = int((cu[1:] - cu[:-1]).max())
        return _varlen_attention(query, key, value, cu, int(max_len), scaling), None
    return _per_document_sdpa(module, query, key, value, cu, dropout, scaling), None


def packed_sdpa_mask(batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0, kv_offset: Any = 0,
                     attention_mask: Optional[torch.Tensor] = None, **kwargs) -> Optional[torch.Tensor]:
    """transformers mask interface: None where the call has the packed form (one row, no padding mask, no cache
    offset, causal mask without custom mask functions), where transformers would build a block-diagonal [1, 1, N, N]
    mask from restarting position ids (or skip the mask for a single document); the attention function then finds
    the documents itself. Every other call gets transformers' sdpa mask."""
    packed_form = (batch_size == 1 and attention_mask is None and q_length == kv_length
                   and isinstance(q_offset, int) and q_offset == 0 and isinstance(kv_offset, int) and kv_offset == 0
                   and not kwargs.get("use_vmap", False) and kwargs.get("local_size") is None)
    if packed_form:
        return None
    return ALL_MASK_ATTENTION_FUNCTIONS[SDPA](batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                                             q_offset=q_offset, kv_offset=kv_offset, attention_mask=attention_mask,
                                             **kwargs)


def register() -> None:
    """Make `NAME` a transformers attention implementation (attention and mask functions). Idempotent."""
    AttentionInterface.register(NAME, packed_sdpa_attention_forward)
    AttentionMaskInterface.register(NAME, packed_sdpa_mask)


def use_packed_attention(model: nn.Module) -> None:
    """Switch the language model of a transformers Qwen3.5 model (text or VL) to `NAME`; a vision tower keeps its
    own implementation. The decoder's attention layers and its mask builder read the text config's
    `_attn_implementation` at call time, so this works on a built (or sharded) model."""
    register()
    model.config.get_text_config()._attn_implementation = NAME
