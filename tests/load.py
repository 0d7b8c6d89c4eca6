"""Timeouts for tests that wait on other processes, scaled by how busy the machine is.

A timeout in a test bounds a hang; it is no measurement. On a loaded machine (other users, `bench/load_suite.sh`'s
busy loops) everything runs several times slower, so a bound picked on an idle box turns into a false failure.
`scaled(s)` is `s` times the load per core (the 1-minute load average over the cores, at least 1, at most 8), times
`QWEN35RL_TEST_TIMEOUT_SCALE` when set (e.g. 3 on a box known to be slow)."""
import os

MAX_FACTOR = 8.0


def load_factor() -> float:
    try:
        per_core = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:  # no load average on this platform
        per_core = 1.0
    return min(MAX_FACTOR, max(1.0, per_core)) * float(os.environ.get("QWEN35RL_TEST_TIMEOUT_SCALE", "1"))


def scaled(seconds: float) -> float:
    return seconds * load_factor()
