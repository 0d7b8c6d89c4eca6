"""Preflight: the resolved config against the cluster it is about to run on, before any worker is built.

1. Resources: `hw.nodes` nodes, each offering `hw.devices_per_node` of `hw.ray_resource` (plus a CPU per worker).
   A cluster being assembled (nodes still running `ray start`) is given `trainer.placement_timeout_s` to reach that;
   a local cluster the run started itself is checked once.
2. Devices: a short probe task per node reports its devices' memory and the installed cluster stack. Memory below
   `hw.memory_gb` is an error (the plan's memory estimate assumed more); far above it, a warning (the plan leaves
   memory unused).
3. Versions: vLLM (rollout=vllm) and megatron-core (backend=megatron) on every node against
   `rollout.vllm_version` / `backend.megatron_core_version`. The config layer derives facts from these versions
   (platform quirks, rules); a difference that changes any of them is an error, any other difference a warning.
4. What the engines build (`config.capabilities`) on each node's stack, e.g. settings that need Transformer Engine
   where it is missing: warnings, or errors for what the engine would refuse.
5. GDN kernels (CUDA): where flash-linear-attention is installed but its backward refuses the GPU
   (`engines.gdn_kernels`), an FSDP run would fail in its first update, after the first generation: an error. The
   Megatron engine falls back to megatron-core's torch recurrence there: a warning.

With trainer.launcher=local there is no cluster: the probe runs in the driver's process (whose device the worker
will use) and steps 2-5 check what it saw, the same way.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from omegaconf import OmegaConf

from qwen35rl.config import engine_specs
from qwen35rl.config.layout import Layout
from qwen35rl.config.problems import ERROR, WARNING, Problem
from qwen35rl.config.resolved import ResolvedRun
from qwen35rl.runtime.cluster import node_ip
from qwen35rl.runtime.platform import Platform, apply_env

log = logging.getLogger(__name__)

from qwen35rl.exit_codes import EXIT_PREFLIGHT  # noqa: E402,F401 - the table of exit codes lives there
MEMORY_SHORT = 0.95
"""Measured device memory below this share of hw.memory_gb is an error (vendors' nominal GB vs what the driver
reports differ by a few percent)."""
MEMORY_SLACK = 1.25
"""Measured device memory above this multiple of hw.memory_gb draws a warning."""
POLL_S = 1.0


class PreflightError(RuntimeError):
    def __init__(self, problems: List[Problem]):
        self.problems = problems
        super().__init__("preflight failed:\n" + "\n".join(p.render() for p in problems))


@dataclass
class Node:
    """A live Ray node as `ray.nodes()` describes it."""

    node_id: str
    address: str
    resources: Dict[str, float] = field(default_factory=dict)


def live_nodes() -> List[Node]:
    import ray

    return [Node(n["NodeID"], str(n.get("NodeManagerAddress", "?")), dict(n.get("Resources", {})))
            for n in ray.nodes() if n.get("Alive")]


# ---------------------------------------------------------------------------------------------- resources
def _fits(node: Node, resource: str, per_node: int, cpus: int) -> bool:
    return node.resources.get(resource, 0) >= per_node and node.resources.get("CPU", 0) >= cpus


def resource_shortage(cfg: Any, platform: Platform, nodes: Sequence[Node]) -> Optional[str]:
    """None when enough nodes offer the run's devices; else what is missing, with the numbers."""
    need_nodes, per_node = cfg.hw.nodes, cfg.hw.devices_per_node
    resource = platform.ray_resource
    cpus = per_node  # one CPU per worker process (on CPU, the worker's device is that CPU)
    fitting = [n for n in nodes if _fits(n, resource, per_node, cpus)]
    if len(fitting) >= need_nodes:
        return None
    total = sum(n.resources.get(resource, 0) for n in nodes)
    want = f"{per_node} {resource}" + (f" + {cpus} CPU" if resource != "CPU" else "")
    per = ", ".join(f"{n.address}: {n.resources.get(resource, 0):g} {resource}"
                    + (f", {n.resources.get('CPU', 0):g} CPU" if resource != "CPU" else "") for n in nodes)
    return (f"needs {want} on each of {need_nodes} node(s) (hw.nodes x hw.devices_per_node), cluster has "
            f"{total:g} {resource} on {len(nodes)} node(s), {len(fitting)} of them enough"
            + (f" [{per}]" if nodes else ""))


