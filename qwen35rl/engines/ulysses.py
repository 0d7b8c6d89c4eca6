"""Ulysses sequence parallelism for Qwen3.5's token mixers (full attention and Gated DeltaNet).

Every rank of an SP group holds 1/sp of one packed row of documents. Around each token mixer an all-to-all swaps
the split: each rank then holds the whole row for 1/sp of the heads, mixes tokens exactly as one rank would, and a
second all-to-all brings the row split back. Everything else (norms, MLP / MoE, projections) is per token.

Heads fewer than sp are replicated so that every rank holds the heads its own heads read:
- attention: query head i reads KV head i // (n_q / n_kv); key/value heads are repeated (each one lcm(n_kv, sp) /
  n_kv times, consecutively), which needs sp | n_q;
- GDN: value head j reads key head j // (n_v / n_k); value heads split contiguously, q/k heads are repeated the same
  way, the causal conv (per channel) and the recurrence (per value head) run on the rank's channels and heads.
  Needs sp | n_v.
The plan's rule `sp_divides_heads` (config/rules/parallelism.py) states both. The row keeps its document boundaries
(`cu_seq_lens_q` of the whole row) so the conv and the recurrence restart at each document (`packed_gdn`) and
attention stays within it (`packed_attention`).
"""
from __future__ import annotations

import contextlib
import functools
import math
import sys
import types
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from qwen35rl.engines.packed_attention import packed_sdpa_attention_forward, packed_sdpa_mask
from qwen35rl.engines import gdn_layer, packed_gdn
from qwen35rl.engines.gdn_layer import is_gdn

NAME = "qwen35rl_ulysses"


@dataclass(frozen=True)
class SpGroup:
    group: Any
    size: int
    rank: int


_ACTIVE: Optional[SpGroup] = None


@contextlib.contextmanager
def sequence_parallel(sp: Optional[SpGroup]) -> Iterator[None]:
    """Token mixers of models switched by `use_ulysses` all-to-all over `sp` inside the block (None: plain)."""
    global _ACTIVE
    prev, _ACTIVE = _ACTIVE, sp
    try:
        yield
    finally:
        _ACTIVE = prev


def active() -> Optional[SpGroup]:
    return _ACTIVE if _ACTIVE is not None and _ACTIVE.size > 1 else None


# ------------------------------------------------------------------------------------------ collectives
def _seq_to_heads(x: torch.Tensor, sp: SpGroup) -> torch.Tensor:
    """[T/sp, H, D] (this rank's tokens, all heads) -> [T, H/sp, D] (all tokens, this rank's heads)."""
    t, h = x.shape[0], x.shape[1]
    send = x.reshape(t, sp.size, h // sp.size, *x.shape[2:]).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=sp.group)
    return recv.reshape(sp.size * t, h // sp.size, *x.shape[2:])  # chunk i came from rank i: tokens in order


def _heads_to_seq(x: torch.Tensor, sp: SpGroup) -> torch.Tensor:
    """[T, H/sp, D] -> [T/sp, H, D]: the inverse of _seq_to_heads."""
    t, h = x.shape[0] // sp.size, x.shape[1]
    send = x.reshape(sp.size, t, h, *x.shape[2:]).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=sp.group)
    return recv.transpose(0, 1).reshape(t, sp.size * h, *x.shape[2:])


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sp: SpGroup, to_heads: bool):
        ctx.sp, ctx.to_heads = sp, to_heads
        return _seq_to_heads(x, sp) if to_heads else _heads_to_seq(x, sp)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        return (_heads_to_seq(grad, ctx.sp) if ctx.to_heads else _seq_to_heads(grad, ctx.sp)), None, None


def seq_to_heads(x: torch.Tensor, sp: SpGroup) -> torch.Tensor:
    return _AllToAll.apply(x, sp, True)


def heads_to_seq(x: torch.Tensor, sp: SpGroup) -> torch.Tensor:
    return _AllToAll.apply(x, sp, False)


class _GatherTokens(torch.autograd.Function):
    """All-gather along dim 0. Every rank of the group computes the same loss from the gathered tensor, so each
    rank's gradient of the whole equals the others': its own slice is the gradient of its input."""

    @staticmethod
    def forward(ctx, x, sp: SpGroup):
        ctx.sp = sp
        parts = [torch.empty_like(x) for _ in range(sp.size)]
        dist.all_gather(parts, x.contiguous(), group=sp.group)
        return torch.cat(parts, 0)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.sp.size, 0)[ctx.sp.rank], None


def gather_tokens(x: torch.Tensor, sp: SpGroup) -> torch.Tensor:
    return _GatherTokens.apply(x, sp)


def repeat_heads(x: torch.Tensor, sp: int, dim: int) -> torch.Tensor:
    """Each head repeated consecutively until the head count is a multiple of sp (lcm(heads, sp) heads)."""
    heads = x.shape[dim]
    times = math.lcm(heads, sp) // heads
    return x if times == 1 else x.repeat_interleave(times, dim=dim)


def _local_heads(x: torch.Tensor, sp: SpGroup, dim: int) -> torch.Tensor:
    return x.chunk(sp.size, dim)[sp.rank]


