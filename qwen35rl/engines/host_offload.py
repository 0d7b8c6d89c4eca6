"""Moving a training engine's device memory to the host between phases, in place.

A colocated run alternates training and generation on the same devices; while the rollout engine generates, the
trainer's parameters, gradients and optimizer states can wait in host memory (`backend.param_offload`,
`grad_offload`, `optimizer_offload`). Here each tensor's storage goes to a host copy and is resized to zero bytes on
the device, then resized and filled again: the storage object stays the same, so every view into it (parameters
that are views into megatron's contiguous buffers, `main_grad`, bucket views, optimizer references) is valid again
after the reload without being told.
"""
from __future__ import annotations

from typing import Dict, Iterable

import torch


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class HostOffload:
    """Storages currently held on the host, by storage identity (a storage shared by several tensors moves once).
    The host buffers are kept from one offload to the next: pinning tens of GB anew each step would cost seconds."""

    def __init__(self) -> None:
        self._away: Dict[int, torch.UntypedStorage] = {}
        self._host: Dict[int, torch.Tensor] = {}

    @property
    def offloaded_bytes(self) -> int:
        return sum(self._host[key].numel() for key in self._away)

    def offload(self, tensors: Iterable[torch.Tensor]) -> int:
        """Copy the storages of these tensors to the host and free them on their device (then the device's cached
        blocks go back to the driver, for a rollout engine that allocates outside torch); returns the bytes moved
        now (storages already away, or empty, are skipped)."""
        moved, devices = 0, set()
        for t in tensors:
            storage = t.untyped_storage()
            key = storage._cdata
            if key in self._away or storage.nbytes() == 0:
                continue
            host = self._host.get(key)
            if host is None or host.numel() != storage.nbytes():
                host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=storage.device.type == "cuda")
                self._host[key] = host
            host.copy_(_bytes(storage))  # blocking: the storage is freed right after
            storage.resize_(0)
            self._away[key] = storage
            moved += host.numel()
            devices.add(storage.device.type)
        for device_type in devices - {"cpu"}:
            module = getattr(torch, device_type, None)
            if module is not None and hasattr(module, "empty_cache"):
                module.empty_cache()
        return moved

    def reload(self) -> int:
        """Give every storage that is away its bytes back on its device; returns the bytes moved."""
        moved = 0
        for key, storage in self._away.items():
            host = self._host[key]
            storage.resize_(host.numel())
            _bytes(storage).copy_(host)
            moved += host.numel()
        self._away.clear()
        return moved
