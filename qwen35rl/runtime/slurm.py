"""Sweeps as Slurm jobs: what runs inside each job before training, and how the launcher sizes each job.

`qwen35rl-train -m ... hydra/launcher=submitit_slurm` submits every job of a sweep as its own Slurm job (the
launcher plugin lives in `hydra_plugins/qwen35rl_submitit`, on hydra-submitit-launcher). Inside a job,
`ray_for_allocation` runs before training and does what `launch/slurm_ray.sh` does for one run:

- an allocation of more than one node (SLURM_JOB_NODELIST / SLURM_NNODES): the Ray head starts on the first node
  and a Ray worker on every other one, each `ray start --block` in its own `srun` step (so Slurm stops Ray with the
  job); once every node has joined, the run gets `ray_address=<head ip>:<port>` (and RAY_ADDRESS);
- one node, the local executor, outside Slurm, `trainer.launcher=local`, or a run that names its cluster already
  (`ray_address`, RAY_ADDRESS): nothing happens, the run starts (or joins) Ray as it always does.

The job's size comes from the composed config (`job_parameters`): `nodes` = hw.nodes, one task per node (the driver:
Ray places one worker per device itself), `gpus_per_node` = hw.devices_per_node on a GPU target, `cpus_per_task`
= 8 per device; anything set under `hydra.launcher` wins.
"""
from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from qwen35rl.config.launcher import launcher_of

log = logging.getLogger(__name__)

RAY_PORT = 6379
HEAD_START_S = 15.0
"""Seconds between starting the head and starting the workers (slurm_ray.sh sleeps as long)."""
JOIN_TIMEOUT_S = 600.0
CPUS_PER_DEVICE = 8
"""`cpus_per_task: auto`: CPUs asked per device (slurm_ray.sh asks 64 for 8 GPUs)."""


class SlurmAllocationError(RuntimeError):
    """The Slurm allocation cannot host the job's config, or Ray did not come up on it."""


