"""Sweep summary: a Hydra callback that collects each job's plan and, when the multirun ends, writes `summary.md`
and `summary.csv` into the sweep directory and prints the table to stderr.

Registered in `conf/config.yaml` under `hydra.callbacks`; a plan job returns its plan dict (`valid`, `problems`,
`memory_gib`, optionally `cost`) as the job's return value.
"""
from __future__ import annotations

import csv
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback

COLUMNS = ("job", "overrides", "valid", "first_error", "train_peak_gib", "capacity_gib", "rollout_peak_gib", "score")


@dataclass
class SweepRow:
    job: int
    overrides: List[str]
    valid: bool
    first_error: str
    train_peak_gib: Optional[float]
    capacity_gib: Optional[float]
    rollout_peak_gib: Optional[float]
    score: Optional[float]


def _first_error(plan: Dict[str, Any]) -> str:
    for p in plan.get("problems", []):
        if p.get("severity") == "error":
            return f"[{p['code']}] {p['key']}: {p['message']}"
    return ""


def _score(plan: Dict[str, Any], job_cfg: Any) -> Optional[float]:
    """The plan's cost score when it carries one, else the cost model's score for the job's config (valid plans
    only: an invalid layout has no meaningful cost)."""
    cost = plan.get("cost")
    if isinstance(cost, dict):
        cost = cost.get("score")
    if isinstance(cost, (int, float)):
        return float(cost)
    if not plan.get("valid") or job_cfg is None:
        return None
    from qwen35rl.config import layout_search, memory
    from qwen35rl.config.layout import derive_layout

    tree = memory.as_tree(job_cfg)
    layout = derive_layout(tree)
    return float(layout_search.cost(tree, layout, memory.estimate(tree, layout))["score"])


def row_from_job(job_return: JobReturn, index: int) -> SweepRow:
    """One table row from a finished job (a failed job is invalid with its exception as the first error)."""
    num = index
    hydra_cfg = job_return.hydra_cfg
    if hydra_cfg is not None:
        try:
            num = int(hydra_cfg.hydra.job.num)
        except Exception:  # a fake or partial hydra config: keep the arrival order
            pass
    overrides = list(job_return.overrides or [])
    if job_return.status != JobStatus.COMPLETED:
        err = job_return._return_value  # the exception; .return_value would re-raise it
        return SweepRow(num, overrides, False, f"job failed: {type(err).__name__}: {err}", None, None, None, None)
    plan = job_return.return_value
    if not isinstance(plan, dict):
        return SweepRow(num, overrides, False, f"job returned no plan ({type(plan).__name__})", None, None, None, None)
    mem = plan.get("memory_gib") or {}
    try:
        score = _score(plan, job_return.cfg)
    except Exception:  # the table is a summary: a cost-model failure must not lose the sweep's results
        score = None
    return SweepRow(num, overrides, bool(plan.get("valid")), _first_error(plan), mem.get("train_peak"),
                    mem.get("capacity"), mem.get("rollout_peak"), score)


def varying_overrides(rows: Sequence[SweepRow]) -> List[List[str]]:
    """Per row, the overrides whose value differs across jobs (all of them for a single job)."""
    if len(rows) < 2:
        return [r.overrides for r in rows]
    values: Dict[str, set] = {}
    for r in rows:
        for o in r.overrides:
            k, _, v = o.partition("=")
            values.setdefault(k, set()).add(v)
    keep = {k for k, vs in values.items() if len(vs) > 1 or any(k not in _keys(r) for r in rows)}
    return [[o for o in r.overrides if o.partition("=")[0] in keep] for r in rows]


def _keys(row: SweepRow) -> set:
    return {o.partition("=")[0] for o in row.overrides}


def _fmt(x: Optional[float], digits: int = 1) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def table_rows(rows: Sequence[SweepRow]) -> List[List[str]]:
    shown = varying_overrides(rows)
    out = []
    for r, ov in zip(rows, shown):
        out.append([str(r.job), " ".join(ov), "yes" if r.valid else "NO", r.first_error,
                    f"{_fmt(r.train_peak_gib)} / {_fmt(r.capacity_gib)}" if r.train_peak_gib is not None else "",
                    _fmt(r.rollout_peak_gib), _fmt(r.score, 3)])
    return out


def render_markdown(rows: Sequence[SweepRow]) -> str:
    header = ["job", "overrides", "valid", "first error", "train peak / capacity (GiB)", "rollout peak (GiB)",
              "cost score"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for cells in table_rows(rows):
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def write_csv(rows: Sequence[SweepRow], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        for r in rows:
            w.writerow([r.job, " ".join(r.overrides), r.valid, r.first_error, r.train_peak_gib, r.capacity_gib,
                        r.rollout_peak_gib, r.score])


class SweepSummary(Callback):
    """Collects every job's plan; at the end of the multirun writes summary.md / summary.csv in the sweep
    directory and prints the table to stderr."""

    def __init__(self) -> None:
        self.rows: List[SweepRow] = []

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        self.rows = []

    def on_job_end(self, config: Any, job_return: JobReturn, **kwargs: Any) -> None:
        self.rows.append(row_from_job(job_return, len(self.rows)))

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        rows = sorted(self.rows, key=lambda r: r.job)
        if not rows:
            return
        sweep_dir = Path(str(config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        table = render_markdown(rows)
        valid = sum(r.valid for r in rows)
        (sweep_dir / "summary.md").write_text(f"# Sweep summary\n\n{valid} of {len(rows)} jobs valid.\n\n{table}")
        write_csv(rows, sweep_dir / "summary.csv")
        print(f"\nsweep summary ({valid}/{len(rows)} valid), written to {sweep_dir}/summary.md and summary.csv:\n"
              f"{table}", file=sys.stderr, flush=True)
