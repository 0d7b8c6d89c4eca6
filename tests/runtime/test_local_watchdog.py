"""The local cluster watchdog's stop step while processes vanish under it (Ray's own fate sharing takes raylet and
GCS down at the same moment the watchdog freezes them)."""
import os
import select
import signal
import subprocess

import pytest

from qwen35rl.runtime import local_watchdog as wd


def exits(pidfd, timeout=30):
    """Whether the process behind `pidfd` exits. kill() returns once SIGKILL is queued; the target dies when it
    next runs, which on a busy machine is after the caller looks at /proc. A pidfd becomes readable on exit."""
    return bool(select.select([pidfd], [], [], timeout)[0])


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


def test_stop_takes_in_children_started_before_the_freeze_and_spares_a_reused_pid():
    # the shell prints the child's pid after fork() returned: the child is in the process table from then on
    parent = subprocess.Popen(["sh", "-c", "sleep 60 >/dev/null & echo $!; wait"], stdout=subprocess.PIPE)
    try:
        grandchild = os.pidfd_open(int(parent.stdout.readline()))   # pins the process: no pid reuse in between
        try:
            bystander = subprocess.Popen(["sleep", "60"])
            try:
                wrong_start = b"0"                          # same pid, another process: not ours to touch
                assert wd.stop({parent.pid: wd.stat(parent.pid)[1], bystander.pid: wrong_start}) == 2
                assert parent.wait(timeout=30) == -signal.SIGKILL
                assert exits(grandchild)
                assert bystander.poll() is None
            finally:
                bystander.kill()
                bystander.wait()
        finally:
            os.close(grandchild)
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()
