"""The processes of a run started in its own session (driver, local Ray, workers, reward workers), read from /proc:
for tests and benchmarks that kill a run and check what is left."""
import os
from pathlib import Path
from typing import List


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
