"""The local cluster watchdog's stop step while processes vanish under it (Ray's own fate sharing takes raylet and
GCS down at the same moment the watchdog freezes them)."""
import os
import select
import signal
import subprocess
import sys

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


# A parent that stays inside one fork-like call until the test lets it out: posix_spawn() (clone with CLONE_VFORK)
# returns only once the child has exec'ed, and the child first opens two FIFOs for reading, each blocking until a
# writer comes. Signals, SIGSTOP included, are acted on when the call returns.
SPAWNER = """
import os, sys
a, b = sys.argv[1:]
os.posix_spawn("/bin/sleep", ["sleep", "60"], os.environ, file_actions=[
    (os.POSIX_SPAWN_OPEN, 5, a, os.O_RDONLY, 0), (os.POSIX_SPAWN_OPEN, 6, b, os.O_RDONLY, 0)])
os.read(0, 1)
"""


def session_pids(sid):
    out = []
    for e in os.listdir("/proc"):
        try:
            with open(f"/proc/{e}/stat", "rb") as f:
                if e.isdigit() and int(f.read().rsplit(b")", 1)[1].split()[3]) == sid:
                    out.append(int(e))
        except (OSError, IndexError, ValueError):
            pass
    return out


def kill_all(pids):
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def all_exit(pids, timeout=30):
    """Whether every one of `pids` exits (or is already gone) within `timeout` seconds in all."""
    fds = []
    try:
        for p in pids:
            try:
                fds.append(os.pidfd_open(p))
            except ProcessLookupError:
                pass
        waiting = list(fds)
        while waiting:
            ready = select.select(waiting, [], [], timeout)[0]
            if not ready:
                return False
            waiting = [fd for fd in waiting if fd not in ready]
        return True
    finally:
        for fd in fds:
            os.close(fd)


@pytest.mark.timeout(120)
def test_stop_reads_the_table_only_once_a_process_caught_inside_a_fork_has_stopped(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    os.mkfifo(a)
    os.mkfifo(b)
    parent = subprocess.Popen([sys.executable, "-c", SPAWNER, str(a), str(b)], stdin=subprocess.PIPE,
                              start_new_session=True)
    seen, released = [], []
    try:
        os.close(os.open(a, os.O_WRONLY))       # returns once the child opened `a`: the parent is inside the call
        real_kill, real_table = wd.kill, wd.table

        def kill(pids, sig):
            real_kill(pids, sig)
            if sig == signal.SIGSTOP and parent.pid in pids:
                os.close(os.open(b, os.O_WRONLY))   # the SIGSTOP is pending; now let the call finish
                released.append(True)

        def table():
            seen.append(wd.thread_states(parent.pid))
            return real_table()

        monkeypatch.setattr(wd, "kill", kill)
        monkeypatch.setattr(wd, "table", table)
        n = wd.stop({parent.pid: wd.stat(parent.pid)[1]})
        assert released and seen
        assert seen[0] and all(s == b"T" for s in seen[0]), f"process table read while the parent was {seen[0]}"
        assert n == 2                           # the parent and the child its call started
        assert parent.wait(timeout=30) == -signal.SIGKILL
        assert all_exit(session_pids(parent.pid))
    finally:
        kill_all(session_pids(parent.pid))
        parent.wait()
        parent.stdin.close()


FORKER = """
import os, signal
while True:
    if os.fork() == 0:
        signal.pause()
        os._exit(0)
    os.write(1, b"+")
"""


@pytest.mark.timeout(120)
def test_no_child_of_a_parent_forking_without_pause_is_left_running():
    for _ in range(3):
        forker = subprocess.Popen([sys.executable, "-c", FORKER], stdout=subprocess.PIPE, start_new_session=True)
        try:
            assert len(forker.stdout.read(5)) == 5  # five children started, more on the way
            assert wd.stop({forker.pid: wd.stat(forker.pid)[1]}) >= 6
            assert forker.wait(timeout=30) == -signal.SIGKILL
            left = session_pids(forker.pid)
            assert all_exit(left), f"still running after stop: {left}"
        finally:
            kill_all(session_pids(forker.pid))
            forker.wait()
            forker.stdout.close()
