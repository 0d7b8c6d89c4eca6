"""Packed sequences (several documents in one row, no padding) through Qwen3.5's Gated DeltaNet layers without the
`causal-conv1d` package.

transformers' GDN layer keeps packed documents apart only through its kernels: the short convolution takes
`seq_idx` from `causal-conv1d` and the recurrence takes `cu_seqlens` from flash-linear-attention (fla). Without
`causal-conv1d` (a CUDA extension that does not build everywhere) the convolution falls back to a plain
depthwise `F.conv1d`, so the first kernel-width - 1 tokens of each document see the previous document's tail
(transformers 5.24 refuses the packed call instead); without fla the torch recurrence carries its state from
one document into the next. On CUDA with fla, the convolution goes to fla's Triton kernel instead, which takes the
boundaries itself (`fla_conv1d`, for padded calls too). `enable_packing` swaps the modeling modules' `causal_conv1d_fn` (always) and
`torch_chunk_gated_delta_rule` (only where it is the torch fallback) for versions that honour the boundaries:
an exact torch convolution, and a per-document torch recurrence where fla is missing. The GDN forward looks these
module globals up at call time, so the swap reaches models that are already built. The full-attention layers
keep documents apart through `packed_attention`.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
from types import ModuleType
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F

MODELING_MODULES = ("transformers.models.qwen3_5.modeling_qwen3_5",
                    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
CONV = "causal_conv1d_fn"
CHUNK_RULE = "torch_chunk_gated_delta_rule"

# modeling module name -> {global name: the function enable_packing replaced}
_ORIGINALS: Dict[str, Dict[str, Callable]] = {}


# ------------------------------------------------------------------------------------------ boundaries
def cu_seqlens_from_seq_idx(seq_idx: torch.Tensor) -> torch.Tensor:
    """[0, start of document 1, ..., T] from per-token document ids ([T] or [1, T], constant within a document)."""
    s = seq_idx.reshape(-1) if seq_idx.dim() == 1 or seq_idx.shape[0] == 1 else None
    if s is None:
        raise ValueError(f"seq_idx of shape {tuple(seq_idx.shape)}: packed sequences live in one row")
    starts = torch.nonzero(s[1:] != s[:-1]).flatten() + 1
    edges = [starts.new_zeros(1), starts, starts.new_full((1,), s.numel())]
    return torch.cat(edges).to(torch.int32)


def packing_boundaries(kwargs: Dict[str, Any]) -> Optional[torch.Tensor]:
    """cu_seqlens of a packed call (transformers' `cu_seq_lens_q`, else derived from `seq_idx`), None otherwise."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        return cu
    seq_idx = kwargs.get("seq_idx")
    return None if seq_idx is None else cu_seqlens_from_seq_idx(seq_idx)


# ------------------------------------------------------------------------------------------ convolution
def _activate(y: torch.Tensor, activation: Optional[str]) -> torch.Tensor:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"activation={activation!r}: expected silu, swish or None")


def _build_spread_index(cu_seqlens: torch.Tensor, length: int, width: int,
                        device: torch.device) -> Tuple[torch.Tensor, int]:
    """Column of every token when W - 1 zeros precede each document, and the number of documents."""
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    if int(cu[0]) != 0 or int(cu[-1]) != length:
        raise ValueError(f"cu_seqlens must run from 0 to the sequence length {length}, got {cu.tolist()}")
    lengths = cu[1:] - cu[:-1]
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
    # token t of document i goes to column t + (i + 1) * (W - 1): each document starts after W - 1 zeros
    return torch.arange(length, device=device) + (doc + 1) * (width - 1), len(lengths)


# the last boundaries tensor and its spread index: one packed forward hands the same cu_seqlens tensor to every GDN
# layer, and building the index waits for the device (the checks and repeat_interleave read values)
_LAST_SPREAD: Dict[str, Any] = {}


def _spread_index(cu_seqlens: torch.Tensor, length: int, width: int, device: torch.device) -> Tuple[torch.Tensor, int]:
    key = (length, width, torch.device(device))
    if _LAST_SPREAD.get("cu") is not cu_seqlens or _LAST_SPREAD.get("key") != key:
        _LAST_SPREAD.clear()  # a failed check below leaves nothing behind
        index = _build_spread_index(cu_seqlens, length, width, device)
        _LAST_SPREAD.update(cu=cu_seqlens, key=key, index=index)
    return _LAST_SPREAD["index"]


