"""Read a verl launch: a bash script that ends up running `python3 -m verl.trainer.main_ppo <overrides...>`, or a
text file of the overrides themselves.

A script is evaluated, not parsed: `evaluate_script` runs it with bash, in a temporary directory (the script's
HOME and working directory are empty folders there) and under a clean environment (a short PATH, HOME, LANG,
TMPDIR, DEVICE and the variables the caller passes; nothing else of the caller's environment), with stand-ins
for python3, python, uv, ray, torchrun, pip, hf, huggingface-cli and the device tool (nvidia-smi or npu-smi)
first on PATH. The stand-ins record how they were called and answer the usual probes (is torch_npu importable,
how many devices a node has); the verl launch they see is the result. Nothing is trained, installed or
downloaded by the stand-ins.

This is NOT a sandbox. The script runs as the user, with bash: it can call any program by its absolute path,
change files outside the temporary directory (a `cd "$(dirname "$0")"` makes the script's own folder the working
directory) and reach the network. Import only scripts you would run.

Nothing the script starts outlives the evaluation. On Linux the script runs under a small reaper process
(`python -I -S <this file> --qwen35rl-reap ...`) that makes itself the child subreaper: a process that leaves the
script's process group or session (`setsid cmd &`, a job under `set -m`, a daemon that double-forks) is still its
descendant, and once the script has ended (background children get a few seconds to record themselves) or run
past its time limit, the reaper kills every descendant left and waits for them. Elsewhere the script's process
group is killed.

This file is also the stand-ins' and the reaper's program: each one runs `python -I -S <this file> --qwen35rl-...`,
so the module imports only light standard-library modules at the top.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple, Union

PathLike = Union[str, "os.PathLike[str]"]

TOOLS = ("python3", "python", "uv", "hf", "huggingface-cli", "pip", "pip3", "ray", "torchrun")
"""Stand-ins every evaluation puts first on PATH."""
DEVICE_TOOLS = {"gpu": "nvidia-smi", "npu": "npu-smi"}
"""The device tool's stand-in, for the evaluated device only."""
DEFAULT_DEVICES_PER_NODE = {"gpu": 8, "npu": 16}
BASE_PATH = "/usr/local/bin:/usr/bin:/bin"
"""The PATH of the clean environment, after the stand-ins' folder."""

_STANDIN_FLAG = "--qwen35rl-standin"
_REAP_FLAG = "--qwen35rl-reap"
_BACKGROUND_GRACE_S = 3.0
"""How long background children of a script that has ended get to record themselves before they are killed."""
_PR_SET_CHILD_SUBREAPER = 36
_BASH_NOISE = ("PWD", "OLDPWD", "SHLVL", "_")
"""Variables bash exports by itself; they are no part of what a script sets."""
_FORWARDED_ARGS = ("$@", "${@}", "$*", "${*}")
"""A script's own arguments forwarded to the launch (`"$@"`); not an override."""
_GPU_NAME = "NVIDIA H100 80GB HBM3"
_GPU_MEMORY_MIB = 81559
_NPU_NAME = "910B3"
_IMPORT_HINT = ("import the override list instead: copy the python3 -m verl.trainer.main_ppo line (e.g. from "
                "`bash -x` or `ps`) into a file, one override per line")


class ScriptError(Exception):
    """A launch script or override file could not be read; the message says what went wrong and what to do."""


@dataclass
class Call:
    """One recorded stand-in invocation."""
    tool: str
    """The stand-in's name: python3, uv, ray, torchrun, pip, hf, nvidia-smi, ..."""
    argv: List[str]
    """Its arguments (argv[1:]), temporary paths mapped back to the caller's."""
    env: Dict[str, str]
    """The full environment it saw, values mapped back like argv."""
    cwd: str = ""
    """Its working directory, mapped back."""


@dataclass
class Launch:
    """The verl launch a script makes, or an imported override list."""
    argv: List[str]
    """Everything after the verl module or entry script: hydra flags (--config-name, ...) and overrides, in order."""
    env: Dict[str, str] = field(default_factory=dict)
    """Variables the launch environment set or changed relative to the clean base environment (exported by the
    script, a `VAR=x python3 ...` prefix, --env lines, a ray job's runtime-env env_vars); not the base variables."""
    unset: List[str] = field(default_factory=list)
    """Variables of the base environment the script removed before the launch."""
    entry: str = ""
    """How verl was started, shortened for messages: "python3 -m verl.trainer.main_ppo", "torchrun ... -m ..."."""
    calls: List[Call] = field(default_factory=list)
    """Every recorded stand-in call, in order."""
    cwd: str = ""
    """The launch's working directory (relative paths in overrides are relative to it), mapped back."""
    status: Optional[int] = None
    """The script's exit status (a non-zero status after the launch is no error); None for an override list."""


