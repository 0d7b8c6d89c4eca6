"""trainer.launcher=local with several workers: the process group's interface (calls in rank order, a failure or a
death named at once, shutdown), the workers' environment and signals, workers that end with their driver, and
`auto` choosing it for a run of this host's CPUs with the same numbers as Ray."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from qwen35rl.config.compose import compose
from qwen35rl.config.launcher import auto_choice, launcher_of
from qwen35rl.config.resolved import resolve_run
from qwen35rl.runtime.cluster import ClusterError, WorkerFailure
from qwen35rl.runtime.local_processes import ProcessWorkerGroup, preloads
from qwen35rl.runtime.platform import resolve_platform
from tests.load import scaled

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ["trainer.launcher=local"]


class Recorder:
    """A worker that says where and how it was built, and fails or dies on request."""

    def __init__(self, cfg, *, layout, rank, world_size, local_rank, fail_init=False, mark=None):
        if fail_init and rank == 1:
            raise ValueError("no such checkpoint")
        self.placed, self.mark = (rank, world_size, local_rank), mark
        self.launcher = cfg.trainer.launcher

    def init_distributed(self, addr, port):
        self.rendezvous = (addr, port)

    def rendezvous_address(self):
        return "127.0.0.1", 12345

    def describe(self, *args, **kwargs):
        import torch

        return {"placed": self.placed, "pid": os.getpid(), "args": args, "kwargs": kwargs, "launcher": self.launcher,
                "rendezvous": self.rendezvous, "threads": torch.get_num_threads(),
                "env": {k: os.environ.get(k) for k in ("QWEN35RL_TEST_VAR", "OMP_NUM_THREADS", "MY_HW_VAR")},
                "sigint": signal.getsignal(signal.SIGINT) == signal.SIG_IGN}

    def fail_on(self, rank):
        if self.placed[0] == rank:
            raise RuntimeError("NaN in the engine")
        time.sleep(0.2)
        return self.placed[0]

    def die_on(self, rank):
        if self.placed[0] == rank:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.placed[0]

    def unsendable(self):
        return lambda: None

    def shutdown(self):
        if self.mark:
            Path(self.mark, f"shutdown-{self.placed[0]}").write_text("ok")


def _group(*overrides, **kwargs):
    run = resolve_run(compose([*LOCAL, *overrides]))
    return ProcessWorkerGroup.create(run, resolve_platform(run.cfg), Recorder, run.layout.world, **kwargs)


def test_workers_answer_in_rank_order_from_their_own_processes(monkeypatch, tmp_path):
    monkeypatch.setenv("QWEN35RL_TEST_VAR", "from the driver")
    started = []
    wg = _group("hw.devices_per_node=3", "+hw.env.MY_HW_VAR=from-hw", on_started=lambda: started.append(1),
                mark=str(tmp_path))
    try:
        assert wg.world == 3 and started == [1]
        got = wg.start("describe", [(r,) for r in range(3)], {"k": 5}).wait()
        assert [g["placed"] for g in got] == [(0, 3, 0), (1, 3, 1), (2, 3, 2)]
        assert [g["args"] for g in got] == [(0,), (1,), (2,)] and all(g["kwargs"] == {"k": 5} for g in got)
        pids = [g["pid"] for g in got]
        assert len(set(pids)) == 3 and os.getpid() not in pids
        assert [w["pid"] for w in wg.where] == pids  # what a failure block names
        assert all(g["rendezvous"] == ("127.0.0.1", 12345) for g in got)  # rank 0's address, joined by all
        assert all(g["launcher"] == "local" for g in got)  # the run's typed config, as is
        # the driver's environment, hw.env for what it does not set, one torch thread each as under Ray
        assert all(g["env"] == {"QWEN35RL_TEST_VAR": "from the driver", "OMP_NUM_THREADS": os.environ["OMP_NUM_THREADS"],
                                "MY_HW_VAR": "from-hw"} for g in got)
        assert all(g["threads"] == int(os.environ["OMP_NUM_THREADS"]) for g in got)
        assert all(g["sigint"] for g in got)  # Ctrl-C is the driver's to handle
        assert wg.start("describe", [("only",)], ranks=[1]).wait()[0]["args"] == ("only",)
        with pytest.raises(ValueError, match="2 shares for 3 workers"):
            wg.start("describe", [(), ()])
    finally:
        wg.shutdown()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shutdown-0", "shutdown-1", "shutdown-2"]
    assert [p.exitcode for p in wg.procs] == [0, 0, 0]


def test_a_failing_rank_is_named_at_once_and_every_worker_is_killed():
    wg = _group()
    try:
        with pytest.raises(WorkerFailure) as e:
            wg.start("fail_on", [(1,)] * 2).wait()
        assert e.value.rank == 1 and e.value.method == "fail_on"
        assert "RuntimeError: NaN in the engine" in e.value.cause and "Traceback" in e.value.detail
        assert e.value.where["pid"] == wg.procs[1].pid
    finally:
        wg.shutdown()
    assert all(p.exitcode is not None for p in wg.procs)


def test_a_worker_that_dies_is_named_with_its_signal():
    wg = _group()
    try:
        with pytest.raises(WorkerFailure) as e:
            wg.start("die_on", [(0,)] * 2).wait()
        assert e.value.rank == 0 and "its process died (killed by SIGKILL)" in e.value.cause
        with pytest.raises(WorkerFailure):  # the group knows it is broken: no call waits on the dead rank
            wg.start("describe", [()] * 2).wait()
    finally:
        wg.shutdown()


def test_a_result_that_cannot_be_sent_fails_the_call_not_the_worker():
    wg = _group()
    try:
        with pytest.raises(WorkerFailure, match="cannot be sent to the driver"):
            wg.start("unsendable", [()] * 2).wait()
    finally:
        wg.shutdown()


def test_a_worker_that_fails_to_start_is_said_and_the_others_stop():
    with pytest.raises(WorkerFailure) as e:
        _group(fail_init=True)
    assert e.value.rank == 1 and e.value.method == "start-up"
    assert e.value.cause == "failed to start (ValueError: no such checkpoint)"


def test_split_and_several_nodes_are_refused_before_any_worker_starts():
    run = resolve_run(compose(LOCAL))
    with pytest.raises(ClusterError, match="trainer.launcher=ray"):
        ProcessWorkerGroup.create_pools(run, resolve_platform(run.cfg), [])


def test_workers_end_with_their_driver():
    """A driver killed without shutting its workers down: they find its lifeline closed and exit."""
    script = textwrap.dedent("""
        import os, sys
        from qwen35rl.config.compose import compose
        from qwen35rl.config.resolved import resolve_run
        from qwen35rl.runtime.local_processes import ProcessWorkerGroup
        from qwen35rl.runtime.platform import resolve_platform
        from tests.runtime.test_local_processes import Recorder

        if __name__ == "__main__":
            run = resolve_run(compose(["trainer.launcher=local"]))
            wg = ProcessWorkerGroup.create(run, resolve_platform(run.cfg), Recorder, 2)
            print(" ".join(str(w["pid"]) for w in wg.where), flush=True)
            os.kill(os.getpid(), 9)
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=scaled(120))
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 2, out.stderr
    deadline = time.monotonic() + scaled(60)
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids)


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# ------------------------------------------------------------------------------------------------- auto
@pytest.mark.parametrize("overrides, env, expected", [
    ([], {}, ("local", "one CPU host, colocated, no Ray cluster named")),
    (["hw.nodes=2"], {}, ("ray", "2 nodes")),
    (["hw=gpu_1x"], {}, ("ray", "cuda devices, which Ray assigns to the workers")),
    (["placement=split", "hw.devices_per_node=4"], {}, ("ray", "placement=split places its pools as Ray actors")),
    (["ray_address=head:6379"], {}, ("ray", "ray_address names a cluster")),
    (["hw.ray_runtime_env.py_executable=/opt/venv/bin/python"], {},
     ("ray", "hw.ray_runtime_env asks Ray for the workers' interpreter")),
    ([], {"RAY_ADDRESS": "head:6379"}, ("ray", "RAY_ADDRESS names a cluster")),
])
def test_auto_is_local_only_for_a_colocated_run_of_this_hosts_cpus(monkeypatch, overrides, env, expected):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    cfg = compose(overrides)
    assert cfg.trainer.launcher == "auto" and auto_choice(cfg) == expected
    assert resolve_run(cfg).cfg.trainer.launcher == expected[0] == launcher_of(cfg)  # concrete from here on
    assert launcher_of(compose([*overrides, "trainer.launcher=ray"])) == "ray"


