"""What both entry points share: argument parsing with Hydra's own parser (its flags anywhere on the command line),
each command's `--help`, the pre-launch config check, error reporting (one block, exit code 2), and running a task
through `@hydra.main` for multirun and run directories."""
from __future__ import annotations

import json
import os
import re
import sys
from typing import Any, Callable, List, Optional, Sequence, Tuple

from qwen35rl.config.compose import ConfigError, normalize_overrides, searchpath_override
from qwen35rl.config.paths import config_dir
from qwen35rl.config.problems import EXIT_CONFIG  # noqa: F401 - the CLI's exit code for a config it refuses
from qwen35rl.config.store import register

_PASS_THROUGH_FLAGS = ("hydra_help", "info", "shell_completion", "cfg")
"""Flags Hydra answers itself (after the config check, for --cfg)."""
_COMPLETION_COMMANDS = ("install", "uninstall", "query")


def _parser():
    from hydra._internal.utils import get_args_parser

    return get_args_parser()


def split_argv(argv: Sequence[str]) -> Tuple[List[str], List[str]]:
    """(Hydra's flags with their values, the overrides), wherever the flags stand: `a=1 -m b=2 --cfg job` gives
    (['-m', '--cfg', 'job'], ['a=1', 'b=2']). Hydra's parser takes the overrides as one positional list, so flags
    after the first override would be refused; they go first. A token after `--` is an override."""
    actions = {s: a for a in _parser()._actions for s in a.option_strings}
    flags: List[str] = []
    overrides: List[str] = []
    argv = list(argv)
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            overrides += argv[i + 1:]
            break
        name, eq, _ = tok.partition("=") if tok.startswith("--") else (tok, "", "")
        action = actions.get(name) if tok.startswith("-") else None
        if action is None:
            (flags if tok.startswith("-") and not re.match(r"^-\d", tok) else overrides).append(tok)
        elif action.nargs == 0 or eq:
            flags.append(tok)
        elif action.nargs == "?":  # --info [what]: takes the next word only when it is one of its choices
            flags.append(tok)
            if i + 1 < len(argv) and argv[i + 1] in (action.choices or ()):
                flags.append(argv[i + 1])
                i += 1
        else:
            flags.append(tok)
            if i + 1 < len(argv):
                flags.append(argv[i + 1])
                i += 1
        i += 1
    return flags, overrides


def parse_args(argv: Sequence[str]):
    """Hydra's parser over argv with its flags anywhere; `args.argv` is the command line as Hydra takes it (flags
    first) and `args.overrides` the overrides, group choices normalized (`compose.normalize_overrides`)."""
    flags, overrides = split_argv(argv)
    args = _parser().parse_args([*flags, "--", *overrides] if overrides else flags)
    args.overrides = normalize_overrides(args.overrides)
    args.argv = [*flags, *args.overrides]
    return args


def wants_hydra_only(args) -> bool:
    """--info, --cfg, --hydra-help, --shell-completion: Hydra answers these itself."""
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


def _named(task: Callable[[Any], Any], command: str) -> Callable[[Any], Any]:
    """`task` under the module name of its command: Hydra names the job (`hydra.job.name`, the log file) after it.
    A task of the command's own module (or of `python -m qwen35rl.cli.<command>`) is already named so."""
    if getattr(task, "__module__", None) in (f"qwen35rl.cli.{command}", "__main__"):
        return task

    def job(cfg: Any) -> Any:
        return task(cfg)

    job.__module__ = f"qwen35rl.cli.{command}"
    job.__name__ = job.__qualname__ = getattr(task, "__name__", "job")
    return job


def _completion_line(line: str, extra: Sequence[str]) -> str:
    """COMP_LINE with our search path after the program's name, so that completion lists the overlay groups (Hydra's
    completion reads the words of the line, not our command line)."""
    head, _, rest = line.lstrip().partition(" ")
    if not extra or not head:
        return line
    return f"{head} {' '.join(extra)} {rest}" if rest else f"{head} {' '.join(extra)} "


_HIDDEN_FROM_COMPLETION = ("model_base", "platform", "schema")
"""Internal trees: other configs include them, the command line may not choose them."""


def _completion_words(text: str) -> str:
    """Hydra's completion answer without the internal trees."""
    keep = [w for w in text.split() if re.split(r"[=./@]", w.lstrip("+~"), maxsplit=1)[0] not in _HIDDEN_FROM_COMPLETION]
    return " ".join(keep) + ("\n" if text.endswith("\n") else "")


def register_all() -> None:
    """The schema, and qwen35rl's launchers as `hydra/launcher=submitit_local|submitit_slurm`
    (hydra_plugins/qwen35rl_submitit). Hydra's plugin scan runs first: it executes every module under hydra_plugins,
    the submitit plugin's config module included, which stores that plugin's entries under the same names;
    registering after it makes ours stay."""
    from hydra.core.plugins import Plugins

    register()
    Plugins.instance()
    try:
        from hydra_plugins.qwen35rl_submitit.launcher import register as register_launchers
    except ImportError:  # an install without the launcher package: Hydra's own configs (if any) stay
        return
    register_launchers()


