"""Moving a training engine's device memory to the host between phases, in place.

A colocated run alternates training and generation on the same devices; while the rollout engine generates, the
trainer's parameters, gradients and optimizer states can wait in host memory (`backend.param_offload`,
`grad_offload`, `optimizer_offload`). Here each tensor's storage goes to a host copy and is resized to zero bytes on
the device, then resized and filled again: the storage object stays the same, so every view into it (parameters
that are views into megatron's contiguous buffers, `main_grad`, bucket views, optimizer references) is valid again
after the reload without being told.
"""
from __future__ import annotations

from typing import Dict, Iterable, Tuple

import torch


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class HostOffload:
    """Storages currently held on the host, by storage identity (a storage shared by several tensors moves once)."""

    def __init__(self) -> None:
        self._away: Dict[int, Tuple[torch.UntypedStorage, torch.Tensor]] = {}

    @property
    def offloaded_bytes(self) -> int:
        return sum(host.numel() for _, host in self._away.values())

    def offload(self, tensors: Iterable[torch.Tensor]) -> int:
        """Copy the storages of these tensors to the host and free them on their device; returns the bytes moved
        now (storages already away, or empty, are skipped)."""
        moved = 0
        for t in tensors:
            storage = t.untyped_storage()
            key = storage._cdata
            if key in self._away or storage.nbytes() == 0:
                continue
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=storage.device.type == "cuda")
            host.copy_(_bytes(storage))
            storage.resize_(0)
            self._away[key] = (storage, host)
            moved += host.numel()
        return moved

    def reload(self) -> int:
        """Give every storage that is away its bytes back on its device; returns the bytes moved."""
        moved = 0
        for storage, host in self._away.values():
            storage.resize_(host.numel())
            _bytes(storage).copy_(host)
            moved += host.numel()
        self._away.clear()
        return moved
