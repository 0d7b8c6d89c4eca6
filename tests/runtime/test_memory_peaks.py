"""Peak device memory per phase: each phase's own window, the overall peak over all of them."""
import pytest

from qwen35rl.runtime.memory_peaks import GIB, MemoryPeaks


class FakeAllocator:
    """torch.cuda's peak counter: the largest allocation since the last reset."""

    def __init__(self):
        self.allocated = self.peak = 0

    def alloc(self, n):
        self.allocated += n
        self.peak = max(self.peak, self.allocated)

    def free(self, n):
        self.allocated -= n

    def max_memory_allocated(self):
        return self.peak

    def reset_peak_memory_stats(self):
        self.peak = self.allocated


def test_each_phase_reads_its_own_peak_and_the_overall_peak_keeps_the_largest():
    dev = FakeAllocator()
    peaks = MemoryPeaks(dev)
    dev.alloc(10 * GIB)                      # weights, before any phase
    with peaks.phase("gen"):
        dev.alloc(30 * GIB)
        dev.free(30 * GIB)
    with peaks.phase("update_actor"):
        dev.alloc(5 * GIB)
        dev.free(5 * GIB)
    assert peaks.take_phases_gb() == {"gen": 40.0, "update_actor": 15.0}
    assert peaks.overall_gb() == 40.0    # the gen window's peak survives the update's reset
    with peaks.phase("update_actor"):
        dev.alloc(1 * GIB)
        dev.free(1 * GIB)
    assert peaks.take_phases_gb() == {"update_actor": 11.0}  # the last call cleared the others
    dev.alloc(50 * GIB)                      # between phases
    assert peaks.overall_gb() == 60.0


def test_a_phase_run_twice_in_a_step_keeps_its_larger_peak():
    dev = FakeAllocator()
    peaks = MemoryPeaks(dev)
    for n in (3 * GIB, 7 * GIB, 2 * GIB):
        with peaks.phase("update_actor"):
            dev.alloc(n)
            dev.free(n)
    assert peaks.take_phases_gb() == {"update_actor": 7.0}


def test_cpu_has_no_phase_peaks_and_its_overall_peak_is_the_resident_set():
    import resource

    peaks = MemoryPeaks(None)
    with peaks.phase("gen"):
        pass
    assert peaks.take_phases_gb() == {}
    rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    assert 0 < peaks.overall_gb() == pytest.approx(rss_gib, rel=0.05)


class FakeDevice(FakeAllocator):
    """Adds the device's own count: what the allocator holds plus memory no allocator sees (the CUDA context)."""

    def __init__(self, total, outside):
        super().__init__()
        self.total, self.outside = total, outside

    def memory_allocated(self):
        return self.allocated

    def memory_reserved(self):
        return self.allocated + self.cached

    cached = 0

    def mem_get_info(self):
        return self.total - self.memory_reserved() - self.outside, self.total

    private = 0                       # reserved in a private pool (vLLM's sleep-mode pool, CUDA graphs)

    def memory_snapshot(self):
        return [{"segment_pool_id": (0, 0), "total_size": self.memory_reserved() - self.private,
                 "allocated_size": self.allocated},
                {"segment_pool_id": (1, 0), "total_size": self.private, "allocated_size": 0}]


def test_a_moment_records_device_use_and_live_bytes_under_their_tracker_names():
    from qwen35rl.runtime.memory_peaks import metric_name

    dev = FakeDevice(total=80 * GIB, outside=3 * GIB)
    peaks = MemoryPeaks(dev)
    dev.alloc(6 * GIB)
    dev.cached = 7 * GIB              # blocks the allocator could not give back
    dev.private = 5 * GIB             # of them in a private pool (a CUDA graph's), 2 in the default pool
    peaks.moment("before_wake")
    dev.cached = 0
    dev.alloc(30 * GIB)               # the engine awake
    with peaks.phase("gen"):
        dev.alloc(1 * GIB)
        dev.free(1 * GIB)
    named = {metric_name(k): v for k, v in peaks.take_phases_gb().items()}
    assert named == {"perf/max_memory_allocated_gb/gen": 37.0, "perf/device_memory_used_gb/gen": 39.0,
                     "perf/device_memory_used_gb/before_wake": 16.0, "perf/memory_allocated_gb/before_wake": 6.0,
                     "perf/memory_reserved_gb/before_wake": 13.0, "perf/memory_default_pool_gb/before_wake": 8.0,
                     "perf/memory_default_pool_free_gb/before_wake": 2.0}
    assert peaks.take_phases_gb() == {}
    MemoryPeaks(None).moment("before_wake")  # CPU: nothing to read, nothing recorded