def test_the_server_preloads_the_run_s_engines():
    assert preloads(resolve_run(compose([])))[:2] == ["torch", "qwen35rl.runtime.worker"]
    assert {"qwen35rl.engines.fsdp_engine", "qwen35rl.engines.hf_rollout"} <= set(preloads(resolve_run(compose([]))))


def test_local_processes_and_ray_train_the_same_numbers(tmp_path):
    """The embedded default's first two steps through local processes and through Ray: every metric but timings
    and memory identical (the same seeds, one torch thread per worker in both)."""
    runs = {}
    for launcher in ("local", "ray"):
        run_dir = tmp_path / launcher
        out = subprocess.run(
            [sys.executable, "-m", "qwen35rl.cli.train", f"hydra.run.dir={run_dir}", "trainer.total_steps=2",
             "trainer.export_hf=false", "trainer.test_freq=-1", f"trainer.launcher={launcher}"],
            cwd=ROOT, capture_output=True, text=True, timeout=scaled(300),
            env={**os.environ, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"})
        assert out.returncode == 0, out.stderr[-3000:]
        runs[launcher] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    skip = ("timing", "perf/", "time", "memory")
    for local, ray in zip(*runs.values()):
        numbers = {k: v for k, v in local.items() if not any(s in k for s in skip)}
        assert len(numbers) > 20 and numbers == {k: ray[k] for k in numbers}
