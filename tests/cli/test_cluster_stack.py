"""The cluster stack (vLLM, megatron-core, torch_npu) is often missing where plans are made: the plan warns, a
training launch stops before anything starts, naming what to install."""
import importlib.util
import subprocess
import sys

import pytest

from qwen35rl.cli.train import main as train_main
from qwen35rl.config.compose import compose
from qwen35rl.config.plan import build_plan, environment_problems


@pytest.fixture
def nothing_installed(monkeypatch):
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name.split(".")[0] in ("vllm", "megatron", "torch_npu") else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_plan_warns_and_stays_valid(nothing_installed):
    cfg = compose(["model=qwen3_5_35b_a3b", "hw=a3_1node", "backend=megatron"])
    plan = build_plan(cfg)
    found = {p["code"]: p for p in plan["problems"]}
    assert plan["valid"]
    for code in ("vllm_not_installed", "megatron_not_installed", "torch_npu_not_installed"):
        assert found[code]["severity"] == "warning"
    assert "vllm-ascend" in found["vllm_not_installed"]["hint"]


def test_gpu_plan_names_the_extra(nothing_installed):
    problems = environment_problems(compose(["model=qwen3_5_27b", "hw=gpu_1node"]))
    assert [p.code for p in problems] == ["vllm_not_installed"]
    assert "pip install 'qwen35rl[gpu]'" in problems[0].hint


def test_train_stops_before_anything_starts(nothing_installed, capsys, tmp_path):
    code = train_main(["rollout=vllm", f"trainer.output_root={tmp_path}"])
    assert code == 2
    err = capsys.readouterr().err
    assert "vllm_not_installed" in err and "qwen35rl[gpu]" in err
    assert not any(tmp_path.iterdir())  # no run directory was made


def test_train_without_vllm_in_a_fresh_process(tmp_path):
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    code = ("import sys; from qwen35rl.cli.train import main; rc = main(['rollout=vllm', 'trainer.output_root=%s']);"
            "print(rc, sorted({m.split('.')[0] for m in sys.modules} & {'ray', 'torch', 'vllm'}))" % tmp_path)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.split()[0] == "2", r.stderr
    assert r.stdout.strip().endswith("[]")  # stopped before importing Ray or torch
    assert "qwen35rl[gpu]" in r.stderr
