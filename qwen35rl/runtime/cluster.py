"""Ray bring-up and the worker group: one worker actor per device, placed by a placement group per node.

A local Ray cluster is started when neither `ray_address` nor RAY_ADDRESS is set (sized to the run on CPU so it
starts in seconds); otherwise the driver joins the running cluster (`ray start` on every node, see launch/).
Ranks follow (node, bundle) order, so ranks of a node are contiguous; rank 0's node hosts the torch.distributed
rendezvous.

`LocalWorkerGroup` is the same interface without Ray (trainer.launcher=local): the one worker of a single-device
run, held in the driver's process. Nothing on its path imports ray.

The groups only move calls (`start`, then the calls' `wait`, or `wait_pools`); what the driver asks of its workers
is said by the typed handles of `qwen35rl.runtime.worker_groups`. The one protocol the groups know themselves is the
bring-up every worker class has: `rendezvous_address` on rank 0, then `init_distributed` on every rank.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import sys
import time
import traceback
from typing import Any, Dict, List, Optional, Sequence, Tuple

from qwen35rl.config import redact
from qwen35rl.config.launcher import launcher_of, ray_runtime_env
from qwen35rl.config.resolved import ResolvedRun
from qwen35rl.runtime import local_watchdog
from qwen35rl.runtime.platform import Platform, apply_env

log = logging.getLogger(__name__)

CPU_OBJECT_STORE_BYTES = 256 * 1024 ** 2


from qwen35rl.exit_codes import EXIT_WORKER_FAILURE  # noqa: E402,F401 - the table of exit codes lives there
_CAUSE_CHARS = 600


class ClusterError(RuntimeError):
    pass


class WorkerFailure(RuntimeError):
    """A worker call failed: which worker (rank, node, process), in which call, and why."""

    def __init__(self, rank: int, where: Dict[str, Any], method: str, cause: str, detail: str = ""):
        self.rank, self.where, self.method, self.cause, self.detail = rank, where, method, cause, detail
        place = f"node {where.get('ip', '?')}" + (f" ({where['hostname']})" if where.get("hostname") else "")
        super().__init__(f"worker rank {rank} on {place}, pid {where.get('pid', '?')}, failed in {method}: {cause}")


def connected_ray() -> Any:
    """The ray module when this process is connected to Ray (a worker or probe task, a driver after ray.init);
    None otherwise, without importing ray."""
    ray = sys.modules.get("ray")
    return ray if ray is not None and ray.is_initialized() else None


def node_ip() -> str:
    """This node's address as Ray sees it; 127.0.0.1 in a process without Ray (trainer.launcher=local)."""
    ray = connected_ray()
    return ray.util.get_node_ip_address() if ray else "127.0.0.1"


def whereabouts() -> Dict[str, Any]:
    """Where this process lives: host, node address, pid (and Ray's node id under Ray)."""
    out: Dict[str, Any] = {"hostname": socket.gethostname(), "ip": node_ip(), "pid": os.getpid()}
    ray = connected_ray()
    if ray:
        out["node_id"] = ray.get_runtime_context().get_node_id()
    return out


def _whereabouts(_worker: Any) -> Dict[str, Any]:
    """Runs inside a worker actor (through `__ray_call__`)."""
    return whereabouts()


def raised_cause(exc: BaseException) -> str:
    """One line on an exception raised inside a worker method (an out-of-memory named as such)."""
    line = f"{type(exc).__name__}: {exc}"
    if "OutOfMemory" in type(exc).__name__ or "out of memory" in str(exc).lower():
        line = f"out of device memory ({line})"
    return _one_line(line)


def _one_line(line: str) -> str:
    line = " ".join(line.split())
    return line if len(line) <= _CAUSE_CHARS else line[:_CAUSE_CHARS] + " ..."


def failure_cause(err: BaseException) -> str:
    """One line on why a worker call failed: the exception raised inside it, or how its process ended."""
    import ray.exceptions as rex

    text = str(err)
    if isinstance(err, rex.RayTaskError) and getattr(err, "cause", None) is not None:
        return raised_cause(err.cause)
    if isinstance(err, rex.OutOfMemoryError):
        line = "killed by Ray's memory monitor: the node ran out of host memory"
    elif isinstance(err, rex.RayActorError) and getattr(err, "_actor_init_failed", False):
        last = [ln for ln in text.splitlines() if ln.strip()][-1:]
        line = f"failed to start ({last[0].strip() if last else 'see the worker log'})"
    elif isinstance(err, rex.RayActorError):
        m = re.search(r"Worker exit type: (\S+) Worker exit detail: (.*?\.)", text)
        how = f" ({m.group(1)}: {m.group(2)})" if m else ""
        line = (f"its process died{how}; killed by a signal, by the kernel's OOM killer (see dmesg on that node), "
                f"or crashed")
    else:
        line = f"{type(err).__name__}: {text}"
    return _one_line(line)


