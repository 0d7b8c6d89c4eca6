"""What a run says on the console and keeps in `train.log`: a line per start-up phase with its time, the step lines,
an end-of-run summary, and one block for a failure (its full traceback only in the log file).

Console lines are INFO records of the `qwen35rl.progress` logger (and any other INFO record), printed as
`[qwen35rl] <message>` by `ConsoleFormatter` (conf/hydra/job_logging/qwen35rl.yaml); the log file gets every record
with its time and logger. Records of the `qwen35rl.file` logger go to the log file only (tracebacks, the library
warnings a CPU run silences). Stdlib only: the logging config imports it.
"""
from __future__ import annotations

import logging
import math
import os
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

PROGRESS = "qwen35rl.progress"
FILE_ONLY = "qwen35rl.file"
progress_log = logging.getLogger(PROGRESS)
file_log = logging.getLogger(FILE_ONLY)


class ConsoleFormatter(logging.Formatter):
    """`[qwen35rl] message` for INFO (every line of it), `[qwen35rl] warning: ...` / `error: ...` above; records of
    other libraries keep their logger's name."""

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            text += "\n" + record.exc_text
        source = "" if record.name.split(".")[0] in ("qwen35rl", "root", "__main__") else f" ({record.name})"
        if record.levelno <= logging.INFO:
            return "\n".join(f"[qwen35rl]{source} {line}" if line else "[qwen35rl]" for line in text.split("\n"))
        return f"[qwen35rl] {record.levelname.lower()}{source}: {text}"


def say(message: str) -> None:
    """A progress line: through logging when it is configured (console + train.log), else straight to stderr."""
    if progress_log.hasHandlers():
        progress_log.info("%s", message)
    else:
        sys.stderr.write("".join(f"[qwen35rl] {line}\n" for line in message.split("\n")))
        sys.stderr.flush()


def log_file() -> Optional[Path]:
    """The file the log goes to (Hydra's job log: <run dir>/train.log), when there is one."""
    for name in (FILE_ONLY, None):
        logger = logging.getLogger(name)
        while logger is not None:
            for h in logger.handlers:
                if isinstance(h, logging.FileHandler):
                    return Path(h.baseFilename)
            logger = logger.parent if logger.propagate else None
    return None


def shown_path(path: Any) -> str:
    """A path as a user types it: relative to the working directory when below it."""
    p = os.path.abspath(str(path))
    rel = os.path.relpath(p)
    return p if rel.startswith("..") else rel


def process_age_s() -> Optional[float]:
    """Seconds since this process started (Linux), None where that is not known."""
    try:
        with open("/proc/self/stat", "rb") as f:
            start_ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


_last_job_end: Optional[float] = None


def job_started_s_ago() -> float:
    """How long ago this launch began: the process start for the first job, the previous job's end for the next
    ones of a sweep."""
    if _last_job_end is not None:
        return time.monotonic() - _last_job_end
    age = process_age_s()
    return age if age is not None and age >= 0 else 0.0


def job_ended() -> None:
    global _last_job_end
    _last_job_end = time.monotonic()


# ---------------------------------------------------------------------------------------------------- phases
class Phases:
    """Start-up phases, one line each as it ends: `<phase> in <s> s: <detail>`. `current` names the phase under way
    (a failure says where it happened)."""

    def __init__(self, started_s_ago: float = 0.0):
        now = time.monotonic()
        self.t0 = now - started_s_ago
        self.last = now
        self.current = "start-up"
        self.seconds: Dict[str, float] = {}

    def begin(self, name: str) -> None:
        self.current = name

    def done(self, name: str, detail: str = "", since_start: bool = False) -> float:
        now = time.monotonic()
        dt = (now - self.t0) if since_start else (now - self.last)
        self.last = now
        self.seconds[name] = dt
        say(f"{name} in {dt:.1f} s" + (f": {detail}" if detail else ""))
        return dt

    def mark(self, name: str) -> float:
        """The end of a phase that says its own line (the preflight)."""
        now = time.monotonic()
        dt, self.last = now - self.last, now
        self.seconds[name] = dt
        return dt

    def total_s(self) -> float:
        return time.monotonic() - self.t0