# ---------------------------------------------------------------------------------------------------------------
# What a command runs: python/uv/ray/torchrun command lines followed to the module, script or code they start.

@dataclass
class _Target:
    kind: str
    """"module", "script", "code" (python -c), "stdin" (python - or bare python), "other" (--version, ...)."""
    value: str
    args: List[str]
    """The arguments after the module or script."""
    head: List[str]
    """The command up to and including the module or script, wrapper options shortened to '...'."""
    env_vars: Dict[str, str] = field(default_factory=dict)
    """A ray job's runtime-env env_vars."""

    def is_verl_launch(self) -> bool:
        if self.kind == "module":
            return self.value.startswith("verl.trainer.")
        if self.kind == "script":
            return re.search(r"(?:^|/)verl/trainer/main_[^/]*\.py$", self.value) is not None
        return False


def _is_python(name: str) -> bool:
    return re.fullmatch(r"python(?:\d+(?:\.\d+)?)?", name) is not None


def _resolve(tool: str, argv: List[str]) -> Optional[_Target]:
    """What `tool argv...` runs, following uv run, ray job submit, torchrun and python -m torch.distributed.run;
    None for anything else. ValueError for a malformed ray --runtime-env-json."""
    name = os.path.basename(tool)
    if _is_python(name):
        return _resolve_python(name, argv)
    if name == "torchrun":
        return _resolve_torchrun(argv, [name])
    if name == "uv":
        return _resolve_uv(argv)
    if name == "ray":
        return _resolve_ray(argv)
    return None


def _resolve_python(name: str, argv: List[str]) -> _Target:
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "-":
            return _Target("stdin", "", argv[i + 1:], [name, "-"])
        if arg == "--":
            i += 1
            break
        if not arg.startswith("-"):
            break
        if arg.startswith("--"):
            if arg == "--check-hash-based-pycs":
                i += 2
                continue
            return _Target("other", arg, argv[i + 1:], [name, arg])
        j = 1
        while j < len(arg):
            opt = arg[j]
            if opt in "cmWX":
                attached = arg[j + 1:]
                if attached:
                    value, rest_at = attached, i + 1
                else:
                    value, rest_at = (argv[i + 1] if i + 1 < len(argv) else ""), i + 2
                if opt == "c":
                    return _Target("code", value, argv[rest_at:], [name, "-c"])
                if opt == "m":
                    rest = argv[rest_at:]
                    if value in ("torch.distributed.run", "torch.distributed.launch"):
                        return _resolve_torchrun(rest, [name, "-m", value])
                    return _Target("module", value, rest, [name, "-m", value])
                i = rest_at - 1  # -W/-X: skip the value
                break
            if opt in "Vh?":
                return _Target("other", "-" + opt, argv[i + 1:], [name, "-" + opt])
            j += 1
        i += 1
    if i >= len(argv):
        return _Target("stdin", "", [], [name])
    return _Target("script", argv[i], argv[i + 1:], [name, argv[i]])


_TORCHRUN_FLAGS = {"--standalone", "--no-python", "--no_python", "--run-path", "--run_path"}


def _resolve_torchrun(argv: List[str], prefix: List[str]) -> Optional[_Target]:
    no_python = False
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-m", "--module"):
            if i + 1 >= len(argv):
                return None
            module = argv[i + 1]
            head = prefix + (["..."] if i else []) + ["-m", module]
            return _Target("module", module, argv[i + 2:], head)
        if arg == "--":
            i += 1
            break
        if not arg.startswith("-"):
            break
        if arg in ("--no-python", "--no_python"):
            no_python = True
        if "=" in arg or arg in _TORCHRUN_FLAGS:
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            i += 2  # an option with its value
        else:
            i += 1
    if i >= len(argv):
        return None
    shown = prefix + (["..."] if i else [])
    if no_python:
        inner = _resolve(argv[i], argv[i + 1:])
        if inner is not None:
            inner.head = shown + inner.head
        return inner
    return _Target("script", argv[i], argv[i + 1:], shown + [argv[i]])


_UV_VALUE_OPTIONS = {
    "--with", "--with-editable", "--with-requirements", "--python", "-p", "--project", "--directory",
    "--env-file", "--extra", "--group", "--only-group", "--no-group", "--package", "--index", "--index-url",
    "--default-index", "--extra-index-url", "--find-links", "-f", "--index-strategy", "--keyring-provider",
    "--resolution", "--prerelease", "--exclude-newer", "--link-mode", "--config-setting", "-C",
    "--refresh-package", "--reinstall-package", "--upgrade-package", "-P", "--no-build-package",
    "--no-binary-package", "--only-binary-package", "--cache-dir", "--color", "--config-file",
    "--python-preference", "--allow-insecure-host", "--no-extra", "--python-platform",
}