def wait_for_resources(cfg: Any, platform: Platform, timeout_s: float,
                       nodes_fn: Callable[[], List[Node]] = live_nodes) -> List[Node]:
    """The nodes that can host workers, once `hw.nodes` of them exist; PreflightError after `timeout_s`."""
    deadline = time.monotonic() + max(timeout_s, 0.0)
    while True:
        nodes = nodes_fn()
        shortage = resource_shortage(cfg, platform, nodes)
        if shortage is None:
            per_node = cfg.hw.devices_per_node
            return [n for n in nodes if _fits(n, platform.ray_resource, per_node, per_node)]
        if time.monotonic() >= deadline:
            waited = f" after waiting {timeout_s:g} s (trainer.placement_timeout_s)" if timeout_s > 0 else ""
            raise PreflightError([Problem(
                "cluster_lacks_devices", "hw", shortage + waited,
                f"check `ray status`; match hw.nodes / hw.devices_per_node / hw.ray_resource to the cluster "
                f"(hw={cfg.hw.name} asks for {platform.ray_resource}; Ascend nodes join with "
                f"ray start --resources='{{\"NPU\": N}}')")])
        time.sleep(POLL_S)


# --------------------------------------------------------------------------------------------- node probe
def probe_node(device_type: str, paths_cfg: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Runs on a node (as a Ray task holding one device, or in the driver with trainer.launcher=local): host,
    device memory, the installed stack and, given the plain config, the paths this node cannot see
    (`rules.path_findings`: tokenizer/checkpoint directories, data files, output root, resume directory)."""
    from qwen35rl.runtime.provenance import package_versions

    from qwen35rl.config.capabilities import Stack

    info: Dict[str, Any] = {"hostname": socket.gethostname(), "address": node_ip(), "packages": package_versions(),
                            "stack": dataclasses.asdict(Stack.installed(device_type))}
    if paths_cfg is not None:
        from qwen35rl.config.rules import path_findings

        info["path_findings"] = [list(f) for f in path_findings(paths_cfg)]
    if device_type == "cpu":
        info["device_name"] = "cpu"
        info["host_memory_gb"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
        return info
    from qwen35rl.runtime.platform import device_module

    mod = device_module(device_type)
    props = mod.get_device_properties(0)
    info["device_name"] = str(props.name)
    info["device_memory_gb"] = props.total_memory / 1e9
    info["visible_devices"] = int(mod.device_count())
    if device_type == "cuda":
        from qwen35rl.engines import gdn_kernels

        info["gdn"] = gdn_kernels.probe(0)
    return info


def probe_nodes(platform: Platform, nodes: Sequence[Node], timeout_s: float,
                paths_cfg: Optional[Dict[str, Any]] = None) -> List[Dict[str, Any]]:
    """`probe_node` on each node, in a fresh process holding one device there (released when it returns)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    resources = {k: v for k, v in platform.bundle().items() if k not in ("CPU", "GPU")}
    task = ray.remote(max_calls=1)(probe_node)  # max_calls=1: the process (and its device) goes away after
    refs = [task.options(num_cpus=1, num_gpus=platform.bundle().get("GPU", 0), resources=resources,
                         runtime_env={"env_vars": platform.worker_env},
                         scheduling_strategy=NodeAffinitySchedulingStrategy(n.node_id, soft=False))
            .remote(platform.device_type, paths_cfg) for n in nodes]
    ready, pending = ray.wait(refs, num_returns=len(refs), timeout=max(timeout_s, 30.0))
    if pending:
        for ref in pending:
            ray.cancel(ref, force=True)
        late = [nodes[refs.index(r)].address for r in pending]
        raise PreflightError([Problem("node_probe_timeout", "hw", f"no answer from the probe on node(s) {late}",
                                      "check those nodes' Ray logs (/tmp/ray/session_latest/logs)")])
    return ray.get(refs)


# ----------------------------------------------------------------------------------------------- memory
def memory_problems(cfg: Any, probes: Sequence[Dict[str, Any]]) -> List[Problem]:
    want = cfg.hw.memory_gb
    out: List[Problem] = []
    for p in probes:
        where = f"{p.get('hostname')} ({p.get('address')})"
        if "device_memory_gb" in p:
            have = float(p["device_memory_gb"])
            if have < want * MEMORY_SHORT:
                out.append(Problem("device_memory_short", "hw.memory_gb",
                                   f"devices on {where} ({p.get('device_name')}) have {have:.1f} GB, the plan "
                                   f"assumes hw.memory_gb={want:g}", f"pick the hw config of these devices, or set "
                                   f"hw.memory_gb={int(have)} and re-plan", ERROR))
            elif have > want * MEMORY_SLACK:
                out.append(Problem("device_memory_unused", "hw.memory_gb",
                                   f"devices on {where} ({p.get('device_name')}) have {have:.1f} GB, the plan "
                                   f"uses hw.memory_gb={want:g}", f"set hw.memory_gb={int(have)} to plan with "
                                   f"all of it", WARNING))
        elif "host_memory_gb" in p:  # CPU workers share the host's memory
            need = want * cfg.hw.devices_per_node
            if float(p["host_memory_gb"]) < need:
                out.append(Problem("host_memory_short", "hw.memory_gb",
                                   f"{where} has {p['host_memory_gb']:.1f} GB of memory for "
                                   f"{cfg.hw.devices_per_node} CPU workers of hw.memory_gb={want:g}",
                                   "lower hw.memory_gb or hw.devices_per_node", WARNING))
    return out


# ---------------------------------------------------------------------------------------------- versions
def relevant_versions(cfg: Any) -> Dict[str, str]:
    """package -> config key of the version facts this run depends on (the engines' specs' `declared_version`)."""
    specs = (engine_specs.declared(engine_specs.ROLLOUT_ENGINES, cfg.rollout.engine),
             engine_specs.declared(engine_specs.TRAIN_ENGINES, cfg.backend.name))
    return dict(s.declared_version for s in specs if s is not None and s.declared_version is not None)


def version_facts(cfg: Any, layout: Layout) -> Tuple[frozenset, Dict[str, Any]]:
    """What the config layer derives from the configured versions: the rules' findings (code, severity) and the
    vLLM engine kwargs after platform quirks."""
    from qwen35rl.config import rules
    from qwen35rl.config.quirks import effective_engine_kwargs

    findings = frozenset((p.code, p.severity) for p in rules.check_all(cfg, layout))
    return findings, effective_engine_kwargs(cfg)


def changed_facts(run: ResolvedRun, key: str, installed: str) -> List[str]:
    """How the derived facts change when `key` holds the installed version instead of the configured one (a
    version changes no degree: both read the run's layout)."""
    plain = OmegaConf.to_container(run.cfg, resolve=True)
    other = OmegaConf.create(plain)
    OmegaConf.update(other, key, installed)
    (found_a, kw_a), (found_b, kw_b) = (version_facts(OmegaConf.create(plain), run.layout),
                                        version_facts(other, run.layout))
    out = [f"rule {code} ({sev}) {'appears' if (code, sev) in found_b else 'goes away'}"
           for code, sev in sorted(found_a ^ found_b)]
    out += [f"vLLM engine arg {k}: {kw_a.get(k, '<unset>')!r} -> {kw_b.get(k, '<unset>')!r}"
            for k in sorted(set(kw_a) | set(kw_b)) if kw_a.get(k) != kw_b.get(k)]
    return out


def version_problems(run: ResolvedRun, probes: Sequence[Dict[str, Any]]) -> List[Problem]:
    from qwen35rl.config.quirks import version_tuple

    cfg = run.cfg
    out: List[Problem] = []
    for package, key in relevant_versions(cfg).items():
        configured = str(OmegaConf.select(cfg, key))
        seen: Dict[Optional[str], List[str]] = {}
        for p in probes:
            seen.setdefault(p["packages"].get(package), []).append(str(p.get("hostname")))
        for installed, hosts in seen.items():
            where = ", ".join(hosts)
            if installed is None:
                out.append(Problem(f"{package}_missing_on_node", key, f"{package} is not installed on {where}",
                                   "install the cluster stack on every node (pip install 'qwen35rl[gpu]')"))
                continue
            if version_tuple(installed) == version_tuple(configured):
                continue
            changes = changed_facts(run, key, installed)
            message = f"{key}={configured} but {where} has {package} {installed}"
            if changes:
                out.append(Problem(f"{package}_version_changes_facts", key,
                                   f"{message}, which changes: {'; '.join(changes)}", f"set {key}={installed}"))
            else:
                out.append(Problem(f"{package}_version_differs", key, f"{message} (no version fact differs)",
                                   f"set {key}={installed} to record it", WARNING))
    return out


# ------------------------------------------------------------------------------------------------- paths
def path_problems(cfg: Any, probes: Sequence[Dict[str, Any]]) -> List[Problem]:
    """Paths a node cannot see (the plan only warns about them when the run joins a cluster): errors, with the
    nodes that lack them."""
    found: Dict[Tuple[str, str, str, str], List[str]] = {}
    for p in probes:
        for code, key, message, hint in p.get("path_findings") or []:
            found.setdefault((code, key, message, hint), []).append(str(p.get("hostname")))
    return [Problem(code, key, f"{message} (on {', '.join(hosts)})", hint, ERROR)
            for (code, key, message, hint), hosts in found.items()]


def plain_config(cfg: Any) -> Dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)


