"""Where metrics go: console progress on stderr (and train.log), `metrics.jsonl` in the run dir, TensorBoard
(default), W&B and MLflow (opt-in through `trainer.trackers`), and a PNG of the main curves at the end. Sample
generations of validation (`trainer.log_val_generations` prompts) go to `generations.jsonl` and TensorBoard text.

Files are written so that a failed write (a full disk) leaves what was there intact: a metrics row is appended in
one write and cut off again if it fails; curves.png and the rewritten metrics.jsonl of a resume go through a temp
file and a rename. A failed write raises OSError naming the file."""
from __future__ import annotations

import io
import json
import logging
import math
import os
import time
import warnings
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional

from qwen35rl.names import TRACKERS

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
GENERATIONS_FILE = "generations.jsonl"
GENERATIONS_TAG = "val/generations"
CURVES_FILE = "curves.png"
# (panel title, metric names drawn in it: the first present ones are plotted)
CURVE_PANELS = (
    ("reward", ("critic/rewards/mean", "critic/score/mean", "val/score/mean")),
    ("KL", ("actor/kl_loss", "actor/ppo_kl")),
    ("entropy", ("actor/entropy",)),
    ("response length", ("response_length/mean",)),
)


class TrackerMissing(RuntimeError):
    """A tracker listed in trainer.trackers whose package is not installed."""


