"""The run's own local Ray cluster starting in a thread beside the driver's imports (`cluster.EarlyLocalRay`):
it survives the end of its start (Ray's PR_SET_PDEATHSIG is per thread), `ray_session` takes it over and stops it,
a start that fails raises where it is taken, a run that ends before taking it leaves no cluster behind; the
preflight of a local CPU cluster probes in the driver."""
import os
import subprocess
import sys
import textwrap

import pytest

from qwen35rl.config.compose import compose
from qwen35rl.runtime import cluster
from qwen35rl.runtime.platform import resolve_platform

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_only_a_run_that_starts_its_own_cluster_starts_it_early(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert cluster.EarlyLocalRay.wanted(compose(["trainer.launcher=ray"]))
    assert cluster.EarlyLocalRay.wanted(compose(["hw.nodes=2"]))  # auto: Ray for more than this host
    assert not cluster.EarlyLocalRay.wanted(compose([]))  # auto: this host's CPUs are local processes
    assert not cluster.EarlyLocalRay.wanted(compose(["ray_address=10.0.0.1:6379"]))
    assert not cluster.EarlyLocalRay.wanted(compose(["trainer.launcher=local", "hw.devices_per_node=1"]))


def test_a_failed_start_raises_where_it_is_taken_and_the_thread_ends(monkeypatch):
    def refuse(cfg, platform, world):
        raise cluster.ClusterError("no room for a cluster here")

    monkeypatch.setattr(cluster, "connect", refuse)
    cfg = compose([])
    early = cluster.EarlyLocalRay(cfg, resolve_platform(cfg), 2)
    with pytest.raises(cluster.ClusterError, match="no room"):
        early.take()
    early.thread.join(timeout=30)
    assert not early.thread.is_alive()


@pytest.mark.slow
def test_the_early_cluster_serves_the_run_then_stops_and_an_untaken_one_is_stopped_too():
    script = textwrap.dedent("""
        import time, ray
        from qwen35rl.config.compose import compose
        from qwen35rl.runtime import cluster
        from qwen35rl.runtime.platform import resolve_platform

        cfg = compose([])
        platform = resolve_platform(cfg)
        early = cluster.EarlyLocalRay(cfg, platform, 2)
        with cluster.ray_session(cfg, platform, 2, early) as started_local:
            assert started_local
            time.sleep(2)  # GCS and raylet outlive the end of the start itself
            assert ray.get(ray.remote(lambda: 41 + 1).remote(), timeout=60) == 42
            from qwen35rl.runtime import preflight

            def no_task(*a, **k):
                raise AssertionError("a local CPU cluster is probed in the driver, without a probe task")

            preflight.probe_nodes = no_task
            from qwen35rl.config.resolved import resolve_run

            seen = preflight.run_preflight(resolve_run(cfg), platform, wait_s=0.0, in_process=True)
            assert len(seen["nodes"]) == 1 and seen["probes"][0]["device_name"] == "cpu"
        assert not ray.is_initialized() and not early.thread.is_alive()

        untaken = cluster.EarlyLocalRay(cfg, platform, 2)
        untaken.close()  # the run ended before it reached Ray (a data error, a signal)
        assert untaken.started_local and not ray.is_initialized() and not untaken.thread.is_alive()
        print("OK")
    """)
    env = dict(os.environ, OMP_NUM_THREADS="1", RAY_AUTH_MODE="disabled", PYTHONPATH=ROOT)
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env,
                         cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-3000:]
