"""Score responses in worker processes with a hard per-call time limit.

A reward function that raises, returns a non-number or runs past `timeout_s` scores 0 and is counted; the run goes
on. Time limits are enforced by killing the worker process (a hung call in a thread could never be stopped), so
the caller is never blocked longer than the limit per call, and reward code needs no signal handling. One scoring
call (a step's batch) is bounded as well: by the time its calls would take if each used its whole limit, spread over
the workers, plus one worker start-up (`step_limit`); responses still unscored then count as timed out.
A reward function that hangs for good is given up on: when the first calls of a batch all run past the limit
(`hung_after`: two per worker, at least 4) and none has returned, the batch's other responses are not run; they
score 0 and count as timed out, and a warning says so. A batch then takes about two limits, not one per response.
A scoring call can be cancelled (`cancel`, polled a few times a second): its workers are killed at once and
`ScoringCancelled` is raised. Whatever stops a call (cancelled, an interrupt), no worker of it is left running.
Workers persist across calls (forked from a forkserver that preloads the built-in rewards), so a step pays no
process start-up. Starting a worker and loading a task (which imports the reward's module) is not part of the
limit: under load that alone can take longer than a call, and would time out every call of a fresh worker. A
worker acknowledges each task once loaded; the limit runs from there (start-up has its own, generous limit).
"""
from __future__ import annotations

import atexit
import logging
import math
import multiprocessing as mp
import os
import pickle
import signal
import threading
import time
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

logger = logging.getLogger(__name__)

Item = Tuple[int, str, str]  # (response position, response text, answer)
_PRELOAD = ["qwen35rl.rewards.builtin", "math_verify"]
STARTUP_TIMEOUT_S = 120.0
"""Time a worker may take to start or to load a task (unpickling imports the reward's module) before it is
given up on; the per-call limit starts once it has the task."""
_STARTED = "started"  # worker -> pool: task loaded, scoring begins
HUNG_AFTER_MIN = 4
"""Timed-out calls, none returned, after which a batch's reward function counts as hung (at least; 2 per worker)."""
_CANCEL_POLL_S = 0.2
_PING = "ping"  # pool -> worker -> pool: alive and ready


