"""`qwen35rl-plan` as a user runs it: real subprocesses, stdout/stderr and exit codes."""
import json
import os
import subprocess
import sys

import pytest

from qwen35rl.cli.plan import main

PLAN = [sys.executable, "-m", "qwen35rl.cli.plan"]


def run(*args, env=None):
    return subprocess.run([*PLAN, *args], capture_output=True, text=True, env={**os.environ, **(env or {})},
                          timeout=120)


def test_json_contract_for_a_reference_run():
    r = run("model=qwen3_5_397b_a17b", "hw=a3_16node", "backend=megatron", "format=json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)  # stdout holds exactly one JSON object
    assert plan["valid"] is True and plan["model"] == "qwen3_5_397b_a17b"
    assert plan["hw"] == "a3_16node" and plan["backend"] == "megatron" and plan["world_size"] == 256
    assert plan["train"] == {"tp": 2, "pp": 4, "cp": 1, "ep": 64, "etp": 1, "dp": 32, "vpp": None}
    assert plan["rollout"] == {"tp": 16, "dp": 16, "ep": 256}
    assert set(plan["params"]) >= {"total", "active"} and plan["params"]["total"] > plan["params"]["active"] > 0
    assert set(plan["memory_gib"]) >= {"train_peak", "rollout_peak", "capacity", "fits"}
    for p in plan["problems"]:
        assert set(p) >= {"code", "severity", "key", "message", "hint"} and p["severity"] in ("error", "warning")


def test_fsdp_train_layout_reports_fsdp_size_and_sp():
    r = run("model=qwen3_5_27b", "hw=gpu_1node", "backend=fsdp", "format=json")
    plan = json.loads(r.stdout)
    assert plan["train"] == {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "etp": 1, "dp": 8, "vpp": None,
                             "fsdp_size": 8, "sp": 1}


def test_invalid_layout_exits_2_with_problems_in_json():
    r = run("model=qwen3_5_27b", "hw=gpu_1node", "backend=megatron", "parallelism.tp=3", "format=json")
    assert r.returncode == 2
    plan = json.loads(r.stdout)
    assert plan["valid"] is False
    assert any(p["key"].startswith("parallelism.tp") and p["severity"] == "error" for p in plan["problems"])


def test_typo_is_one_block_exit_2_no_traceback():
    r = run("model=qwen3_5_27", "format=json")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and "did you mean 'qwen3_5_27b'" in r.stderr
    assert json.loads(r.stdout)["problems"][0]["key"] == "model"
    r = run("hw.nodez=4")
    assert r.returncode == 2 and "hw.nodez" in r.stderr and "did you mean 'nodes'" in r.stderr
    assert r.stdout == ""


def test_full_traceback_on_request():
    r = run("hw.nodes=four", env={"HYDRA_FULL_ERROR": "1"})
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_text_plan_is_readable():
    r = run("model=qwen3_5_35b_a3b", "hw=gpu_1node", "backend=megatron")
    assert r.returncode == 0, r.stderr
    for fragment in ("qwen3_5_35b_a3b", "TP2", "EP8", "world 8", "rollout", "responses/step", "memory",
                     "CUDA_DEVICE_MAX_CONNECTIONS=1"):
        assert fragment in r.stdout


def test_plan_imports_nothing_heavy(capsys):
    before = set(sys.modules)
    for heavy in ("torch", "ray", "transformers", "vllm"):
        if heavy in before:
            pytest.skip(f"{heavy} already imported by another test in this process")
    assert main(["model=qwen3_5_122b_a10b", "hw=a3_4node", "backend=megatron", "format=json"]) == 0
    json.loads(capsys.readouterr().out)
    loaded = {m.split(".")[0] for m in sys.modules}
    assert not loaded & {"torch", "ray", "transformers", "vllm"}


def test_plan_in_fresh_interpreter_imports_nothing_heavy():
    code = ("import sys; from qwen35rl.cli.plan import main; main(['model=qwen3_5_27b','hw=gpu_1node','format=json']);"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch','ray','transformers','vllm'}), "
            "file=sys.stderr)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stderr.strip().splitlines()[-1] == "[]"


def test_multirun_prints_one_json_per_job(tmp_path):
    r = run("-m", "model=qwen3_5_35b_a3b", "hw=gpu_1node", "backend=megatron", "parallelism.tp=1,2,3",
            "format=json", f"trainer.output_root={tmp_path}")
    assert r.returncode == 0, r.stderr
    plans = [json.loads(line) for line in r.stdout.splitlines() if line.strip()]
    assert [p["train"]["tp"] for p in plans] == [1, 2, 3]
    assert plans[1]["valid"] and not plans[2]["valid"]


def test_sweep_with_a_typo_starts_nothing(tmp_path):
    r = run("-m", "model=qwen3_5_27b,qwen3_5_9", f"trainer.output_root={tmp_path}")
    assert r.returncode == 2 and "did you mean" in r.stderr
    assert not (tmp_path / "sweeps").exists()


def test_megatron_on_image_data_plans_valid(tmp_path):
    """Image data trains the vision tower on the Megatron engine too: the CPU layouts of its tests and a reference
    run on geo3k plan valid (exit 0), with the tower's activations in the estimate."""
    from tests.runtime.geo3k_fixture import write_geo3k

    files = write_geo3k(tmp_path / "geo3k.parquet", 4)  # a CPU run is local: its data files are read here
    cpu = ["backend=megatron", "data=geo3k", "hw=cpu", "hw.devices_per_node=2", f"data.train_files=[{files}]",
           f"data.val_files=[{files}]"]
    for layout in (["model=qwen3_5_tiny_vl", "parallelism.tp=2"],
                   ["model=qwen3_5_tiny_vl", "parallelism.pp=2", "parallelism.vpp=2"],
                   ["model=qwen3_5_tiny_vl_moe", "parallelism.ep=2"]):
        r = run(*cpu, *layout, "format=json")
        assert r.returncode == 0, r.stdout
        plan = json.loads(r.stdout)
        assert plan["valid"] and plan["memory_gib"]["fits"]
        assert all(p["severity"] == "warning" for p in plan["problems"])  # TE options, turned off on CPU
    r = run("model=qwen3_5_397b_a17b", "hw=a3_16node", "backend=megatron", "data=geo3k", "format=json")
    assert r.returncode == 0, r.stdout
    plan = json.loads(r.stdout)
    assert plan["valid"] and plan["memory_gib"]["terms"]["train/vision_activations"] > 0


@pytest.mark.parametrize("entry", ["qwen35rl.cli.plan", "qwen35rl.cli.train"])
def test_cfg_output_is_redacted(entry):
    """--cfg job / all print the config through the redaction rule: secret-looking keys show REDACTED, and the
    secret values appear nowhere (not in hydra.overrides either)."""
    for what in ("job", "all"):
        r = subprocess.run([sys.executable, "-m", entry, "--cfg", what, "+hw.env.WANDB_API_KEY=abc123secret",
                            "+hw.env.HF_TOKEN=x"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert "abc123secret" not in r.stdout + r.stderr and "HF_TOKEN=x" not in r.stdout
        assert "WANDB_API_KEY: REDACTED" in r.stdout and "HF_TOKEN: REDACTED" in r.stdout
        assert "OMP_NUM_THREADS: '1'" in r.stdout or "OMP_NUM_THREADS:" in r.stdout  # the rest is Hydra's YAML
        assert ("hydra:" in r.stdout) == (what == "all") and "model:" in r.stdout
