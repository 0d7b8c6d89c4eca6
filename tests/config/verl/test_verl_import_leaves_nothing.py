"""`qwen35rl-import verl` runs the launch script; nothing the script starts outlives the command, including what
leaves the script's process group or session (`setsid`, a job under `set -m`, a daemon that double-forks)."""
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from qwen35rl.config.verl.script import ScriptError, evaluate_script
from tests.load import scaled

FIXTURE = Path(__file__).parent / "fixtures" / "fsdp_27b.sh"
_SCRIPT = Path(sys.executable).parent / "qwen35rl-import"
IMPORT = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "qwen35rl.cli.import_verl"]

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def detaching(pids: Path) -> str:
    """Lines that start three `sleep 300`s out of the script's process group and write their pids to `pids`."""
    return textwrap.dedent(f"""\
        setsid sleep 300 </dev/null >/dev/null 2>&1 &
        echo $! >> {pids}
        set -m
        sleep 300 </dev/null >/dev/null 2>&1 &
        echo $! >> {pids}
        set +m
        sh -c 'setsid sh -c "sleep 300 </dev/null >/dev/null 2>&1 & echo \\$! >> {pids}; wait" &'
        while [ "$(wc -l < {pids})" -lt 3 ]; do sleep 0.05; done
        """)


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:].split()[0] != "Z"


def check_and_clean(pids_file: Path) -> None:
    pids = [int(p) for p in pids_file.read_text().split()]
    left = [p for p in pids if running(p)]
    for pid in left:  # the test's own sleeps, should any be left
        os.kill(pid, 9)
    assert len(pids) == 3, pids
    assert not left, f"still running after the import: {left}"


def test_the_import_command_leaves_no_process_behind(tmp_path):
    pids = tmp_path / "pids"
    pids.touch()
    text = FIXTURE.read_text()
    first, rest = text.split("\n", 1)
    script = tmp_path / "run.sh"
    script.write_text(f"{first}\n{detaching(pids)}{rest}")
    proc = subprocess.run([*IMPORT, "verl", str(script), "--device", "gpu", "--out", str(tmp_path / "conf")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=scaled(300))
    check_and_clean(pids)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "conf" / "experiment").is_dir()


def test_a_script_past_its_time_limit_leaves_nothing_behind_either(tmp_path):
    pids = tmp_path / "pids"
    pids.touch()
    script = tmp_path / "run.sh"
    script.write_text("#!/bin/bash\n" + detaching(pids) + "sleep 300\n")
    t0 = time.monotonic()
    with pytest.raises(ScriptError, match="did not finish within 5 s"):
        evaluate_script(script, timeout_s=5)
    assert time.monotonic() - t0 < scaled(60)  # stopped at its limit, not after the sleeps
    check_and_clean(pids)


def test_the_script_still_sees_a_clean_environment_and_its_exit_status(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text('#!/bin/bash\n[ -z "${PYTHONPATH+x}${VIRTUAL_ENV+x}" ] || exit 9\n'
                      'python3 -m verl.trainer.main_ppo a=1 b="$LANG"\nexit 7\n')
    launch = evaluate_script(script)
    assert launch.argv == ["a=1", "b=C.UTF-8"] and launch.status == 7
