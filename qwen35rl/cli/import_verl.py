"""`qwen35rl-import verl SOURCE`: a verl launch script (or its override list) -> a qwen35rl experiment overlay, the
`qwen35rl-train` command that runs it, and a table of every verl key (carried, already the default, carried from
verl's default, not carried and why). The imported composition is then checked by the plan like any other.

Exit 0 when the imported composition plans valid, 2 when it does not or the launch cannot be imported. A launch
with parts qwen35rl does not run (another engine or entry point, a non-GRPO algorithm, distillation, a reward model,
video data) is refused with every part named; `--force` imports the rest and lists what it left out. A checkpoint
that is not Qwen3.5 is refused even then. The script
runs under bash with stand-in python3/uv/ray/torchrun/pip/hf first on PATH: this is not a sandbox (a script can
still call programs by absolute path), so import only scripts you would run."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from qwen35rl.cli.stdout import console_script
from qwen35rl.config.problems import EXIT_CONFIG
from qwen35rl.config.paths import ENV_CONFIG_PATH, config_path_set, extra_config_dirs


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="qwen35rl-import",
        description="Turn a verl launch into a qwen35rl composition: an experiment overlay plus the command that "
                    "runs it. The script is evaluated with bash under a clean environment and stand-in python3, uv, "
                    "ray, torchrun, pip and hf (nothing is started, downloaded or installed; not a sandbox: import "
                    "only scripts you would run).")
    p.add_argument("framework", choices=["verl"], help="the framework the launch is for")
    p.add_argument("source", help="a verl launch script (.sh) or a text file with one override per line")
    p.add_argument("--device", choices=["gpu", "npu"], default="gpu",
                   help="the hardware the script branches on ($DEVICE, the torch_npu probe); default gpu")
    p.add_argument("--devices-per-node", type=int, default=None, metavar="N",
                   help="what device-count probes answer (default 8 on gpu, 16 on npu)")
    p.add_argument("--env", metavar="FILE", help="KEY=VALUE lines of the launch environment")
    p.add_argument("--name", help="the experiment's name (default: verl's trainer.experiment_name)")
    p.add_argument("--out", metavar="DIR", help=f"where experiment/NAME.yaml goes (default: the first "
                   f"{ENV_CONFIG_PATH} entry, else ./qwen35rl_conf)")
    p.add_argument("--model", help="the model option, when the checkpoint is neither here nor named like one")
    p.add_argument("--hw", help="the hw option, instead of the preset matching the launch's device counts")
    p.add_argument("--data", help="the data option, instead of the one the data files suggest")
    p.add_argument("--backend", choices=["fsdp", "megatron"],
                   help="the backend option, instead of the one the launch's engine names")
    p.add_argument("--force", action="store_true",
                   help="replace an existing overlay of that name, and import a launch with refused parts: they are "
                        "left out and listed (a checkpoint that is not Qwen3.5 is refused still)")
    p.add_argument("--format", choices=["text", "json"], default="text")
    return p


def out_dir(arg: Optional[str]) -> Path:
    if arg:
        return Path(arg).expanduser().resolve()
    extra = extra_config_dirs()
    return extra[0] if extra else Path("qwen35rl_conf").resolve()


def check_plan(cmd: Sequence[str], env: Dict[str, str]) -> Dict[str, Any]:
    from qwen35rl.config.compose import ConfigError, compose
    from qwen35rl.config.plan import build_plan

    with config_path_set(env.get(ENV_CONFIG_PATH)):
        try:
            plan = build_plan(compose(list(cmd[1:])))
        except ConfigError as e:
            return {"valid": False, "problems": [e.to_problem_dict()]}
    return {"valid": plan["valid"], "problems": plan["problems"]}


def report(imp, overlay: Path, hw_overlay: Optional[Path], cmd: List[str], cmd_env: Dict[str, str],
           plan: Dict[str, Any]) -> Dict[str, Any]:
    return {"overlay": str(overlay), "hw_overlay": str(hw_overlay) if hw_overlay else None, "name": imp.name,
            "command": cmd, "command_env": cmd_env, "model": imp.groups["model"], "backend": imp.groups["backend"],
            "hw": imp.groups["hw"], "data": imp.groups["data"], "picked": imp.picked, "carried": imp.carried,
            "defaults": imp.defaults, "verl_defaults": imp.verl_defaults, "implied": imp.implied,
            "fixed": imp.fixed, "not_carried": imp.not_carried, "dropped": imp.dropped, "settings": imp.overlay,
            "env": {"carried": imp.env_carried, "defaults": imp.env_defaults, "not_carried": imp.env_not_carried},
            "plan": plan}


def _short(v: Any, width: int = 60) -> str:
    from qwen35rl.config.verl.exporter import hydra_value

    text = hydra_value(v)
    return text if len(text) <= width else text[:width - 3] + "..."


def _wrapped(items: Sequence[str], indent: str, width: int = 116) -> List[str]:
    import textwrap

    return textwrap.wrap(", ".join(items), width, initial_indent=indent, subsequent_indent=indent,
                         break_on_hyphens=False)


def render(r: Dict[str, Any], values: Dict[str, Any], source: str) -> str:
    import shlex

    lines = [f"qwen35rl-import verl: {source} -> {r['overlay']}"]
    if r["dropped"]:
        lines.append(f"LEFT OUT (--force): {len(r['dropped'])} part(s) of the launch qwen35rl does not run:")
        lines += [f"  {x['key']}={_short(x['value'], 40)}: {x['why']}; {x['instead']}" for x in r["dropped"]]
    for g in ("model", "backend", "hw", "data"):
        lines.append(f"  {g + '=' + r[g]:<28} from {r['picked'][g]}")
    if r["hw_overlay"]:
        lines.append(f"  new hw overlay: {r['hw_overlay']}")
    left_out = [x for x in r["dropped"] if x["key"] in values]  # a refused entry point or default is no key
    n_keys = len(r["carried"]) + len(r["defaults"]) + len(r["fixed"]) + len(r["not_carried"]) + len(left_out)
    lines.append(f"verl keys: {n_keys} ({len(r['carried'])} carried, {len(r['defaults'])} already the default, "
                 f"{len(r['fixed'])} what qwen35rl always does, {len(r['not_carried'])} not carried"
                 + (f", {len(left_out)} left out" if left_out else "")
                 + f"); {len(r['verl_defaults'])} verl defaults carried")
    if r["carried"]:
        lines.append("  carried:")
        lines += [f"    {k}={_short(values.get(k))}  ->  {q}" for k, q in r["carried"].items()]
    if r["verl_defaults"]:
        lines.append("  verl defaults the script relies on, where qwen35rl composes otherwise (carried):")
        lines += [f"    {k} (verl's default)  ->  {q}={_short(r['settings'].get(q))}" for k, q in r["verl_defaults"].items()]
    if r["implied"]:
        lines.append("  verl's data format (prompt_key=prompt: preprocessed parquet):")
        lines += [f"    {k}={_short(v)}" for k, v in r["implied"].items()]
    if r["defaults"]:
        lines.append("  already the composed default:")
        lines += _wrapped(r["defaults"], "    ")
    if r["fixed"]:
        lines.append("  what qwen35rl always does (no setting needed):")
        lines += [f"    {k}={_short(values.get(k), 40)}  ({why})" for k, why in r["fixed"].items()]
    if r["not_carried"]:
        lines.append("  not carried:")
        lines += [f"    {x['key']}={_short(x['value'], 40)}  ({x['why']})" for x in r["not_carried"]]
    env = r["env"]
    if env["carried"] or env["defaults"] or env["not_carried"]:
        lines.append("environment:")
        if env["carried"]:
            lines.append("  carried: " + ", ".join(f"{k} -> {q}" for k, q in env["carried"].items()))
        if env["defaults"]:
            lines.append("  already the default:")
            lines += _wrapped(env["defaults"], "    ")
        lines += [f"  not carried: {x['key']}  ({x['why']})" for x in env["not_carried"]]
    plan = r["plan"]
    errors = [p for p in plan["problems"] if p["severity"] == "error"]
    warnings = [p for p in plan["problems"] if p["severity"] != "error"]
    lines.append(f"plan: {'VALID' if plan['valid'] else 'INVALID'}" +
                 (f" ({len(warnings)} warning(s))" if warnings else ""))
    for p in errors + warnings:
        lines.append(f"  {p['severity']}: {p['key']}: {p['message']}" + (f"\n    hint: {p['hint']}" if p.get("hint") else ""))
    prefix = "".join(f"{k}={shlex.quote(v)} " for k, v in r["command_env"].items())
    lines += ["run it:", f"  {prefix}{' '.join(shlex.quote(a) for a in r['command'])}",
              f"  (check it first: {prefix}qwen35rl-plan {' '.join(shlex.quote(a) for a in r['command'][1:])})"]
    return "\n".join(lines)


def _written(write: Any, directory: Path, failure: Any) -> Any:
    """`write()` of the overlays under `directory`, a refusal naming --out when they cannot go there (a file in the
    way, a read-only directory, a full disk)."""
    from qwen35rl.config.paths import unwritable_dir

    why = unwritable_dir(str(directory))
    if why is None:
        try:
            return write()
        except OSError as e:
            why = f"{e.strerror or e} ({e.filename or directory})"
    raise failure("--out", f"the overlay cannot be written under {directory}: {why}",
                  "pass --out DIR, a directory you can write")


@console_script
def main(argv: Optional[Sequence[str]] = None) -> int:
    from qwen35rl.config.verl.importer import ImportFailure, command, import_launch, write_overlay
    from qwen35rl.config.verl.script import ScriptError, load_source, read_env_file

    args = parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        if not Path(args.source).is_file():
            raise ImportFailure("SOURCE", f"{args.source} is not a file", "pass a verl launch script or an "
                                "override list")
        env = read_env_file(args.env) if args.env else {}
        launch = load_source(args.source, device=args.device, env=env, devices_per_node=args.devices_per_node)
        imp = import_launch(launch.argv, launch.env, device=args.device, name=args.name, fallback_name=Path(args.source).stem,
                            model=args.model, hw=args.hw, data=args.data, entry=launch.entry, force=args.force,
                            backend=args.backend)
        directory = out_dir(args.out)
        overlay, hw_overlay = _written(lambda: write_overlay(imp, directory, args.source, force=args.force),
                                       directory, ImportFailure)
    except (ImportFailure, ScriptError) as e:
        print(e.render() if hasattr(e, "render") else f"qwen35rl-import: {e}", file=sys.stderr)
        if args.format == "json":
            out = {"error": str(getattr(e, "message", e)), "key": getattr(e, "key", "SOURCE")}
            if getattr(e, "refusals", None):
                out["refused"] = [r.as_dict() for r in e.refusals]
            print(json.dumps(out, default=str))
        return EXIT_CONFIG
    cmd = command(imp)
    cmd_env = {}
    if directory not in extra_config_dirs():
        cmd_env[ENV_CONFIG_PATH] = os.pathsep.join([*map(str, extra_config_dirs()), str(directory)])
    plan = check_plan(cmd, cmd_env)
    r = report(imp, overlay, hw_overlay, cmd, cmd_env, plan)
    if args.format == "json":
        print(json.dumps(r, default=str))
    else:
        print(render(r, imp.verl_values, args.source))
    return 0 if plan["valid"] else EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