def ray_address(cfg: Any) -> Optional[str]:
    """The cluster to join: `ray_address`, else RAY_ADDRESS, else None (start a local one)."""
    return cfg.get("ray_address") or os.environ.get("RAY_ADDRESS") or None


def unreachable_cluster(cfg: Any, resolve_auto: bool = False) -> Optional[str]:
    """The error text when the cluster the run joins does not answer (qwen35rl.runtime.ray_reach), else None.
    `auto` is checked only with `resolve_auto` (Ray, imported, reads which cluster it means)."""
    from qwen35rl.runtime.ray_reach import ray_address_problem

    address = ray_address(cfg)
    if not address or address == "local":
        return None
    source = "ray_address" if cfg.get("ray_address") else "RAY_ADDRESS"
    target = str(address)
    if target == "auto":
        if not resolve_auto:
            return None
        try:
            from ray._private.services import canonicalize_bootstrap_address

            target = canonicalize_bootstrap_address("auto") or ""
        except Exception:  # noqa: BLE001 - no cluster recorded here: ray.init says so itself, at once
            return None
    problem = ray_address_problem(target, source) if target else None
    if problem and target != str(address):
        problem = problem.replace(f"{source}={target}:", f"{source}={address} (the cluster {target}):", 1)
    return problem


@contextlib.contextmanager
def _signal_handlers_kept() -> Any:
    """ray.init installs a C-level SIGTERM handler of its own that aborts the process with a stack trace, in place
    of the run's clean stop (qwen35rl.runtime.signals): the Python handlers in place before it are put back as
    soon as it returns. (Blocking the signals meanwhile is no way out: the Ray processes it starts would inherit
    the blocked mask, and a later SIGTERM would no longer stop them.)"""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in handlers.items():
            if handler is not None:
                signal.signal(s, handler)


def connect(cfg: Any, platform: Platform, world: int) -> bool:
    """Connect the driver to Ray. Returns True when this call started a local cluster (and must stop it)."""
    import ray

    if ray.is_initialized():
        return False
    address = ray_address(cfg)
    quiet: Dict[str, Any] = dict(logging_level=logging.WARNING, log_to_driver=True, configure_logging=True)
    runtime_env = ray_runtime_env(cfg)
    if runtime_env:
        quiet["runtime_env"] = runtime_env
    if address:
        problem = unreachable_cluster(cfg, resolve_auto=True)  # ray.init would wait for minutes, uninterruptibly
        if problem:
            raise ClusterError(problem)
        with _signal_handlers_kept():
            ray.init(address=address, **quiet)
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private single-user cluster
    kwargs: Dict[str, Any] = dict(include_dashboard=False, **quiet)
    if platform.ray_resource == "CPU":
        # each worker is one CPU device; one spare CPU for Ray's own helpers
        kwargs.update(num_cpus=world + 1, object_store_memory=CPU_OBJECT_STORE_BYTES)
    elif platform.ray_resource not in ("GPU",):
        kwargs.update(resources={platform.ray_resource: cfg.hw.devices_per_node})
    with _signal_handlers_kept():
        ray.init(**kwargs)
    return True


def _no_thread_sigterm_note(record: logging.LogRecord) -> bool:
    """Ray's note that a thread cannot install its SIGTERM handler: the run's own handlers stop it."""
    return "SIGTERM handler is not set" not in record.getMessage()