def _finite_or_none(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v


# ----------------------------------------------------------------------------------------------------- backends
class JsonlTracker:
    """One JSON object per step: {"step": N, metric: value, ...}. On resume, rows after the resumed step (logged
    by the interrupted run after its last checkpoint) are dropped so every step appears once."""

    def __init__(self, run_dir: Path, start_step: int, name: str = METRICS_FILE):
        from qwen35rl.runtime.checkpoint import write_atomic

        self.path = run_dir / name
        if self.path.exists():
            kept = [line for line in self.path.read_text().splitlines() if _step_of(line) is not None
                    and _step_of(line) <= start_step]
            write_atomic(self.path, "".join(line + "\n" for line in kept).encode())
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        self.write_rows([{"step": step, **{k: _finite_or_none(v) for k, v in metrics.items()}}])

    def log_generations(self, step: int, samples: List[Mapping[str, Any]]) -> None:
        pass  # the samples have their own file (GenerationsFile)

    def write_rows(self, rows: List[Mapping[str, Any]]) -> None:
        """Rows appended in one write; a failed write leaves the file as it was."""
        data = "".join(json.dumps(row) + "\n" for row in rows).encode()
        size = os.fstat(self._fd).st_size
        try:
            _append(self._fd, data)
        except OSError as e:
            try:  # no half row: the file ends with the last complete one
                os.ftruncate(self._fd, size)
            except OSError:
                pass
            raise OSError(e.errno, e.strerror, str(self.path)) from e

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _append(fd: int, data: bytes) -> None:
    """All of `data` at the end of the file (os.write may write only a part)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _step_of(line: str) -> Optional[int]:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


class ConsoleTracker:
    """A progress line per logged step on stderr: step, elapsed, ETA, reward (and validation when present).
    The ETA uses the pace of the steps since the first one logged by this process (Ray start-up and the first
    step's warm-up would otherwise inflate it)."""

    def __init__(self, total_steps: int, start_step: int, stream=None):
        self.total, self.start_step = total_steps, start_step
        self.stream = stream
        """None: the line is a progress record (console + train.log, qwen35rl.runtime.report.say)."""
        self.t0 = time.monotonic()
        self._first: Optional[tuple] = None  # (time, step) of the first logged step

    def _eta(self, now: float, step: int, metrics: Mapping[str, Any]) -> float:
        if self._first is None:
            self._first = (now, step)
            per_step = metrics.get("timing_s/step") or float("nan")
        else:
            t_first, s_first = self._first
            per_step = (now - t_first) / max(step - s_first, 1)
        return per_step * (self.total - step)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        now = time.monotonic()
        eta = self._eta(now, step, metrics)
        parts = [f"step {step}/{self.total}", f"{_hms(now - self.t0)}<{_hms(eta)}"]
        for key, label in (("critic/score/mean", "reward"), ("response_length/mean", "len"),
                           ("actor/pg_loss", "pg_loss"), ("val/score/mean", "val"), ("timing_s/step", "s/step")):
            if metrics.get(key) is not None:
                parts.append(f"{label} {metrics[key]:.4g}")
        if self.stream is None:
            from qwen35rl.runtime.report import say

            say(" | ".join(parts))
        else:
            self.stream.write("[qwen35rl] " + " | ".join(parts) + "\n")
            self.stream.flush()

    def log_generations(self, step: int, samples: List[Mapping[str, Any]]) -> None:
        pass

    def close(self) -> None:
        pass


def _hms(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class TensorBoardTracker:
    def __init__(self, run_dir: Path, start_step: int):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        # purge_step drops events the interrupted run wrote after the checkpoint it resumes from
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=start_step + 1 if start_step else None)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                self.writer.add_scalar(k, v, global_step=step)
        self.writer.flush()

    def log_generations(self, step: int, samples: List[Mapping[str, Any]]) -> None:
        self.writer.add_text(GENERATIONS_TAG, generations_markdown(samples), global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, cfg: Any, run_dir: Path):
        wandb = _import_tracker("wandb")
        from omegaconf import OmegaConf

        # the run id follows the run dir, so a resumed run continues the same W&B run
        self.run = wandb.init(project=cfg.trainer.project_name, name=cfg.trainer.run_name,
                              id=_stable_id(run_dir), resume="allow", dir=str(run_dir),
                              config=OmegaConf.to_container(cfg, resolve=True))

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        self.run.log(dict(metrics), step=step)

    def log_generations(self, step: int, samples: List[Mapping[str, Any]]) -> None:
        import wandb

        columns = list(GENERATION_FIELDS)
        table = wandb.Table(columns=columns, data=[[s.get(c) for c in columns] for s in samples])
        self.run.log({GENERATIONS_TAG: table}, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    def __init__(self, cfg: Any, run_dir: Path):
        self.mlflow = _import_tracker("mlflow")
        if not os.environ.get("MLFLOW_TRACKING_URI"):  # keep the run's files in its run dir, not the cwd
            self.mlflow.set_tracking_uri((run_dir / "mlruns").resolve().as_uri())
        self.mlflow.set_experiment(cfg.trainer.project_name)
        self.mlflow.start_run(run_name=cfg.trainer.run_name)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        clean = {k.replace("@", "_"): float(v) for k, v in metrics.items()
                 if isinstance(v, (int, float)) and math.isfinite(float(v))}
        self.mlflow.log_metrics(clean, step=step)

    def log_generations(self, step: int, samples: List[Mapping[str, Any]]) -> None:
        self.mlflow.log_text(generations_markdown(samples), f"generations/step_{step}.md")

    def close(self) -> None:
        self.mlflow.end_run()


def _import_tracker(name: str):
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        raise TrackerMissing(f"trainer.trackers includes '{name}' but the {name} package is not installed: "
                             f"pip install 'qwen35rl[trackers]' (or drop '{name}' from trainer.trackers)") from None


def _stable_id(run_dir: Path) -> str:
    """The run's id (provenance: made by its first start), the same for every resume and another after the
    directory started over (`trainer.resume=never` moves the earlier run, provenance included, aside); a run
    recorded before runs had ids keeps the id of its directory."""
    import hashlib

    from qwen35rl.runtime.provenance import PROVENANCE_DIR, run_id

    return run_id(run_dir / PROVENANCE_DIR) or hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:16]


# -------------------------------------------------------------------------------------------------- generations
GENERATION_FIELDS = ("step", "index", "prompt", "response", "answer", "score")
"""One sample of validation: the prompt's row index, its text, the greedy response, the ground truth, the score."""


def generations_markdown(samples: List[Mapping[str, Any]]) -> str:
    """The samples as a Markdown table (TensorBoard's text panel renders it)."""
    def cell(v: Any) -> str:
        text = f"{v:.4g}" if isinstance(v, float) else str(v)
        return text.replace("|", "\\|").replace("\n", "<br>")

    cols = [c for c in GENERATION_FIELDS if c != "step"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(s.get(c, "")) for c in cols) + " |" for s in samples]
    return "\n".join(lines)


class GenerationsFile:
    """`generations.jsonl`: one row per sample (GENERATION_FIELDS); on resume, the rows of steps after the resumed
    one are dropped, as metrics.jsonl's are."""

    def __init__(self, run_dir: Path, start_step: int):
        self.run_dir = run_dir
        exists = (run_dir / GENERATIONS_FILE).exists()
        self.file: Optional[JsonlTracker] = JsonlTracker(run_dir, start_step, GENERATIONS_FILE) if exists else None
        """Opened at the first samples: a run without validation leaves no empty file."""

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        pass

    def log_generations(self, step: int, samples: List[Mapping[str, Any]]) -> None:
        if self.file is None:
            self.file = JsonlTracker(self.run_dir, step, GENERATIONS_FILE)
        self.file.write_rows([{"step": step, **{k: v for k, v in s.items() if k != "step"}} for s in samples])

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


# ------------------------------------------------------------------------------------------------------ facade
class Tracking:
    """Fan-out of one step's metrics to every tracker in `trainer.trackers`. Built before Ray starts, so a missing
    W&B / MLflow package fails fast."""

    def __init__(self, cfg: Any, run_dir: Path, total_steps: int, start_step: int = 0, console_stream=None):
        names = [str(t) for t in cfg.trainer.trackers]
        unknown = [t for t in names if t not in TRACKERS]
        if unknown:
            raise ValueError(f"trainer.trackers: unknown {unknown}; known: {', '.join(TRACKERS)}")
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir = run_dir
        self.backends: List[Any] = []
        for name in names:
            if name == "console":
                self.backends.append(ConsoleTracker(total_steps, start_step, console_stream))
            elif name == "jsonl":
                self.backends.append(JsonlTracker(run_dir, start_step))
                self.backends.append(GenerationsFile(run_dir, start_step))
            elif name == "tensorboard":
                try:
                    self.backends.append(TensorBoardTracker(run_dir, start_step))
                except ImportError as e:
                    warnings.warn(f"TensorBoard logging is off: {e} (pip install tensorboard)", stacklevel=2)
            elif name == "wandb":
                self.backends.append(WandbTracker(cfg, run_dir))
            elif name == "mlflow":
                self.backends.append(MlflowTracker(cfg, run_dir))

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        for b in self.backends:
            b.log(step, metrics)

    def log_generations(self, step: int, samples: List[Mapping[str, Any]]) -> None:
        """Sample generations of a validation (GENERATION_FIELDS each) to every tracker that keeps them."""
        if samples:
            for b in self.backends:
                b.log_generations(step, samples)

    def close(self) -> None:
        """Closes every backend; one that fails to (a full disk, a tracker server gone) is logged, not raised."""
        for b in self.backends:
            try:
                b.close()
            except Exception as e:  # noqa: BLE001 - clean-up must not hide the run's own outcome
                log.warning("closing the %s tracker failed: %s: %s", type(b).__name__, type(e).__name__, e)
        self.backends = []


# ------------------------------------------------------------------------------------------------------ curves
def read_metrics(path: Path) -> List[Dict[str, Any]]:
    """The rows of metrics.jsonl; a line that does not parse (cut off by a crash) is skipped."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line) if line.strip() else None
        except ValueError:
            row = None
        if isinstance(row, dict):
            rows.append(row)
    return rows


def plot_curves(rows: Iterable[Mapping[str, Any]], out_png: Path) -> Path:
    """Reward, KL, entropy and response length against step, one panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(rows)
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (title, names) in zip(axes.flat, CURVE_PANELS):
        drawn = False
        for name in names:
            pts = [(r["step"], r[name]) for r in rows if r.get(name) is not None]
            if pts and all(y == 0 for _, y in pts) and name != names[-1]:
                continue  # a term that is off (e.g. kl_loss without use_kl_loss) would only flatten the panel
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="." if len(pts) < 50 else None, label=name)
                drawn = True
        if drawn:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="grey")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    from qwen35rl.runtime.checkpoint import write_atomic

    out_png, png = Path(out_png), io.BytesIO()
    try:  # a curves.png is whole or the previous one
        fig.savefig(png, dpi=100, format="png")
        write_atomic(out_png, png.getvalue())
    finally:
        plt.close(fig)
    return out_png


def plot_curves_safely(run_dir: Path) -> Optional[Path]:
    """curves.png from the run's metrics.jsonl; any failure is logged as a warning (clean-up of a run that may
    already be failing must not raise a second error)."""
    try:
        rows = read_metrics(Path(run_dir) / METRICS_FILE)
        return plot_curves(rows, Path(run_dir) / CURVES_FILE) if rows else None
    except Exception as e:  # noqa: BLE001 - includes a missing matplotlib and a full disk
        log.warning("no %s: %s: %s", CURVES_FILE, type(e).__name__, e)
        return None