def _resolve_uv(argv: List[str]) -> Optional[_Target]:
    if not argv or argv[0] != "run":
        return None
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg in ("-m", "--module"):
            if i + 1 >= len(argv):
                return None
            module = argv[i + 1]
            head = ["uv", "run"] + (["..."] if i > 1 else []) + ["-m", module]
            return _Target("module", module, argv[i + 2:], head)
        if arg == "--":
            i += 1
            break
        if not arg.startswith("-"):
            break
        i += 2 if (arg in _UV_VALUE_OPTIONS and "=" not in arg) else 1
    if i >= len(argv):
        return None
    shown = ["uv", "run"] + (["..."] if i > 1 else [])
    command, rest = argv[i], argv[i + 1:]
    if command.endswith(".py"):
        return _Target("script", command, rest, shown + [command])
    inner = _resolve(command, rest)
    if inner is not None:
        inner.head = shown + inner.head
    return inner


_RAY_SUBMIT_VALUE_OPTIONS = {
    "--address", "--job-id", "--submission-id", "--runtime-env", "--runtime-env-json", "--working-dir",
    "--metadata-json", "--entrypoint-num-cpus", "--entrypoint-num-gpus", "--entrypoint-memory",
    "--entrypoint-resources", "--entrypoint-label-selector", "--headers", "--verify", "--log-style",
    "--log-color",
}


def _resolve_ray(argv: List[str]) -> Optional[_Target]:
    if argv[:2] != ["job", "submit"]:
        return None
    options: List[str] = []
    rest = argv[2:]
    if "--" in rest:
        cut = rest.index("--")
        options, entry = rest[:cut], rest[cut + 1:]
    else:
        i = 0
        while i < len(rest) and rest[i].startswith("-"):
            i += 2 if (rest[i] in _RAY_SUBMIT_VALUE_OPTIONS and "=" not in rest[i]) else 1
        options, entry = rest[:i], rest[i:]
    env_vars: Dict[str, str] = {}
    for k, opt in enumerate(options):
        text = None
        if opt == "--runtime-env-json" and k + 1 < len(options):
            text = options[k + 1]
        elif opt.startswith("--runtime-env-json="):
            text = opt.split("=", 1)[1]
        if text is not None:
            try:
                runtime_env = json.loads(text)
            except ValueError as exc:
                raise ValueError(f"the --runtime-env-json of `ray job submit` is not valid JSON ({exc}): {text}")
            if isinstance(runtime_env, dict) and isinstance(runtime_env.get("env_vars"), dict):
                env_vars.update({str(key): str(v) for key, v in runtime_env["env_vars"].items()})
    if len(entry) == 1 and any(c.isspace() for c in entry[0]):
        try:  # one quoted entrypoint string: ray runs it through a shell
            entry = shlex.split(entry[0])
        except ValueError:
            return None
    if not entry:
        return None
    inner = _resolve(entry[0], entry[1:])
    if inner is not None:
        inner.head = ["ray", "job", "submit"] + (["..."] if options else []) + ["--"] + inner.head
        inner.env_vars = {**inner.env_vars, **env_vars}
    return inner


# ---------------------------------------------------------------------------------------------------------------
# The stand-ins: record the call, then answer like the tool would on a node of the evaluated device.

