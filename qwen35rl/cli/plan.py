"""`qwen35rl-plan [overrides]`: compose, check and print the plan of a run without starting anything.

Exit 0 when the plan is valid, 2 when it is not or the config cannot be composed. `format=json` prints exactly one
JSON object on stdout (one per job with -m). Imports no torch, ray, transformers or vllm. `--help` (qwen35rl/cli/help.py)
says more."""
from __future__ import annotations

import json
import sys
from typing import Any, Dict, List, Optional, Sequence

from omegaconf import DictConfig

from qwen35rl.cli.common import EXIT_CONFIG, output_format, run_hydra, start
from qwen35rl.cli.stdout import console_script, writing_stdout
from qwen35rl.config.compose import resolve_in_place

_sweep_results: List[Dict[str, Any]] = []


def emit(plan: Dict[str, Any], fmt: str, cfg: DictConfig) -> None:
    from qwen35rl.config.plan import render_text
    from qwen35rl.config.redact import redact_urls

    plan.update(redact_urls(plan))  # a URL's password in any value (an address, a path) is not printed

    if fmt == "json":
        print(json.dumps(plan), flush=True)
    elif fmt == "verl":
        from qwen35rl.config.verl.exporter import render, shell_problems

        refused = shell_problems(cfg, plan["verl"]) if "verl" in plan else []
        if refused:  # what the script cannot hold safely: nothing of it is printed, and the plan is invalid
            plan["problems"] = plan["problems"] + [p.to_dict() for p in refused]
            plan["valid"] = False
        elif "verl" in plan:
            print(render(plan["verl"]), flush=True)
        if not plan["valid"]:  # the problems go to stderr and the exit code says it (another one's launch prints)
            print(render_text(plan), file=sys.stderr, flush=True)
    else:
        print(render_text(plan), flush=True)


def plan_config(cfg: DictConfig) -> Dict[str, Any]:
    from qwen35rl.config.plan import build_plan

    return build_plan(cfg)


def _sweep_job(cfg: DictConfig) -> Dict[str, Any]:
    from hydra.core.hydra_config import HydraConfig

    resolve_in_place(cfg)  # a literal ${ in a value stays literal
    plan = plan_config(cfg)
    sweep = HydraConfig.get().sweep  # the job's directory as this sweep lays it out (training's sweep has its own)
    plan["output_dir"] = f"{sweep.dir}/{sweep.subdir}"
    _sweep_results.append(plan)
    with writing_stdout():
        emit(plan, str(cfg.format), cfg)
    return plan


@console_script
def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, cfg, done = start(argv, "plan")
    if done is not None:
        return done
    if args.multirun:
        _sweep_results.clear()
        run_hydra(_sweep_job, args, "plan", extra=["hydra.output_subdir=null"])
        return 0 if any(p["valid"] for p in _sweep_results) else EXIT_CONFIG
    plan = plan_config(cfg)
    plan["output_dir"] = args.run_dir  # where training writes: hydra.run.dir, whatever sets it
    emit(plan, output_format(args.overrides), cfg)
    return 0 if plan["valid"] else EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
