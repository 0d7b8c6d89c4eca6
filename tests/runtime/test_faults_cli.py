"""Faults in the middle of a run, as `qwen35rl-train` meets them: each ends in a bounded, named stop that loses
nothing. Damaged and incomplete checkpoints are moved aside and named, never resumed from or overwritten; a hung
reward function is cut off, counted and, hung for good, stops the run; SIGTERM stops a run within seconds even
while the reward hangs, naming the last checkpoint; a full disk is one block with the path and the free space."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import errno
import io
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


def _env(**extra):
    """The test's environment with the tests' reward helpers importable (and no cluster to join)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           **extra}
    env.pop("RAY_ADDRESS", None)
    return env


def train(cwd, *overrides, timeout=300):
    """`qwen35rl-train` in `cwd` (run directory `run/`)."""
    return subprocess.run([*TRAIN, "hydra.run.dir=run", *SMALL, *overrides], capture_output=True, text=True,
                          cwd=cwd, timeout=scaled(timeout), env=_env())


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


# ---------------------------------------------------------------------------------------------------- rewards
def test_a_hung_reward_function_costs_seconds_a_step_is_counted_and_stops_the_run(tmp_path):
    """The tiny default's batches (8 prompts x 16 responses) with a reward that hangs on every call and the default
    data.reward_timeout_s: each step gives up on it after its first calls (not one limit per response: 64 x 5 s on
    two reward workers), scores 0, counts every response in reward/timeout, says so, and the run stops with exit 5
    after data.reward_failure_window steps, with the last checkpoint named."""
    from qwen35rl.exit_codes import EXIT_REWARD_FAILURE

    proc = subprocess.run([*TRAIN, "hydra.run.dir=run", *LOCAL, "trainer.total_steps=10", "trainer.save_freq=1",
                           "trainer.test_freq=-1", "data.reward=tests.rewards.reward_helpers:always_hangs"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=scaled(900), env=_env())
    err = proc.stderr
    assert proc.returncode == EXIT_REWARD_FAILURE, err[-4000:]
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["reward/timeout"] == 128 and r["critic/score/mean"] == 0 for r in rows)
    assert all(r["timing_s/reward"] < 100 for r in rows), [r["timing_s/reward"] for r in rows]
    hung = [line for line in err.splitlines() if "the reward function looks hung" in line]
    assert len(hung) == 3 and "ran past data.reward_timeout_s=5 s and none returned" in hung[0], hung
    assert "responses score 0 without being run (counted in reward/timeout)" in hung[0]
    assert ("[qwen35rl] error: the reward function failed too often: the run stopped (exit code 5)\n"
            "  what:  the reward function (tests.rewards.reward_helpers:always_hangs) failed on 384 of 384 "
            "responses (100%) over steps 1-3") in err
    # the step that fills the window stops before its checkpoint
    assert "last complete checkpoint: run/checkpoints/step_2 (step 2)" in err and "Traceback" not in err


# ------------------------------------------------------------------------------------------------- SIGTERM
def _wait_for(path: Path, proc, err: Path, what: str):
    deadline = time.monotonic() + scaled(600)
    while not path.exists():
        assert proc.poll() is None, f"ended before {what}: {err.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what}"
        time.sleep(0.05)


