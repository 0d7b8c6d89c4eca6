"""The local cluster watchdog's stop step while processes vanish under it (Ray's own fate sharing takes raylet and
GCS down at the same moment the watchdog freezes them)."""
import signal
import subprocess

import pytest

from qwen35rl.runtime import local_watchdog as wd


def dead(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except OSError:
        return True


@pytest.fixture
def child():
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_frozen_process_missing_from_the_table_is_still_killed(child, monkeypatch):
    start = wd.stat(child.pid)[1]
    monkeypatch.setattr(wd, "table", lambda: {})       # gone from /proc between the freeze and the look
    assert wd.stop({child.pid: start}) == 1
    assert child.wait(timeout=30) == -signal.SIGKILL


def test_what_was_frozen_is_killed_even_when_a_step_fails(child, monkeypatch):
    def broken():
        raise RuntimeError("proc unreadable")
    monkeypatch.setattr(wd, "table", broken)
    with pytest.raises(RuntimeError):
        wd.stop({child.pid: wd.stat(child.pid)[1]})
    assert child.wait(timeout=30) == -signal.SIGKILL


def test_stop_takes_in_children_started_before_the_freeze_and_spares_a_reused_pid(tmp_path):
    parent = subprocess.Popen(["sh", "-c", "sleep 60 & echo $! > " + str(tmp_path / "pid") + "; wait"])
    try:
        for _ in range(300):
            if (tmp_path / "pid").exists() and (tmp_path / "pid").read_text().strip():
                break
            subprocess.run(["sleep", "0.01"])
        grandchild = int((tmp_path / "pid").read_text())
        bystander = subprocess.Popen(["sleep", "60"])
        try:
            wrong_start = b"0"                          # same pid, another process: not ours to touch
            assert wd.stop({parent.pid: wd.stat(parent.pid)[1], bystander.pid: wrong_start}) == 2
            assert parent.wait(timeout=30) == -signal.SIGKILL
            assert dead(grandchild)
            assert bystander.poll() is None
        finally:
            bystander.kill()
            bystander.wait()
    finally:
        parent.kill()
        parent.wait()