# ------------------------------------------------------------------------------------------- GDN kernels
FLA_FIX = ("install tilelang (and nvcc, for its JIT) or Triton >= 3.7.1 there, so that fla's kernels run; or "
           "uninstall flash-linear-attention there (transformers then runs its torch GDN code: slower, more memory)")


def _torch_gdn_fit(run: ResolvedRun) -> Tuple[str, bool]:
    """The memory estimate again with the torch GDN recurrence (what a node without fla's kernels runs): a phrase
    for the problem and whether it fits. On an H200 the Megatron engine's torch recurrence measured 112.2 GiB where
    this estimate says 94.4 (bench/results/h200.md, 2026-12-02c): a lower bound there."""
    from qwen35rl.config.memory import estimate

    est = estimate(run.cfg, run.layout, gdn="torch")
    peak = max(est.train_peak_gib, est.rollout_peak_gib)
    if est.fits:
        return f"estimated {peak:.1f} GiB per device with that code, of {est.capacity_gib:.1f} GiB usable", True
    return (f"estimated {peak:.1f} GiB per device with that code, more than the {est.capacity_gib:.1f} GiB usable: "
            f"the run would run out of memory"), False


def gdn_problems(run: ResolvedRun, probes: Sequence[Dict[str, Any]]) -> List[Problem]:
    """Nodes whose flash-linear-attention would refuse the GDN backward (fla issue #640)."""
    cfg = run.cfg
    refused: Dict[Tuple[str, str, str], List[str]] = {}
    for p in probes:
        g = p.get("gdn") or {}
        if g.get("fla_backward_refused"):
            cap = ".".join(map(str, g.get("capability") or []))
            refused.setdefault((str(g.get("fla")), str(g.get("triton")), f"{p.get('device_name')}, compute "
                                f"capability {cap}"), []).append(str(p.get("hostname")))
    out: List[Problem] = []
    missing = [str(p.get("hostname")) for p in probes if "gdn" in p and not (p["gdn"] or {}).get("fla")]
    if missing:
        runs = ("megatron-core's torch GDN recurrence" if engine_specs.train_uses(cfg, "megatron")
                else "transformers' torch GDN code")
        fit, fits = _torch_gdn_fit(run)
        out.append(Problem("fla_missing_on_node", "hw", f"flash-linear-attention is not installed on "
                           f"{', '.join(missing)}: the Gated DeltaNet layers run {runs} there (slower, and more "
                           f"activation memory than the plan's estimate, which assumes fla's kernels; {fit})",
                           "pip install flash-linear-attention on the GPU nodes (Hopper: see the README's GPU notes)",
                           WARNING if fits else ERROR))
    for (fla, triton, device), hosts in refused.items():
        where = f"{', '.join(hosts)} ({device}, Triton {triton}, no usable TileLang)"
        if engine_specs.train_uses(cfg, "megatron"):  # megatron-core falls back to its torch recurrence
            fit, fits = _torch_gdn_fit(run)
            out.append(Problem("fla_gdn_backward_refused", "backend.transformer_overrides.deterministic_mode",
                               f"flash-linear-attention {fla} refuses its GDN backward on {where}: the Megatron "
                               "policy trains with megatron-core's torch GDN recurrence (slower, and more activation "
                               f"memory than the plan assumed; {fit})", FLA_FIX, WARNING if fits else ERROR))
        else:
            out.append(Problem("fla_gdn_backward_refused", "backend.name",
                               f"flash-linear-attention {fla} is installed on {where}, where its GDN backward "
                               "refuses to run (fla issue #640): transformers would pick it and the first update "
                               "would fail after the first generation", FLA_FIX))
    return out


