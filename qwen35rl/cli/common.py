"""What both entry points share: argument parsing with Hydra's own parser, the pre-launch config check, error
reporting (one block, exit code 2), and running a task through `@hydra.main` for multirun and run directories."""
from __future__ import annotations

import json
import sys
from typing import Any, Callable, Optional, Sequence, Tuple

from qwen35rl.config.compose import ConfigError, searchpath_override
from qwen35rl.config.paths import config_dir
from qwen35rl.config.problems import EXIT_CONFIG  # noqa: F401 - the CLI's exit code for a config it refuses
from qwen35rl.config.store import register

_PASS_THROUGH_FLAGS = ("help", "hydra_help", "info", "shell_completion", "cfg")


def parse_args(argv: Sequence[str]):
    from hydra._internal.utils import get_args_parser

    return get_args_parser().parse_args(list(argv))


def wants_hydra_only(args) -> bool:
    """--help, --info, --cfg ...: Hydra answers these itself."""
    return any(getattr(args, f, None) for f in _PASS_THROUGH_FLAGS)


def output_format(overrides: Sequence[str]) -> str:
    fmt = "text"
    for o in overrides:
        if o.startswith("format="):
            fmt = o.split("=", 1)[1]
    return fmt


def report_config_error(err: ConfigError, fmt: str) -> int:
    print(err.render(), file=sys.stderr)
    if fmt == "json":
        print(json.dumps({"valid": False, "problems": [err.to_problem_dict()]}))
    return EXIT_CONFIG


def run_hydra(task: Callable[[Any], Any], argv: Sequence[str], extra: Sequence[str] = ()) -> None:
    """Run `task` through @hydra.main over argv (+ our search path and extra overrides)."""
    import hydra

    register()
    sys_argv = sys.argv
    try:
        sys.argv = [sys_argv[0], *argv, *searchpath_override(), *extra]
        hydra.main(config_path=str(config_dir()), config_name="config", version_base="1.3")(task)()
    finally:
        sys.argv = sys_argv


def start(argv: Sequence[str]) -> Tuple[Any, Optional[Any], Optional[int]]:
    """Parse argv and check the config before anything runs: (args, composed config or None for a sweep, exit
    code when already done: Hydra's own flags answered, or a config error reported)."""
    from qwen35rl.config.compose import check_sweep, compose

    args = parse_args(argv)
    if wants_hydra_only(args):
        from omegaconf import OmegaConf

        if getattr(args, "cfg", None):  # Hydra prints the config itself: its output goes through the redaction
            print_redacted(lambda: run_hydra(lambda cfg: print(OmegaConf.to_yaml(cfg)), argv), args.overrides)
        else:
            run_hydra(lambda cfg: print(OmegaConf.to_yaml(cfg)), argv)
        return args, None, 0
    overrides = list(args.overrides)
    try:
        if args.multirun:
            check_sweep(overrides)
            return args, None, None
        return args, compose(overrides), None
    except ConfigError as e:
        e.overrides = overrides  # never echo the value of a secret-looking key
        return args, None, report_config_error(e, output_format(overrides))


def secrets_of(overrides: Sequence[str]) -> set:
    """The secret values a command line carries: in its overrides (by key name), in the config they compose and in
    the environment (qwen35rl/config/redact.py's rule)."""
    from qwen35rl.config.redact import is_secret_name, secret_values

    found = set()
    for ov in overrides:
        k, eq, v = ov.lstrip("+~").partition("=")
        if eq and v and is_secret_name(k.strip()):
            found.add(v)
    try:
        from omegaconf import OmegaConf
        from qwen35rl.config.compose import compose

        tree = OmegaConf.to_container(compose([o for o in overrides], resolve=False), resolve=False)
    except Exception:  # a config that does not compose: Hydra reports it; the overrides' values are known already
        tree = {}
    return found | secret_values(tree)


def print_redacted(fn: Callable[[], Any], overrides: Sequence[str]) -> None:
    """Run `fn` (Hydra printing a config: --cfg job/hydra/all) with its stdout redacted: secret-looking keys show
    REDACTED, and secret values are scrubbed wherever they appear."""
    import contextlib
    import io

    from qwen35rl.config.redact import redact_yaml

    from qwen35rl.config.redact import REDACTED, is_secret_name

    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            fn()
    finally:
        text = buf.getvalue()
        if text:
            for ov in overrides:  # the overrides as Hydra lists them (hydra.overrides.task), short values too
                k, eq, v = ov.lstrip("+~").partition("=")
                if eq and v and is_secret_name(k.strip()):
                    text = text.replace(f"{k}={v}", f"{k}={REDACTED}")
            sys.stdout.write(redact_yaml(text, secrets_of(overrides)))
            sys.stdout.flush()
