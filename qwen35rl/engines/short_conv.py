"""Qwen3.5's short causal convolution (depthwise, kernel width 4, before every Gated DeltaNet recurrence) as W
shifted multiply-adds over the time-major projection, with a hand-written backward.

transformers' fallback runs it as a depthwise `F.conv1d` over [B, D, T], which on CUDA is `_conv_depthwise2d`: in
the 0.8B model's reference pass on an H200 it was 21% of the kernel time, more than every matmul together
(bench/results/h200.md, 2026-12-02d), and the packed form needed a zero-spread copy of the input and a gather of
the output around it. Here output t is sum_k w[:, W-1-k] * x[t-k], where a term counts only when token t-k lies
in t's document (`positions`: each token's index within its document; a padded row is one document). Forward and
backward are each one pointwise pass (plus the weight gradient's reduction) over the [B, T, D] layout the
projection writes, in fp32, rounded once at the end; with `compiled` they go through torch.compile, which fuses
each into a kernel or two. The forward keeps only x: the backward recomputes the pre-activation. With `l2norm` the
q and k parts come L2-normalised per head as well (the recurrence's input norm, in fp32 before rounding; the
backward recomputes it too), so no separate norm kernel runs. The same math runs eagerly on CPU, so what the CPU
tests pin is what a compiled GPU run computes up to fp32 summation order.
"""
from __future__ import annotations

import functools
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from qwen35rl.engines.compile_regions import raise_recompile_limit


def _compute_dtype(weight: Tensor) -> torch.dtype:
    return torch.promote_types(weight.dtype, torch.float32)


def _shift(x: Tensor, k: int) -> Tensor:
    """x[:, t - k] at t (zero before the row's start), for x [B, T, D]."""
    return F.pad(x, (0, 0, k, 0))[:, : x.shape[1]] if k else x


def _unshift(g: Tensor, k: int) -> Tensor:
    """g[:, s + k] at s (zero past the row's end): the adjoint of `_shift`."""
    return F.pad(g, (0, 0, 0, k))[:, k:] if k else g


def _pre_activation(x: Tensor, weight: Tensor, bias: Optional[Tensor], positions: Tensor) -> Tensor:
    cd = _compute_dtype(weight)
    xc, wc = x.to(cd), weight.to(cd)
    width = weight.shape[1]
    pre = xc * wc[:, width - 1]
    for k in range(1, width):
        inside = (positions >= k)[None, :, None]  # token t - k belongs to t's document
        pre = pre + torch.where(inside, _shift(xc, k), 0.0) * wc[:, width - 1 - k]
    return pre if bias is None else pre + bias.to(cd)


L2NORM_EPS = 1e-6
"""transformers' and fla's epsilon of the q/k L2 norm: x / sqrt(sum(x^2) + eps) over each head."""


def _l2norm(y: Tensor, head_dim: int) -> Tuple[Tensor, Tensor]:
    """(y normalised over each head of head_dim channels, its 1 / norm), in y's (fp32) dtype, for y [B, T, n * hd]."""
    heads = y.unflatten(-1, (-1, head_dim))
    rstd = torch.rsqrt(heads.pow(2).sum(-1, keepdim=True) + L2NORM_EPS)
    return (heads * rstd).flatten(-2), rstd


def _forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], positions: Tensor, silu: bool,
             splits: Optional[Tuple[int, ...]], l2norm: Optional[Tuple[int, int]] = None
             ) -> Union[Tensor, Tuple[Tensor, ...]]:
    pre = _pre_activation(x, weight, bias, positions)
    act = F.silu(pre) if silu else pre
    if splits is None:
        return act.to(x.dtype)
    parts = torch.split(act, list(splits), -1)
    normed, head_dim = l2norm or (0, 0)
    return tuple((_l2norm(p, head_dim)[0] if i < normed else p).to(x.dtype).contiguous()
                 for i, p in enumerate(parts))


def _backward(x: Tensor, weight: Tensor, bias: Optional[Tensor], positions: Tensor, grads: List[Tensor],
              silu: bool, l2norm: Optional[Tuple[int, int]] = None) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    cd = _compute_dtype(weight)
    xc, wc = x.to(cd), weight.to(cd)
    width = weight.shape[1]
    grads = [g.to(cd) for g in grads]
    if silu or l2norm:
        pre = _pre_activation(x, weight, bias, positions)
    if l2norm:  # d (y / |y|) / dy applied to the first parts' gradients: (g - n <g, n>) / |y| per head
        normed, head_dim = l2norm
        act = F.silu(pre) if silu else pre
        parts = torch.split(act, [g.shape[-1] for g in grads], -1)
        for i in range(normed):
            n, rstd = _l2norm(parts[i], head_dim)
            gh, nh = grads[i].unflatten(-1, (-1, head_dim)), n.unflatten(-1, (-1, head_dim))
            grads[i] = ((gh - nh * (gh * nh).sum(-1, keepdim=True)) * rstd).flatten(-2)
    g = grads[0] if len(grads) == 1 else torch.cat(grads, -1)
    if silu:
        s = torch.sigmoid(pre)
        g = g * s * (1 + pre * (1 - s))  # d silu(pre) / d pre
    grad_x = g * wc[:, width - 1]
    columns = [None] * width
    columns[width - 1] = (g * xc).sum((0, 1))
    for k in range(1, width):
        gk = torch.where((positions >= k)[None, :, None], g, 0.0)  # output t took x[t - k]
        grad_x = grad_x + _unshift(gk, k) * wc[:, width - 1 - k]
        columns[width - 1 - k] = (gk * _shift(xc, k)).sum((0, 1))
    grad_w = torch.stack(columns, 1).to(weight.dtype)
    grad_b = None if bias is None else g.sum((0, 1)).to(bias.dtype)
    return grad_x.to(x.dtype), grad_w, grad_b