# ------------------------------------------------------------------------------------ what the engines build
def capability_problems(run: ResolvedRun, probes: Sequence[Dict[str, Any]]) -> List[Problem]:
    """The engines' declaration (`config.capabilities`) on the stack each node has: what the plan could not know
    (is Transformer Engine installed there?) decided now, before the engines would refuse it."""
    from qwen35rl.config import capabilities

    cfg, layout = run.cfg, run.layout
    planned = {(p.code, p.severity) for p in capabilities.problems(cfg, layout)}
    found: Dict[Tuple[str, str], Tuple[Problem, List[str]]] = {}
    for probe in probes:
        if "stack" not in probe:
            continue
        for p in capabilities.problems(cfg, layout, capabilities.Stack(**probe["stack"])):
            if (p.code, p.severity) not in planned:
                found.setdefault((p.code, p.severity), (p, []))[1].append(str(probe.get("hostname")))
    return [dataclasses.replace(p, message=f"{p.message} (on {', '.join(hosts)})") for p, hosts in found.values()]


# ---------------------------------------------------------------------------------------------- disk space
def disk_problems(cfg: Any) -> List[Problem]:
    """The output directory (seen from the driver) has room for two checkpoints: the one being written and the
    last complete one it replaces only when done."""
    import shutil
    from pathlib import Path

    from qwen35rl.config.memory import checkpoint_gib

    root = Path(str(cfg.trainer.output_root)).expanduser().resolve()
    while not root.exists() and root != root.parent:
        root = root.parent
    try:
        free_gib = shutil.disk_usage(root).free / 2 ** 30
    except OSError:
        return []
    need = 2 * checkpoint_gib(cfg)
    if free_gib >= need:
        return []
    return [Problem("output_disk_short", "trainer.output_root", f"{root} has {free_gib:.1f} GiB free; two "
                    f"checkpoints of this run take {need:.1f} GiB (one is {need / 2:.1f} GiB)",
                    "free space there, or point trainer.output_root at a larger file system (a full disk stops the "
                    "run at its next checkpoint, with what was written kept)", WARNING)]


