"""trainer.launcher=local with more than one worker: the workers of a single-host CPU run, without Ray.

Each worker is a process forked from a server (multiprocessing's forkserver) that imported torch, transformers and
the run's engines once, while the driver composed, imported and read its data: a worker starts in milliseconds
instead of importing everything again (2.8 s of one core each), and no Ray processes start beside them. The driver
talks to each worker over a pipe, one call at a time per worker, through `ProcessWorkerGroup`, which has
`cluster.WorkerGroup`'s interface: calls fan out to the ranks and gather in rank order, a failure in any rank raises
`WorkerFailure` at once (the others of a collective would wait for it), and a worker whose process dies is named
with its exit.

Workers ignore SIGINT and SIGTERM, which a terminal or `timeout` sends to the whole process group: the driver's own
handling stops the run at the end of a step and then shuts the workers down. A worker ends when the driver asks it
to, is killed by the driver, or finds the driver gone (a lifeline pipe only the driver holds reaches end-of-file),
even in the middle of a call.
"""
from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import traceback
from typing import Any, Dict, List, Optional, Sequence, Tuple

from qwen35rl.config import engine_specs
from qwen35rl.config.resolved import ResolvedRun
from qwen35rl.runtime.cluster import ClusterError, WorkerFailure, _check_shares, raised_cause, whereabouts
from qwen35rl.runtime.platform import Platform

log = logging.getLogger(__name__)

STOP_WAIT_S = 10.0
"""How long an idle worker gets to leave its process group and exit before it is killed."""


def _context() -> Any:
    return multiprocessing.get_context("forkserver")


def preloads(run: ResolvedRun) -> List[str]:
    """What the server imports before it forks any worker: the worker and the modules of the run's engines."""
    builders = [engine_specs.train_engine(run.cfg).builder, engine_specs.rollout_engine(run.cfg).builder]
    return ["torch", "qwen35rl.runtime.worker", "qwen35rl.models.tokenizer",
            *dict.fromkeys(b.partition(":")[0] for b in builders)]


def start_server(run: ResolvedRun) -> None:
    """Start the server (its imports run in its own process; this returns at once). Called as early as the launch
    knows the run, so that the imports overlap the driver's own; a server already running is kept (its imports
    are a superset for any run of this process but a new engine, which a worker then imports itself)."""
    ctx = _context()
    ctx.set_forkserver_preload(preloads(run))
    from multiprocessing import forkserver

    forkserver.ensure_running()


def wanted(run: ResolvedRun) -> bool:
    """The run's workers are local processes (trainer.launcher=local with more than one device)."""
    return run.cfg.trainer.launcher == "local" and run.layout.devices > 1


