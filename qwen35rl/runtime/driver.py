"""What a training job does once its config is checked: the data, the checkpoint to resume from, Ray and the
preflight, the workers and their engines, then the GRPO loop (`qwen35rl.runtime.grpo`); every failure ends in one
block and an exit code (`qwen35rl.runtime.disk_full` for a full disk)."""
from __future__ import annotations

import logging
from contextlib import contextmanager, nullcontext
from functools import partial
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from omegaconf import DictConfig

from qwen35rl.config import capabilities
from qwen35rl.config.problems import EXIT_CONFIG
from qwen35rl.config.resolved import ResolvedRun, resolve_run
from qwen35rl.exit_codes import EXIT_INTERRUPTED, EXIT_REWARD_FAILURE, EXIT_TERMINATED, ExitCode
from qwen35rl.runtime import checkpoint as ckpt
from qwen35rl.runtime.disk_full import disk_full, quiet_log_files_when_full, report_disk_full
from qwen35rl.runtime.grpo import GRPOTrainer, RewardFailure
from qwen35rl.runtime import provenance, quiet, report
from qwen35rl.runtime.cluster import (EXIT_WORKER_FAILURE, ClusterError, LocalWorkerGroup, WorkerFailure, WorkerGroup,
                                      ray_session)
from qwen35rl.runtime.platform import Platform, require_stack, resolve_platform
from qwen35rl.runtime.preflight import EXIT_PREFLIGHT, PreflightError, run_local_preflight, run_preflight
from qwen35rl.runtime import signals
from qwen35rl.runtime.signals import StopRequest
from qwen35rl.runtime.tracking import Tracking, plot_curves_safely
from qwen35rl.runtime.worker import PolicyWorker, needs_reference
from qwen35rl.runtime.worker_groups import PolicyWorkers, RolloutWorkers

log = logging.getLogger(__name__)

EXIT_ERROR = int(ExitCode.ERROR)
"""An unexpected error (a bug): said in one block, the traceback in the log file."""


class _Where:
    """What the run is doing, for a failure's block: the start-up phase, then the trainer's activity."""

    def __init__(self, phases: report.Phases):
        self.phases = phases
        self.trainer: Any = None

    def __str__(self) -> str:
        if self.trainer is not None and self.trainer.activity:
            return self.trainer.activity
        return f"start-up ({self.phases.current})"


def run_training(run: Union[ResolvedRun, DictConfig], run_dir: Path, *, decision: Any = None,
                 phases: Optional[report.Phases] = None, stop: Optional[StopRequest] = None,
                 early_ray: Any = None) -> int:
    """Train the validated `run` in `run_dir`; returns the process exit code (qwen35rl.exit_codes). A config
    (tests, scripts) is resolved here first, as `qwen35rl-train` resolves it before the job starts.
    `decision`: what run_identity decided about the run directory (decided here when not given); `phases`: the
    start-up clock of the launch; `stop`: the launch's signal handling, installed already (else installed here once
    Ray is up); `early_ray`: the local cluster's start under way (`cluster.EarlyLocalRay`). A full disk anywhere ends the run with EXIT_DISK_FULL and one block saying what could not be
    written; any other failure ends it with one block too (its traceback in the log file)."""
    run_dir = Path(run_dir).resolve()
    where = _Where(phases or report.Phases())
    quiet_log_files_when_full()
    try:
        run = run if isinstance(run, ResolvedRun) else resolve_run(run, str(run_dir))
        return _run_training(run, run_dir, decision, where, stop, early_ray)
    except Exception as e:  # noqa: BLE001 - every failure ends in one block and an exit code
        if disk_full(e):
            return report_disk_full(e, run_dir)
        log.error("%s", report.unexpected_block(e, str(where), run_dir, EXIT_ERROR))
        return EXIT_ERROR


def _describe_data(train_set: Sequence[Any], loader: Any, val_set: Sequence[Any], total_steps: int,
                   cfg: DictConfig, skipped: Optional[Dict[str, List[str]]] = None) -> str:
    bad = {split: len(rows) for split, rows in (skipped or {}).items() if rows}

    def left_out(split: str) -> str:
        return f" ({bad[split]} bad row(s) skipped: data.skip_bad_rows=true)" if split in bad else ""

    return (f"{len(train_set)} train prompts ({loader.batches_per_epoch} steps of {cfg.data.train_batch_size} per "
            f"epoch){left_out('train')}, {len(val_set)} validation prompts{left_out('val')}, reward {cfg.data.reward}; "
            f"{total_steps} step(s) to run")


