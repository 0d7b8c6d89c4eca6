"""Faults in the middle of a run, as `qwen35rl-train` meets them: each ends in a bounded, named stop that loses
nothing. Damaged and incomplete checkpoints are moved aside and named, never resumed from or overwritten; a hung
reward function is cut off, counted and, hung for good, stops the run; SIGTERM stops a run within seconds even
while the reward hangs, naming the last checkpoint; a full disk is one block with the path and the free space."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qwen35rl.runtime.checkpoint import verify
from qwen35rl.runtime.tracking import read_metrics
from tests.load import scaled

_SCRIPT = Path(sys.executable).parent / "qwen35rl-train"
TRAIN = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "qwen35rl.cli.train"]
LOCAL = ["trainer.launcher=local", "hw.devices_per_node=1"]
SMALL = ["data.train_batch_size=4", "rollout.n=4", "algorithm.mini_batch_size=2",
         "backend.micro_batch_size_per_device=4", "trainer.test_freq=-1"]
ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def train(cwd, *overrides, timeout=300):
    """`qwen35rl-train` in `cwd` (run directory `run/`), the tests' reward helpers importable."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([*TRAIN, "hydra.run.dir=run", *SMALL, *overrides], capture_output=True, text=True,
                          cwd=cwd, timeout=scaled(timeout), env=env)


def _ok(proc):
    assert proc.returncode == 0, proc.stderr[-4000:]


# ------------------------------------------------------------------------------------------------ checkpoints
def test_damaged_and_incomplete_checkpoints_are_moved_aside_named_and_never_overwritten(tmp_path):
    """step_3 loses its meta.json (an unfinished copy), step_2 a shard's tail: the next launch names both, moves
    them aside whole, resumes from step_1 and writes new step_2 / step_3 beside them."""
    ckpts = tmp_path / "run" / "checkpoints"
    _ok(train(tmp_path, *LOCAL, "trainer.total_steps=3", "trainer.save_freq=1", "trainer.max_keep_checkpoints=0"))
    (ckpts / "step_3" / "meta.json").unlink()
    shard = max((ckpts / "step_2" / "model").glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    before = {step: sorted(str(p.relative_to(ckpts / step)) for p in (ckpts / step).rglob("*"))
              for step in ("step_2", "step_3")}

    proc = train(tmp_path, *LOCAL, "trainer.total_steps=4", "trainer.save_freq=1", "trainer.max_keep_checkpoints=0")
    _ok(proc)
    aside = {p.name.split(".")[0]: p for p in ckpts.glob("*.incomplete-*")}
    assert sorted(aside) == ["step_2", "step_3"]
    for step, files in before.items():  # kept whole, as they were
        assert sorted(str(p.relative_to(aside[step])) for p in aside[step].rglob("*")) == files
    err = proc.stderr
    assert (f"[qwen35rl] warning: checkpoint run/checkpoints/step_3 skipped: no meta.json (a copy made in part, or "
            f"its meta.json deleted); moved aside to run/checkpoints/{aside['step_3'].name} (kept, not deleted)") in err
    assert (f"[qwen35rl] warning: checkpoint run/checkpoints/step_2 skipped: model/{shard.name} is "
            f"{(aside['step_2'] / 'model' / shard.name).stat().st_size} bytes, ") in err
    assert f"moved aside to run/checkpoints/{aside['step_2'].name} (kept, not deleted)" in err
    assert "resuming from run/checkpoints/step_1 (step 1 of 4)" in err
    assert err.index("step_3 skipped") < err.index("step_2 skipped") < err.index("resuming from")
    for step in (1, 2, 3, 4):
        assert verify(ckpts / f"step_{step}") is None
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3, 4]
