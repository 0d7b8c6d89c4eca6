"""Packed sequences (several documents in one row, no padding) through Qwen3.5's Gated DeltaNet layers without the
`causal-conv1d` package, and the layers' short convolution on a kernel of this project.

transformers' GDN layer keeps packed documents apart only through its kernels: the short convolution takes
`seq_idx` from `causal-conv1d` and the recurrence takes `cu_seqlens` from flash-linear-attention (fla). Without
`causal-conv1d` (a CUDA extension that does not build everywhere) the convolution falls back to a plain
depthwise `F.conv1d`, so the first kernel-width - 1 tokens of each document see the previous document's tail
(transformers 5.24 refuses the packed call instead), and that fallback is slow on CUDA; without fla the torch
recurrence carries its state from one document into the next. `enable_packing` swaps the modeling modules'
`causal_conv1d_fn` (always: packed and padded calls go to `short_conv`, which takes the documents' boundaries) and
`torch_chunk_gated_delta_rule` (only where it is the torch fallback: a per-document torch recurrence). The GDN
forward looks these module globals up at call time, so the swap reaches models that are already built. The
full-attention layers keep documents apart through `packed_attention`.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
from types import ModuleType
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from qwen35rl.engines.short_conv import short_causal_conv

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
COMPILE = False
"""Run the convolutions of CUDA tensors through torch.compile (`short_conv`); the FSDP engine sets it from
backend.use_torch_compile. CPU tensors always run the same math eagerly."""


def _build_positions(cu_seqlens: Optional[torch.Tensor], length: int, device: torch.device) -> torch.Tensor:
    """Each token's index within its document ([T]); one document when cu_seqlens is None."""
    t = torch.arange(length, device=device)
    if cu_seqlens is None:
        return t
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    if int(cu[0]) != 0 or int(cu[-1]) != length:
        raise ValueError(f"cu_seqlens must run from 0 to the sequence length {length}, got {cu.tolist()}")
    return t - cu[torch.searchsorted(cu[1:], t, right=True)]


# the last boundaries tensor and its positions: one packed forward hands the same cu_seqlens tensor to every GDN
# layer, and checking it waits for the device
_LAST_POSITIONS: Dict[str, Any] = {}


def positions(cu_seqlens: Optional[torch.Tensor], length: int, device: torch.device) -> torch.Tensor:
    key = (length, torch.device(device))
    if _LAST_POSITIONS.get("cu", False) is not cu_seqlens or _LAST_POSITIONS.get("key") != key:
        _LAST_POSITIONS.clear()  # a failed check below leaves nothing behind
        built = _build_positions(cu_seqlens, length, device)
        _LAST_POSITIONS.update(cu=cu_seqlens, key=key, positions=built)
    return _LAST_POSITIONS["positions"]


def document_conv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], activation: Optional[str],
                  cu_seqlens: Optional[torch.Tensor], splits: Optional[Sequence[int]] = None,
                  l2norm: Optional[Tuple[int, int]] = None):
    """`short_conv.short_causal_conv` of time-major x [B, T, D] whose rows `cu_seqlens` splits into documents (None:
    one per row), compiled for CUDA tensors when `COMPILE` is set; with `splits`, one contiguous tensor per part
    (`l2norm`: the first parts normalised per head)."""
    return short_causal_conv(x, weight, bias, positions(cu_seqlens, x.shape[1], x.device), activation,
                             compiled=COMPILE and x.is_cuda, splits=splits, l2norm=l2norm)


def packed_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                         activation: Optional[str] = None, cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Depthwise causal convolution of x [B, D, T] with weight [D, W], where no output sees an input of another
    document: `cu_seqlens` ([N + 1], from 0 to T) splits the time axis of every row into documents (None: one).

    transformers' `causal_conv1d_fn` contract, on `short_conv.short_causal_conv` over the time-major layout: the
    GDN layer hands over its projection [B, T, D] transposed, which is read as it lies, and the result comes back
    as the same kind of view, so the layer's transpose back is free. Computed in fp32 (or weight's dtype if wider),
    returned in x's; compiled for CUDA tensors when `COMPILE` is set."""
    return document_conv(x.transpose(1, 2), weight, bias, activation, cu_seqlens).transpose(1, 2)


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
def _packing_conv(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        # padded batches and a prefill after cached conv states (prepended to the row) are one document per row
        return packed_causal_conv1d(hidden_states, weight, bias, activation, cu_seqlens=packing_boundaries(kwargs))

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
