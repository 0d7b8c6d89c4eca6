"""What `qwen35rl-train` runs for one job once its config is valid: the start-up clock's first line, the run
directory's identity (a refused resume, or a finished run, ends here in a second or two: torch and Ray are not even
imported), then the driver."""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from qwen35rl.config.resolved import ResolvedRun
from qwen35rl.runtime import report, run_identity

log = logging.getLogger(__name__)


def _describe_config(run: ResolvedRun, run_dir: Path) -> str:
    cfg = run.cfg
    return (f"{cfg.model.name} on {cfg.hw.name} ({run.layout.devices} device(s)), backend {cfg.backend.name}, "
            f"rollout {cfg.rollout.engine}, algorithm {cfg.algorithm.name}, data {cfg.data.name}; run directory "
            f"{report.shown_path(run_dir)}")


def train(run: ResolvedRun, run_dir: Path) -> int:
    """One training job of the resolved `run`: returns its exit code (qwen35rl.exit_codes). Ctrl-C / SIGTERM stop it
    within seconds at any point, the last line naming the checkpoint the same command resumes from
    (qwen35rl.runtime.signals)."""
    from qwen35rl.exit_codes import EXIT_INTERRUPTED
    from qwen35rl.runtime.signals import STOP_TIMEOUT_S, StopRequest, last_checkpoint

    from qwen35rl.runtime.checkpoint import checkpoint_dir

    checkpoint_dir(run_dir, run.cfg)  # every report of this job names the configured checkpoint directory
    phases = report.Phases(report.job_started_s_ago())
    stop = StopRequest(run.cfg.trainer.get("stop_timeout_s", STOP_TIMEOUT_S))
    try:
        with stop:
            return _train(run, Path(run_dir), phases, stop)
    except KeyboardInterrupt:  # before the driver's own handling: start-up
        code = stop.exit_code or EXIT_INTERRUPTED
        report.say(f"stopped by {stop.reason or 'an interrupt'} during start-up ({phases.current}) (exit code "
                   f"{code}); {last_checkpoint(run_dir)}")
        return code
    finally:
        report.job_ended()


def _train(run: ResolvedRun, run_dir: Path, phases: report.Phases, stop: Any) -> int:
    cfg = run.cfg
    phases.done("config + plan checked", _describe_config(run, run_dir), since_start=True)
    decision = run_identity.settle(cfg, run_dir)
    if decision.exit_code is not None:
        return decision.exit_code
    if cfg.trainer.launcher == "ray":  # a cluster that does not answer is said in seconds, before the imports
        from qwen35rl.exit_codes import EXIT_PREFLIGHT
        from qwen35rl.runtime.cluster import unreachable_cluster

        problem = unreachable_cluster(cfg)
        if problem:
            log.error("%s", problem)
            return EXIT_PREFLIGHT
    early = _early_local_ray(run)
    _early_local_processes(run)
    try:
        phases.begin("libraries imported")
        t0 = time.monotonic()
        from qwen35rl.runtime.driver import run_training  # torch, transformers: the slow imports

        import torch
        import transformers

        if time.monotonic() - t0 > 0.05:
            phases.done("libraries imported", f"torch {torch.__version__}, transformers {transformers.__version__}")
        return run_training(run, run_dir, decision=decision, phases=phases, stop=stop, early_ray=early)
    finally:
        if early is not None:
            early.close()


def _early_local_processes(run: ResolvedRun) -> None:
    """The local workers' server, importing torch and the engines now in its own process (`local_processes`)."""
    from qwen35rl.runtime import local_processes

    if local_processes.wanted(run):
        local_processes.start_server(run)


def _early_local_ray(run: ResolvedRun) -> Any:
    """The run's own local Ray cluster, starting now in a thread (`cluster.EarlyLocalRay`), or None."""
    from qwen35rl.runtime.cluster import EarlyLocalRay

    if not EarlyLocalRay.wanted(run.cfg):
        return None
    from qwen35rl.runtime.platform import resolve_platform

    return EarlyLocalRay(run.cfg, resolve_platform(run.cfg), run.layout.devices)