class EarlyLocalRay:
    """The local Ray cluster of a run that starts one, started in a thread while the driver imports torch and
    prepares its data: Ray's own processes come up on the other cores meanwhile (on a 2-core machine that hides
    most of Ray's 2-3 s start). `ray_session` takes it over; `close` stops it when the run ends before that (a
    config or data error, a signal).
    The thread lives until the cluster is stopped: Ray starts GCS and raylet with PR_SET_PDEATHSIG, which Linux
    ties to the thread that forked them, so they would be killed the moment a finished thread exited."""

    def __init__(self, cfg: Any, platform: Platform, world: int):
        import threading

        self.started_local, self.watchdog, self.error = False, None, None
        self.seconds = 0.0
        self.taken = False
        self.ready, self.stopped = threading.Event(), threading.Event()
        t0 = time.monotonic()

        def start() -> None:
            logging.getLogger("ray._private.worker").addFilter(_no_thread_sigterm_note)  # once: the same object
            # ray.init in the main thread installs a C-level SIGTERM handler that aborts the driver, and
            # `_signal_handlers_kept` puts the run's handlers back over it; a thread cannot, so the driver's core
            # worker is told not to install it (this process only: workers read their own environment)
            from ray._private import ray_constants

            ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
            try:
                self.started_local = connect(cfg, platform, world)
                self.watchdog = LocalClusterWatchdog.start() if self.started_local else None
            except BaseException as e:  # noqa: BLE001 - raised where the driver takes the cluster over
                self.error = e
            finally:
                self.seconds = time.monotonic() - t0
                self.ready.set()
            self.stopped.wait()

        self.thread = threading.Thread(target=start, name="qwen35rl-ray-start", daemon=True)
        self.thread.start()

    @classmethod
    def wanted(cls, cfg: Any) -> bool:
        """The run starts a local cluster of its own (trainer.launcher=ray, no cluster address)."""
        return launcher_of(cfg) == "ray" and not ray_address(cfg)

    def take(self) -> Tuple[bool, Optional["LocalClusterWatchdog"]]:
        """Wait for the start; (whether a local cluster was started, its watchdog), or the start's error. The
        taker stops the cluster, then calls `done`."""
        self.ready.wait()
        if self.error is not None:
            self.close()
            raise self.error
        self.taken = True
        return self.started_local, self.watchdog

    def done(self) -> None:
        """The cluster is stopped: the start thread may end."""
        self.stopped.set()
        self.thread.join()

    def close(self) -> None:
        """Stop the cluster if nobody took it over."""
        if self.taken:
            return
        self.taken = True
        self.ready.wait()
        _leave_local(self.started_local, self.watchdog)
        self.done()


@contextlib.contextmanager
def ray_session(cfg: Any, platform: Platform, world: int, early: Optional[EarlyLocalRay] = None):
    """Connected to Ray for the duration (yields whether this run started a local cluster, which is stopped on
    exit). A local cluster is watched by `LocalClusterWatchdog`, so that it goes away with the driver even when
    the driver is killed. `early`: the cluster's start already under way (`EarlyLocalRay`)."""
    if early is not None:
        started_local, watchdog = early.take()
    else:
        started_local = connect(cfg, platform, world)
        watchdog = LocalClusterWatchdog.start() if started_local else None
    try:
        yield started_local
    finally:
        _leave_local(started_local, watchdog)
        if early is not None:
            early.done()


def _leave_local(started_local: bool, watchdog: Optional["LocalClusterWatchdog"]) -> None:
    """Stop the local cluster this run started (if it is still connected) and release its watchdog."""
    ray = connected_ray()
    if started_local and ray is not None:
        ray.shutdown()
    if watchdog is not None:
        watchdog.release()


class LocalClusterWatchdog:
    """A small process that stops the local Ray cluster this driver started once the driver is gone, however it
    ended (SIGKILL, the kernel's OOM killer). Ray's own fate sharing takes the raylet and GCS down with the
    driver, but their children (DashboardAgent, RuntimeEnvAgent, idle workers) linger for about a minute; the
    watchdog keeps a list of the driver's descendants (every `poll_s`) and when the driver's pipe closes or its
    pid is gone, it freezes and kills those still running. Only this driver's descendants are touched, never
    another Ray cluster on the host. On a normal exit (`release`) it only stops what ray.shutdown left behind."""

    POLL_S = 0.25

    def __init__(self, proc: Any):
        self.proc = proc

    @classmethod
    def start(cls) -> Optional["LocalClusterWatchdog"]:
        import subprocess

        if not os.path.isdir("/proc"):
            return None
        try:
            proc = subprocess.Popen([sys.executable, "-I", "-S", local_watchdog.__file__, str(os.getpid()), str(cls.POLL_S)],
                                    stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, close_fds=True)
        except OSError as e:
            log.warning("no watchdog for the local Ray cluster (%s): after a crash its processes may linger", e)
            return None
        return cls(proc)

    def release(self) -> None:
        """The cluster was shut down normally: let the watchdog sweep up what is left and exit."""
        try:
            self.proc.stdin.write("released\n")
            self.proc.stdin.close()
        except (OSError, ValueError):
            pass


