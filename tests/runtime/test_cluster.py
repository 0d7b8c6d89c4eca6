"""Which Ray cluster the driver uses, and a worker group failing fast, naming the worker, when one worker raises
or dies while the others wait for it (as in a collective)."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import signal
import time

import pytest
from omegaconf import OmegaConf

from tests.processes import cmdline, session_pids
from qwen35rl.config.compose import compose
from qwen35rl.config.resolved import resolve_run
from qwen35rl.runtime.cluster import WorkerFailure, WorkerGroup, ray_address
from qwen35rl.runtime.platform import resolve_platform


def test_ray_address_precedence(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert ray_address(OmegaConf.create({"ray_address": None})) is None
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert ray_address(OmegaConf.create({"ray_address": None})) == "10.0.0.1:6379"
    assert ray_address(OmegaConf.create({"ray_address": "auto"})) == "auto"


class FlakyWorker:
    """Rank `fail_rank` fails in `step` the way it is told; the others block, like ranks waiting in a collective
    for the failed one."""

    def __init__(self, cfg, *, layout, rank, world_size, local_rank, fail_init=False):
        if fail_init and rank == 1:
            raise ValueError("no such checkpoint")
        self.rank = rank

    def rendezvous_address(self):
        return "127.0.0.1", 0

    def init_distributed(self, addr, port):
        pass

    def pid(self):
        return os.getpid()

    def step(self, fail_rank, how):
        if self.rank == fail_rank:
            if how == "raise":
                raise RuntimeError("NaN in the engine")
            if how == "oom":
                import torch

                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(3600)


@pytest.fixture(scope="module")
def ray_cluster():
    import sys

    import ray
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import a test module
    ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("how, cause", [
    ("raise", "RuntimeError: NaN in the engine"),
    ("oom", "out of device memory (OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB)"),
    ("kill", "its process died"),
])
def test_a_failing_worker_is_named_at_once(ray_cluster, how, cause):
    cfg = compose(["hw.devices_per_node=3", "trainer.placement_timeout_s=60"])
    wg = WorkerGroup.create(resolve_run(cfg), resolve_platform(cfg), FlakyWorker, 3)
    try:
        pids = wg.start("pid", [()] * 3).wait()
        assert [w["pid"] for w in wg.where] == pids
        t0 = time.monotonic()
        with pytest.raises(WorkerFailure) as e:
            wg.start("step", [(1, how)] * 3).wait()
        assert time.monotonic() - t0 < 20          # ranks 0 and 2 would sleep for an hour
        assert e.value.rank == 1 and e.value.method == "step"
        assert str(e.value).startswith(f"worker rank 1 on node {wg.where[1]['ip']} ({wg.where[1]['hostname']}), "
                                       f"pid {pids[1]}, failed in step: {cause}")
    finally:
        wg.shutdown()


@pytest.mark.slow
def test_a_worker_that_fails_to_start_is_named(ray_cluster):
    import ray

    cfg = compose(["hw.devices_per_node=3", "trainer.placement_timeout_s=60"])
    with pytest.raises(WorkerFailure) as e:
        WorkerGroup.create(resolve_run(cfg), resolve_platform(cfg), FlakyWorker, 3, fail_init=True)
    assert e.value.rank == 1 and "failed to start (ValueError: no such checkpoint)" in str(e.value)
    assert ray.util.placement_group_table() and all(
        g["state"] == "REMOVED" for g in ray.util.placement_group_table().values())


# ------------------------------------------------------------------------------- the local cluster after a crash
@pytest.mark.slow
def test_local_cluster_goes_away_when_the_driver_is_sigkilled(tmp_path):
    """Ray's own fate sharing takes raylet and GCS down with a killed driver, but its agents (DashboardAgent,
    RuntimeEnvAgent) and idle workers lingered about a minute; the watchdog stops them within seconds, and only
    them (the run is in its own session: everything of it is that session's)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(sys.executable).parent / "qwen35rl-train"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "qwen35rl.cli.train"]
    run = tmp_path / "run"
    proc = subprocess.Popen([*cmd, f"hydra.run.dir={run}", "trainer.total_steps=100", "trainer.test_freq=-1",
                             "trainer.save_freq=-1", "trainer.launcher=ray"], stdout=subprocess.DEVNULL,
                            stderr=open(tmp_path / "stderr.txt", "w"), start_new_session=True, env=dict(os.environ))
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 600
    try:
        while not (metrics.exists() and metrics.read_text().strip()):
            assert proc.poll() is None, (tmp_path / "stderr.txt").read_text()[-3000:]
            assert time.monotonic() < deadline, "no step logged"
            time.sleep(0.05)
        assert any("DashboardAgent" in cmdline(p) or "raylet" in cmdline(p) for p in session_pids(proc.pid))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        t0 = time.monotonic()
        while session_pids(proc.pid) and time.monotonic() - t0 < 15:
            time.sleep(0.1)
        left = {p: cmdline(p) for p in session_pids(proc.pid)}
    finally:
        for p in session_pids(proc.pid):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert not left, f"left {time.monotonic() - t0:.0f} s after the driver's SIGKILL: {left}"
    assert "stopped its" in (tmp_path / "stderr.txt").read_text()