# ------------------------------------------------------------------------------------------ attention
def ulysses_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                              scaling: Optional[float] = None, **kwargs):
    """transformers attention interface (query [1, H, T/sp, D]; key/value [1, H_kv, T/sp, D] -> [1, T/sp, H, D]):
    attention over the whole row for this rank's heads, by `packed_attention`."""
    sp = active()
    if sp is None:
        return packed_sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                             scaling=scaling, **kwargs)
    if attention_mask is not None or query.shape[0] != 1:
        raise ValueError(f"{NAME}: sequence parallel attention takes one packed row without mask")
    key, value = repeat_heads(key, sp.size, 1), repeat_heads(value, sp.size, 1)
    q, k, v = (seq_to_heads(t[0].transpose(0, 1), sp).transpose(0, 1)[None] for t in (query, key, value))
    # the local head counts: sdpa's GQA grouping must follow them, not the module's full counts
    local = types.SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], is_causal=True,
                                  training=module.training)
    out, _ = packed_sdpa_attention_forward(local, q, k, v, None, dropout=dropout, scaling=scaling, **kwargs)
    return heads_to_seq(out[0], sp)[None], None  # [1, T, H/sp, D] -> [1, T/sp, H, D]


# ------------------------------------------------------------------------------------------ Gated DeltaNet
def _gdn_conv_weight(module: nn.Module, sp: SpGroup) -> torch.Tensor:
    """The conv channels of this rank's q, k (repeated key heads) and v sections: [C_local, W]."""
    w = module.conv1d.weight.squeeze(1)
    q, k, v = torch.split(w, [module.key_dim, module.key_dim, module.value_dim])
    width = w.shape[-1]

    def heads(section, n, dim):
        per_head = repeat_heads(section.reshape(n, dim, width), sp.size, 0)
        return _local_heads(per_head, sp, 0).reshape(-1, width)

    return torch.cat([heads(q, module.num_k_heads, module.head_k_dim), heads(k, module.num_k_heads, module.head_k_dim),
                      heads(v, module.num_v_heads, module.head_v_dim)])


def ulysses_gdn_forward(module: nn.Module, original, hidden_states: torch.Tensor, cache=None, attention_mask=None,
                        **kwargs):
    """transformers' Qwen3.5 GDN forward for one packed row split over the SP group (the same math; the conv and
    recurrence run on this rank's heads over the whole row). Outside `sequence_parallel`: the original forward."""
    sp = active()
    if sp is None:
        return original(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    cu = kwargs.get("cu_seq_lens_q")
    if cache is not None or attention_mask is not None or hidden_states.shape[0] != 1 or cu is None:
        raise ValueError("sequence parallel GDN takes one packed row (cu_seq_lens_q, no mask, no cache)")
    x = hidden_states[0]  # [T/sp, hidden]
    t_local = x.shape[0]
    dk, dv = module.head_k_dim, module.head_v_dim
    qkv = module.in_proj_qkv(x)
    q, k, v = torch.split(qkv, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    q, k = (seq_to_heads(repeat_heads(t.reshape(t_local, -1, dk), sp.size, 1), sp) for t in (q, k))
    v = seq_to_heads(v.reshape(t_local, -1, dv), sp)
    b = seq_to_heads(module.in_proj_b(x)[..., None], sp)[..., 0]  # [T, H_v/sp]
    a = seq_to_heads(module.in_proj_a(x)[..., None], sp)[..., 0]
    length = q.shape[0]
    mixed = torch.cat([q.reshape(length, -1), k.reshape(length, -1), v.reshape(length, -1)], -1)
    kl, vl = q.shape[1] * dk, v.shape[1] * dv
    normed = gdn_layer.QK_NORM_IN_CONV
    q, k, v = packed_gdn.document_conv(mixed[None], _gdn_conv_weight(module, sp), module.conv1d.bias,
                                       module.activation, cu, splits=(kl, kl, vl), l2norm=(2, dk) if normed else None)
    q, k = q.view(1, length, -1, dk), k.view(1, length, -1, dk)
    v = v.view(1, length, -1, dv)
    core = gdn_layer.recurrence(sys.modules[type(module).__module__], q, k, v, a[None], b[None],
                                _local_heads(module.A_log, sp, 0), _local_heads(module.dt_bias, sp, 0), cu,
                                normalised=normed)
    core = heads_to_seq(core[0], sp)  # [T/sp, H_v, dv]
    z = module.in_proj_z(x).reshape(-1, dv)
    core = module.norm(core.reshape(-1, dv), z).reshape(1, t_local, -1)
    return module.out_proj(core)


def register() -> None:
    AttentionInterface.register(NAME, ulysses_attention_forward)
    AttentionMaskInterface.register(NAME, packed_sdpa_mask)


def use_ulysses(model: nn.Module) -> None:
    """Switch a transformers Qwen3.5 model's language model to Ulysses token mixers (active only inside
    `sequence_parallel`; packed attention otherwise). Works on a built or sharded model."""
    register()
    model.config.get_text_config()._attn_implementation = NAME
    for m in model.modules():
        if is_gdn(m) and not isinstance(m.forward, functools.partial):
            m.forward = functools.partial(ulysses_gdn_forward, m, m.forward)
