"""What every console script (pyproject.toml's [project.scripts]) does when the reader of its output goes away
(`qwen35rl-plan ... | head -1`): it stops writing and exits with EXIT_STDOUT_CLOSED (141, what the shell reports
for a command that SIGPIPE ended), printing nothing more. Stdlib only."""
from __future__ import annotations

import contextlib
import functools
import os
import sys
from typing import Any, Callable, Iterator, Optional, Sequence

from qwen35rl.exit_codes import EXIT_STDOUT_CLOSED


class StdoutClosed(BaseException):
    """The reader of stdout has gone. A BaseException: Hydra reports any Exception of a task with its traceback."""


def _reader_gone(stream: Any) -> bool:
    """Whether `stream` is a pipe or socket whose reading end is closed (poll says POLLERR/POLLHUP)."""
    try:
        import select

        poll = select.poll()
        poll.register(stream.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0))
    except (AttributeError, OSError, ValueError):  # not a file (a test's buffer), or closed
        return False


def _closed_output(err: BaseException) -> int:
    """Exit quietly when `err` comes from a standard stream whose reader has gone; re-raise anything else."""
    gone = [s for s in (sys.stdout, sys.stderr) if _reader_gone(s)]
    if not gone and not isinstance(err, StdoutClosed):
        raise err
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in gone:  # what is still buffered, and the interpreter's flush at exit, go nowhere
        os.dup2(devnull, stream.fileno())
    os.close(devnull)
    return EXIT_STDOUT_CLOSED


def console_script(main: Callable[[Optional[Sequence[str]]], int]) -> Callable[[Optional[Sequence[str]]], int]:
    """`main` of a console script, ending quietly on a closed stdout (the module's rule); any other error is
    untouched."""

    @functools.wraps(main)
    def entry(argv: Optional[Sequence[str]] = None) -> int:
        exiting: Optional[SystemExit] = None
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's --help and usage errors
            if e.code in (0, None) and _reader_gone(sys.stdout):  # argparse ignores a failed write of its help
                return _closed_output(e)
            exiting = e
        except (BrokenPipeError, StdoutClosed) as e:
            return _closed_output(e)
        try:
            sys.stdout.flush()  # the last buffered lines; left to the interpreter's exit, a closed pipe is reported
        except BrokenPipeError as e:
            return _closed_output(e)
        if exiting is not None:
            raise exiting
        return code

    return entry


@contextlib.contextmanager
def writing_stdout() -> Iterator[None]:
    """Around a Hydra task's writes to stdout: a closed stdout becomes StdoutClosed, which passes Hydra (it would
    report a BrokenPipeError as the job's failure, with a traceback) and ends the command at `console_script`."""
    try:
        yield
    except BrokenPipeError:
        if not _reader_gone(sys.stdout):
            raise
        raise StdoutClosed() from None