def _run_training(run: ResolvedRun, run_dir: Path, decision: Any, where: _Where, given_stop: Optional[StopRequest],
                  early_ray: Any = None) -> int:
    from qwen35rl.runtime import run_identity

    cfg, layout = run.cfg, run.layout
    phases = where.phases
    run_dir.mkdir(parents=True, exist_ok=True)
    if decision is None:
        decision = run_identity.settle(cfg, run_dir)
    if decision.exit_code is not None:
        return decision.exit_code
    phases.begin("data")
    platform = resolve_platform(cfg)
    require_stack(platform, cfg.rollout.engine)
    note = quiet.note_for_log(platform.device_type)
    if note and quiet.quiet_known_warnings(platform.device_type):
        report.file_log.info("%s", note)

    from qwen35rl.data import PromptLoader, build_dataset
    from qwen35rl.models.tokenizer import build_tokenizer
    from qwen35rl.rewards import get_reward_fn

    tokenizer = build_tokenizer(cfg.model)
    skipped_rows: Dict[str, List[str]] = {"train": [], "val": []}  # data.skip_bad_rows: the rows left out

    def prompts(split: str) -> List[Any]:
        examples = build_dataset(cfg.data, tokenizer, split, skipped_rows[split])
        if cfg.data.kind == "multimodal":
            from qwen35rl.runtime.image_prompts import tokenize_image_prompts

            examples = tokenize_image_prompts(examples, cfg.model, cfg.data, tokenizer, split)
        return examples

    from qwen35rl.data import DataError

    try:  # prompts that cannot make a batch are the config's problem: said before Ray, exit 2
        train_set = prompts("train")
        loader = PromptLoader(train_set, cfg.data.train_batch_size, seed=cfg.trainer.seed, shuffle=cfg.data.shuffle)
        validating = cfg.trainer.test_freq > 0 or cfg.trainer.val_before_train
        val_set = prompts("val") if validating else []
    except (DataError, ValueError) as e:
        if isinstance(e, DataError) or "needs at least that many prompts" in str(e):
            log.error("[data_unusable] data: %s\n  nothing was started", e)
            return EXIT_CONFIG
        raise
    total_steps = int(cfg.trainer.total_steps or cfg.trainer.total_epochs * loader.batches_per_epoch)
    try:
        reward_fn = get_reward_fn(cfg.data.reward)
    except Exception as e:  # noqa: BLE001 - a reward that does not load is the config's problem, said before Ray
        why = str(e) if str(e).startswith("data.reward") else f"data.reward={cfg.data.reward!r}: {type(e).__name__}: {e}"
        log.error("[reward_not_loadable] data.reward: %s\n  hint: a built-in reward, or an importable "
                  "`pkg.module:function` (or `path/to/file.py:function`, or verl's "
                  "`verl:path/to/file.py:compute_score`); nothing was started", why)
        return EXIT_CONFIG

    checkpoints = ckpt.CheckpointManager(ckpt.checkpoint_dir(run_dir, cfg), cfg.trainer.max_keep_checkpoints)
    checkpoints.remove_partial()
    try:
        resume_from = checkpoints.resolve(cfg.trainer.resume)
    except ckpt.CheckpointError as e:  # an explicit trainer.resume that is missing or damaged: before Ray starts
        log.error("%s", e)
        return EXIT_CONFIG
    meta = ckpt.read_meta(resume_from) if resume_from else {}
    refused = resume_from and capabilities.resume_problem(meta.get("checkpoint_layout"),
                                                          capabilities.checkpoint_layout(cfg, layout))
    if refused:
        log.error("cannot resume from %s\n%s", resume_from, refused.render())
        return EXIT_CONFIG
    start_step = int(meta["step"]) if resume_from else 0
    if resume_from is None:
        moved = run_identity.start_over(run_dir, checkpoints.root)
        if moved is not None:
            report.say(f"starting over at step 0 (trainer.resume={cfg.trainer.resume}): the earlier run's outputs in "
                       f"this directory moved to {report.shown_path(moved)}/")
    start_dir = provenance.record_start(run_dir, cfg, start_step=start_step, resume_from=resume_from)
    tracking = Tracking(cfg, run_dir, total_steps, start_step)

    from qwen35rl.rewards.scoring import warm_pool

    warm_pool()  # reward workers start while Ray and the workers do; out of every scoring time limit
    phases.done("data ready", _describe_data(train_set, loader, val_set, total_steps, cfg, skipped_rows)
                + (f"; resuming from {report.shown_path(resume_from)} (step {start_step} of {total_steps})"
                   if resume_from else ""))
    code = EXIT_ERROR
    trainer = None
    stop = given_stop or StopRequest(cfg.trainer.get("stop_timeout_s", signals.STOP_TIMEOUT_S))
    try:
        phases.begin("Ray up" if cfg.trainer.launcher == "ray" else "preflight")
        with launcher(run, platform, phases, early_ray) as (preflight, group_cls), \
                (nullcontext(stop) if given_stop else stop):
            phases.begin("preflight")
            provenance.record_cluster(start_dir, preflight())
            phases.mark("preflight")  # the preflight says its own line
            optimizer_steps = (total_steps * cfg.algorithm.ppo_epochs
                               * (cfg.data.train_batch_size // cfg.algorithm.mini_batch_size))
            phases.begin("workers up")

            def started() -> None:
                pools = f" ({layout.world} training, {layout.rollout_world} rollout)" if layout.split else ""
                phases.done("workers up", f"{layout.devices} worker process(es){pools} on {cfg.hw.nodes} node(s)")
                phases.begin("engines built")

            workers, rollout_workers = start_workers(run, platform, group_cls, started, run_dir=str(run_dir),
                                                     optimizer_steps=optimizer_steps)
            try:
                phases.done("engines built", _describe_engines(run, workers.engine_build_s()))
                trainer = GRPOTrainer(cfg, layout, workers, tokenizer, loader, val_set, reward_fn,
                                      tracking, checkpoints, stop, total_steps, run_dir, rollout_workers=rollout_workers)
                trainer.phases, trainer.provenance_start = phases, start_dir.name
                if cfg.data.skip_bad_rows:
                    trainer.data_metrics = {f"data/skipped_rows/{split}": len(rows)
                                            for split, rows in skipped_rows.items()}
                where.trainer = trainer
                if resume_from:
                    phases.begin("checkpoint restored")
                    trainer.restore(resume_from)
                    phases.done("checkpoint restored", f"step {start_step} from {report.shown_path(resume_from)}")
                phases.begin("first step")
                code = trainer.fit()
                return code
            finally:
                stop.ending()  # a signal from here on does not cut the clean-up short
                if trainer is not None and not stop.abandoned:
                    trainer.prefetch.close()
                workers.shutdown()
                if rollout_workers is not workers:
                    rollout_workers.shutdown()
                if trainer is not None and stop.abandoned:  # its generation ended with the workers
                    trainer.prefetch.close()
    except KeyboardInterrupt:  # a second signal, the stop timeout, or a signal during start-up
        code = stop.exit_code or EXIT_INTERRUPTED
        if trainer is None:
            report.say(f"stopped by {stop.reason or 'an interrupt'} during {where} (exit code {code}); "
                       f"{signals.last_checkpoint(run_dir)}")
        return code
    except (PreflightError, ClusterError) as e:
        log.error("%s", e)
        return EXIT_PREFLIGHT
    except WorkerFailure as e:  # every worker was killed on the way out, and a local Ray stopped
        if disk_full(e):
            raise  # said as a full disk by run_training
        log.error("%s", report.failure_block("a worker failed", what=str(e), where=str(where),
                                             fix=report.known_fix(f"{e.cause}\n{e.detail}"),
                                             code=EXIT_WORKER_FAILURE, run_dir=run_dir, detail=e.detail))
        return EXIT_WORKER_FAILURE
    except RewardFailure as e:
        log.error("%s", report.failure_block(
            "the reward function failed too often", what=str(e), where=str(where),
            fix="fix the reward function (or raise data.max_reward_failure_rate / data.reward_timeout_s), then run "
                "the same command again", code=EXIT_REWARD_FAILURE, run_dir=run_dir))
        return EXIT_REWARD_FAILURE
    except ckpt.CheckpointError as e:
        log.error("%s", e)
        return EXIT_CONFIG
    finally:  # clean-up never raises a second error: the exit code stays the first one's
        tracking.close()
        plot_curves_safely(run_dir)
        if trainer is not None and code in (0, EXIT_INTERRUPTED, EXIT_TERMINATED):
            _say_summary(trainer, run_dir, code, phases)


def _describe_engines(run: ResolvedRun, took: Dict[str, float]) -> str:
    """What each worker built; `took`: rank 0's seconds per part (where a long start-up's minutes went)."""
    cfg = run.cfg
    train = [f"{cfg.backend.name} train engine"] + (["reference policy"] if needs_reference(cfg) else [])
    if run.layout.split:
        built = (f"{', '.join(train)} on each training worker; {cfg.rollout.engine} rollout engine on each rollout "
                 f"worker")
    else:
        built = ", ".join(train + [f"{cfg.rollout.engine} rollout engine"]) + " on each worker"
    return built + (f" (rank 0: {', '.join(f'{part} {s:.1f} s' for part, s in took.items())})" if took else "")


def start_workers(run: ResolvedRun, platform: Platform, group_cls: type, on_started: Callable[[], None],
                  **worker_kwargs: Any) -> Tuple[PolicyWorkers, Union[PolicyWorkers, RolloutWorkers]]:
    """(training workers, rollout workers): one colocated group twice, or with `placement=split` the training pool on
    the first devices and the rollout pool on the last, joined by a weight-sync communicator of their own (training
    rank 0 hosts it and sends; see `weight_sync`). Every worker gets `run`'s config and layout as they are."""
    layout = run.layout
    if not layout.split:
        workers = PolicyWorkers(group_cls.create(run, platform, PolicyWorker, layout.world, on_started=on_started,
                                                 **worker_kwargs))
        return workers, workers
    from qwen35rl.runtime.rollout_worker import RolloutWorker

    capabilities.check_placement(run.cfg)  # what the plan refuses never reaches the workers
    train_group, rollout_group = group_cls.create_pools(run, platform, [
        (PolicyWorker, layout.world, worker_kwargs), (RolloutWorker, layout.rollout_world, {})],
        on_started=on_started)
    workers, rollout_workers = PolicyWorkers(train_group), RolloutWorkers(rollout_group)
    try:
        workers.join_weight_sync(rollout_workers)
    except BaseException:
        workers.shutdown()
        rollout_workers.shutdown()
        raise
    return workers, rollout_workers


def _say_summary(trainer: "GRPOTrainer", run_dir: Path, code: int, phases: report.Phases) -> None:
    """The end-of-run block (a summary must not turn a finished run into a failed one)."""
    try:
        from qwen35rl.runtime.tracking import METRICS_FILE, read_metrics

        rows = read_metrics(run_dir / METRICS_FILE)
        done_steps = trainer.step - trainer.first_step
        if code == 0:
            head = f"done: step {trainer.step} of {trainer.total_steps}"
        elif trainer.stop.abandoned and trainer.activity:  # the step under way was given up: its work is lost
            done_steps = max(0, done_steps - 1)
            head = (f"stopped in {trainer.activity} (exit code {code}): {trainer.stop.reason}; what it did is not "
                    f"kept, {signals.last_checkpoint(run_dir)}")
        elif trainer.stop.abandoned:
            head = (f"stopped by {trainer.stop.reason} during start-up ({phases.current}) (exit code {code}); "
                    f"{signals.last_checkpoint(run_dir)}")
        else:
            head = (f"stopped at step {trainer.step} of {trainer.total_steps} (exit code {code}); "
                    f"{signals.last_checkpoint(run_dir)}")
        report.say(report.summary(run_dir, rows, trainer.total_steps, head=head, wall_s=phases.total_s(),
                                  steps_this_launch=done_steps))
    except Exception as e:  # noqa: BLE001
        log.warning("no end-of-run summary: %s: %s", type(e).__name__, e)


@contextmanager
def launcher(run: ResolvedRun, platform: Platform, phases: Optional[report.Phases] = None,
             early_ray: Any = None) -> Iterator[Tuple[Callable[[], Dict[str, Any]], type]]:
    """How the workers start (trainer.launcher): yields the preflight to run and the worker group class. `ray`
    connects to Ray for the duration (a local cluster it starts is stopped on exit); `local` needs no Ray: one
    worker lives in this process, more are local processes (`local_processes`), and the probe runs here. A local
    CPU cluster is probed here too: its one node is this host, and a probe task would cost a process start."""
    cfg = run.cfg
    if cfg.trainer.launcher == "local":
        from qwen35rl.runtime import local_processes

        yield (partial(run_local_preflight, run, platform),
               local_processes.ProcessWorkerGroup if local_processes.wanted(run) else LocalWorkerGroup)
        return
    with ray_session(cfg, platform, run.layout.devices, early_ray) as started_local:
        if phases is not None:
            beside = f"; started beside the imports, {early_ray.seconds:.1f} s in all" if early_ray else ""
            phases.done("Ray up", _describe_ray(started_local) + beside)
        # a cluster still being assembled gets time to reach its size; a local one is what it is
        wait_s = 0.0 if started_local else cfg.trainer.placement_timeout_s
        here = started_local and platform.device_type == "cpu"
        yield partial(run_preflight, run, platform, wait_s=wait_s, in_process=here), WorkerGroup


def _describe_ray(started_local: bool) -> str:
    import ray

    try:
        resources = ray.cluster_resources()
        nodes = len([n for n in ray.nodes() if n.get("Alive")])
    except Exception:  # noqa: BLE001 - a description only
        resources, nodes = {}, 0
    have = ", ".join(f"{resources[k]:g} {k}" for k in ("CPU", "GPU", "NPU") if resources.get(k))
    what = "started a local cluster" if started_local else f"joined the cluster at {ray.get_runtime_context().gcs_address}"
    return f"{what} ({nodes} node(s){', ' + have if have else ''})"