def _record(record: str, tool: str, argv: List[str], lc_ctype: str) -> None:
    try:
        cwd = os.getcwd()
    except OSError:
        cwd = os.environ.get("PWD", "")
    env = dict(os.environ)
    env.pop("LC_CTYPE", None)
    if lc_ctype:  # "=value" when the caller had it, "" when not
        env["LC_CTYPE"] = lc_ctype[1:]
    line = json.dumps({"tool": tool, "argv": argv, "env": env, "cwd": cwd}) + "\n"
    data = line.encode("utf-8", "surrogateescape")
    try:
        import fcntl
        fd = os.open(record, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    except (ImportError, OSError):
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        while data:
            data = data[os.write(fd, data):]
    except OSError:
        pass
    finally:
        os.close(fd)


def _probe(code: str, device: str, count: int) -> Tuple[int, str, str]:
    """(exit status, stdout, stderr) of `python -c code` on a node with `count` devices of `device`."""
    if re.search(r"\btorch_npu\b", code) and device != "npu":
        return 1, "", "ModuleNotFoundError: No module named 'torch_npu'\n"
    if "device_count" in code:
        return 0, f"{count}\n", ""
    if re.search(r"\bnpu\.is_available\b", code):
        if device != "npu":
            return 1, "", "AttributeError: module 'torch' has no attribute 'npu'\n"
        return 0, "True\n", ""
    if re.search(r"\bcuda\.is_available\b", code):
        return 0, ("True\n" if device == "gpu" else "False\n"), ""
    return 0, "", ""


def _option_value(argv: List[str], name: str) -> Optional[str]:
    for k, arg in enumerate(argv):
        if arg == name and k + 1 < len(argv):
            return argv[k + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _nvidia_smi(argv: List[str], count: int) -> Tuple[int, str, str]:
    ids = list(range(count))
    chosen = _option_value(argv, "--id") or _option_value(argv, "-i")
    if chosen is not None:
        try:
            ids = [int(x) for x in chosen.split(",") if int(x) < count]
        except ValueError:
            return 6, "", f"No devices were found matching {chosen!r}\n"

    def uuid(i: int) -> str:
        return f"GPU-{i:08x}-0000-0000-0000-000000000000"

    if "-L" in argv or "--list-gpus" in argv:
        return 0, "".join(f"GPU {i}: {_GPU_NAME} (UUID: {uuid(i)})\n" for i in ids), ""
    query = _option_value(argv, "--query-gpu")
    if query is not None:
        fmt = _option_value(argv, "--format") or "csv"
        units = "nounits" not in fmt
        fields = [f.strip() for f in query.split(",") if f.strip()]
        lines = []
        if "noheader" not in fmt:
            lines.append(", ".join(f + (" [MiB]" if units and f.startswith("memory.") else "") for f in fields))
        for i in ids:
            values = {"name": _GPU_NAME, "gpu_name": _GPU_NAME, "index": str(i), "count": str(count),
                      "uuid": uuid(i), "gpu_uuid": uuid(i),
                      "memory.total": f"{_GPU_MEMORY_MIB} MiB" if units else str(_GPU_MEMORY_MIB)}
            lines.append(", ".join(values.get(f, "0") for f in fields))
        return 0, "".join(line + "\n" for line in lines), ""
    if any(not a.startswith("-") for a in argv):  # a subcommand (topo, nvlink, ...): nothing to say
        return 0, "", ""
    rows = [f"| {i:>3}  {_GPU_NAME:<24}| 00000000:{i:02X}:00.0 Off |    0MiB / {_GPU_MEMORY_MIB}MiB |" for i in ids]
    bar = "+" + "-" * 78 + "+"
    table = [bar, "| NVIDIA-SMI (qwen35rl stand-in)                                               |", bar,
             "| GPU  Name                    | Bus-Id          Disp.A | Memory-Usage          |", bar,
             *rows, bar]
    return 0, "\n".join(table) + "\n", ""


def _npu_smi(argv: List[str], count: int) -> Tuple[int, str, str]:
    if argv not in (["info"], ["info", "-l"]):
        return 0, "", ""
    if "-l" in argv:
        lines = [f"Total Count : {count}", ""]
        for i in range(count):
            lines += [f"NPU ID : {i}", "Chip Count : 1", ""]
        return 0, "\n".join(lines) + "\n", ""
    bar = "+" + "-" * 27 + "+" + "-" * 15 + "+" + "-" * 32 + "+"
    lines = [bar, "| npu-smi (qwen35rl stand-in)" + " " * 48 + "|", bar,
             "| NPU   Name                | Health        | Power(W)    Temp(C)            |",
             "| Chip                      | Bus-Id        | AICore(%)   HBM-Usage(MB)      |",
             bar]
    for i in range(count):
        lines.append(f"| {i:<5} {_NPU_NAME:<19} | OK            | 90.0        40                 |")
        lines.append(f"| 0                         | 0000:{i:02X}:00.0  | 0           3000 / 65536       |")
        lines.append(bar)
    return 0, "\n".join(lines) + "\n", ""


def _standin_main(args: List[str]) -> int:
    record, device, count_text, tool, lc_ctype, argv = args[0], args[1], args[2], args[3], args[4], args[5:]
    count = int(count_text)
    _record(record, tool, argv, lc_ctype)
    status, out, err = 0, "", ""
    if tool == "nvidia-smi":
        status, out, err = _nvidia_smi(argv, count)
    elif tool == "npu-smi":
        status, out, err = _npu_smi(argv, count)
    else:
        try:
            target = _resolve(tool, argv)
        except ValueError as exc:
            target, status, err = None, 1, f"{tool}: {exc}\n"
        if target is not None and target.kind == "code":
            status, out, err = _probe(target.value, device, count)
        elif target is not None and target.kind == "stdin":
            status, out, err = _probe(sys.stdin.read(), device, count)
        elif target is not None and target.kind == "other" and target.value in ("-V", "--version"):
            out = "Python {}.{}.{}\n".format(*sys.version_info[:3])
    try:
        sys.stdout.write(out)
        sys.stdout.flush()
        sys.stderr.write(err)
        sys.stderr.flush()
    except (BrokenPipeError, OSError):
        pass
    return status


# ---------------------------------------------------------------------------------------------------------------
# Evaluating a script.

def _write_standins(bindir: str, record: str, device: str, count: int) -> None:
    python = sys.executable
    if not python:
        raise ScriptError("cannot find the running Python interpreter, which the stand-ins need; "
                          + _IMPORT_HINT)
    program = os.path.abspath(__file__)
    for tool in TOOLS + (DEVICE_TOOLS[device],):
        words = [python, "-I", "-S", program, _STANDIN_FLAG, record, device, str(count), tool]
        # Python's start-up may set LC_CTYPE (C locale coercion): the wrapper passes the caller's own value.
        body = "#!/bin/sh\nexec " + " ".join(shlex.quote(w) for w in words) + ' "${LC_CTYPE+=}${LC_CTYPE-}" "$@"\n'
        target = os.path.join(bindir, tool)
        with open(target, "w", encoding="utf-8") as f:
            f.write(body)
        os.chmod(target, 0o755)


def _group_alive(pgid: int) -> bool:
    """Whether a process of the group is still running (zombies that nobody reaps do not count)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if not os.path.isdir("/proc"):
        return True
    return any(len(fields) >= 3 and fields[2] == str(pgid) and fields[0] != "Z" for _, fields in _proc_stats())


def _proc_stats() -> Iterator[Tuple[int, List[str]]]:
    """(pid, the fields of /proc/<pid>/stat after the command name: state, ppid, pgrp, ...) of every process that
    can be read now (one that ends meanwhile is left out)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode("ascii", "replace")
        except OSError:
            continue
        yield int(entry), stat[stat.rfind(")") + 2:].split()


def _kill_group(pgid: int) -> None:
    import signal
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _can_reap() -> bool:
    """Whether the script can run under the reaper (Linux: prctl's child subreaper and /proc)."""
    return sys.platform.startswith("linux") and os.path.isdir("/proc")


def _descendants(root: int) -> Dict[int, str]:
    """pid -> state letter (R, S, Z, ...) of every descendant of `root`, read from /proc."""
    children: Dict[int, List[int]] = {}
    state: Dict[int, str] = {}
    for pid, fields in _proc_stats():
        if len(fields) < 2 or not fields[1].isdigit():
            continue
        state[pid] = fields[0]
        children.setdefault(int(fields[1]), []).append(pid)
    found: Dict[int, str] = {}
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found[child] = state[child]
                todo.append(child)
    return found


def _kill_descendants() -> None:
    """SIGKILL every descendant of this process and reap them, until none is left (a child subreaper inherits the
    orphans of the ones it kills, so a few rounds catch the grandchildren too)."""
    import signal
    import time

    me = os.getpid()
    for _ in range(500):
        left = _descendants(me)
        for pid, state in left.items():
            if state != "Z":
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
        if not left:
            return
        time.sleep(0.01)


def _reaper_main(args: List[str]) -> int:
    """`--qwen35rl-reap TIMEOUT_S STATUS_FILE ENV_FILE PROGRAM ARGS...`: run the program (bash and the script) with
    the environment of ENV_FILE (JSON), as this process's child subreaper; once it has ended and its background
    children had their grace, or TIMEOUT_S has passed, kill every descendant left. STATUS_FILE receives
    `exit <status>` or `timeout`."""
    import ctypes
    import signal
    import subprocess
    import time

    timeout_s, status_file, env_file, argv = float(args[0]), args[1], args[2], args[3:]
    with open(env_file, encoding="utf-8") as f:
        env = json.load(f)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # without it, the script's process group is still killed below (its descendants by parentage)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # the importer gave up: clean up
    status = "timeout"
    started = time.monotonic()
    try:
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            status = f"exit {proc.wait(timeout=timeout_s)}"
        except subprocess.TimeoutExpired:
            pass
        else:
            deadline = min(started + timeout_s, time.monotonic() + _BACKGROUND_GRACE_S)
            while time.monotonic() < deadline and any(s != "Z" for s in _descendants(os.getpid()).values()):
                time.sleep(0.02)
    finally:
        _kill_descendants()
        with open(status_file, "w", encoding="utf-8") as f:
            f.write(status)
    return 0


def _mapper(pairs: List[Tuple[str, str]]):
    pairs = [(a, b) for a, b in pairs if a and a != b]
    patterns = [(re.compile(re.escape(a) + r"(?![\w.-])"), b) for a, b in sorted(pairs, key=lambda p: -len(p[0]))]

    def apply(text: str) -> str:
        for pattern, replacement in patterns:
            text = pattern.sub(lambda _m, r=replacement: r, text)
        return text

    return apply


def _tail(text: str, lines: int = 10) -> str:
    kept = [line for line in text.splitlines() if line.strip()][-lines:]
    return "\n".join("  " + line for line in kept)


def _describe_call(call: Call) -> str:
    shown = " ".join(shlex.quote(a) for a in call.argv[:4])
    text = f"{call.tool} {shown}".strip()
    if len(text) > 100:
        text = text[:97] + "..."
    elif len(call.argv) > 4:
        text += " ..."
    return text


def evaluate_script(path: PathLike, device: str = "gpu", env: Optional[Dict[str, str]] = None,
                    devices_per_node: Optional[int] = None, timeout_s: float = 60.0) -> Launch:
    """Run the launch script with bash under stand-ins (see the module docstring) and return the verl launch
    it makes. ScriptError when it makes none, several different ones, or does not finish within timeout_s."""
    import shutil
    import subprocess
    import tempfile
    import time

    if device not in DEFAULT_DEVICES_PER_NODE:
        raise ValueError(f"device must be 'gpu' or 'npu', not {device!r}")
    count = DEFAULT_DEVICES_PER_NODE[device] if devices_per_node is None else devices_per_node
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ValueError(f"devices_per_node must be a positive integer, not {devices_per_node!r}")
    script = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if not os.path.isfile(script):
        raise ScriptError(f"{script}: no such launch script; check the path")
    bash = shutil.which("bash") or ("/bin/bash" if os.path.exists("/bin/bash") else None)
    if bash is None:
        raise ScriptError(f"{script}: bash is needed to evaluate a launch script and was not found; install bash, "
                          f"or {_IMPORT_HINT}")
    extra = {str(k): str(v) for k, v in (env or {}).items()}
    real_home = os.path.expanduser("~")
    caller_cwd = os.getcwd()

    with tempfile.TemporaryDirectory(prefix="qwen35rl-import-", ignore_cleanup_errors=True) as tmp:
        root = os.path.realpath(tmp)
        home, work, bindir = (os.path.join(root, name) for name in ("home", "work", "bin"))
        for d in (home, work, bindir):
            os.mkdir(d)
        record = os.path.join(root, "calls.jsonl")
        _write_standins(bindir, record, device, count)
        base = {"PATH": BASE_PATH, "HOME": home}
        for name in ("USER", "LOGNAME"):
            if name in os.environ:
                base[name] = os.environ[name]
        base.update({"LANG": "C.UTF-8", "TMPDIR": root, "DEVICE": device})
        run_env = {**base, **extra}
        run_env["PATH"] = bindir + os.pathsep + run_env["PATH"]
        out_path, err_path = os.path.join(root, "stdout"), os.path.join(root, "stderr")
        timed_out = ScriptError(
            f"{script}: the script did not finish within {timeout_s:g} s and was stopped (a script that waits for a "
            f"cluster, a job or a download cannot be evaluated); {_IMPORT_HINT}")
        with open(out_path, "wb") as out_f, open(err_path, "wb") as err_f:
            started = time.monotonic()
            if _can_reap():  # nothing the script starts survives it, even outside its process group
                status_path, env_path = os.path.join(root, "status"), os.path.join(root, "env.json")
                with open(env_path, "w", encoding="utf-8") as f:
                    json.dump(run_env, f)
                reaper = [sys.executable, "-I", "-S", os.path.abspath(__file__), _REAP_FLAG, repr(float(timeout_s)),
                          status_path, env_path, bash, script]
                proc = subprocess.Popen(reaper, cwd=work, env={"PATH": BASE_PATH, "LANG": "C.UTF-8"},
                                        stdin=subprocess.DEVNULL, stdout=out_f, stderr=err_f, start_new_session=True)
                try:
                    proc.wait(timeout=timeout_s + 60.0)  # the reaper keeps the time limit; this bounds the reaper
                except subprocess.TimeoutExpired:
                    pass  # said as the time limit below
                finally:
                    if proc.poll() is None:  # interrupted, or the reaper hung: it kills what is left, or is killed
                        proc.terminate()
                        try:
                            proc.wait(timeout=10.0)
                        except subprocess.TimeoutExpired:
                            _kill_group(proc.pid)
                            proc.wait()
                try:
                    with open(status_path, encoding="utf-8") as f:
                        outcome = f.read().split()
                except OSError:
                    outcome = ["timeout"]
                if outcome[:1] != ["exit"]:
                    raise timed_out
                status = int(outcome[1])
            else:
                proc = subprocess.Popen([bash, script], cwd=work, env=run_env, stdin=subprocess.DEVNULL,
                                        stdout=out_f, stderr=err_f, start_new_session=True)
                try:
                    status = proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    _kill_group(proc.pid)
                    proc.wait()
                    raise timed_out
                # Background children (`nohup python3 -m verl... &`) get a moment to record themselves.
                deadline = min(started + timeout_s, time.monotonic() + _BACKGROUND_GRACE_S)
                while _group_alive(proc.pid) and time.monotonic() < deadline:
                    time.sleep(0.02)
                _kill_group(proc.pid)

        unmap = _mapper([(home, real_home), (work, caller_cwd)])
        with open(err_path, "rb") as f:
            stderr_text = unmap(f.read().decode("utf-8", "replace"))
        raw_calls = []
        try:
            with open(record, "rb") as f:
                for line in f:
                    try:
                        item = json.loads(line.decode("utf-8", "surrogateescape"))
                        raw_calls.append((str(item["tool"]), [str(a) for a in item["argv"]],
                                          {str(k): str(v) for k, v in item["env"].items()}, str(item.get("cwd", ""))))
                    except (ValueError, KeyError, TypeError, AttributeError):
                        continue  # a line cut short by a killed process
        except FileNotFoundError:
            pass

    calls = [Call(tool, [unmap(a) for a in argv], {k: unmap(v) for k, v in call_env.items()}, unmap(cwd))
             for tool, argv, call_env, cwd in raw_calls]
    launches = []
    for (tool, _, call_env, _), call in zip(raw_calls, calls):
        try:
            target = _resolve(tool, call.argv)
        except ValueError as exc:
            raise ScriptError(f"{script}: {exc}; fix the script, or {_IMPORT_HINT}")
        if target is not None and target.is_verl_launch():
            launches.append((target, call, call_env))

    if not launches:
        listed = "\n".join("  " + _describe_call(c) for c in calls[:20]) or "  (none)"
        if len(calls) > 20:
            listed += f"\n  ... and {len(calls) - 20} more"
        message = (f"{script}: the script ran (exit status {status}) but never called "
                   f"python3 -m verl.trainer.main_ppo.\nRecorded calls:\n{listed}")
        if stderr_text.strip():
            message += f"\nLast lines of its stderr:\n{_tail(stderr_text)}"
        if "unbound variable" in stderr_text:
            message += "\nA variable the script needs is not set: give it with an --env FILE line (KEY=VALUE)."
        raise ScriptError(message + f"\nHint: {_IMPORT_HINT}.")
    first_target, first_call, first_env = launches[0]
    for other_target, _, _ in launches[1:]:
        if other_target.args != first_target.args:
            a, b = first_target.args, other_target.args
            k = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
            left = repr(a[k]) if k < len(a) else "(nothing)"
            right = repr(b[k]) if k < len(b) else "(nothing)"
            raise ScriptError(
                f"{script}: the script launched verl {len(launches)} times with different overrides (the first "
                f"difference: {left} vs {right}); pass the override list file of the one run to import instead "
                f"(copy its python3 -m verl.trainer.main_ppo line into a file, one override per line)")

    launch_env: Dict[str, str] = {}
    for key, value in first_env.items():
        if key in _BASH_NOISE or key.startswith("BASH_FUNC_"):
            continue
        if key == "PATH":
            value = os.pathsep.join(p for p in value.split(os.pathsep) if p != bindir)
        if base.get(key) == value:
            continue
        launch_env[key] = unmap(value)
    launch_env.update(first_target.env_vars)
    unset = [key for key in run_env if key not in first_env]
    return Launch(argv=list(first_target.args), env=launch_env, unset=unset, entry=" ".join(first_target.head),
                  calls=calls, cwd=first_call.cwd, status=status)


# ---------------------------------------------------------------------------------------------------------------
# Override lists and env files.

_HEAD_LINE = re.compile(r"^(?:[A-Za-z_]\w*=\S*\s+)*(?:\S*/)?(?:python[\d.]*|uv|ray|torchrun)(?:\s|$)")


def _read_text(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ScriptError(f"{path}: cannot read the {what} ({exc}); check the path and that it is a UTF-8 text file")


def _split(path: Path, lineno: int, line: str) -> List[str]:
    try:
        return shlex.split(line)
    except ValueError as exc:
        raise ScriptError(f"{path}:{lineno}: cannot split this line into words ({exc}): {line}; close the quote, "
                          f"or write one override per line without quotes")


def _launch_words(words: List[str]) -> Optional[List[str]]:
    """The arguments of the verl launch in a command's words (leading VAR=value words skipped), or None."""
    while words and re.match(r"^[A-Za-z_]\w*=", words[0]):
        words = words[1:]
    if not words:
        return None
    try:
        target = _resolve(words[0], words[1:])
    except ValueError:
        target = None
    return target.args if target is not None and target.is_verl_launch() else None


def read_override_list(path: PathLike) -> List[str]:
    """The overrides of a text file as a user copies them: one override per line (blank lines, `#` comments and
    trailing `\\` continuations skipped); a `python3 -m verl.trainer.main_ppo ...` line (also `+ ...` from bash -x,
    `uv run ...`, `torchrun ...`) contributes the words after the verl module; a line that starts with a quote is
    split like the shell would; any other line is one override, verbatim."""
    p = Path(os.path.expanduser(os.fspath(path)))
    text = _read_text(p, "override list")
    overrides: List[str] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if line.endswith("\\"):
            line = line[:-1].rstrip()
        if not line or line.startswith("#"):
            continue
        traced = re.match(r"^\++\s+", line)
        if traced:
            words = _launch_words(_split(p, lineno, line[traced.end():]))
            overrides += words or []  # other traced commands are no part of the launch
        elif _HEAD_LINE.match(line):
            words = _launch_words(_split(p, lineno, line))
            if words is None:
                raise ScriptError(f"{p}:{lineno}: this line runs a command but not verl.trainer: {line}; keep only "
                                  f"the python3 -m verl.trainer.main_ppo line and its overrides")
            overrides += words
        elif line[0] in "'\"":
            overrides += _split(p, lineno, line)
        else:
            overrides.append(line)
    overrides = [o for o in overrides if o not in _FORWARDED_ARGS]
    if not overrides:
        raise ScriptError(f"{p}: no overrides found; write one override per line (key=value), or the "
                          f"python3 -m verl.trainer.main_ppo command line with them")
    return overrides


_ENV_LINE = re.compile(r"^(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")


def read_env_file(path: PathLike) -> Dict[str, str]:
    """`KEY=VALUE` lines (optional `export `, `#` comments, blank lines; a value may be quoted with ' or ")."""
    p = Path(os.path.expanduser(os.fspath(path)))
    text = _read_text(p, "env file")
    result: Dict[str, str] = {}
    fix = "write KEY=VALUE (one per line, an optional leading `export `, quote a value with spaces)"
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _ENV_LINE.match(line)
        if not m:
            raise ScriptError(f"{p}:{lineno}: not a KEY=VALUE line: {line}; {fix}")
        key, value = m.group(1), m.group(2).strip()
        if value[:1] in ("'", '"'):
            quote = value[0]
            if quote == "'":
                end = value.find("'", 1)
                inner = value[1:end] if end > 0 else None
            else:
                m2 = re.match(r'"((?:[^"\\]|\\.)*)"', value)
                end = m2.end() - 1 if m2 else -1
                inner = re.sub(r'\\(["\\$`])', r"\1", m2.group(1)) if m2 else None
            after = value[end + 1:].strip() if end > 0 else ""
            if inner is None or (after and not after.startswith("#")):
                raise ScriptError(f"{p}:{lineno}: the quoted value of {key} is not closed or is followed by more "
                                  f"text: {line}; {fix}")
            value = inner
        else:
            value = re.split(r"\s+#", value, maxsplit=1)[0]
        result[key] = value
    return result


def _looks_like_script(p: Path) -> bool:
    if p.suffix == ".sh":
        return True
    text = _read_text(p, "launch file")
    lines = text.splitlines()
    if lines and lines[0].startswith("#!"):
        return True
    for raw in lines:
        line = raw.strip()
        if _HEAD_LINE.match(line) and re.search(r"\bverl[./]trainer\b", line):
            # A bare head line followed by one override per line is an override list, not a script.
            if line.endswith("\\"):
                return True
            try:
                words = _launch_words(shlex.split(line))
            except ValueError:
                return True
            if words:
                return True
    return False


def load_source(path: PathLike, device: str = "gpu", env: Optional[Dict[str, str]] = None,
                devices_per_node: Optional[int] = None) -> Launch:
    """A launch script (.sh, a #! first line, or a line that runs verl.trainer with arguments) is evaluated;
    any other file is read as an override list."""
    p = Path(os.path.expanduser(os.fspath(path)))
    if not p.is_file():
        raise ScriptError(f"{p}: no such file; give a verl launch script (.sh) or a file of overrides")
    if _looks_like_script(p):
        return evaluate_script(p, device=device, env=env, devices_per_node=devices_per_node)
    return Launch(argv=read_override_list(p), env=dict(env or {}), entry=f"override list {p}", cwd=os.getcwd())


if __name__ == "__main__":
    if sys.argv[1:2] == [_STANDIN_FLAG] and len(sys.argv) >= 7:
        sys.exit(_standin_main(sys.argv[2:]))
    if sys.argv[1:2] == [_REAP_FLAG] and len(sys.argv) >= 6:
        sys.exit(_reaper_main(sys.argv[2:]))
    sys.exit("qwen35rl.config.verl.script is a library (evaluate_script, read_override_list, load_source)")