# ------------------------------------------------------------------------------------------------ node lists
def _split_top(text: str) -> List[str]:
    """Split at the commas outside brackets: `a[1-2,4],b` -> [`a[1-2,4]`, `b`]."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in {text!r}")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise ValueError(f"unbalanced '[' in {text!r}")
    parts.append(cur)
    return [p for p in parts if p]


def _expand_range(item: str) -> List[str]:
    """`01-03` -> 01 02 03 (zero padding kept), `7` -> 7."""
    lo, dash, hi = item.partition("-")
    if not dash:
        return [item]
    if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
        raise ValueError(f"bad range {item!r}")
    width = len(lo) if lo.startswith("0") else 0
    return [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]


def _expand_one(expr: str) -> List[str]:
    m = re.search(r"\[([^\[\]]*)\]", expr)
    if m is None:
        return [expr]
    head, tail = expr[:m.start()], expr[m.end():]
    out = []
    for item in m.group(1).split(","):
        for value in _expand_range(item.strip()):
            out += [head + value + rest for rest in _expand_one(tail)]
    return out


def parse_nodelist(nodelist: str) -> List[str]:
    """Host names of a Slurm node list, in Slurm's order, as `scontrol show hostnames` prints them:
    `gpu[001-003,007],login-a,rack[1-2]-n[1-2]` -> gpu001 gpu002 gpu003 gpu007 login-a rack1-n1 rack1-n2 ..."""
    nodes: List[str] = []
    for part in _split_top(nodelist.strip()):
        nodes += _expand_one(part)
    return nodes


@dataclass
class Allocation:
    """The Slurm allocation this process runs in."""

    job_id: str
    nodes: List[str]
    cpus_per_task: Optional[int] = None

    @property
    def multi_node(self) -> bool:
        return len(self.nodes) > 1


def allocation(env: Optional[Mapping[str, str]] = None) -> Optional[Allocation]:
    """The allocation of a Slurm job (SLURM_JOB_NODELIST, SLURM_NNODES / SLURM_JOB_NUM_NODES), None outside one
    (and for submitit's local executor)."""
    env = os.environ if env is None else env
    if env.get("SUBMITIT_EXECUTOR") == "local":
        return None
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        return None
    nodes = parse_nodelist(nodelist)
    count = env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES")
    if count and count.isdigit() and int(count) != len(nodes):
        raise SlurmAllocationError(f"SLURM_JOB_NODELIST={nodelist!r} names {len(nodes)} node(s) but SLURM_NNODES="
                                   f"{count}")
    cpus = env.get("SLURM_CPUS_PER_TASK")
    return Allocation(env.get("SLURM_JOB_ID", "?"), nodes, int(cpus) if cpus and cpus.isdigit() else None)


# ------------------------------------------------------------------------------------------------ Ray bring-up
def _ray_executable() -> str:
    """The `ray` of this interpreter's environment (compute nodes see the same file system), else PATH's."""
    beside = Path(sys.executable).parent / "ray"
    return str(beside) if beside.is_file() else (shutil.which("ray") or "ray")


def srun_step(node: str, cpus_per_task: Optional[int] = None) -> List[str]:
    """One task on one node of the allocation, as slurm_ray.sh starts its steps."""
    cmd = ["srun", "--nodes=1", "--ntasks=1"]
    if cpus_per_task:
        cmd.append(f"--cpus-per-task={cpus_per_task}")
    return cmd + ["-w", node]


def _device_flags(ray_resource: str, devices_per_node: int) -> List[str]:
    if ray_resource == "GPU":
        return [f"--num-gpus={devices_per_node}"]
    if ray_resource == "CPU":
        return []  # Ray counts the step's CPUs itself
    return [f"--resources={{\"{ray_resource}\": {devices_per_node}}}"]


def ray_start_commands(alloc: Allocation, head_ip: str, port: int, ray_resource: str, devices_per_node: int,
                       ray: str = "ray") -> List[List[str]]:
    """The `srun ... ray start --block` commands: the head on the first node, then a worker on each other node."""
    devices = _device_flags(ray_resource, devices_per_node)
    head = srun_step(alloc.nodes[0], alloc.cpus_per_task) + [
        ray, "start", "--head", f"--node-ip-address={head_ip}", f"--port={port}", *devices,
        "--disable-usage-stats", "--block"]
    workers = [srun_step(node, alloc.cpus_per_task) + [
        ray, "start", f"--address={head_ip}:{port}", *devices, "--disable-usage-stats", "--block"]
        for node in alloc.nodes[1:]]
    return [head, *workers]


def head_ip_of(alloc: Allocation, run: Callable[..., Any] = subprocess.run) -> str:
    """The head node's address, asked on the node itself (`hostname --ip-address` in a step there)."""
    out = run([*srun_step(alloc.nodes[0]), "hostname", "--ip-address"], capture_output=True, text=True,
              timeout=120, check=True).stdout.split()
    if not out:
        raise SlurmAllocationError(f"`hostname --ip-address` on {alloc.nodes[0]} printed nothing")
    return out[0]


def _wait_for_nodes(count: int, address: str, timeout_s: float) -> None:
    from qwen35rl.runtime import wait_for_nodes

    try:
        wait_for_nodes.main([str(count), address, str(timeout_s)])
    except SystemExit as e:  # it exits with its message when the nodes do not join in time
        raise SlurmAllocationError(str(e.code)) from None


def _stop(procs: Sequence[Any]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()  # srun forwards it to its step: `ray start --block` stops that node's Ray
    for p in procs:
        try:
            p.wait(timeout=30)
        except Exception:  # Slurm ends the steps with the job anyway
            pass


@dataclass
class BringUp:
    """What `ray_for_allocation` did: the address it set and the srun steps it started."""

    address: Optional[str]
    commands: List[List[str]]
    processes: List[Any]


def bring_up(cfg: Any, env: Optional[Mapping[str, str]] = None, popen: Callable[..., Any] = subprocess.Popen,
             run: Callable[..., Any] = subprocess.run, wait: Callable[[int, str, float], None] = _wait_for_nodes,
             sleep: Callable[[float], None] = time.sleep) -> BringUp:
    """Start Ray over a multi-node Slurm allocation for this run (see the module docstring); the process runners
    are parameters so that tests can record the commands instead of running srun."""
    env = os.environ if env is None else env
    if launcher_of(cfg) != "ray":
        return BringUp(None, [], [])
    if cfg.get("ray_address") or env.get("RAY_ADDRESS"):
        return BringUp(None, [], [])  # the run names its cluster
    alloc = allocation(env)
    if alloc is None or not alloc.multi_node:
        return BringUp(None, [], [])
    if env.get("SLURM_PROCID", "0") != "0":  # one task of several in an srun step: task 0 brings Ray up
        return BringUp(None, [], [])
    nodes, devices = int(cfg.hw.nodes), int(cfg.hw.devices_per_node)
    if nodes != len(alloc.nodes):
        raise SlurmAllocationError(
            f"Slurm job {alloc.job_id} has {len(alloc.nodes)} node(s) ({', '.join(alloc.nodes)}) but the run asks "
            f"for hw.nodes={nodes}; submit it with hydra.launcher.nodes={nodes} (the default) or set hw.nodes")
    port = int(env.get("RAY_PORT", RAY_PORT))
    head_ip = head_ip_of(alloc, run)
    address = f"{head_ip}:{port}"
    commands = ray_start_commands(alloc, head_ip, port, str(cfg.hw.ray_resource), devices, _ray_executable())
    print(f"[qwen35rl] Slurm job {alloc.job_id}: Ray head on {alloc.nodes[0]} ({address}), {len(alloc.nodes)} "
          f"node(s) x {devices} device(s)", file=sys.stderr, flush=True)
    procs = [popen(commands[0])]
    atexit.register(_stop, procs)
    sleep(HEAD_START_S)
    procs += [popen(cmd) for cmd in commands[1:]]
    wait(len(alloc.nodes), address, JOIN_TIMEOUT_S)
    return BringUp(address, commands, procs)


def ray_for_allocation(cfg: Any, **runners: Any) -> Any:
    """Called by a training job before it trains: on a multi-node Slurm allocation, bring up Ray across its nodes
    and point the run at it (`ray_address`, RAY_ADDRESS); otherwise leave the config as it is. Returns cfg.
    `runners`: `bring_up`'s environment and process runners (tests)."""
    done = bring_up(cfg, **runners)
    if done.address:
        from omegaconf import open_dict

        os.environ["RAY_ADDRESS"] = done.address
        with open_dict(cfg):
            cfg.ray_address = done.address
    return cfg


# ------------------------------------------------------------------------------------------------ job sizes
def job_parameters(launcher: Mapping[str, Any], cfg: Any) -> Dict[str, Any]:
    """A job's launcher parameters (its resolved `hydra.launcher`, without `_target_`) with `auto` made concrete
    from its composed config: gpus_per_node = hw.devices_per_node on a GPU target (none otherwise), cpus_per_task
    = 8 per device."""
    params = {k: v for k, v in dict(launcher).items() if k != "_target_"}
    devices = int(cfg.hw.devices_per_node)
    if params.get("gpus_per_node") == "auto":
        params["gpus_per_node"] = devices if str(cfg.hw.ray_resource) == "GPU" else None
    if params.get("cpus_per_task") == "auto":
        params["cpus_per_task"] = CPUS_PER_DEVICE * devices
    return params


def exit_code_of(job_return: Any) -> int:
    """A training job's exit code from its Hydra job return (1 when the job failed outright)."""
    from hydra.core.utils import JobStatus

    from qwen35rl.exit_codes import EXIT_CONFIG

    if job_return.status != JobStatus.COMPLETED:
        return 1
    value = job_return.return_value
    if not isinstance(value, dict):
        return 1
    if not value.get("valid", True):
        return EXIT_CONFIG
    return int(value.get("exit_code", 1))