def placement_groups(platform: Platform, nodes: int, devices_per_node: int, timeout_s: float) -> List[Any]:
    """One STRICT_PACK placement group per node (its devices on one host), all ready within `timeout_s` or a
    ClusterError naming what is missing."""
    import ray
    from ray.util.placement_group import placement_group

    bundle = platform.bundle()
    groups = [placement_group([bundle for _ in range(devices_per_node)], strategy="STRICT_PACK",
                              name=f"qwen35rl-node{i}-{os.getpid()}") for i in range(nodes)]
    ready, pending = ray.wait([g.ready() for g in groups], num_returns=len(groups), timeout=timeout_s)
    if pending:
        for g in groups:
            ray.util.remove_placement_group(g)
        free, total = ray.available_resources(), ray.cluster_resources()
        have = ", ".join(f"{free.get(k, 0):g} of {total.get(k, 0):g} {k}" for k in bundle)
        raise ClusterError(
            f"placement: needs {nodes} node(s) x {devices_per_node} bundles of {bundle} (one node each), "
            f"{len(pending)} of {nodes} still unplaced after {timeout_s:g} s (trainer.placement_timeout_s); free "
            f"now: {have}. Other actors or placement groups may hold them, or no single node has "
            f"{devices_per_node} free: check `ray status` against hw.nodes / hw.devices_per_node.")
    return groups