def _worker_main(conn: Connection) -> None:
    """Score (fn, example, items) tasks one item at a time, answering (position, ok, value or error) per item."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        if task == _PING:
            conn.send(_PING)
            continue
        fn, example, items = task
        conn.send(_STARTED)
        for position, response, answer in items:
            try:
                value = float(fn(response, answer, example))
                if not math.isfinite(value):
                    raise ValueError(f"reward is {value}")
                conn.send((position, True, value))
            except Exception as e:  # noqa: BLE001 - any failure of user code scores 0
                conn.send((position, False, f"{type(e).__name__}: {e}"))


class ScoringCancelled(RuntimeError):
    """A scoring call stopped by its `cancel` (the run is stopping): its responses have no scores."""


class _Worker:
    def __init__(self, ctx: Any):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child,), daemon=True, name="reward-worker")
        self.process.start()
        child.close()
        self.items: Deque[Item] = deque()
        self.deadline = math.inf
        self.started = False
        """Whether the current task is loaded (its per-call limit runs)."""

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()


class RewardPool:
    """Persistent reward worker processes. `score` is safe to call from any thread (one call at a time)."""

    def __init__(self, num_workers: Optional[int] = None):
        self.num_workers = num_workers or min(8, os.cpu_count() or 1)
        self._ctx = mp.get_context("forkserver")
        self._ctx.set_forkserver_preload(_PRELOAD)
        self._idle: List[_Worker] = []
        self._lock = threading.Lock()

    def warm(self) -> None:
        """Start every worker and wait until each answers, so the first scoring call pays no start-up."""
        with self._lock:
            while len(self._idle) < self.num_workers:
                self._idle.append(_Worker(self._ctx))
            for worker in list(self._idle):
                try:
                    worker.conn.send(_PING)
                    ok = worker.conn.poll(STARTUP_TIMEOUT_S) and worker.conn.recv() == _PING
                except (OSError, EOFError):
                    ok = False
                if not ok:
                    logger.warning("reward worker did not start within %g s", STARTUP_TIMEOUT_S)
                    self._idle.remove(worker)
                    worker.kill()

    def step_limit(self, num_responses: int, limit: float) -> float:
        """The bound of one scoring call: every call using its whole limit, responses spread over the workers,
        plus one worker start-up."""
        return limit * math.ceil(max(num_responses, 1) / self.num_workers) + STARTUP_TIMEOUT_S

    def hung_after(self) -> int:
        """Timed-out calls of a batch, none returned, that make its reward function count as hung."""
        return max(HUNG_AFTER_MIN, 2 * self.num_workers)

    def score(self, fn: Callable, responses: Sequence[str], answers: Sequence[str], examples: Sequence[Any],
              timeout_s: Optional[float], errors: Optional[List[str]] = None,
              step_timeout_s: Optional[float] = None,
              cancel: Optional[Callable[[], bool]] = None) -> Tuple[List[float], Dict[str, int]]:
        """`errors` (when given) receives one line per failed response ("response <i>: <error>"). `step_timeout_s`
        bounds the whole call (default `step_limit`; none without a per-call limit). `cancel`: polled while
        waiting; True stops the call (ScoringCancelled)."""
        if not (len(responses) == len(answers) == len(examples)):
            raise ValueError(f"{len(responses)} responses, {len(answers)} answers, {len(examples)} examples")
        try:
            pickle.dumps(fn)
        except Exception as e:
            raise TypeError(f"reward function {fn!r} must be importable at module level (pkg.module:function) "
                            f"to run in worker processes ({e})") from None
        limit = math.inf if timeout_s is None or timeout_s <= 0 else float(timeout_s)
        if step_timeout_s is None or step_timeout_s <= 0:
            step_timeout_s = self.step_limit(len(responses), limit)
        with self._lock:
            busy: List[_Worker] = []
            try:
                return self._score(fn, responses, answers, examples, limit, float(step_timeout_s),
                                   [] if errors is None else errors, cancel, busy)
            except BaseException:  # cancelled, interrupted: no scoring process of this call is left running
                for worker in busy:
                    worker.kill()
                raise

    def _score(self, fn, responses, answers, examples, limit, step_timeout_s, errors, cancel, busy):
        scores = [0.0] * len(responses)
        stats = {"reward/failed": 0, "reward/timeout": 0}
        returned = [0]  # calls that returned (a score or an error): a function that returns is not hung
        step_deadline = time.monotonic() + step_timeout_s
        pending = deque(_chunks_by_example(responses, answers, examples))

        def fail(worker: _Worker, kind: str, message: str) -> None:
            position, _, _ = worker.items.popleft()
            stats[kind] += 1
            errors.append(f"response {position}: {message}")
            if worker.items:  # the rest of its chunk goes to another worker
                pending.appendleft((examples[worker.items[0][0]], list(worker.items)))
            busy.remove(worker)
            worker.kill()

        while pending or busy:
            while pending and len(busy) < self.num_workers:
                example, items = pending.popleft()
                worker = self._idle.pop() if self._idle else _Worker(self._ctx)
                try:
                    worker.conn.send((fn, example, items))
                except (BrokenPipeError, EOFError, OSError):  # died while idle: replace it, retry the chunk
                    worker.kill()
                    pending.appendleft((example, items))
                    continue
                worker.items, worker.started = deque(items), False
                worker.deadline = time.monotonic() + STARTUP_TIMEOUT_S
                busy.append(worker)
            next_deadline = min(min(w.deadline for w in busy), step_deadline)
            wait_s = None if math.isinf(next_deadline) else max(0.0, next_deadline - time.monotonic())
            if cancel is not None:
                wait_s = _CANCEL_POLL_S if wait_s is None else min(wait_s, _CANCEL_POLL_S)
            for conn in wait([w.conn for w in busy], timeout=wait_s):
                worker = next(w for w in busy if w.conn is conn)
                self._drain(worker, scores, stats, errors, limit, fail, returned)
            if cancel is not None and cancel():
                raise ScoringCancelled(f"scoring of {len(responses)} responses cancelled")
            now = time.monotonic()
            for worker in [w for w in busy if w.deadline <= now]:
                if worker.conn.poll():  # answered just in time
                    self._drain(worker, scores, stats, errors, limit, fail, returned)
                if worker in busy and worker.deadline <= now:
                    fail(worker, "reward/timeout", f"no result within {limit:g} s" if worker.started
                         else f"worker did not load the task within {STARTUP_TIMEOUT_S:g} s")
            for worker in [w for w in busy if not w.items]:
                busy.remove(worker)
                self._idle.append(worker)
            if (pending or busy) and not returned[0] and stats["reward/timeout"] >= self.hung_after():
                left = [pos for w in busy for pos, _, _ in w.items] + [pos for _, items in pending for pos, _, _ in items]
                stats["reward/timeout"] += len(left)
                why = (f"not run: the reward function looks hung (its first {stats['reward/timeout'] - len(left)} "
                       f"calls of this batch ran past {limit:g} s and none returned)")
                errors.extend(f"response {pos}: {why}" for pos in sorted(left))
                logger.warning("reward: the reward function looks hung: its first %d calls of this batch ran past "
                               "data.reward_timeout_s=%g s and none returned; the other %d responses score 0 "
                               "without being run (counted in reward/timeout)", stats["reward/timeout"] - len(left),
                               limit, len(left))
                for worker in busy:
                    worker.kill()
                busy.clear()
                pending.clear()
            if (pending or busy) and time.monotonic() >= step_deadline:
                left = [pos for w in busy for pos, _, _ in w.items] + [pos for _, items in pending for pos, _, _ in items]
                stats["reward/timeout"] += len(left)
                errors.extend(f"response {pos}: not scored within the step's bound of {step_timeout_s:g} s"
                              for pos in sorted(left))
                for worker in busy:
                    worker.kill()
                busy.clear()
                pending.clear()
        if errors:
            logger.warning("reward: %d failed, %d timed out of %d; first: %s", stats["reward/failed"],
                           stats["reward/timeout"], len(responses), errors[0])
        return scores, stats

    @staticmethod
    def _drain(worker, scores, stats, errors, limit, fail, returned) -> None:
        """Collect every answer the worker has sent so far (`returned[0]` counts them)."""
        while worker.items and worker.conn.poll():
            try:
                message = worker.conn.recv()
            except (EOFError, OSError):
                fail(worker, "reward/failed", f"worker process died (exit code {worker.process.exitcode})")
                return
            if message == _STARTED:
                worker.started, worker.deadline = True, time.monotonic() + limit
                continue
            position, ok, value = message
            worker.items.popleft()
            returned[0] += 1
            if ok:
                scores[position] = value
            else:
                stats["reward/failed"] += 1
                errors.append(f"response {position}: {value}")
            worker.deadline = time.monotonic() + limit  # the limit is per call

    def close(self) -> None:
        with self._lock:
            for worker in self._idle:
                try:
                    worker.conn.send(None)
                except OSError:
                    pass
                worker.process.join(timeout=1)
                if worker.process.is_alive():
                    worker.kill()
            self._idle = []


def _chunks_by_example(responses, answers, examples) -> List[Tuple[Any, List[Item]]]:
    """Consecutive responses of the same prompt travel as one task, so the example is sent once per group."""
    chunks: List[Tuple[Any, List[Item]]] = []
    for position, (response, answer, example) in enumerate(zip(responses, answers, examples)):
        if chunks and chunks[-1][0] is example:
            chunks[-1][1].append((position, response, answer))
        else:
            chunks.append((example, [(position, response, answer)]))
    return chunks


_POOL: Optional[RewardPool] = None
_POOL_LOCK = threading.Lock()


def _shared_pool() -> RewardPool:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = RewardPool()
            atexit.register(_POOL.close)
        return _POOL


def warm_pool() -> None:
    """Start the shared pool's workers now (before the first step), in a thread while the caller goes on (Ray,
    workers). A scoring call waits for them (the pool's lock), and its time limits start after that."""
    threading.Thread(target=_shared_pool().warm, daemon=True, name="reward-pool-warm").start()


def score_responses(fn: Callable, responses: Sequence[str], answers: Sequence[str], examples: Sequence[Any],
                    timeout_s: Optional[float], errors: Optional[List[str]] = None,
                    step_timeout_s: Optional[float] = None,
                    cancel: Optional[Callable[[], bool]] = None) -> Tuple[List[float], Dict[str, int]]:
    """Scores of `fn(response, answer, example)` per response, in order, and the counts `reward/failed` (raised,
    returned a non-number or the worker died) and `reward/timeout` (ran past `timeout_s`, the call past
    `step_timeout_s`, or not run because the function looks hung); both score 0. `errors` receives one line per
    failure. `cancel`: see RewardPool.score."""
    return _shared_pool().score(fn, responses, answers, examples, timeout_s, errors, step_timeout_s, cancel)
