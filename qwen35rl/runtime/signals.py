"""Clean shutdown on Ctrl-C / SIGTERM: the first signal asks the loop to stop after the current step (it then
writes a checkpoint and exits); a second one interrupts at once. Checkpoints are atomic either way, so the last
finished one stays intact."""
from __future__ import annotations

import logging
import signal
import threading
from typing import Any, Dict, Optional

log = logging.getLogger(__name__)

HANDLED = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """Context manager installing the handlers (main thread only; elsewhere it just never triggers)."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self._previous: Dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        """128 + signal number, the shell convention (130 for Ctrl-C, 143 for SIGTERM)."""
        return 128 + int(self.signum) if self.signum is not None else 0

    def request(self, signum: int = signal.SIGINT) -> None:
        self.signum = signum

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: stopping now")
        self.signum = signum
        log.warning("%s received: finishing the current step, then checkpointing and stopping "
                    "(send it again to stop at once)", signal.Signals(signum).name)

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for s in HANDLED:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