class WorkerGroup:
    """The colocated workers of a run, rank order. Calls fan out to every worker and gather results in rank order."""

    def __init__(self, actors: List[Any], groups: List[Any]):
        self.actors, self.groups = actors, groups
        self.where: List[Dict[str, Any]] = [{} for _ in actors]
        """Host, node address and pid of each rank (known once the workers answered)."""

    @property
    def world(self) -> int:
        return len(self.actors)

    @classmethod
    def create(cls, run: ResolvedRun, platform: Platform, worker_cls: type, world: int, *,
               on_started: Optional[Any] = None, **worker_kwargs: Any) -> "WorkerGroup":
        """Place one `worker_cls(run.cfg, layout=run.layout, rank=, world_size=, local_rank=, **worker_kwargs)`
        actor per device (Ray must be connected) and join them in torch.distributed. `on_started()` is called once
        every worker answered, before they join (and build their engines)."""
        return cls.create_pools(run, platform, [(worker_cls, world, worker_kwargs)], on_started=on_started)[0]

    @classmethod
    def create_pools(cls, run: ResolvedRun, platform: Platform, pools: Sequence[Tuple[type, int, Dict[str, Any]]], *,
                     on_started: Optional[Any] = None) -> List["WorkerGroup"]:
        """One worker group per (worker class, world, keyword arguments) of `pools`, which take the devices in rank
        order (node-major: the first pool the first devices of node 0). Every worker is placed in the per-node
        placement groups before any pool joins; each pool then joins its own torch.distributed world (rank 0 of the
        pool hosts the rendezvous) and builds its engines, all pools at once. Every worker gets `run`'s typed config
        and layout as they are (Ray pickles them)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cfg = run.cfg
        nodes, per_node = cfg.hw.nodes, cfg.hw.devices_per_node
        total = sum(world for _, world, _ in pools)
        if nodes * per_node != total:
            raise ClusterError(f"worker pools of {[w for _, w, _ in pools]} devices != hw.nodes {nodes} x "
                               f"hw.devices_per_node {per_node}")
        groups = placement_groups(platform, nodes, per_node, cfg.trainer.placement_timeout_s)
        resources = {k: v for k, v in platform.bundle().items() if k not in ("CPU", "GPU")}
        made: List["WorkerGroup"] = []
        offset = 0
        for index, (worker_cls, world, worker_kwargs) in enumerate(pools):
            remote_cls = ray.remote(worker_cls)
            prefix = "worker" if index == 0 else f"pool{index}-worker"
            actors = []
            for rank in range(world):
                node, local_rank = divmod(offset + rank, per_node)
                actors.append(remote_cls.options(
                    num_cpus=1,
                    num_gpus=platform.bundle().get("GPU", 0),
                    resources=resources,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=groups[node], placement_group_bundle_index=local_rank),
                    runtime_env={"env_vars": platform.worker_env},
                    name=f"qwen35rl-{prefix}-{rank}-{os.getpid()}",
                ).remote(cfg, layout=run.layout, rank=rank, world_size=world, local_rank=local_rank,
                         **worker_kwargs))
            made.append(cls(actors, groups))
            offset += world
        try:
            for wg in made:
                wg.where = wg._gather([a.__ray_call__.remote(_whereabouts) for a in wg.actors], "start-up")
            if on_started is not None:
                on_started()
            joins = [wg._join() for wg in made]  # every pool joins at once: their engines build in parallel
            for calls in joins:
                calls.wait()
        except BaseException:
            for wg in made:
                wg.shutdown()
            raise
        return made

    # ------------------------------------------------------------------------------------------------- calls
    def start(self, method: str, per_rank: Sequence[Sequence[Any]], kwargs: Optional[Dict[str, Any]] = None,
              ranks: Optional[Sequence[int]] = None) -> "Calls":
        """`method` on the workers of `ranks` (every rank by default), without waiting: the worker of ranks[i] gets
        the positional arguments per_rank[i], each the same `kwargs`. The results come from `Calls.wait` (or
        `wait_pools`, which lets the driver keep two pools busy at once)."""
        ranks = list(range(self.world)) if ranks is None else list(ranks)
        _check_shares(method, per_rank, len(ranks))
        refs = [getattr(self.actors[r], method).remote(*args, **(kwargs or {})) for r, args in zip(ranks, per_rank)]
        return Calls(self, method, refs, ranks)

    def _join(self) -> "Calls":
        """The bring-up: rank 0 names the torch.distributed rendezvous on its node, then every rank joins it and
        builds its engines (under way when this returns)."""
        master_addr, master_port = self.start("rendezvous_address", [()], ranks=[0]).wait()[0]
        return self.start("init_distributed", [(master_addr, master_port)] * self.world)

    def _gather(self, refs: List[Any], method: str, ranks: Optional[List[int]] = None) -> List[Any]:
        """Results in order, failing at the first worker that fails. Waiting for all of them instead would hang:
        the other ranks of a collective call wait for the failed one until the collective times out."""
        import ray

        ranks = list(range(len(refs))) if ranks is None else ranks
        position = {ref: i for i, ref in enumerate(refs)}
        results: List[Any] = [None] * len(refs)
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                i = position[ref]
                try:
                    results[i] = ray.get(ref)
                except ray.exceptions.RayError as e:
                    rank = ranks[i]
                    raise WorkerFailure(rank, self.where[rank] or _where_from(str(e)), method, failure_cause(e),
                                        str(e)) from None
        return results

    def shutdown(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:  # already gone
                pass
        for g in self.groups:
            try:
                ray.util.remove_placement_group(g)
            except Exception:
                pass


class LocalWorkerGroup:
    """The one worker of a single-device run in the driver's process (trainer.launcher=local), with WorkerGroup's
    interface. Calls are plain method calls; an exception raised in one becomes the WorkerFailure a Ray worker's
    would (rank 0, this process, the traceback as detail), so the driver stops and reports the run the same way.

    Environment: `platform.worker_env` (hw.env + backend.env) is set in this process, except for variables the
    user already set: here the user's environment is the worker's (CUDA_VISIBLE_DEVICES picks the device, a
    debugging NCCL_DEBUG stays), and the values kept are logged. Variables a library reads when it is imported
    (OMP_NUM_THREADS for torch) only count when set before the run starts."""

    world = 1

    def __init__(self, worker: Any):
        self.worker = worker
        self.where: List[Dict[str, Any]] = [whereabouts()]

    @classmethod
    def create(cls, run: ResolvedRun, platform: Platform, worker_cls: type, world: int, *,
               on_started: Optional[Any] = None, **worker_kwargs: Any) -> "LocalWorkerGroup":
        """Build `worker_cls(run.cfg, layout=run.layout, rank=0, world_size=1, local_rank=0, **worker_kwargs)` here
        and join it in a torch.distributed group of one (`on_started()` in between, as WorkerGroup.create)."""
        if world != 1:
            raise ClusterError(f"trainer.launcher=local runs one worker in this process, the layout has world "
                               f"{world}: use trainer.launcher=ray")
        kept = {k: os.environ[k] for k, v in platform.worker_env.items() if os.environ.get(k, v) != v}
        apply_env(platform.worker_env)
        if kept:
            log.info("the worker keeps these variables of this process's environment over hw.env / backend.env: "
                     "%s", redact.redact(kept))
        try:
            worker = worker_cls(run.cfg, layout=run.layout, rank=0, world_size=1, local_rank=0, **worker_kwargs)
        except Exception as e:  # noqa: BLE001 - reported like a Ray worker that failed to start
            raise WorkerFailure(0, whereabouts(), "start-up", f"failed to start ({raised_cause(e)})",
                                traceback.format_exc()) from None
        wg = cls(worker)
        if on_started is not None:
            on_started()
        try:
            wg.start("init_distributed", [("127.0.0.1", free_port())]).wait()
        except BaseException:
            wg.shutdown()
            raise
        return wg

    def start(self, method: str, per_rank: Sequence[Sequence[Any]], kwargs: Optional[Dict[str, Any]] = None,
              ranks: Optional[Sequence[int]] = None) -> "Finished":
        """WorkerGroup.start in this process: the call runs to its end before this returns."""
        ranks = [0] if ranks is None else list(ranks)
        if ranks != [0]:
            raise IndexError(f"{method}: ranks {ranks} of a world of 1")
        _check_shares(method, per_rank, 1)
        return Finished([self._call(method, per_rank[0], kwargs or {})])

    def _call(self, method: str, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
        try:
            return getattr(self.worker, method)(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - KeyboardInterrupt passes: the driver handles it
            raise WorkerFailure(0, self.where[0], method, raised_cause(e), traceback.format_exc()) from None

    def shutdown(self) -> None:
        """The worker's own shutdown (PolicyWorker: leave the process group); a failure there is only logged, so
        that it does not hide the error the run stops with."""
        try:
            getattr(self.worker, "shutdown", lambda: None)()
        except Exception as e:  # noqa: BLE001
            log.warning("worker shutdown: %s", raised_cause(e))


class Calls:
    """One method under way on workers of a Ray worker group (`WorkerGroup.start`)."""

    def __init__(self, group: WorkerGroup, method: str, refs: List[Any], ranks: List[int]):
        self.group, self.method, self.refs, self.ranks = group, method, refs, ranks

    def wait(self) -> List[Any]:
        """The results in rank order; a failed worker raises WorkerFailure."""
        return self.group._gather(self.refs, self.method, self.ranks)


class Finished:
    """Calls that ended before `start` returned (LocalWorkerGroup: the worker lives in the driver's process)."""

    def __init__(self, results: List[Any]):
        self.results = results

    def wait(self) -> List[Any]:
        return self.results


def wait_pools(calls: Sequence[Any]) -> List[List[Any]]:
    """Results of calls started on several worker groups at once (`Calls` or `Finished`, of `start`), failing at the
    first worker that fails in any of them: the other side of a cross-pool collective (a weight sync) would otherwise
    wait for it until its timeout."""
    results = [c.results if isinstance(c, Finished) else [None] * len(c.refs) for c in calls]
    owner = {ref: (i, j) for i, c in enumerate(calls) if isinstance(c, Calls) for j, ref in enumerate(c.refs)}
    if not owner:
        return results
    import ray

    pending = list(owner)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        for ref in ready:
            i, j = owner[ref]
            results[i][j] = calls[i].group._gather([ref], calls[i].method, ranks=[calls[i].ranks[j]])[0]
    return results


def _check_shares(method: str, per_rank: Sequence[Any], world: int) -> None:
    if len(per_rank) != world:
        raise ValueError(f"{method}: {len(per_rank)} shares for {world} workers")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _where_from(text: str) -> Dict[str, Any]:
    """pid and node address as Ray prints them in an error (for a worker that failed before answering)."""
    out: Dict[str, Any] = {}
    for key, pattern in (("pid", r"pid[=:]\s*(\d+)"), ("ip", r"ip[=:]\s*([0-9a-fA-F.:]+[0-9a-fA-F])")):
        m = re.search(pattern, text)
        if m:
            out[key] = int(m.group(1)) if key == "pid" else m.group(1)
    return out
