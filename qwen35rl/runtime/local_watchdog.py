"""The watchdog of a local Ray cluster, run as its own small process (`python -I -S local_watchdog.py DRIVER POLL_S`).

Stdlib only and run by path in isolated mode (its folder, which holds a `platform.py`, stays off the path), so it
starts in milliseconds and imports nothing of the project. It keeps a list of the driver's descendants; when the
driver's pipe closes or its pid is gone, it freezes and kills those still running. A process takes a SIGSTOP only when it
next leaves the kernel: one in the middle of a fork() when the signal lands finishes the fork first, and its new child
runs free. So the process table is read for new children only once every thread of every frozen process has stopped. Processes vanish while it works (Ray's raylet and GCS go down with the driver by themselves): every step
tolerates a pid that is gone, and whatever it froze is killed even if a step fails.
"""
import os
import select
import signal
import sys
import time

ME = os.getpid()


def stat(pid):
    """(ppid, start time) of a live pid, or None; the start time tells a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            rest = f.read().rsplit(b")", 1)[1].split()
        return int(rest[1]), rest[19]
    except (OSError, IndexError, ValueError):
        return None


def table():
    out = {}
    for e in os.listdir("/proc"):
        if e.isdigit() and int(e) != ME:
            st = stat(int(e))
            if st:
                out[int(e)] = st
    return out


def descendants(roots, procs):
    """`roots` and every process below them in `procs` (pid -> (ppid, start))."""
    found, frontier = set(), set(roots)
    while frontier:
        found |= frontier
        frontier = {p for p, (ppid, _) in procs.items() if ppid in frontier and p not in found}
    return found


def alive(pid, start):
    st = stat(pid)
    return st is not None and st[1] == start


def kill(pids, sig):
    for p in pids:
        try:
            os.kill(p, sig)
        except OSError:
            pass


FREEZE_WAIT_S = 5.0    # a process in uninterruptible sleep stops only when it wakes: after this, go on without it


def thread_states(pid):
    """The states (b"R", b"S", b"T", ...) of the threads of `pid`, or None if it is gone. A thread that exits while
    being read counts as b"X" (dead)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    states = []
    for t in tids:
        try:
            with open(f"/proc/{pid}/task/{t}/stat", "rb") as f:
                states.append(f.read().rsplit(b")", 1)[1].split()[0])
        except (OSError, IndexError):
            states.append(b"X")
    try:
        if sorted(os.listdir(f"/proc/{pid}/task")) != sorted(tids):
            states.append(b"R")                        # a thread started meanwhile: look again
    except OSError:
        return None
    return states


def frozen(pid, start):
    """Whether the process can start nothing any more: gone, a zombie, or every one of its threads stopped (a
    thread stops only outside a system call, so no fork() of it is half done)."""
    if not alive(pid, start):
        return True
    states = thread_states(pid)
    return states is None or all(s in b"TtZX" for s in states)


def wait_frozen(pids, limit_s=None):
    """Wait until every process in `pids` (pid -> start) is `frozen`, at most `limit_s` (FREEZE_WAIT_S); returns
    those that are not."""
    deadline = time.monotonic() + (FREEZE_WAIT_S if limit_s is None else limit_s)
    delay = 0.0005
    while True:
        pids = {p: s for p, s in pids.items() if not frozen(p, s)}
        if not pids or time.monotonic() >= deadline:
            return pids
        time.sleep(delay)
        delay = min(2 * delay, 0.05)


def stop(pids):
    """Freeze `pids` (pid -> start) and the children they started before they stopped (a stopped process starts
    nothing new), round after round until a look at the process table finds nothing new, then kill them all;
    returns how many it stopped."""
    stopped = {}
    try:
        while True:
            new = {p: s for p, s in pids.items() if p not in stopped and alive(p, s)}
            if not new:
                break
            kill(new, signal.SIGSTOP)
            stopped.update(new)
            wait_frozen(new)                           # a fork() under way when SIGSTOP landed completes first
            procs = table()
            # a frozen pid may have been exiting already and is gone from the table: only live ones count
            pids = {p: procs[p][1] for p in descendants(set(stopped), procs) if p in procs}
    finally:
        kill([p for p, s in stopped.items() if alive(p, s)], signal.SIGKILL)
    return len(stopped)


class Watch:
    """The driver's descendants, added to at each look and never forgotten: once the driver dies its children
    are reparented, and the last look may be the only one that saw them."""

    def __init__(self, driver):
        self.driver = driver
        self.known = {}

    def snapshot(self):
        procs = table()
        for p in [p for p, s in self.known.items() if procs.get(p, (0, None))[1] != s]:
            del self.known[p]
        self.known.update({p: procs[p][1] for p in descendants({self.driver}, procs) if p != self.driver})

    def ray_processes_left(self):
        def ray_process(pid):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    return b"ray" in f.read()
            except OSError:
                return False
        return {p: s for p, s in self.known.items() if alive(p, s) and ray_process(p)}


def main(driver, poll_s):
    signal.signal(signal.SIGINT, signal.SIG_IGN)      # Ctrl-C goes to the driver; the driver decides
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    driver_start = (stat(driver) or (0, None))[1]
    watch = Watch(driver)
    watch.snapshot()
    released = False
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], poll_s)
        if ready:
            line = sys.stdin.readline()
            if line.strip() == "released":
                released = True
                continue
            if not line:                              # the driver's end closed: it exited or was killed
                break
        if not alive(driver, driver_start):
            break
        if not released:
            watch.snapshot()
    if released:
        # the cluster was shut down: what of it is still there after a grace is stopped
        deadline = time.monotonic() + 3.0
        while any(alive(p, s) for p, s in watch.known.items()) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = watch.ray_processes_left()
        if left:
            stop(left)
        return
    n = stop(watch.known)
    if n:
        sys.stderr.write(f"[qwen35rl] driver (pid {driver}) ended without stopping its local Ray cluster: "
                         f"stopped its {n} remaining processes\n")


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]))
