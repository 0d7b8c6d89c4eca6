"""A full disk anywhere in a run: recognised under whatever wrapped it, and said in one block (what could not be
written, where, how much room is left) with its exit code. The run's log files stop writing quietly meanwhile."""
from __future__ import annotations

import errno
import logging
import re
import shutil
import sys
from pathlib import Path
from typing import Callable

from qwen35rl.exit_codes import EXIT_DISK_FULL
from qwen35rl.runtime import checkpoint as ckpt
from qwen35rl.runtime import report
from qwen35rl.runtime.cluster import WorkerFailure

log = logging.getLogger(__name__)


class DiskFull(OSError):
    """No space left on device while writing `what`."""

    def __init__(self, what: str):
        super().__init__(errno.ENOSPC, "No space left on device", what)
        self.what = what


_ENOSPC_TEXT = ("No space left on device", "[Errno 28]", "Disk quota exceeded", "[Errno 122]")


def disk_full(e: BaseException) -> bool:
    """Whether `e` (or what caused it, or a worker's error text) is a full disk (ENOSPC, or EDQUOT: a quota)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(e, WorkerFailure) and any(t in f"{e.cause}\n{e.detail}" for t in _ENOSPC_TEXT):
            return True
        e = e.__cause__ or e.__context__
    return False


def unwritten(e: BaseException) -> str:
    """What could not be written, as precisely as the error tells."""
    if isinstance(e, DiskFull):
        return e.what
    if isinstance(e, OSError) and e.filename:
        return str(e.filename)
    if isinstance(e, WorkerFailure):
        m = re.search(r"No space left on device: '([^']+)'", f"{e.cause}\n{e.detail}")
        return (m.group(1) if m else e.cause) + f" (worker rank {e.rank}, in {e.method})"
    cause = e.__cause__ or e.__context__
    return unwritten(cause) if cause is not None else str(e).splitlines()[0]


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def report_disk_full(e: BaseException, run_dir: Path) -> int:
    """One block for a full disk: what could not be written, the free space, the last complete checkpoint."""
    try:
        usage = shutil.disk_usage(run_dir)
        free = f"{_size(usage.free)} free of {_size(usage.total)} on the file system of {run_dir}"
    except OSError as err:
        free = f"unknown ({err})"
    checkpoints = ckpt.CheckpointManager(ckpt.checkpoint_dir(run_dir))
    try:
        checkpoints.remove_partial()  # a half-written save only takes space
        last = checkpoints.latest(verified=False)
    except OSError:
        last = None
    if last is not None:
        step = last.name.split("_", 1)[1]
        resume = f"{last} (step {step}); free some space and run the same command again: it resumes from there"
    else:
        resume = "none yet (the run would start again from step 0)"
    raise_exceptions, logging.raiseExceptions = logging.raiseExceptions, False
    try:  # a log file on the full disk must not add a traceback of its own to the block
        log.error("no space left on device: the run stopped (exit code %d)\n"
                  "  could not write:          %s\n"
                  "  free space:               %s\n"
                  "  last complete checkpoint: %s\n"
                  "  Everything written before is intact (metrics.jsonl up to the last logged step).",
                  EXIT_DISK_FULL, unwritten(e), free, resume)
    finally:
        logging.raiseExceptions = raise_exceptions
    return EXIT_DISK_FULL


def quiet_log_files_when_full() -> None:
    """A log file on a full disk loses its records quietly: logging would print '--- Logging error ---' and a
    traceback on stderr for every record, around the one block that says the disk is full."""
    for name in (None, report.FILE_ONLY):
        for handler in logging.getLogger(name).handlers:
            if not isinstance(handler, logging.FileHandler) or getattr(handler, "_quiet_when_full", False):
                continue

            def handle_error(record: logging.LogRecord, default: Callable = handler.handleError) -> None:
                if not disk_full(sys.exc_info()[1]):
                    default(record)

            handler.handleError = handle_error  # type: ignore[method-assign]
            handler._quiet_when_full = True  # type: ignore[attr-defined]


