"""Sweep summary: a Hydra callback that collects each job's plan and, when the multirun ends, writes `summary.md`
and `summary.csv` into the sweep directory and prints the table to stderr.

Registered in `conf/config.yaml` under `hydra.callbacks`; a plan job returns its plan dict (`valid`, `problems`,
`memory_gib`, optionally `cost`, `train`, `rollout`) as the job's return value. Each row shows the job's own layout
(its degrees, from the plan or the job's config) and every error of the job. A job directory the job left empty (a
plan job writes nothing there) is removed when the job ends.
"""
from __future__ import annotations

import csv
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback

from qwen35rl.config.layout_search import SCORE_UNIT

COLUMNS = ("job", "overrides", "valid", "layout", "first_error", "errors", "train_peak_gib", "capacity_gib",
           "rollout_peak_gib", "score", "score_unit")
"""summary.csv's columns: `errors` holds every error of the job, one per line; `score` is in `score_unit`."""


@dataclass
class SweepRow:
    job: int
    overrides: List[str]
    valid: bool
    errors: List[str]
    """Every error of the job, in the plan's order (a failed job: its exception)."""
    train_peak_gib: Optional[float]
    capacity_gib: Optional[float]
    rollout_peak_gib: Optional[float]
    score: Optional[float]
    """The cost model's score in estimated seconds per RL step (valid jobs only)."""
    layout: str = ""
    """The job's own layout, e.g. "TP4 PP1 CP1 EP8 ETP1 DP2 | rollout TP8 DP1 EP1" (empty when unknown)."""

    @property
    def first_error(self) -> str:
        return self.errors[0] if self.errors else ""


def _errors(plan: Dict[str, Any]) -> List[str]:
    return [f"[{p['code']}] {p['key']}: {p['message']}" for p in plan.get("problems", [])
            if p.get("severity") == "error"]


def _layout_text(train: Dict[str, Any], rollout: Dict[str, Any], pools: Optional[Tuple[int, int]] = None) -> str:
    """"TP2 PP1 ... | rollout TP1 DP2 EP1", and with placement=split " | pools 6+2" (training + rollout devices)."""
    if not train:
        return ""
    text = " ".join(f"{k.upper()}{v}" for k, v in train.items() if v is not None)
    if rollout and rollout.get("tp") is not None:
        text += f" | rollout TP{rollout['tp']} DP{rollout['dp']} EP{rollout['ep']}"
    if pools:
        text += f" | pools {pools[0]}+{pools[1]}"
    return text


def _layout(plan: Dict[str, Any], job_cfg: Any) -> str:
    """The job's layout from its plan, else from its config (a train job's return carries no layout; a searched
    layout is only known to the plan)."""
    if plan.get("train"):
        placed = plan.get("placement") or {}
        pools = ((placed["pools"]["training"]["devices"], placed["pools"]["rollout"]["devices"])
                 if placed.get("mode") == "split" else None)
        return _layout_text(plan["train"], plan.get("rollout") or {}, pools)
    if job_cfg is None:
        return ""
    try:
        from qwen35rl.config.layout import derive_layout
        from qwen35rl.config.memory import as_tree

        tree = as_tree(job_cfg)
        if tree["parallelism"]["auto"]:
            return "parallelism=auto"
        layout = derive_layout(tree)
        return _layout_text(layout.train_dict(), layout.rollout_dict(),
                            (layout.world, layout.rollout_world) if layout.split else None)
    except Exception:  # the table is a summary: a config it cannot read leaves the cell empty
        return ""


def _score(plan: Dict[str, Any], job_cfg: Any) -> Optional[float]:
    """The plan's cost score when it carries one, else the cost model's score for the job's config (valid plans
    only: an invalid layout has no meaningful cost)."""
    if not plan.get("valid"):
        return None
    cost = plan.get("cost")
    if isinstance(cost, dict):
        cost = cost.get("score")
    if isinstance(cost, (int, float)):
        return float(cost)
    if job_cfg is None:
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
        return SweepRow(num, overrides, False, [f"job failed: {type(err).__name__}: {err}"], None, None, None, None,
                        _layout({}, job_return.cfg))
    plan = job_return.return_value
    if not isinstance(plan, dict):
        return SweepRow(num, overrides, False, [f"job returned no plan ({type(plan).__name__})"], None, None, None,
                        None, _layout({}, job_return.cfg))
    mem = plan.get("memory_gib") or {}
    try:
        score = _score(plan, job_return.cfg)
    except Exception:  # the table is a summary: a cost-model failure must not lose the sweep's results
        score = None
    return SweepRow(num, overrides, bool(plan.get("valid")), _errors(plan), mem.get("train_peak"),
                    mem.get("capacity"), mem.get("rollout_peak"), score, _layout(plan, job_return.cfg))


def remove_if_empty(job_dir: Optional[str]) -> None:
    """Remove a job's output directory when the job left nothing in it (Hydra makes one for every job)."""
    if not job_dir:
        return
    path = Path(job_dir)
    try:
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()
    except OSError:  # another process wrote into it meanwhile: it stays
        pass


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
        out.append([str(r.job), " ".join(ov), "yes" if r.valid else "NO", r.layout, "<br>".join(r.errors),
                    f"{_fmt(r.train_peak_gib)} / {_fmt(r.capacity_gib)}" if r.train_peak_gib is not None else "",
                    _fmt(r.rollout_peak_gib), _fmt(r.score, 3)])
    return out


def render_markdown(rows: Sequence[SweepRow]) -> str:
    header = ["job", "overrides", "valid", "layout", "errors", "train peak / capacity (GiB)", "rollout peak (GiB)",
              "score (est. s/step)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for cells in table_rows(rows):
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def write_csv(rows: Sequence[SweepRow], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        for r in rows:
            w.writerow([r.job, " ".join(r.overrides), r.valid, r.layout, r.first_error, "\n".join(r.errors),
                        r.train_peak_gib, r.capacity_gib, r.rollout_peak_gib, r.score,
                        SCORE_UNIT if r.score is not None else ""])


class SweepSummary(Callback):
    """Collects every job's plan; at the end of the multirun writes summary.md / summary.csv in the sweep
    directory and prints the table to stderr."""

    def __init__(self) -> None:
        self.rows: List[SweepRow] = []

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        self.rows = []

    def on_job_end(self, config: Any, job_return: JobReturn, **kwargs: Any) -> None:
        self.rows.append(row_from_job(job_return, len(self.rows)))
        try:
            job_dir = config.hydra.runtime.output_dir
        except Exception:  # a fake or partial config: nothing to tidy
            job_dir = None
        remove_if_empty(job_dir)

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
