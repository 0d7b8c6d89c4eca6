"""The processes of a run started in its own session (driver, local Ray, workers, reward workers), read from /proc:
for tests and benchmarks that kill a run and check what is left."""
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import List, Sequence

from tests.load import scaled


def session_pids(sid: int) -> List[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    out.append(int(entry))
            except (ProcessLookupError, PermissionError):
                pass
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def workers_of(driver: int) -> List[int]:
    """The training workers of a run started in its own session: Ray's PolicyWorker actors, or the local worker
    processes (named qwen35rl-rank<N>)."""
    pids = session_pids(driver)
    ray = [p for p in pids if cmdline(p).startswith("ray::") and "PolicyWorker" in cmdline(p)]
    return ray or [p for p in pids if comm(p).startswith("qwen35rl-rank")]


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def kill_after_checkpoint(cmd: Sequence[str], run_dir: Path, step: int) -> None:
    """Start `cmd` (a training run into `run_dir`) in its own session; SIGKILL the whole session (driver, Ray,
    workers) once the step's checkpoint is committed."""
    proc = subprocess.Popen(list(cmd), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=dict(os.environ))
    marker = Path(run_dir) / "checkpoints" / f"step_{step}" / "meta.json"
    deadline = time.monotonic() + scaled(600)
    try:
        while not marker.exists():
            assert proc.poll() is None, f"run ended before its step-{step} checkpoint: {proc.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, "no checkpoint before the deadline"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stderr.close()
