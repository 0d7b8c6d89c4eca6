"""trainer.launcher: how the workers start, with `auto` made concrete (one rule, read by the plan, the rules and the
launch). Torch-free and Ray-free."""
from __future__ import annotations

import os
from typing import Any, Dict, Tuple

from qwen35rl.config.tree import get as _get

LAUNCHERS = ("auto", "ray", "local")


def ray_runtime_env(cfg: Any) -> Dict[str, str]:
    """The fields of `hw.ray_runtime_env` that are set: the job's runtime_env given to ray.init, which every actor of
    the run inherits (each actor's own env_vars, the worker environment, are merged over it)."""
    env = _get(cfg, "hw.ray_runtime_env") or {}
    return {str(k): str(v) for k, v in env.items() if v not in (None, "")}


def auto_choice(cfg: Any) -> Tuple[str, str]:
    """What `auto` means for this run, and why. `local` for a colocated run of this host's CPUs that names no Ray
    cluster: there Ray would only add its start-up (a cluster of its own, a process per worker that imports torch
    again). `ray` otherwise."""
    if _get(cfg, "ray_address") not in (None, ""):
        return "ray", "ray_address names a cluster"
    if os.environ.get("RAY_ADDRESS"):
        return "ray", "RAY_ADDRESS names a cluster"
    if int(_get(cfg, "hw.nodes", 1)) != 1:
        return "ray", f"{_get(cfg, 'hw.nodes')} nodes"
    if _get(cfg, "hw.device", "cpu") != "cpu":
        return "ray", f"{_get(cfg, 'hw.device')} devices, which Ray assigns to the workers"
    if _get(cfg, "placement.mode", "colocated") != "colocated":
        return "ray", "placement=split places its pools as Ray actors"
    if ray_runtime_env(cfg):
        return "ray", "hw.ray_runtime_env asks Ray for the workers' interpreter"
    return "local", "one CPU host, colocated, no Ray cluster named"


def launcher_of(cfg: Any) -> str:
    """`ray` or `local`: trainer.launcher, `auto` resolved by `auto_choice`."""
    configured = str(_get(cfg, "trainer.launcher", "auto"))
    return auto_choice(cfg)[0] if configured == "auto" else configured