def test_sigterm_while_the_reward_hangs_stops_the_run_within_seconds_naming_the_last_checkpoint(tmp_path):
    """Through Ray, as the default: step 1 checkpoints, then the reward function hangs (limit 600 s: neither the
    limit nor the hung-reward cut ends it soon). SIGTERM: the step cannot finish within trainer.stop_timeout_s (10 s),
    so it is abandoned; the run exits 143 within seconds, says why and which checkpoint the same command resumes
    from, and leaves no process behind (hung reward workers included)."""
    from tests.processes import cmdline, session_pids

    flag, err = tmp_path / "hang", tmp_path / "stderr.txt"
    proc = subprocess.Popen([*TRAIN, "hydra.run.dir=run", "hw.devices_per_node=2", *SMALL, "trainer.total_steps=100",
                             "trainer.save_freq=1", "data.reward_timeout_s=600",
                             "data.reward=tests.rewards.reward_helpers:hang_when_told"],
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=open(err, "w"), start_new_session=True,
                            env=_env(QWEN35RL_TEST_HANG=str(flag)))
    try:
        _wait_for(tmp_path / "run" / "checkpoints" / "step_1" / "meta.json", proc, err, "step-1 checkpoint")
        flag.touch()
        _wait_for(Path(f"{flag}.hanging"), proc, err, "hanging reward")
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=scaled(120))  # a bound on a hang; the number that counts is below
        except subprocess.TimeoutExpired:
            pytest.fail(f"the run did not stop within {scaled(120):.0f} s of SIGTERM")
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = err.read_text()
    assert proc.returncode == 128 + signal.SIGTERM, text[-3000:]
    assert took < scaled(30), f"{took:.1f} s from SIGTERM to exit"
    last = max(int(p.name.split("_")[1]) for p in (tmp_path / "run" / "checkpoints").glob("step_*"))
    assert verify(tmp_path / "run" / "checkpoints" / f"step_{last}") is None
    assert "SIGTERM received: finishing the current step and checkpointing it if that takes at most 10 s" in text
    assert (f"[qwen35rl] stopped in training step {last + 1} of 100 (exit code 143): SIGTERM, and the step did not "
            f"finish within 10 s (trainer.stop_timeout_s); what it did is not kept, the same command resumes from "
            f"the last checkpoint, run/checkpoints/step_{last} (step {last})") in text
    assert "Traceback" not in text
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == list(range(1, last + 1))
    deadline = time.monotonic() + scaled(15)
    while session_pids(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = {pid: cmdline(pid) for pid in session_pids(proc.pid)}
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left behind: {left}"


def test_sigterm_during_start_up_stops_at_once_naming_where_to_resume(tmp_path):
    err = tmp_path / "stderr.txt"
    proc = subprocess.Popen([*TRAIN, "hydra.run.dir=run", *LOCAL, "trainer.total_steps=100"], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=open(err, "w"), start_new_session=True, env=_env())
    try:
        deadline = time.monotonic() + scaled(300)
        while "config + plan checked" not in err.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=scaled(120))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = err.read_text()
    assert proc.returncode == 128 + signal.SIGTERM, text[-3000:]
    assert "[qwen35rl] stopped by SIGTERM during start-up (" in text
    assert "(exit code 143); no checkpoint yet: the same command starts again at step 0" in text
    assert "Traceback" not in text and not (tmp_path / "run" / "metrics.jsonl").exists()


# ------------------------------------------------------------------------------------------------ full disk
class _FullDisk(io.TextIOBase):
    """A log file on a full disk: every write fails with ENOSPC."""

    def write(self, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self):
        pass


def test_a_full_disk_through_the_command_is_one_block_with_the_path_and_the_free_space(tmp_path, monkeypatch, capfd):
    """qwen35rl-train in this process (its console script's main), the disk filling up while step 2's checkpoint is
    written: train.log and curves.png cannot be written either from then on. Exit 6 and one block on stderr (what could not be
    written, the free space, the last complete checkpoint); no traceback, no logging error; nothing written before
    is lost."""
    import logging

    from qwen35rl.cli.train import main
    from qwen35rl.exit_codes import EXIT_DISK_FULL
    from qwen35rl.runtime import checkpoint as ckpt
    from qwen35rl.runtime import tracking

    monkeypatch.chdir(tmp_path)
    real = ckpt.save_trainer_state

    def save_trainer_state(path, state):
        if state["step"] == 2:
            for handler in logging.getLogger().handlers:
                if isinstance(handler, logging.FileHandler):
                    handler.stream = _FullDisk()
            raise OSError(errno.ENOSPC, "No space left on device", str(Path(path) / "trainer_state.pt"))
        real(path, state)

    def plot_curves(rows, out):  # curves.png: the disk is still full at the end
        raise OSError(errno.ENOSPC, "No space left on device", str(out))

    monkeypatch.setattr(ckpt, "save_trainer_state", save_trainer_state)
    monkeypatch.setattr(tracking, "plot_curves", plot_curves)
    code = main(["hydra.run.dir=run", *LOCAL, *SMALL, "trainer.total_steps=3", "trainer.save_freq=1"])
    err = capfd.readouterr().err
    assert code == EXIT_DISK_FULL, err[-3000:]
    assert "Traceback" not in err and "Logging error" not in err, err[-3000:]
    block = err[err.index("[qwen35rl] error: no space left on device: the run stopped (exit code 6)"):]
    lines = block.splitlines()
    assert lines[1].startswith("  could not write:          checkpoint step_2: ")
    assert lines[1].endswith("/run/checkpoints/.tmp-step_2-%d/trainer_state.pt" % os.getpid())
    assert lines[2].startswith("  free space:               ") and " free of " in lines[2]
    assert lines[2].endswith(f"on the file system of {tmp_path / 'run'}")
    assert lines[3] == (f"  last complete checkpoint: {tmp_path / 'run' / 'checkpoints' / 'step_1'} (step 1); free some "
                        f"space and run the same command again: it resumes from there")
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_1"]
    assert verify(tmp_path / "run" / "checkpoints" / "step_1") is None
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2]
