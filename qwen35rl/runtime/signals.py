"""Ctrl-C / SIGTERM stop a run within seconds, whatever it is doing, and the last message names the checkpoint the
same command resumes from.

While the training loop runs, the first signal asks it to stop after the current step, which it then checkpoints;
if the step and its checkpoint are not done within `trainer.stop_timeout_s` (10 s by default: schedulers give about
30 s between SIGTERM and SIGKILL), or a second signal comes, the step is abandoned at once (KeyboardInterrupt in the
main thread: a worker call, generation or a hung reward function alike) and the run stops from its last
checkpoint. During start-up the first signal stops at once (there is nothing to finish); once the run is shutting
down, signals are only noted, so that the clean-up (workers, a local Ray cluster) is not cut short. Checkpoints are
atomic either way, so the last finished one stays intact. (While `ray.init` itself runs, a few seconds of the
start-up, Ray's own SIGTERM handler is in place: it ends the process with a stack trace, and the local cluster's
watchdog removes what the run started.)
"""
from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from typing import Any, Dict, Optional

log = logging.getLogger(__name__)

HANDLED = (signal.SIGINT, signal.SIGTERM)
STOP_TIMEOUT_S = 10.0
"""trainer.stop_timeout_s's default."""
START, LOOP, END = "start", "loop", "end"


class StopRequest:
    """Context manager installing the handlers (main thread only; elsewhere it just never triggers)."""

    def __init__(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        self.signum: Optional[int] = None
        self.timeout_s = float(timeout_s)
        self.phase = START
        """START: a signal stops at once; LOOP: the first one lets the step finish (see the module docstring); END:
        the run is shutting down, signals are noted."""
        self.abandoned = False
        """The current step was given up (a second signal, the timeout, or a signal during start-up)."""
        self.reason = ""
        """Why the run stopped, for its last message."""
        self._previous: Dict[int, Any] = {}
        self._timer: Optional[threading.Timer] = None
        self._lock = threading.Lock()
        self._main: Optional[int] = None
        self._expired = False

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    @property
    def exit_code(self) -> int:
        """128 + signal number, the shell convention (130 for Ctrl-C, 143 for SIGTERM)."""
        return 128 + int(self.signum) if self.signum is not None else 0

    def request(self, signum: int = signal.SIGINT) -> None:
        """As if the signal came, without its timeout (tests)."""
        self.signum = signum
        self.reason = signal.Signals(signum).name

    def run_loop(self) -> None:
        """The training loop starts: from now on the first signal lets the step finish."""
        self.phase = LOOP

    def ending(self) -> None:
        """The run is shutting down: no signal interrupts the clean-up any more (a second one still does)."""
        with self._lock:
            self.phase = END
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        first = self.signum is None
        if first:
            self.signum = signum
        if self.phase == START:
            self.abandoned = True
            self.reason = name
            raise KeyboardInterrupt(f"{name}: stopping")
        if self.phase == END:
            if not first:
                raise KeyboardInterrupt(f"second {name}: stopping now")
            log.warning("%s received while the run shuts down: it stops once the clean-up is done", name)
            self.reason = name
            return
        if not first:  # a second signal, or the timeout's own (see _expire)
            self.abandoned = True
            self.reason = (f"{self.name}, and the step did not finish within {self.timeout_s:g} s "
                           f"(trainer.stop_timeout_s)" if self._expired else f"a second {name}")
            raise KeyboardInterrupt(self.reason)
        self.reason = name
        log.warning("%s received: finishing the current step and checkpointing it if that takes at most %g s "
                    "(trainer.stop_timeout_s), else stopping without it (send it again to stop at once)",
                    name, self.timeout_s)
        with self._lock:
            if self._main is not None and self._timer is None:
                self._timer = threading.Timer(self.timeout_s, self._expire)
                self._timer.daemon = True
                self._timer.start()

    def _expire(self) -> None:
        """The step did not finish within the timeout: interrupt the main thread (a real signal, so that a blocking
        wait returns), which then abandons the step."""
        with self._lock:
            if self.phase != LOOP or self._main is None or self.abandoned:
                return
            self._expired = True
            signal.pthread_kill(self._main, self.signum or signal.SIGTERM)

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            self._main = threading.get_ident()
            for s in HANDLED:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._main = None
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()


def last_checkpoint(run_dir: Path) -> str:
    """Where the same command resumes from: the newest finished checkpoint of the run directory, or step 0."""
    from qwen35rl.runtime.checkpoint import CheckpointManager, _shown, checkpoint_dir

    try:
        last = CheckpointManager(checkpoint_dir(run_dir)).latest(verified=False)
    except OSError:
        last = None
    if last is None:
        return "no checkpoint yet: the same command starts again at step 0"
    return f"the same command resumes from the last checkpoint, {_shown(last)} (step {last.name.split('_', 1)[1]})"