def packed_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                         activation: Optional[str] = None, cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Depthwise causal convolution of x [B, D, T] with weight [D, W], where no output sees an input of another
    document: `cu_seqlens` ([N + 1], from 0 to T) splits the time axis of every row into documents.

    It runs the `F.conv1d` a single document gets, once over the row with W - 1 zeros inserted before each
    document: before the activation, outputs and input gradients equal the per-document convolution bit for bit;
    memory O(D * (T + N * (W - 1))). The same torch ops run on every device (a depthwise conv with a 4-wide kernel is
    cheap next to the layer's projections), so what the CPU tests pin is what a GPU run computes. Same dtype rules as
    transformers' `causal_conv1d_fn`: computed in weight's dtype, returned in x's.
    """
    batch, dim, length = x.shape
    width = weight.shape[-1]
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, length])
    dest, docs = _spread_index(cu_seqlens, length, width, x.device)
    # spread time-major: the GDN layer hands over its projection [B, T, D] transposed, so copying whole token rows
    # reads and writes contiguous memory (copying along T of the [B, D, T] view would stride by D on every element)
    xt = x.transpose(1, 2)
    spread = xt.new_zeros(batch, length + docs * (width - 1), dim, dtype=weight.dtype)
    spread = spread.index_copy(1, dest, xt.to(weight.dtype))
    # the [B, D, T'] view is the layout transformers' padded call gives conv1d too
    y = F.conv1d(spread.transpose(1, 2), weight.unsqueeze(1), bias, groups=dim)  # column c sees spread[c : c + W]
    y = y.index_select(2, dest - (width - 1))
    return _activate(y, activation).to(x.dtype)


# ------------------------------------------------------------------------------------------ recurrence
def dispatches_to_torch(fn: Callable) -> bool:
    """Whether a transformers kernel-or-fallback function (`use_kernel_func_from_hub_with_fallback`) runs its torch
    reference: its wrapper closes over the implementation picked at import, the package's or the wrapped one."""
    torch_fn = getattr(fn, "__wrapped__", None)
    if torch_fn is None:
        return True  # the torch function itself
    try:
        impl = inspect.getclosurevars(fn).nonlocals.get("implementation", torch_fn)
    except (TypeError, ValueError):
        return importlib.util.find_spec("fla") is None
    return impl is torch_fn


def _default_chunk_rule() -> Callable:
    module = importlib.import_module(MODELING_MODULES[0])
    return original(module, CHUNK_RULE)


def packed_chunk_gated_delta_rule(query, key, value, g, beta, chunk_size: int = 64, initial_state=None,
                                  output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                                  cu_seqlens: Optional[torch.Tensor] = None, *, reference: Optional[Callable] = None,
                                  **kwargs):
    """transformers' `torch_chunk_gated_delta_rule` (`reference`, by default the dense model's) that honours
    `cu_seqlens` (or `seq_idx` in kwargs) when that reference is the torch fallback: the recurrence runs once per
    document (state from `initial_state[i]`, none by default) and the outputs are concatenated; final states come
    back as [N, ...] as fla returns them. Correct but slow (CPU runs, tests). Without packing information, or when
    the reference is fla's kernel (which takes cu_seqlens itself), the call goes to the reference unchanged."""
    reference = reference or _default_chunk_rule()
    if cu_seqlens is None and kwargs.get("seq_idx") is not None:
        cu_seqlens = cu_seqlens_from_seq_idx(kwargs["seq_idx"])
    args = dict(chunk_size=chunk_size, initial_state=initial_state, output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    if cu_seqlens is None or not dispatches_to_torch(reference):
        return reference(query, key, value, g=g, beta=beta, cu_seqlens=cu_seqlens, **args, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"packed recurrence over {query.shape[0]} rows: packed documents live in one row")
    outs: List[torch.Tensor] = []
    states: List[torch.Tensor] = []
    bounds = cu_seqlens.tolist()
    for i, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
        doc = slice(start, stop)
        args["initial_state"] = None if initial_state is None else initial_state[i:i + 1]
        out, state = reference(query[:, doc], key[:, doc], value[:, doc], g=g[:, doc], beta=beta[:, doc], **args)
        outs.append(out)
        if state is not None:
            states.append(state)
    return torch.cat(outs, 1), (torch.cat(states, 0) if output_final_state else None)


# ------------------------------------------------------------------------------------------ patching
FLA_CONV = False
"""Route the convolutions of CUDA tensors to flash-linear-attention's Triton kernel where fla imports (packed and
padded calls alike). Off: measured on an H200 (bench/results/h200.md, 2026-12-02) it made the 0.8B update 16%
slower on all-at-cap rows and 7% faster on the realistic lengths, and each new shape autotunes its backward for
tens of seconds; the torch convolutions stay (what the CPU tests pin)."""


@functools.lru_cache(maxsize=None)
def _fla_causal_conv1d() -> Optional[Callable]:
    try:
        from fla.modules.causal_conv1d import causal_conv1d
    except Exception:  # noqa: BLE001 - no fla, or an fla without the module: the torch convolution
        return None
    return causal_conv1d


def fla_conv_applies(x: torch.Tensor) -> bool:
    return FLA_CONV and x.is_cuda and _fla_causal_conv1d() is not None


def fla_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
               activation: Optional[str] = None, cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """transformers' `causal_conv1d_fn` contract (x [B, D, T], weight [D, W]) on fla's Triton kernel, which takes
    [B, T, D] (the GDN layer's projection before transformers transposes it: no copy) and the documents' boundaries
    itself. The depthwise F.conv1d it replaces runs a slow cuDNN kernel per direction."""
    xt = x.transpose(1, 2)
    if not xt.is_contiguous():  # a prefill after a cached conv state hands over [B, D, T] itself
        xt = xt.contiguous()
    y, _ = _fla_causal_conv1d()(xt, weight, bias, activation=activation, cu_seqlens=cu_seqlens)
    return y.transpose(1, 2)


def _packing_conv(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        cu = packing_boundaries(kwargs)
        if fla_conv_applies(hidden_states):
            return fla_conv1d(hidden_states, weight, bias, activation, cu_seqlens=cu)
        if cu is None:  # padded batches, prefill with a cache
            return orig(hidden_states, weight, bias, activation=activation, **kwargs)
        return packed_causal_conv1d(hidden_states, weight, bias, activation, cu_seqlens=cu)

    return causal_conv1d_fn


def _packing_chunk_rule(orig: Callable) -> Callable:
    return functools.wraps(orig)(functools.partial(packed_chunk_gated_delta_rule, reference=orig))


def modeling_modules() -> List[ModuleType]:
    """The Qwen3.5 modeling modules this transformers has (dense, MoE)."""
    out = []
    for name in MODELING_MODULES:
        try:
            out.append(importlib.import_module(name))
        except ImportError:
            pass
    return out


def original(module: ModuleType, name: str) -> Callable:
    """The module's function `name` as transformers defined it, whether or not packing is enabled."""
    return _ORIGINALS.get(module.__name__, {}).get(name, getattr(module, name))


def is_packing_enabled(module: ModuleType) -> bool:
    return module.__name__ in _ORIGINALS


def enable_packing(*modules: ModuleType) -> None:
    """Make packed calls (kwargs `cu_seq_lens_q`/`seq_idx`) of these modeling modules' GDN layers keep documents
    apart (default: every Qwen3.5 modeling module). Idempotent; `disable_packing` undoes it."""
    for module in modules or modeling_modules():
        if is_packing_enabled(module):
            continue
        saved = {CONV: getattr(module, CONV)}
        if dispatches_to_torch(getattr(module, CHUNK_RULE)):
            saved[CHUNK_RULE] = getattr(module, CHUNK_RULE)
        setattr(module, CONV, _packing_conv(saved[CONV]))
        if CHUNK_RULE in saved:
            setattr(module, CHUNK_RULE, _packing_chunk_rule(saved[CHUNK_RULE]))
        _ORIGINALS[module.__name__] = saved


def disable_packing(*modules: ModuleType) -> None:
    """Put back transformers' own functions (default: in every module where packing is enabled)."""
    names = [m.__name__ for m in modules] if modules else list(_ORIGINALS)
    for name in names:
        saved = _ORIGINALS.pop(name, None)
        if saved is not None:
            module = importlib.import_module(name)
            for attr, fn in saved.items():
                setattr(module, attr, fn)


@contextlib.contextmanager
def packing_enabled(*modules: ModuleType) -> Iterator[None]:
    """`enable_packing` for the duration of the block; modules already enabled before it stay enabled."""
    targets = list(modules or modeling_modules())
    fresh = [m for m in targets if not is_packing_enabled(m)]
    enable_packing(*targets)
    try:
        yield
    finally:
        if fresh:
            disable_packing(*fresh)
