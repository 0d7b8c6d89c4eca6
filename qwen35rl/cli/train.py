"""`qwen35rl-train [overrides]`: compose and check the run config, then build the Ray workers and run GRPO.

With no arguments it trains the tiny Qwen3.5 on CPU (the embedded default). Every config problem is reported before
Ray or any heavy package starts; with -m, invalid jobs of a sweep are skipped and listed.

Exit codes (qwen35rl/exit_codes.py):
"""
from __future__ import annotations

import dataclasses
import sys

from qwen35rl.exit_codes import EXIT_INTERRUPTED, EXIT_TERMINATED, table as _exit_code_table

__doc__ += _exit_code_table() + "\n"
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from qwen35rl.cli.common import EXIT_CONFIG, run_hydra, start
from qwen35rl.cli.stdout import console_script
from qwen35rl.config.compose import resolve_in_place
from qwen35rl.config.problems import ERROR, Problem

if TYPE_CHECKING:
    from qwen35rl.config.resolved import ResolvedRun

_exit_codes: List[int] = []
_checked: Dict[str, Any] = {}
"""A single run as `main` resolved and checked it before Hydra started the job: the job takes it instead of
searching the layout and running the rules a second time (a sweep's jobs each do it themselves)."""


def launch_problems(run: ResolvedRun) -> List[Problem]:
    """Problems that stop a launch: what resolving found, the plan's errors, and missing cluster packages (warnings
    for a plan, errors for a run, which needs them here)."""
    from qwen35rl.config.plan import environment_problems
    from qwen35rl.config import rules

    problems = list(run.problems) + rules.check_all(run.cfg, run.layout)
    problems += [Problem(p.code, p.key, p.message, p.hint, ERROR) for p in environment_problems(run.cfg)]
    # what the plan only warns of for a cluster run, a launch needs here: the checkpoint path, the tracker packages
    # (the driver builds the trackers)
    needed = lambda p: p.code == "model_path_missing" or (p.code == "names_valid" and p.key == "trainer.trackers")  # noqa: E731
    return [Problem(p.code, p.key, p.message, p.hint, ERROR) if needed(p) else p for p in problems]


def _print_problems(problems: List[Problem]) -> None:
    for p in problems:
        print(f"qwen35rl: {p.render()}", file=sys.stderr)


def _train_job(cfg: DictConfig) -> Dict[str, Any]:
    from hydra.core.hydra_config import HydraConfig
    from qwen35rl.config.resolved import resolve_run

    stopped = next((c for c in _exit_codes if c in (EXIT_INTERRUPTED, EXIT_TERMINATED)), None)
    if stopped is not None:  # Ctrl-C / SIGTERM stopped an earlier job of this sweep: the rest do not start
        print("qwen35rl: not started: the sweep was stopped by a signal in an earlier job", file=sys.stderr)
        _exit_codes.append(stopped)
        return {"valid": True, "problems": [], "exit_code": stopped, "skipped": "the sweep was stopped"}
    resolve_in_place(cfg)  # a literal ${ in a value stays literal
    run_dir = str(HydraConfig.get().runtime.output_dir)
    checked = _checked.pop("run", None)
    if checked is not None and checked[0] == OmegaConf.to_container(cfg):  # the config main checked: as it was
        run, problems = dataclasses.replace(checked[1], run_dir=run_dir), list(checked[2])
    else:
        run = resolve_run(cfg, run_dir)
        problems = launch_problems(run)
    errors = [p for p in problems if p.severity == ERROR]
    _print_problems(problems)
    if errors:  # a sweep job that is invalid returns without launching anything
        _exit_codes.append(EXIT_CONFIG)
        return {"valid": False, "problems": [p.to_dict() for p in problems]}
    from qwen35rl.runtime.entry import train as run_training  # run identity and start-up lines, then the driver
    from qwen35rl.runtime.slurm import ray_for_allocation

    # a multi-node Slurm job (hydra/launcher=submitit_slurm): Ray across its nodes, the run's config pointed at it
    # (a copy: the address changes nothing that was resolved)
    run = dataclasses.replace(run, cfg=ray_for_allocation(run.cfg.copy()))
    code = run_training(run, Path(run_dir))
    _exit_codes.append(code)
    return {"valid": True, "problems": [p.to_dict() for p in problems], "exit_code": code}


def _run_dir_refused(args: Any) -> bool:
    """The run directory cannot be made here (a file or a read-only directory in its way): said, before Hydra
    would fail making it."""
    from qwen35rl.config.paths import unwritable_dir

    why = unwritable_dir(args.run_dir)
    if why:
        given = any(o.lstrip("+").startswith("hydra.run.dir=") for o in args.overrides)
        key = "hydra.run.dir" if given else "trainer.output_root"
        print(f"qwen35rl: config error at '{key}': the run directory {args.run_dir} cannot be made: {why}\n"
              f"  hint:    set {key} to a directory you can write", file=sys.stderr)
    return bool(why)


def _reward_refused(name: str) -> bool:
    """A custom reward is loaded once here, before Hydra makes the run directory: one that does not load (or exits
    while being imported) is refused with nothing written. The plan only looks it up."""
    if ":" not in name:
        return False
    from qwen35rl.rewards.registry import get_reward_fn

    try:
        get_reward_fn(name)
    except ValueError as e:
        print(f"qwen35rl: error: [reward_not_loadable] data.reward: {e}\n  hint: a built-in reward, an importable "
              "`pkg.module:function`, `path/to/file.py:function` or verl's `verl:path/to/file.py:compute_score`; "
              "nothing was started", file=sys.stderr)
        return True
    return False


@console_script
def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, cfg, done = start(argv, "train")  # --help, --cfg, --info, a refused config: answered here, without Ray
    if done is not None:
        return done
    if not args.multirun:
        from qwen35rl.config.resolved import resolve_run

        if _run_dir_refused(args):
            return EXIT_CONFIG

        composed = OmegaConf.to_container(cfg)
        run = resolve_run(cfg, args.run_dir)
        problems = launch_problems(run)
        errors = [p for p in problems if p.severity == ERROR]
        if errors:
            _print_problems(errors)
            return EXIT_CONFIG
        if _reward_refused(str(run.cfg.data.reward)):
            return EXIT_CONFIG
        _checked["run"] = (composed, run, problems)
    _exit_codes.clear()
    try:
        run_hydra(_train_job, args, "train")
    finally:
        _checked.clear()
    if not _exit_codes:
        return 1
    if args.multirun:
        return 0 if any(c == 0 for c in _exit_codes) else max(_exit_codes)
    return _exit_codes[0]


if __name__ == "__main__":
    sys.exit(main())