# --------------------------------------------------------------------------------------------------- summary
def _fmt(v: Optional[float]) -> str:
    return "n/a" if v is None or not math.isfinite(v) else f"{v:.3g}"


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _series(rows: Sequence[Mapping[str, Any]], key: str) -> List[Tuple[int, float]]:
    return [(int(r["step"]), float(r[key])) for r in rows if isinstance(r.get(key), (int, float))]


def summary(run_dir: Path, rows: Sequence[Mapping[str, Any]], total_steps: Optional[int], *,
            head: str, wall_s: Optional[float] = None, steps_this_launch: Optional[int] = None) -> str:
    """The end-of-run block: steps, wall time, tokens/s, reward first -> last, best validation, where the results
    are. `rows`: metrics.jsonl's."""
    run_dir = Path(run_dir)
    lines = [head]
    timed = [r for r in rows if isinstance(r.get("timing_s/step"), (int, float)) and r["timing_s/step"] > 0]
    tokens = sum(float(r.get("perf/total_num_tokens") or 0) for r in timed)
    step_s = sum(float(r["timing_s/step"]) for r in timed)
    pace = []
    if wall_s is not None:
        pace.append(f"{_hms(wall_s)} wall time" + (f" for {steps_this_launch} step(s) in this launch"
                                                   if steps_this_launch is not None else ""))
    if timed:
        pace.append(f"{step_s / len(timed):.2f} s per step, {tokens / step_s:,.0f} tokens/s (generation + training, "
                    f"over {len(timed)} logged steps)")
    if pace:
        lines.append("  time:        " + "; ".join(pace))
    reward = _series(rows, "critic/score/mean")
    if reward:
        (s0, r0), (s1, r1) = reward[0], reward[-1]
        last5 = [v for _, v in reward[-5:]]
        tail = f" (mean of the last {len(last5)}: {_fmt(sum(last5) / len(last5))})" if len(reward) >= 5 else ""
        lines.append(f"  reward:      critic/score/mean {_fmt(r0)} at step {s0} -> {_fmt(r1)} at step {s1}{tail}")
    val = _series(rows, "val/score/mean")
    if val:
        best_step, best = max(val, key=lambda sv: (sv[1], -sv[0]))
        if len(val) == 1:
            lines.append(f"  validation:  val/score/mean {_fmt(best)} at step {best_step}")
        else:
            lines.append(f"  validation:  best val/score/mean {_fmt(best)} at step {best_step} (first "
                         f"{_fmt(val[0][1])} at step {val[0][0]}, last {_fmt(val[-1][1])} at step {val[-1][0]})")
    skipped = next(({k.rsplit("/", 1)[1]: int(r[k]) for k in r if k.startswith("data/skipped_rows/") and r[k]}
                    for r in reversed(rows) if any(k.startswith("data/skipped_rows/") for k in r)), {})
    if skipped:
        names = {"train": "train", "val": "validation"}
        lines.append("  data:        " + ", ".join(f"{n} {names.get(s, s)} row(s)" for s, n in skipped.items())
                     + " skipped while loading (data.skip_bad_rows=true: they cannot make a prompt; the log names "
                       "them)")
    where = [("metrics", run_dir / "metrics.jsonl"), ("tensorboard", run_dir / "tensorboard"),
             ("curves", run_dir / "curves.png"), ("samples", run_dir / "generations.jsonl")]
    from qwen35rl.runtime.checkpoint import CheckpointManager, checkpoint_dir

    newest = CheckpointManager(checkpoint_dir(run_dir)).latest(verified=False)
    if newest is not None:
        where.append(("checkpoint", newest))
    where.append(("export", run_dir / "final"))
    logfile = log_file()
    if logfile is not None:
        where.append(("log", logfile))
    for label, path in where:
        if path.exists():
            extra = " (Hugging Face format)" if label == "export" else ""
            lines.append(f"  {label + ':':<12} {shown_path(path)}{'/' if path.is_dir() else ''}{extra}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------- failures
_FIXES: Tuple[Tuple[str, str], ...] = (
    (r"out of device memory",
     "lower backend.micro_batch_size_per_device (or backend.max_tokens_per_device with backend.dynamic_batch_size)"
     " or rollout.gpu_memory_utilization, or turn on backend.gradient_checkpointing / backend.param_offload; "
     "qwen35rl-plan with the same overrides shows the memory estimate"),
    (r"killed by Ray's memory monitor",
     "the node ran out of host memory: fewer workers per node (hw.devices_per_node), less host offload "
     "(backend.optimizer_offload / param_offload), or a node with more memory"),
    (r"its process died",
     "the worker's own log says why (a local worker's is this run's output; a Ray worker's: `ray logs` or "
     "/tmp/ray/session_latest/logs/worker-*.err on that node; dmesg for the kernel's OOM killer); then run the same "
     "command again: it resumes from the last checkpoint"),
    (r"failed to start",
     "every node needs the same qwen35rl install and packages (qwen35rl-plan and the preflight list them); "
     "the cause above names what is missing"),
    (r"DistNetworkError|[Tt]imed out|Watchdog caught collective|NCCL error|HCCL",
     "a collective did not complete: a rank is stuck or the network setup is wrong (hw.env: NCCL_* / HCCL_* "
     "variables, backend.dist_timeout_s); the other ranks' logs show which one"),
    (r"No module named '([^']+)'", "install the missing package ({0}) where the error happened (every node)"),
    (r"FileNotFoundError|No such file or directory",
     "the file named above does not exist where the error happened: paths must be on a file system every node "
     "sees"),
)


def known_fix(text: str) -> Optional[str]:
    for pattern, fix in _FIXES:
        m = re.search(pattern, text)
        if m:
            return fix.format(*m.groups())
    return None


def _innermost(tb: Optional[Any]) -> str:
    frames = traceback.extract_tb(tb) if tb is not None else []
    if not frames:
        return ""
    f = frames[-1]
    return f"{shown_path(f.filename)}:{f.lineno} in {f.name}"


def failure_block(headline: str, *, what: str, where: str, fix: Optional[str], code: int, run_dir: Path,
                  detail: str = "") -> str:
    """One block for a run stopped by a failure; `detail` (the full traceback) goes to the log file only."""
    if detail:
        file_log.error("%s: the full error\n%s", headline, detail.rstrip())
    logfile = log_file()
    lines = [f"{headline}: the run stopped (exit code {code})",
             f"  what:  {what}",
             f"  where: {where}",
             f"  fix:   {fix or 'no known fix: the traceback says where it comes from'}"]
    if detail:
        lines.append(f"  the full traceback: {shown_path(logfile)}" if logfile is not None
                     else "  the full traceback: logged to the qwen35rl.file logger (no log file is configured)")
    from qwen35rl.runtime.checkpoint import CheckpointManager, checkpoint_dir

    try:
        last = CheckpointManager(checkpoint_dir(run_dir)).latest(verified=False)
    except OSError:
        last = None
    if last is not None:
        lines.append(f"  last complete checkpoint: {shown_path(last)} (step {last.name.split('_', 1)[1]}); the same "
                     "command resumes from there once fixed")
    return "\n".join(lines)


def unexpected_block(e: BaseException, where: str, run_dir: Path, code: int) -> str:
    what = " ".join(f"{type(e).__name__}: {e}".split())
    if len(what) > 600:
        what = what[:600] + " ..."
    at = _innermost(e.__traceback__)
    detail = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    return failure_block("an unexpected error", what=what, where=where + (f", at {at}" if at else ""),
                         fix=known_fix(detail), code=code, run_dir=run_dir, detail=detail)