def run_hydra(task: Callable[[Any], Any], args: Any, command: str, extra: Sequence[str] = ()) -> None:
    """Run `task` through @hydra.main over the command line `args.argv` (flags first), our search path and `extra`
    overrides, as the job `command`."""
    import contextlib
    import io

    import hydra

    register_all()
    search = searchpath_override()
    sys_argv, comp_line = sys.argv, os.environ.get("COMP_LINE")
    query = getattr(args, "shell_completion", False) and any(o.startswith("query=") for o in args.overrides)
    argv = ["--hydra-help"] if getattr(args, "hydra_help", False) else args.argv  # Hydra's help takes no overrides
    buf = io.StringIO()
    try:
        sys.argv = [sys_argv[0], *argv, *search, *extra]
        if comp_line is not None and query:
            os.environ["COMP_LINE"] = _completion_line(comp_line, search)
        with contextlib.redirect_stdout(buf) if query else contextlib.nullcontext():
            hydra.main(config_path=str(config_dir()), config_name="config",
                       version_base="1.3")(_named(task, command))()
    finally:
        sys.argv = sys_argv
        if comp_line is not None:
            os.environ["COMP_LINE"] = comp_line
        if query:
            sys.stdout.write(_completion_words(buf.getvalue()))
            sys.stdout.flush()


def _print_config(cfg: Any) -> None:
    from omegaconf import OmegaConf

    print(OmegaConf.to_yaml(cfg))


def _completion_usage(command: str) -> str:
    return (f"usage: qwen35rl-{command} --shell-completion install=bash|uninstall=bash|query=bash (also zsh, fish)\n"
            f"  install the completion of this shell: eval \"$(qwen35rl-{command} --shell-completion install=bash)\"")


def _held(fn: Callable[[], Any]) -> None:
    """Run `fn` (Hydra printing an answer) with its stdout held and written when it ends: a closed stdout then
    raises here, for the console script to end quietly, not inside Hydra, which would report it with a traceback."""
    import contextlib
    import io

    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            fn()
    finally:
        sys.stdout.write(buf.getvalue())
        sys.stdout.flush()


def _answered(fn: Callable[[], Any]) -> int:
    """Run Hydra answering one of its flags; its exit code (Hydra ends some answers with sys.exit)."""
    try:
        fn()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except ConfigError as e:  # QWEN35RL_CONFIG_PATH names a directory that is not there
        return report_config_error(e, "text")
    return 0


def start(argv: Sequence[str], command: str = "plan") -> Tuple[Any, Optional[Any], Optional[int]]:
    """Parse argv and check the config before anything runs: (args, composed config or None for a sweep, exit
    code when already done: --help or Hydra's own flags answered, or a config error reported). `args.run_dir`: the
    directory a run of this config writes to (None for a sweep)."""
    from qwen35rl.config.compose import check_sweep, compose_run

    register_all()
    try:
        args = parse_args(argv)
    except SystemExit as e:  # argparse printed its usage: an unknown flag, a flag without its value
        return None, None, int(e.code or 0) if not isinstance(e.code, str) else EXIT_CONFIG
    args.run_dir = None
    if args.help:
        from qwen35rl.cli.help import render

        print(render(command), flush=True)
        return args, None, 0
    overrides = list(args.overrides)
    if args.shell_completion:
        given = [o.partition("=")[0] for o in overrides if o.partition("=")[0] in _COMPLETION_COMMANDS]
        if len(given) != 1:
            print(_completion_usage(command), file=sys.stderr)
            return args, None, EXIT_CONFIG
        return args, None, _answered(lambda: _held(lambda: run_hydra(_print_config, args, command)))
    if args.info or args.hydra_help:  # about the composition itself: Hydra answers, broken configs included; --info
        # prints the composed config, so its output goes through the redaction as --cfg's does
        return args, None, _answered(lambda: print_redacted(lambda: run_hydra(_print_config, args, command), overrides))
    try:
        if args.multirun:
            check_sweep(overrides)
            cfg = None
        else:  # the run directory as the training job will have it (`hydra.job.name` is train's)
            cfg, args.run_dir = compose_run(overrides, job_name="train")
    except ConfigError as e:
        e.overrides = overrides  # never echo the value of a secret-looking key
        return args, None, report_config_error(e, output_format(overrides))
    if args.cfg:  # the config as checked; Hydra prints it, and its output goes through the redaction
        return args, None, _answered(lambda: print_redacted(lambda: run_hydra(_print_config, args, command), overrides))
    return args, cfg, None


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
    """Run `fn` (Hydra printing a config: --cfg job/hydra/all, --info) with its stdout redacted: secret-looking keys
    show REDACTED, and secret values are scrubbed wherever they appear."""
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
