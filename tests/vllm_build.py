"""tests/vllm_env.sh as a background job of the test session. The build is mostly downloads and unpacking, so it
starts as soon as collection has selected the vllm suite (`conftest.pytest_collection_modifyitems`) and overlaps the
CPU-bound tests before it; `test_vllm_suite` waits for it. A session that ends first stops it (the environment then
has no stamp, and the next build starts from scratch)."""
from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path
from typing import Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
_job: Optional[Tuple[subprocess.Popen, Path]] = None


def build_env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    return env


def start() -> None:
    """Start the build once per session, at low priority, its output in a log file."""
    global _job
    if _job is not None:
        return
    log = Path(tempfile.mkstemp(prefix="qwen35rl-vllm-env-", suffix=".log")[1])
    with log.open("w") as out:
        proc = subprocess.Popen(["nice", "-n", "10", "bash", str(ROOT / "tests" / "vllm_env.sh")], cwd=ROOT,
                                env=build_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    _job = (proc, log)


def wait(timeout: float) -> Tuple[int, str]:
    """The build's exit code and output (starting it now if nothing did)."""
    start()
    proc, log = _job
    proc.wait(timeout=timeout)
    return proc.returncode, log.read_text()


def stop() -> None:
    """End a build still running (the session is over); nothing when none was started."""
    if _job is not None and _job[0].poll() is None:
        _job[0].terminate()
        try:
            _job[0].wait(timeout=30)
        except subprocess.TimeoutExpired:
            _job[0].kill()
