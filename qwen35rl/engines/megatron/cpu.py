"""megatron-core on CPU over gloo (debugging, CI and `hw=cpu` runs): megatron assumes CUDA, so this process gets
stand-ins. torch.cuda device queries and streams answer for the CPU, CPU tensors report torch.cuda.* types (the
distributed optimizer accepts nothing else), gloo gets reduce-scatter / all-gather-into-tensor emulations, the
model-parallel RNG fork is a no-op and recompute saves the CPU RNG as the device one, the alltoall MoE dispatcher's
split sizes stay on the host, and flash-linear-attention (when not installed) is replaced by modules that make
megatron's GatedDeltaNet use its own torch recurrence (`deterministic_mode`, which the engine sets on CPU).
torch.compile goes off (megatron wraps small fusions in it).

`install()` changes torch for the whole process: the Megatron engine calls it only in a process whose device is
the CPU (a Ray worker or a spawned test process), before megatron is imported. Idempotent.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.machinery
import importlib.util
import os
import sys
import types

import torch
import torch.distributed as dist

FLA_STANDIN = "qwen35rl stand-in"
"""The origin of the stand-in fla modules (`fla_standins`)."""

_installed = False


class _Done:
    def wait(self):
        pass

    def synchronize(self):
        pass


class _Stream:
    def __init__(self, *a, **k):
        pass

    def wait_stream(self, *a):
        pass

    def record_event(self, *a):
        return _Done()

    def synchronize(self):
        pass


@contextlib.contextmanager
def _uncoalesced(group):
    """Run a collective now: inside `_coalescing_manager` (the distributed optimizer's gradient reduce-scatter and
    parameter all-gather) torch defers it to the end of the block, after the emulation has read its result."""
    from torch.distributed.distributed_c10d import _get_default_group, _world

    pg = group or _get_default_group()
    deferred = _world.pg_coalesce_state.pop(pg, None)
    try:
        yield
    finally:
        if deferred is not None:
            _world.pg_coalesce_state[pg] = deferred


def install() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    import torch._dynamo

    os.environ["TORCHDYNAMO_DISABLE"] = "1"  # also in the processes this one starts
    torch._dynamo.config.disable = True
    if importlib.util.find_spec("fla") is None:
        fla_standins()
    _cuda_standins()


def fla_standins() -> None:
    """Where flash-linear-attention is not installed (any device): the modules megatron-core's GatedDeltaNet
    imports, so that it builds and runs its own torch recurrence (`deterministic_mode`, which the engine then sets).
    Must run before megatron.core.ssm.gated_delta_net is imported."""
    if "fla" in sys.modules:
        return
    fla = {name: types.ModuleType(name) for name in
           ("fla", "fla.modules", "fla.modules.l2norm", "fla.modules.convolution", "fla.ops", "fla.ops.gated_delta_rule")}
    for name, module in fla.items():  # importlib.util.find_spec raises on a module in sys.modules without one
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, origin=FLA_STANDIN)
    fla["fla.modules.l2norm"].l2norm = lambda x, dim=-1, eps=1e-6, **_: x * torch.rsqrt((x * x).sum(dim, keepdim=True) + eps)
    fla["fla.modules.convolution"].causal_conv1d = None
    fla["fla.ops.gated_delta_rule"].chunk_gated_delta_rule = None  # deterministic_mode uses megatron's torch recurrence
    sys.modules.update(fla)


def _cuda_standins() -> None:
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    stream = _Stream()
    torch.cuda.Stream = _Stream  # a class: modules imported later use it in type hints (`torch.cuda.Stream | None`)
    torch.cuda.current_stream = lambda *a, **k: stream
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()

    def on_cpu(fn):
        @functools.wraps(fn)
        def wrapped(*a, **k):
            if str(k.get("device", "")).startswith("cuda"):
                k["device"] = "cpu"
            return fn(*a, **k)
        return wrapped

    for name in ("tensor", "zeros", "empty", "ones", "full", "arange"):
        setattr(torch, name, on_cpu(getattr(torch, name)))
    torch.Tensor.cuda = lambda self, *a, **k: self
    tensor_type = torch.Tensor.type

    def cuda_type(self, dtype=None, *a, **k):  # the distributed optimizer accepts only torch.cuda.*Tensor params
        if dtype is None and self.device.type == "cpu":
            return tensor_type(self).replace("torch.", "torch.cuda.", 1)
        return tensor_type(self, dtype, *a, **k)

    torch.Tensor.type = cuda_type

    def reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        full = input.clone()
        with _uncoalesced(group):
            dist.all_reduce(full, op=op, group=group)
        output.copy_(full.chunk(dist.get_world_size(group))[dist.get_rank(group)])
        return _Done() if async_op else None

    def all_gather_into(output, input, group=None, async_op=False):
        parts = [torch.empty_like(input) for _ in range(dist.get_world_size(group))]
        with _uncoalesced(group):
            dist.all_gather(parts, input.contiguous(), group=group)
        output.copy_(torch.cat(parts))
        return _Done() if async_op else None

    dist.reduce_scatter_tensor = dist._reduce_scatter_base = reduce_scatter
    dist.all_gather_into_tensor = dist._all_gather_base = all_gather_into
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    # activation recompute saves and restores the device RNG around the recomputed forward: the CPU one stands in
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda *a, **k: None
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    def to_host(tensor, as_numpy=False, record_stream=False):  # the alltoall dispatcher's split sizes, "from the GPU"
        return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor

    moe_utils.maybe_move_tensor_to_cpu = token_dispatcher.maybe_move_tensor_to_cpu = to_host
