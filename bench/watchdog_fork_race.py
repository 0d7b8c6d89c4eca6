"""How often `local_watchdog.stop` leaves a child running: a parent with a large heap forks without pause (a fork
copies its page tables, so it spends most of its time inside fork()), the watchdog stops it, and every process of
its session must be gone, a zombie or have SIGKILL pending right after.

    .venv/bin/python bench/watchdog_fork_race.py [RUNS=30] [HEAP_MB=512]

Prints one line per run that left a child running, then the count."""
import os
import signal
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from qwen35rl.runtime import local_watchdog as wd  # noqa: E402

FORKER = """
import os, signal, sys
heap = bytearray(int(sys.argv[1]) << 20)
for k in range(0, len(heap), 4096):
    heap[k] = 1
os.write(1, b"go\\n")
while True:
    if os.fork() == 0:
        signal.pause()
        os._exit(0)
    os.write(1, b"+")
"""


def session(sid):
    out = {}
    for e in os.listdir("/proc"):
        try:
            with open(f"/proc/{e}/stat", "rb") as f:
                rest = f.read().rsplit(b")", 1)[1].split()
            if int(rest[3]) == sid:
                out[int(e)] = rest[0]
        except (OSError, IndexError, ValueError):
            pass
    return out


def sigkill_pending(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith(("ShdPnd", "SigPnd")) and int(line.split()[1], 16) >> (signal.SIGKILL - 1) & 1
                       for line in f)
    except OSError:
        return True                                   # gone


def main(runs=30, heap_mb=512):
    missed = 0
    for i in range(runs):
        p = subprocess.Popen([sys.executable, "-c", FORKER, str(heap_mb)], stdout=subprocess.PIPE,
                             start_new_session=True)
        try:
            p.stdout.readline()                       # the heap is touched; forking from now on
            p.stdout.read(3)                          # three children started, more on the way
            wd.stop({p.pid: wd.stat(p.pid)[1]})
            left = {q: s for q, s in session(p.pid).items() if s not in (b"Z", b"X") and not sigkill_pending(q)}
            if left:
                missed += 1
                print(f"run {i}: left running {left}", flush=True)
        finally:
            for q in session(p.pid):
                try:
                    os.kill(q, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait()
            p.stdout.close()
    print(f"{missed} of {runs} runs left a child running (heap {heap_mb} MiB)")


if __name__ == "__main__":
    main(*map(int, sys.argv[1:3]))
