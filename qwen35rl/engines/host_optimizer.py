"""The optimizer step of a trainer whose parameters, gradients and Adam states live on the host (FSDP2's
CPUOffloadPolicy, the only way a 4B policy's fp32 states fit beside a colocated vLLM engine on one 80 GB card).

There the step is CPU work over 16 bytes per parameter, and torch's defaults for host tensors are the slow ones:
AdamW's per-tensor loop (foreach is a CUDA default) and a gradient norm that copies every gradient to float64.
A process also keeps the thread count its launcher gave it (one under Ray), so the step runs on the cores this
device's share of the node holds, then gives them back.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Iterable, Iterator, Sequence

import torch


def node_thread_share(devices_per_node: int) -> int:
    """CPU threads one device's process may use: the node's cores over its devices."""
    return max(1, (os.cpu_count() or 1) // max(int(devices_per_node), 1))


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to `n` for the block, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, int(n)))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def adamw(params: Iterable[torch.nn.Parameter], backend: Any, on_host: bool) -> torch.optim.AdamW:
    """AdamW over `params`; on the host the fused kernel (one vectorised pass per tensor instead of a dozen
    elementwise ops: 3-4x faster on one thread, bench/results/host_optimizer.md)."""
    return torch.optim.AdamW(params, lr=backend.lr, betas=tuple(backend.betas), weight_decay=backend.weight_decay,
                             fused=True if on_host else None)


ROW = 4096
"""Elements per float32 partial norm on the host: short enough that float32 squares sum to ~1e-8 relative."""


def squared_norm(grads: Sequence[torch.Tensor], on_host: bool, device: torch.device) -> torch.Tensor:
    """Sum of squared gradient elements as a float64 0-d tensor on `device`. Host gradients: float32 norms of rows of
    `ROW` elements, squared and summed in float64 (~5e-9 relative to the exact sum, 25-50x faster than a float64
    copy of each gradient; one float32 norm per tensor is off by ~1e-4). Device gradients keep the exact elementwise
    float64 sum (cheap there, and the runs recorded so far used it)."""
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        g = g.detach()
        if not on_host:
            sq += g.double().pow(2).sum().to(device)
            continue
        flat = g.reshape(-1)
        whole = flat.numel() // ROW * ROW
        rows = torch.linalg.vector_norm(flat[:whole].view(-1, ROW), dim=1).double().square().sum()
        tail = torch.linalg.vector_norm(flat[whole:]).double().square()
        sq += (rows + tail).to(device)
    return sq
