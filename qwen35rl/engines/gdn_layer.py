"""Qwen3.5's Gated DeltaNet layer forward for training calls (no cache), on this project's kernels.

transformers' forward projects q, k and v as one [B, T, D] tensor, transposes it for the convolution, transposes it
back and splits it: q, k and v reach the recurrence as strided views, which fla's kernels copy into contiguous
tensors (and whose gradients autograd concatenates again in the backward). On an H200 those copies were about a
sixth of the 0.8B model's reference pass (bench/results/h200.md, 2026-12-02d). Here the convolution
(`packed_gdn.document_conv`) writes q, k and v as three contiguous tensors itself, q and k L2-normalised per head,
and takes their gradients apart. The math is transformers' own: the same projections, SiLU convolution, q/k norm,
gates (beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)), recurrence (the modeling module's
`torch_chunk_gated_delta_rule`, fla's kernel where it imports, with the documents' boundaries), gated norm and output
projection. Calls with a cache (generation) keep transformers' forward.
"""
from __future__ import annotations

import functools
import inspect
import sys
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from qwen35rl.engines import packed_gdn


def is_gdn(module: nn.Module) -> bool:
    return type(module).__name__.endswith("GatedDeltaNet") and hasattr(module, "in_proj_qkv")


def _cache_of(args: tuple, kwargs: dict) -> Any:
    # transformers 5.17 names it cache_params, 5.24 cache (positional: right after hidden_states)
    for name in ("cache", "cache_params"):
        if kwargs.get(name) is not None:
            return kwargs[name]
    return args[0] if args else None


QK_NORM_IN_CONV = True
"""Normalise q and k in the short convolution and call the recurrence with its in-kernel norm off. fla's own L2
norm is a Triton kernel whose block count is a compile-time constant and autotune key growing with the token count,
so with token-budget micro batches every new size band compiled and autotuned it again (8.9 + 10.2 s in one step on
an H200, bench/results/h200.md, 2026-12-04). False: the recurrence's own norm (a bench variant of
bench/gpu/train_phases.py, to compare the two)."""

FLA_FUSED_GATES = False
"""Hand fla 0.6 the raw gate inputs and the key heads unrepeated (`use_gate_in_kernel`, `use_beta_sigmoid_in_kernel`,
grouped value heads): a dozen fewer ops per layer and call, and no repeated q and k. Off by default: not yet run on a
GPU (tests/engines/test_gdn_layer.py's CUDA test and the `fused` variant of bench/gpu/train_phases.py check and
measure it)."""


@functools.lru_cache(maxsize=None)
def _fla_rule_with_fused_gates() -> Optional[Callable]:
    """fla's chunk_gated_delta_rule where its autograd function takes the raw gate and beta inputs (fla 0.6, which
    also takes fewer key than value heads), else None. The public function passes `use_gate_in_kernel` on through
    **kwargs, which an fla without it would drop silently: the autograd function's signature says whether it is
    taken."""
    try:
        from fla.ops.gated_delta_rule import chunk as fla_chunk
    except ImportError:
        return None
    fn = getattr(fla_chunk, "chunk_gated_delta_rule", None)
    autograd_fn = getattr(fla_chunk, "ChunkGatedDeltaRuleFunction", None)
    if fn is None or autograd_fn is None:
        return None
    takes = set(inspect.signature(autograd_fn.forward).parameters)
    return fn if {"use_gate_in_kernel", "A_log", "dt_bias", "use_beta_sigmoid_in_kernel"} <= takes else None


def fused_gates_rule(modeling: Any, device: torch.device) -> Optional[Callable]:
    """fla's rule with fused gates when FLA_FUSED_GATES is set, the tensors are on CUDA and the modeling module's
    recurrence is fla's; None otherwise."""
    if not FLA_FUSED_GATES or device.type != "cuda":
        return None
    if packed_gdn.dispatches_to_torch(packed_gdn.original(modeling, packed_gdn.CHUNK_RULE)):
        return None
    return _fla_rule_with_fused_gates()


def recurrence(modeling: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               A_log: torch.Tensor, dt_bias: torch.Tensor, cu_seqlens: Optional[torch.Tensor],
               normalised: bool = True) -> torch.Tensor:
    """The gated delta rule over q, k [B, T, H_k, d_k] (L2-normalised per head, or by the rule when not
    `normalised`) and v [B, T, H_v, d_v] (H_v a multiple of H_k), from the raw gate inputs a and b [B, T, H_v]:
    beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias). Through the modeling module's rule (transformers'
    torch code, or fla's kernel through it) with the key heads repeated to the value heads and the gates computed
    here, or `fused_gates_rule`'s fla call."""
    fused = fused_gates_rule(modeling, q.device)
    if fused is not None:
        core, _ = fused(q, k, v, g=a, beta=b, initial_state=None, output_final_state=False, cu_seqlens=cu_seqlens,
                        use_qk_l2norm_in_kernel=not normalised, use_gate_in_kernel=True, A_log=A_log,
                        dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True)
        return core
    groups = v.shape[2] // q.shape[2]
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    core, _ = modeling.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=b.sigmoid(), initial_state=None,
                                                    output_final_state=False, use_qk_l2norm_in_kernel=not normalised,
                                                    cu_seqlens=cu_seqlens)
    return core


def training_forward(module: nn.Module, original: Callable, hidden_states: torch.Tensor, *args, **kwargs):
    """The layer's forward without a cache (transformers' `original` with one)."""
    if _cache_of(args, kwargs) is not None:
        return original(hidden_states, *args, **kwargs)
    attention_mask = kwargs.pop("attention_mask", args[1] if len(args) > 1 else None)
    modeling = sys.modules[type(module).__module__]
    h = modeling.apply_mask_to_padding_states(hidden_states, attention_mask)
    batch, length, _ = h.shape
    dk, dv = module.head_k_dim, module.head_v_dim
    cu = packed_gdn.packing_boundaries(kwargs)
    normed = QK_NORM_IN_CONV
    q, k, v = packed_gdn.document_conv(module.in_proj_qkv(h), module.conv1d.weight.squeeze(1), module.conv1d.bias,
                                       module.activation, cu, splits=(module.key_dim, module.key_dim, module.value_dim),
                                       l2norm=(2, dk) if normed else None)
    q, k = q.view(batch, length, -1, dk), k.view(batch, length, -1, dk)
    v = v.view(batch, length, -1, dv)
    core = recurrence(modeling, q, k, v, module.in_proj_a(h), module.in_proj_b(h), module.A_log, module.dt_bias, cu,
                      normalised=normed)
    z = module.in_proj_z(h).reshape(-1, dv)
    core = module.norm(core.reshape(-1, dv), z).reshape(batch, length, -1)
    return module.out_proj(core)


def use_training_forward(model: nn.Module) -> int:
    """Give every GDN layer of a built (or sharded) model `training_forward`; returns how many layers it reached.
    Idempotent. The convolution's and recurrence's packed forms are `packed_gdn.enable_packing`'s."""
    n = 0
    for m in model.modules():
        if is_gdn(m):
            if not (isinstance(m.forward, functools.partial) and m.forward.func is training_forward):
                m.forward = functools.partial(training_forward, m, m.forward)
            n += 1
    return n
