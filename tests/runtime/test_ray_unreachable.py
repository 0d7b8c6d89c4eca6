"""A `ray_address` (or RAY_ADDRESS) where no Ray cluster answers stops `qwen35rl-train` in seconds with exit 3,
naming the address and the fix (ray.init would wait for minutes, uninterruptibly); a live cluster passes the
same check."""
import os

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import socket
import socketserver
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from qwen35rl.exit_codes import EXIT_PREFLIGHT
from qwen35rl.runtime import ray_reach
from qwen35rl.runtime.cluster import ClusterError, connect, unreachable_cluster
from tests.load import scaled

_SCRIPT = Path(sys.executable).parent / "qwen35rl-train"
TRAIN = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "qwen35rl.cli.train"]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Http(socketserver.BaseRequestHandler):
    def handle(self):
        self.request.recv(1024)
        self.request.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")


@pytest.fixture
def http_port():
    """A port where something that is not Ray listens (an HTTP server)."""
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Http)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def train(run_dir, *overrides, ray_address_env=None):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    if ray_address_env:
        env["RAY_ADDRESS"] = ray_address_env
    t0 = time.monotonic()
    proc = subprocess.run([*TRAIN, f"hydra.run.dir={run_dir}", "trainer.total_steps=1", *overrides],
                          capture_output=True, text=True, timeout=scaled(300), env=env)
    return proc, time.monotonic() - t0


def test_a_closed_port_stops_train_in_seconds_naming_the_address_and_the_fix(tmp_path):
    port = closed_port()
    proc, took = train(tmp_path / "run", f"ray_address=127.0.0.1:{port}")
    assert proc.returncode == EXIT_PREFLIGHT, proc.stderr[-3000:]
    assert (f"[qwen35rl] error: [ray_unreachable] ray_address=127.0.0.1:{port}: no Ray cluster answers there: "
            f"nothing listens on port {port} of 127.0.0.1 (connection refused); nothing was started") in proc.stderr
    assert f"fix:   start Ray on that node first (`ray start --head --port={port}`" in proc.stderr
    assert "or correct ray_address" in proc.stderr and "Traceback" not in proc.stderr
    assert "libraries imported" not in proc.stderr  # said before torch and Ray are even imported
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "metrics.jsonl").exists()
    assert took < scaled(30), f"{took:.1f} s"  # seconds, where ray.init waits for minutes


def test_another_service_on_the_port_of_ray_address_is_named_as_such(tmp_path, http_port):
    proc, _ = train(tmp_path / "run", ray_address_env=f"127.0.0.1:{http_port}")
    assert proc.returncode == EXIT_PREFLIGHT, proc.stderr[-3000:]
    assert f"[ray_unreachable] RAY_ADDRESS=127.0.0.1:{http_port}: no Ray cluster answers there: port {http_port} of " \
           f"127.0.0.1 answers, but not as a Ray cluster does" in proc.stderr
    assert "(ray_address, when set, takes precedence over RAY_ADDRESS)" in proc.stderr


def test_what_each_address_says():
    port = closed_port()
    assert "nothing listens on port" in ray_reach.unreachable(f"127.0.0.1:{port}")
    assert "nothing listens on port" in ray_reach.unreachable(f"ray://127.0.0.1:{port}")
    assert "does not resolve" in ray_reach.unreachable("no-such-host.invalid:6379")
    assert ray_reach.unreachable("auto") is None and ray_reach.host_port("auto") is None
    assert ray_reach.host_port("ray://head-0:10001") == ("head-0", 10001)
    assert ray_reach.host_port("[::1]:6379") == ("::1", 6379)
    problem = ray_reach.ray_address_problem(f"ray://127.0.0.1:{port}", "ray_address")
    assert "ray start --head --ray-client-server-port=" in problem and "its Ray Client port" in problem


def test_an_unreachable_cluster_is_a_cluster_error_before_ray_init(monkeypatch):
    import ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = OmegaConf.create({"ray_address": f"127.0.0.1:{closed_port()}"})
    with pytest.raises(ClusterError, match=r"\[ray_unreachable\] ray_address=127\.0\.0\.1:\d+: no Ray cluster"):
        connect(cfg, None, 1)
    assert not ray.is_initialized()
    assert unreachable_cluster(OmegaConf.create({"ray_address": None})) is None  # a local cluster: nothing to ask


@pytest.mark.slow
def test_a_live_cluster_answers(monkeypatch):
    import ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ctx = ray.init(num_cpus=1, include_dashboard=False, configure_logging=False)
    try:
        address = ctx.address_info["gcs_address"]
        assert ray_reach.unreachable(address) is None
        assert unreachable_cluster(OmegaConf.create({"ray_address": address})) is None
    finally:
        ray.shutdown()
