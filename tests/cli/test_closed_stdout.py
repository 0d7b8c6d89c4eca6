"""Every console script ends quietly when the reader of its output goes away (`| head -1`): exit code 141
(EXIT_STDOUT_CLOSED), nothing on stderr that was not there before, never a traceback (issue 37)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qwen35rl.exit_codes import EXIT_STDOUT_CLOSED

BIN = Path(sys.executable).parent
FIXTURES = Path(__file__).resolve().parents[1] / "config" / "verl" / "fixtures"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
ENV.pop("QWEN35RL_CONFIG_PATH", None)


def closed_stdout(cmd, *args, cwd):
    """Run a console script with stdout a pipe whose reading end is already closed: every write fails."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([str(BIN / cmd), *map(str, args)], stdout=write_end, stderr=subprocess.PIPE, text=True,
                              cwd=cwd, env=ENV, timeout=180)
    finally:
        os.close(write_end)


def test_pyproject_lists_the_console_scripts_tested_here():
    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    scripts = text.split("[project.scripts]", 1)[1].split("\n\n", 1)[0]
    assert sorted(line.split(" = ")[0] for line in scripts.strip().splitlines()) == sorted(
        {case[0] for case in CASES})


CASES = [
    ("qwen35rl-plan", []),
    ("qwen35rl-plan", ["format=json"]),
    ("qwen35rl-plan", ["format=verl"]),
    ("qwen35rl-plan", ["hw.nodes=0"]),  # refused before any layout arithmetic
    ("qwen35rl-plan", ["data.train_batch_size=3", "format=verl"]),  # invalid: the launch prints, problems on stderr
    ("qwen35rl-plan", ["--cfg", "job"]),
    ("qwen35rl-plan", ["--info", "config"]),
    ("qwen35rl-plan", ["-m", "rollout.n=4,8", "hydra.sweep.dir=sweep"]),
    ("qwen35rl-plan", ["-m", "rollout.n=4,8", "format=verl", "hydra.sweep.dir=sweep"]),
    ("qwen35rl-plan", ["parallelism=auto"]),
    ("qwen35rl-plan", ["--help"]),
    ("qwen35rl-plan", ["--shell-completion", "install=bash"]),
    ("qwen35rl-train", ["--help"]),
    ("qwen35rl-train", ["--cfg", "job"]),
    ("qwen35rl-import", ["verl", FIXTURES / "fsdp_27b.sh", "--out", "conf"]),
    ("qwen35rl-import", ["verl", FIXTURES / "megatron_35b.sh", "--out", "conf", "--format", "json"]),
    ("qwen35rl-import", ["--help"]),
    ("qwen35rl-data", ["--help"]),
]


@pytest.mark.parametrize("cmd,args", CASES, ids=[" ".join([c, *map(str, a)]).replace(str(FIXTURES) + "/", "")
                                                 for c, a in CASES])
def test_a_closed_stdout_ends_the_command_quietly(cmd, args, tmp_path):
    run = closed_stdout(cmd, *args, cwd=tmp_path)
    assert run.returncode == EXIT_STDOUT_CLOSED, run.stderr
    assert not any(word in run.stderr for word in ("Traceback", "Error", "Logging error")), run.stderr


def test_head_in_a_pipefail_shell(tmp_path):
    """As a user types it: the first line arrives, the rest goes nowhere, no traceback."""
    plan = BIN / "qwen35rl-plan"
    run = subprocess.run(["bash", "-c", f"set -o pipefail; '{plan}' format=verl | head -1; echo \"status $?\""],
                         capture_output=True, text=True, cwd=tmp_path, env=ENV, timeout=180)
    first, status = run.stdout.splitlines()
    assert first.startswith("# verl 0.9.1 launch equivalent")
    assert status in ("status 0", f"status {EXIT_STDOUT_CLOSED}")  # 0 when all was written before head closed
    assert run.stderr == ""


def test_other_broken_pipes_still_raise(monkeypatch):
    """A BrokenPipeError while stdout and stderr are fine (a subprocess's pipe, say) is a real error and keeps its
    traceback."""
    from qwen35rl.cli.stdout import console_script

    @console_script
    def main(argv=None):
        raise BrokenPipeError("a worker's pipe")

    with open(os.devnull, "w") as devnull:
        monkeypatch.setattr(sys, "stdout", devnull)
        monkeypatch.setattr(sys, "stderr", devnull)
        with pytest.raises(BrokenPipeError, match="a worker's pipe"):
            main([])


def test_info_is_redacted_like_cfg(capsys):
    from qwen35rl.cli.plan import main

    assert main(["--info", "config", "+hw.env.WANDB_API_KEY=s3cr3t-value"]) == 0
    out = capsys.readouterr().out
    assert "WANDB_API_KEY: REDACTED" in out and "s3cr3t-value" not in out
