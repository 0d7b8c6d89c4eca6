"""Peak device memory per phase: each phase's own window, the overall peak over all of them."""
from qwen35rl.runtime.memory_peaks import MemoryPeaks


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
    dev.alloc(10e9)                      # weights, before any phase
    with peaks.phase("gen"):
        dev.alloc(30e9)
        dev.free(30e9)
    with peaks.phase("update_actor"):
        dev.alloc(5e9)
        dev.free(5e9)
    assert peaks.take_phases_gb() == {"gen": 40.0, "update_actor": 15.0}
    assert peaks.overall_gb() == 40.0    # the gen window's peak survives the update's reset
    with peaks.phase("update_actor"):
        dev.alloc(1e9)
        dev.free(1e9)
    assert peaks.take_phases_gb() == {"update_actor": 11.0}  # the last call cleared the others
    dev.alloc(50e9)                      # between phases
    assert peaks.overall_gb() == 60.0


def test_a_phase_run_twice_in_a_step_keeps_its_larger_peak():
    dev = FakeAllocator()
    peaks = MemoryPeaks(dev)
    for n in (3e9, 7e9, 2e9):
        with peaks.phase("update_actor"):
            dev.alloc(n)
            dev.free(n)
    assert peaks.take_phases_gb() == {"update_actor": 7.0}


def test_cpu_has_no_phase_peaks():
    peaks = MemoryPeaks(None)
    with peaks.phase("gen"):
        pass
    assert peaks.take_phases_gb() == {} and peaks.overall_gb() is None