# --------------------------------------------------------------------------------------------------- entry
def check_probes(run: ResolvedRun, probes: Sequence[Dict[str, Any]]) -> List[Problem]:
    """What the node probes saw against the run (memory, versions, GDN kernels). Warnings are logged and
    returned; errors raise PreflightError (with every error found)."""
    cfg = run.cfg
    problems = (memory_problems(cfg, probes) + version_problems(run, probes) + gdn_problems(run, probes)
                + capability_problems(run, probes) + path_problems(cfg, probes) + disk_problems(cfg))
    for p in problems:
        if p.severity != ERROR:
            log.warning("preflight: %s", p.render())
    errors = [p for p in problems if p.severity == ERROR]
    if errors:
        raise PreflightError(errors)
    return problems


def run_preflight(run: ResolvedRun, platform: Platform, *, wait_s: float, in_process: bool = False) -> Dict[str, Any]:
    """All checks against the connected Ray cluster. Returns what was seen, for the run's provenance.
    `in_process`: the cluster is this host's CPUs alone (a local CPU cluster), probed in this process."""
    cfg = run.cfg
    t0 = time.monotonic()
    nodes = wait_for_resources(cfg, platform, wait_s)
    if in_process and len(nodes) == 1:
        probes = [probe_node(platform.device_type, plain_config(cfg))]
    else:
        probes = probe_nodes(platform, nodes, cfg.trainer.placement_timeout_s, plain_config(cfg))
    warnings = check_probes(run, probes)
    log.info("preflight passed in %.1f s: %d node(s) can host the run", time.monotonic() - t0, len(nodes))
    return {"nodes": [{"node_id": n.node_id, "address": n.address, "resources": n.resources} for n in nodes],
            "probes": list(probes), "warnings": [p.to_dict() for p in warnings]}


def run_local_preflight(run: ResolvedRun, platform: Platform) -> Dict[str, Any]:
    """trainer.launcher=local: the same checks on this process's device, probed here (no Ray). Returns what was
    seen, for the run's provenance."""
    t0 = time.monotonic()
    apply_env(platform.worker_env)  # the probe sees the workers' environment, as a Ray probe task does
    try:
        probe = probe_node(platform.device_type, plain_config(run.cfg))
    except Exception as e:  # noqa: BLE001 - no such device here: no driver, a CPU-only torch, ...
        raise PreflightError([Problem(
            "local_device_missing", "hw.device", f"hw.device={platform.device_type}, but this process cannot use "
            f"a {platform.device_type} device ({type(e).__name__}: {' '.join(str(e).split())})",
            "run where the device is visible (CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES), or pick the hw "
            "config of this machine (hw=cpu)")]) from None
    warnings = check_probes(run, [probe])
    log.info("preflight passed in %.1f s: %s (%s) hosts the run on this host, without Ray", time.monotonic() - t0,
             probe["hostname"], probe["device_name"])
    return {"launcher": "local", "nodes": [], "probes": [probe], "warnings": [p.to_dict() for p in warnings]}
