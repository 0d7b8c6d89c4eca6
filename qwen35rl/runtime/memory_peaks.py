"""Peak device memory per phase of a step (gen, ref, update_actor, ...) next to the run's overall peak.

The plan estimates the rollout's and the trainer's peaks apart; one `max_memory_allocated` over the whole run cannot
say which phase set it. Each phase resets the allocator's peak counter when it starts and reads it when it ends; the
overall peak is the largest of those windows (and of the time between them), so `perf/max_memory_allocated_gb`
keeps its meaning. On CPU there is no allocator counter to reset (the resident-set peak only grows): no phase peaks,
and the overall peak is the process's peak resident set. All in GiB, the plan's unit and verl's for
`perf/max_memory_allocated_gb`.

Memory that is not the caching allocator's (vLLM's sleep-mode pools, allocated through its own cuMem allocator; the
CUDA context) is in no allocator counter: each phase also records the device's used memory (total - free, one
`mem_get_info` at its end), `perf/device_memory_used_gb/<phase>`, the number to hold against the plan's rollout
estimate under vLLM. A `moment` (e.g. `before_wake`: the trainer's side, the engine's KV cache asleep) records both the
device's used memory and the allocator's live bytes at one point, `perf/memory_allocated_gb/<moment>`, and what the
allocator holds from the device then, `perf/memory_reserved_gb/<moment>` (after an empty_cache: blocks it could not
give back). Used less reserved is what no allocator counts (CUDA context, loaded kernels, communicators, memory of
libraries with their own allocators). Reserved counts private pools too (vLLM's sleep-mode pools, asleep or not;
CUDA graphs): `perf/memory_default_pool_gb/<moment>` is the part in the allocator's default pool, from its
segment list, and `perf/memory_default_pool_free_gb/<moment>` the free bytes inside those segments: what an
empty_cache cannot give back because live blocks share their segments (fragmentation).
"""
from __future__ import annotations

import contextlib
import resource
from typing import Any, Dict, Iterator, Optional, Tuple

from qwen35rl.config.memory import GIB


class MemoryPeaks:
    def __init__(self, device: Optional[Any]):
        """`device`: torch.cuda or torch.npu (reset_peak_memory_stats, max_memory_allocated), None on CPU."""
        self.device = device
        self.overall = 0
        self.phases: Dict[str, int] = {}
        self.used: Dict[str, int] = {}
        self.live: Dict[str, int] = {}
        self.reserved: Dict[str, int] = {}
        self.default_pool: Dict[str, int] = {}
        self.default_free: Dict[str, int] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.device is None:
            yield
            return
        self.overall = max(self.overall, self.device.max_memory_allocated())  # before the reset forgets it
        self.device.reset_peak_memory_stats()
        try:
            yield
        finally:
            peak = self.device.max_memory_allocated()
            self.phases[name] = max(self.phases.get(name, 0), peak)
            self.overall = max(self.overall, peak)
            used = self.device_used()
            if used is not None:
                self.used[name] = max(self.used.get(name, 0), used)

    def moment(self, name: str) -> None:
        """The device's used memory, the allocator's live and reserved bytes now (largest over the step)."""
        if self.device is None:
            return
        self.live[name] = max(self.live.get(name, 0), int(self.device.memory_allocated()))
        reserved = getattr(self.device, "memory_reserved", None)
        if reserved is not None:
            self.reserved[name] = max(self.reserved.get(name, 0), int(reserved()))
        default = self.default_pool_segments()
        if default is not None:
            self.default_pool[name] = max(self.default_pool.get(name, 0), default[0])
            self.default_free[name] = max(self.default_free.get(name, 0), default[0] - default[1])
        used = self.device_used()
        if used is not None:
            self.used[name] = max(self.used.get(name, 0), used)

    def default_pool_segments(self) -> Optional[Tuple[int, int]]:
        """(reserved, allocated) bytes of the allocator's segments in its default pool (pool id (0, 0)); None where
        the device module has no segment list."""
        snapshot = getattr(self.device, "memory_snapshot", None)
        if snapshot is None:
            return None
        try:
            segments = snapshot()
        except Exception:  # a diagnostic: whatever the allocator's segment list refuses, the run goes on
            return None
        default = [s for s in segments if tuple(s.get("segment_pool_id", (0, 0))) == (0, 0)]
        return sum(int(s.get("total_size", 0)) for s in default), sum(int(s.get("allocated_size", 0)) for s in default)

    def device_used(self) -> Optional[int]:
        """Bytes in use on the device, by anyone (None where the device module cannot say)."""
        info = getattr(self.device, "mem_get_info", None)
        if info is None:
            return None
        free, total = info()
        return int(total - free)

    def overall_gb(self) -> float:
        """The run's peak so far: of the device's allocator, on CPU the process's peak resident set."""
        if self.device is None:
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # ru_maxrss is KiB on Linux
        return max(self.overall, self.device.max_memory_allocated()) / GIB

    def take_phases_gb(self) -> Dict[str, float]:
        """Each phase's peak since the last call (GiB), and clears them: one step's phases per call. The device's used
        memory at a phase's end (or a moment) comes as `DEVICE_USED + name`, a moment's live and reserved bytes as `LIVE + name`
        and `RESERVED + name`, the default pool's reserved and free bytes as `DEFAULT_POOL + name` and `DEFAULT_FREE + name`."""
        out = {k: v / GIB for k, v in self.phases.items()}
        out.update({DEVICE_USED + k: v / GIB for k, v in self.used.items()})
        out.update({LIVE + k: v / GIB for k, v in self.live.items()})
        out.update({RESERVED + k: v / GIB for k, v in self.reserved.items()})
        out.update({DEFAULT_POOL + k: v / GIB for k, v in self.default_pool.items()})
        out.update({DEFAULT_FREE + k: v / GIB for k, v in self.default_free.items()})
        for counts in (self.phases, self.used, self.live, self.reserved, self.default_pool, self.default_free):
            counts.clear()
        return out


DEVICE_USED = "device_used:"
LIVE = "allocated:"
RESERVED = "reserved:"
DEFAULT_POOL = "default_pool:"
DEFAULT_FREE = "default_pool_free:"


def metric_name(key: str) -> str:
    """The tracker's name of a `take_phases_gb` key."""
    for prefix, metric in ((DEVICE_USED, "perf/device_memory_used_gb/"), (LIVE, "perf/memory_allocated_gb/"),
                           (RESERVED, "perf/memory_reserved_gb/"), (DEFAULT_POOL, "perf/memory_default_pool_gb/"),
                           (DEFAULT_FREE, "perf/memory_default_pool_free_gb/")):
        if key.startswith(prefix):
            return metric + key[len(prefix):]
    return "perf/max_memory_allocated_gb/" + key