RECOMPILE_LIMIT = 64
"""Graphs per compiled function: one per row count (1 for packed rows), dtype, bias and split layout; past dynamo's
default limit of 8 a new guard set would run eagerly, 2-3x slower than transformers' convolution."""


def _compiled(fn: Callable) -> Callable:
    """fn through torch.compile with only the time axis dynamic: packed rows change length every micro batch, while
    static channel counts let Inductor index without divisions by a symbolic size (on an H200 the all-dynamic
    kernels were 1.6x slower, 2.7x with split outputs: bench/results/h200.md, 2026-12-03b)."""
    raise_recompile_limit(RECOMPILE_LIMIT)
    compiled = torch.compile(fn)  # automatic dynamic: a size that changes on a later call becomes dynamic then

    @functools.wraps(fn)
    def call(x, weight, bias, positions, *rest):
        grads = rest[0] if rest and isinstance(rest[0], list) else []  # the backward's
        for t in (x, *grads):  # [B, T, D]
            torch._dynamo.maybe_mark_dynamic(t, 1)
        torch._dynamo.maybe_mark_dynamic(positions, 0)
        return compiled(x, weight, bias, positions, *rest)

    return call


@functools.lru_cache(maxsize=None)
def _fns(compiled: bool) -> Tuple[Callable, Callable]:
    """(forward, backward): compiled (`_compiled`), or eager."""
    if not compiled:
        return _forward, _backward
    return _compiled(_forward), _compiled(_backward)


def _detached(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.detach()


class _ShortConv(torch.autograd.Function):
    # The compiled functions get detached tensors: the backward is written by hand, and a requires_grad flag that
    # differs between calls (policy, frozen reference, no_grad passes) would be one more guard set each.
    @staticmethod
    def forward(ctx, x, weight, bias, positions, silu, compiled, splits, l2norm):
        ctx.save_for_backward(x, weight, bias, positions)
        ctx.silu, ctx.compiled, ctx.l2norm = silu, compiled, l2norm
        return _fns(compiled)[0](x.detach(), weight.detach(), _detached(bias), positions, silu, splits, l2norm)

    @staticmethod
    def backward(ctx, *grads):  # an unused output's gradient comes as zeros (materialised)
        x, weight, bias, positions = ctx.saved_tensors
        grad_x, grad_w, grad_b = _fns(ctx.compiled)[1](x.detach(), weight.detach(), _detached(bias), positions,
                                                       [g.contiguous() for g in grads], ctx.silu, ctx.l2norm)
        return grad_x, grad_w, grad_b, None, None, None, None, None


def short_causal_conv(x: Tensor, weight: Tensor, bias: Optional[Tensor], positions: Tensor,
                      activation: Optional[str] = None, compiled: bool = False,
                      splits: Optional[Sequence[int]] = None, l2norm: Optional[Tuple[int, int]] = None
                      ) -> Union[Tensor, Tuple[Tensor, ...]]:
    """Depthwise causal convolution of time-major x [B, T, D] with weight [D, W] (bias [D]), each token seeing only
    earlier tokens of its document: `positions` [T] (int) is each token's index within its document, shared by the
    rows. Returns [B, T, D] in x's dtype, or with `splits` (sizes along D) one contiguous tensor per part, written
    as such (what fla's kernels take for q, k and v, without a copy of each); `activation` silu/swish or None;
    `compiled`: through torch.compile. `l2norm` (parts, head_dim): the first `parts` split outputs come L2-normalised
    over each head of head_dim channels (the GDN recurrence's q and k), from the fp32 activation before rounding;
    the backward recomputes the norm rather than keeping it."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation={activation!r}: expected silu, swish or None")
    if x.dim() != 3 or weight.dim() != 2 or x.shape[2] != weight.shape[0] or positions.shape != x.shape[1:2]:
        raise ValueError(f"expected x [B, T, D], weight [D, W] and positions [T]; got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)} and {tuple(positions.shape)}")
    if splits is not None and sum(splits) != x.shape[2]:
        raise ValueError(f"splits {list(splits)} do not add up to the {x.shape[2]} channels")
    if l2norm is not None and (splits is None or l2norm[0] > len(splits)
                               or any(n % l2norm[1] for n in splits[:l2norm[0]])):
        raise ValueError(f"l2norm {tuple(l2norm)}: the first {l2norm[0]} of splits {splits} are not whole heads")
    return _ShortConv.apply(x.contiguous(), weight, bias, positions, activation is not None, bool(compiled),
                            None if splits is None else tuple(int(n) for n in splits),
                            None if l2norm is None else (int(l2norm[0]), int(l2norm[1])))
