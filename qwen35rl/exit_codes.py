"""The exit codes of the qwen35rl commands: one table, read by `qwen35rl-train --help` and the README."""
from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    ERROR = 1
    CONFIG = 2
    PREFLIGHT = 3
    WORKER_FAILURE = 4
    REWARD_FAILURE = 5
    DISK_FULL = 6
    INTERRUPTED = 130
    STDOUT_CLOSED = 141
    TERMINATED = 143


MEANINGS = {
    ExitCode.OK: "done",
    ExitCode.ERROR: "an unexpected error (a bug: one block says where; the traceback is in train.log)",
    ExitCode.CONFIG: "the config is refused before anything starts (including a resume whose experiment changed, "
                     "data that cannot make a batch, a reward that does not load), or trainer.resume names a damaged "
                     "checkpoint",
    ExitCode.PREFLIGHT: "the cluster does not match the config (preflight), or no Ray cluster answers at ray_address "
                        "/ RAY_ADDRESS (said in seconds, naming the address)",
    ExitCode.WORKER_FAILURE: "a worker failed (rank, node, call and its error are printed)",
    ExitCode.REWARD_FAILURE: "the reward function failed on more than data.max_reward_failure_rate of the responses "
                             "over data.reward_failure_window steps (its first errors are printed)",
    ExitCode.DISK_FULL: "no space left on device: what could not be written, the free space and the last complete "
                        "checkpoint are printed (nothing written before is lost)",
    ExitCode.INTERRUPTED: "interrupted (Ctrl-C): the step under way finished and checkpointed if that took at most "
                          "trainer.stop_timeout_s, else given up; the last line names the checkpoint the same command "
                          "resumes from",
    ExitCode.STDOUT_CLOSED: "stdout was closed by its reader (piped into `head`, say): the command stopped writing "
                            "and exited quietly, any command (128 + SIGPIPE, as the shell reports a command that "
                            "SIGPIPE ended)",
    ExitCode.TERMINATED: "preempted (SIGTERM), within seconds as for Ctrl-C (130)",
}

EXIT_CONFIG = int(ExitCode.CONFIG)
"""Exit code of a command that refuses its config (before anything starts)."""
EXIT_PREFLIGHT = int(ExitCode.PREFLIGHT)
"""Exit code of a run the cluster cannot host as configured."""
EXIT_WORKER_FAILURE = int(ExitCode.WORKER_FAILURE)
"""Exit code of a run stopped because a worker died or raised."""
EXIT_REWARD_FAILURE = int(ExitCode.REWARD_FAILURE)
EXIT_DISK_FULL = int(ExitCode.DISK_FULL)
EXIT_INTERRUPTED = int(ExitCode.INTERRUPTED)
EXIT_TERMINATED = int(ExitCode.TERMINATED)
EXIT_STDOUT_CLOSED = int(ExitCode.STDOUT_CLOSED)


def table(markdown: bool = False) -> str:
    """The table as text (`--help`) or as a Markdown table (README)."""
    if markdown:
        return "\n".join(["| code | meaning |", "|---:|---|"]
                         + [f"| {int(c)} | {m} |" for c, m in MEANINGS.items()])
    return "\n".join(f"  {int(c):>3}  {m}" for c, m in MEANINGS.items())