# ------------------------------------------------------------------------------------------- the worker side
def _serve(conn: Any, lifeline: Any, env: Dict[str, str], worker_cls: type, cfg: Any, init: Dict[str, Any]) -> None:
    """A worker process: build `worker_cls(cfg, **init)`, answer ("ok", where) or ("err", cause, traceback), then
    one reply per call until asked to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _name_process(f"qwen35rl-rank{init['rank']}")
    threading.Thread(target=_exit_with_driver, args=(lifeline,), name="qwen35rl-lifeline", daemon=True).start()
    os.environ.clear()
    os.environ.update(env)
    logging.basicConfig(level=logging.WARNING,
                        format=f"(worker rank={init['rank']} pid={os.getpid()}) %(levelname)s %(name)s: %(message)s")
    import torch

    torch.set_num_threads(max(1, int(env.get("OMP_NUM_THREADS") or 1)))  # imported before the variable was set
    try:  # a worker's output is the run's terminal: no progress bars between the step lines (the export's)
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    try:
        worker = worker_cls(cfg, **init)
    except Exception as e:  # noqa: BLE001 - said by the driver as a worker that failed to start
        conn.send(("err", f"failed to start ({raised_cause(e)})", traceback.format_exc()))
        return
    conn.send(("ok", whereabouts()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message[0] == "stop":
            try:
                getattr(worker, "shutdown", lambda: None)()
            finally:
                conn.send(("ok", None))
            return
        _, method, args, kwargs = message
        try:
            reply: Tuple[Any, ...] = ("ok", getattr(worker, method)(*args, **kwargs))
        except Exception as e:  # noqa: BLE001 - the driver reports it as this rank's failure
            reply = ("err", raised_cause(e), traceback.format_exc())
        try:
            conn.send(reply)
        except (BrokenPipeError, EOFError):
            return
        except Exception as e:  # noqa: BLE001 - a result that does not pickle
            conn.send(("err", f"{method} returned what cannot be sent to the driver ({raised_cause(e)})",
                       traceback.format_exc()))


def _name_process(name: str) -> None:
    """The name `ps -o comm` / `top` show for this worker (Linux; the command line stays the server's)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _exit_with_driver(lifeline: Any) -> None:
    try:
        lifeline.recv_bytes()
    except (EOFError, OSError):
        pass
    os._exit(1)  # the driver is gone (or closed the lifeline): nothing will read what this worker does


# ------------------------------------------------------------------------------------------- the driver side
class ProcessWorkerGroup:
    """The workers of a single-host run as local processes, rank order, with `cluster.WorkerGroup`'s interface."""

    def __init__(self, procs: List[Any], conns: List[Any], lifeline: Any):
        self.procs, self.conns, self.lifeline = procs, conns, lifeline
        self.where: List[Dict[str, Any]] = [{"hostname": "", "ip": "127.0.0.1", "pid": p.pid} for p in procs]
        self.busy: List[Optional[str]] = [None] * len(procs)
        """Per rank, the method it was sent and has not answered yet."""
        self.broken = False
        """A worker failed (or a wait was interrupted): the others may be stuck in a collective."""
        self.failure: Optional[WorkerFailure] = None
        """The first failure, raised again by any later call."""
        self.closed = False

    @property
    def world(self) -> int:
        return len(self.procs)

    @classmethod
    def create(cls, run: ResolvedRun, platform: Platform, worker_cls: type, world: int, *,
               on_started: Optional[Any] = None, **worker_kwargs: Any) -> "ProcessWorkerGroup":
        """Fork one `worker_cls(run.cfg, layout=run.layout, rank=, world_size=, local_rank=, **worker_kwargs)` per
        device from the server and join them in torch.distributed (`on_started()` once every worker answered, before
        they join and build their engines). The workers' environment is this process's, with `platform.worker_env`
        (hw.env + backend.env) for what this process does not set, and one torch thread each unless
        OMP_NUM_THREADS says otherwise (as Ray gives a worker of one CPU)."""
        if run.cfg.hw.nodes != 1:
            raise ClusterError(f"trainer.launcher=local starts its workers on this host; hw.nodes={run.cfg.hw.nodes}: "
                               f"use trainer.launcher=ray")
        start_server(run)
        ctx = _context()
        env = {"OMP_NUM_THREADS": "1", **platform.worker_env, **os.environ}  # what this process sets wins
        lifeline_r, lifeline_w = ctx.Pipe(duplex=False)
        procs, conns = [], []
        try:
            for rank in range(world):
                mine, theirs = ctx.Pipe()
                init = dict(layout=run.layout, rank=rank, world_size=world, local_rank=rank, **worker_kwargs)
                proc = ctx.Process(target=_serve, args=(theirs, lifeline_r, env, worker_cls, run.cfg, init),
                                   name=f"qwen35rl-worker-{rank}")
                proc.start()
                theirs.close()
                procs.append(proc)
                conns.append(mine)
        except BaseException:  # the workers already started go with the one that could not
            for proc in procs:
                proc.kill()
            lifeline_w.close()
            raise
        finally:
            lifeline_r.close()
        wg = cls(procs, conns, lifeline_w)
        try:
            wg.busy = ["start-up"] * world
            wg.where = wg._gather(list(range(world)), "start-up")
            if on_started is not None:
                on_started()
            address = wg.start("rendezvous_address", [()], ranks=[0]).wait()[0]
            wg.start("init_distributed", [tuple(address)] * world).wait()
        except BaseException:
            wg.shutdown()
            raise
        return wg

    @classmethod
    def create_pools(cls, run: ResolvedRun, platform: Platform, pools: Sequence[Any], *,
                     on_started: Optional[Any] = None) -> List["ProcessWorkerGroup"]:
        raise ClusterError("placement=split places its two pools as Ray actors: use trainer.launcher=ray")

    # ------------------------------------------------------------------------------------------------- calls
    def start(self, method: str, per_rank: Sequence[Sequence[Any]], kwargs: Optional[Dict[str, Any]] = None,
              ranks: Optional[Sequence[int]] = None) -> "ProcessCalls":
        """`method` on the workers of `ranks` (every rank by default) without waiting: the worker of ranks[i] gets
        the positional arguments per_rank[i], each the same `kwargs`."""
        ranks = list(range(self.world)) if ranks is None else list(ranks)
        _check_shares(method, per_rank, len(ranks))
        if self.failure is not None:
            raise self.failure
        for r, args in zip(ranks, per_rank):
            if self.busy[r] is not None:
                raise RuntimeError(f"{method}: worker {r} has not answered {self.busy[r]} yet")
            try:
                self.conns[r].send(("call", method, tuple(args), kwargs or {}))
            except (BrokenPipeError, OSError):
                self.broken = True
                self.failure = self._died(r, method)
                raise self.failure from None
            self.busy[r] = method
        return ProcessCalls(self, method, ranks)

    def _gather(self, ranks: List[int], method: str) -> List[Any]:
        """The answers of `ranks` in order, failing at the first worker that fails or dies."""
        results: Dict[int, Any] = {}
        pending = set(ranks)
        try:
            while pending:
                waiting = {}
                for r in pending:  # an answer, or the process's end
                    waiting[self.conns[r]] = waiting[self.procs[r].sentinel] = r
                for item in multiprocessing.connection.wait(list(waiting)):
                    r = waiting[item]
                    if r not in pending:
                        continue
                    try:
                        if not self.conns[r].poll():
                            raise EOFError
                        reply = self.conns[r].recv()
                    except (EOFError, OSError):  # its process ended without answering
                        raise self._died(r, method) from None
                    pending.discard(r)
                    self.busy[r] = None
                    if reply[0] == "err":
                        raise WorkerFailure(r, self.where[r], method, reply[1], reply[2])
                    results[r] = reply[1]
        except BaseException as e:
            self.broken = True  # failed or interrupted: the others may wait in a collective, answers are owed
            if isinstance(e, WorkerFailure) and self.failure is None:
                self.failure = e
            raise
        return [results[r] for r in ranks]

    def _died(self, rank: int, method: str) -> WorkerFailure:
        proc = self.procs[rank]
        proc.join(1.0)
        code = proc.exitcode
        how = (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exit code {code}" if code is not None else "no exit code yet")
        return WorkerFailure(rank, self.where[rank], method,
                             f"its process died ({how}); killed by a signal, by the kernel's OOM killer, or crashed",
                             f"local worker process rank {rank} (pid {proc.pid}) ended ({how}) while running "
                             f"{method}, without answering; what it printed went to this run's output")

    def shutdown(self) -> None:
        """Idle workers leave their process group and exit (killed after STOP_WAIT_S); after a failure or an
        interrupted call, every worker is killed at once, as Ray kills its actors."""
        if self.closed:
            return
        self.closed = True
        if not self.broken and not any(self.busy):
            for conn in self.conns:
                try:
                    conn.send(("stop",))
                except (BrokenPipeError, OSError):
                    pass
            for proc in self.procs:
                proc.join(STOP_WAIT_S)
        for proc in self.procs:
            if proc.exitcode is None:
                proc.kill()
        for proc in self.procs:
            proc.join(5.0)
        for conn in self.conns:
            conn.close()
        self.lifeline.close()


class ProcessCalls:
    """One method under way on workers of a `ProcessWorkerGroup`."""

    def __init__(self, group: ProcessWorkerGroup, method: str, ranks: List[int]):
        self.group, self.method, self.ranks = group, method, ranks

    def wait(self) -> List[Any]:
        """The results in rank order; a failed worker raises WorkerFailure."""
        return self.group._gather(self.ranks, self.method)
