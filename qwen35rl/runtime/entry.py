"""What `qwen35rl-train` runs for one job once its config is valid: the start-up clock's first line, the run
directory's identity (a refused resume, or a finished run, ends here in a second or two: torch and Ray are not even
imported), then the driver."""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from qwen35rl.runtime import report, run_identity

log = logging.getLogger(__name__)


def _describe_config(cfg: Any, run_dir: Path) -> str:
    world = int(cfg.hw.nodes) * int(cfg.hw.devices_per_node)
    return (f"{cfg.model.name} on {cfg.hw.name} ({world} device(s)), backend {cfg.backend.name}, rollout "
            f"{cfg.rollout.engine}, algorithm {cfg.algorithm.name}, data {cfg.data.name}; run directory "
            f"{report.shown_path(run_dir)}")


def settle(cfg: Any, run_dir: Path) -> run_identity.Decision:
    """run_identity's decision on `run_dir`, and what it prints: the refusal (logged by `decide`), or "already
    complete" with where the results are."""
    decision = run_identity.decide(cfg, run_dir)
    if decision.complete is not None:
        from qwen35rl.runtime.tracking import METRICS_FILE, read_metrics

        step, total = decision.complete
        head = (f"already complete (step {step} of {total}): nothing to train; raise trainer.total_steps to train "
                f"further, or trainer.resume=never to start over")
        report.say(report.summary(run_dir, read_metrics(Path(run_dir) / METRICS_FILE), total, head=head))
    return decision


def train(cfg: Any, run_dir: Path) -> int:
    """One training job: returns its exit code (qwen35rl.exit_codes)."""
    phases = report.Phases(report.job_started_s_ago())
    try:
        phases.done("config + plan checked", _describe_config(cfg, run_dir), since_start=True)
        decision = settle(cfg, run_dir)
        if decision.exit_code is not None:
            return decision.exit_code
        phases.begin("libraries imported")
        t0 = time.monotonic()
        from qwen35rl.runtime.driver import run_training  # torch, transformers: the slow imports

        import torch
        import transformers

        if time.monotonic() - t0 > 0.05:
            phases.done("libraries imported", f"torch {torch.__version__}, transformers {transformers.__version__}")
        return run_training(cfg, run_dir, decision=decision, phases=phases)
    finally:
        report.job_ended()
