"""A NON-editable install of the built wheel into a fresh venv finds every config group (conf/ ships inside it)."""
import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_in_fresh_venv_finds_every_config_group(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(ROOT)],
                   check=True, timeout=600)
    wheel = next(dist.glob("qwen35rl-*.whl"))
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    # The config layer needs only hydra/omegaconf: install those, not the training stack.
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True, timeout=600)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "hydra-core>=1.3,<1.4", "omegaconf>=2.3,<2.4"],
                   check=True, timeout=600)
    probe = ("import json, qwen35rl\n"
             "from qwen35rl.config.compose import available_options, GROUPS\n"
             "from qwen35rl.config.paths import config_dir\n"
             "print(json.dumps({'file': qwen35rl.__file__, 'conf': str(config_dir()),\n"
             "  'groups': {g: available_options(g) for g in GROUPS}}))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "QWEN35RL_CONFIG_PATH")}
    r = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    found = json.loads(r.stdout)
    assert str(env_dir) in found["file"] and str(env_dir) in found["conf"]  # not the source checkout
    for group in ("model", "hw", "backend", "rollout", "algorithm", "data", "cluster", "recipe", "parallelism"):
        shipped = sorted(p.relative_to(ROOT / "conf" / group).with_suffix("").as_posix()
                         for p in (ROOT / "conf" / group).rglob("*.yaml") if "common/" not in p.as_posix())
        assert found["groups"][group] == shipped, group
    plan = subprocess.run([str(env_dir / "bin" / "qwen35rl-plan"), "model=qwen3_5_397b_a17b", "hw=a3_16node",
                           "backend=megatron", "format=json"], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=120)
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["valid"] is True
