"""The plan as text (issue 18, item 9): the batch line shows n, the memory breakdown and host offload, the score's
unit, `parallelism=auto` keeping the tested layout's hardware deltas and showing its rank, each layout named by its
own degrees; every tiny model plans valid with each backend and algorithm, and trains out of the box."""
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from qwen35rl.config import layout_search
from qwen35rl.config.compose import compose
from qwen35rl.config.plan import _fmt_gib, build_plan, render_text
from qwen35rl.runtime.tracking import read_metrics
from tests.load import scaled

MG397_A3 = ["model=qwen3_5_397b_a17b", "hw=a3_16node", "backend=megatron"]
_plans = {}


def plan_of(*overrides):
    if overrides not in _plans:
        p = build_plan(compose(list(overrides)))
        _plans[overrides] = (p, render_text(p))
    return _plans[overrides]


def line(text, head):
    (found,) = [ln for ln in text.splitlines() if ln.startswith(f"  {head}")]
    return found


def test_batch_line_shows_the_number_of_responses_per_prompt():
    plan, text = plan_of("rollout.n=5")
    assert plan["batch"]["responses_per_prompt"] == 5
    assert "8 prompts x 5 -> 40 responses/step" in line(text, "batch")
    assert " x n " not in text


def test_memory_breakdown_and_host_offload_are_in_the_text():
    plan, text = plan_of(*MG397_A3)
    mem = plan["memory_gib"]
    lines = text.splitlines()
    at = lines.index(line(text, "memory"))
    # the phases' terms, largest first, below the peaks
    assert [lines[at + i].split()[0] for i in (1, 2, 3)] == ["train:", "log-prob:", "rollout:"]
    assert f"log-prob peak {_fmt_gib(mem['log_prob_peak'])}" in lines[at]
    assert f"activations {_fmt_gib(mem['terms']['log_prob/activations'])}" in lines[at + 2]
    terms = mem["terms"]
    largest = max((v, k) for k, v in terms.items() if k.startswith("train/"))[1]
    assert largest == "train/grads" and lines[at + 1].split()[1:4] == ["grads", f"{terms[largest]:.1f}", "GiB,"]
    assert f"vLLM pool {terms['rollout/pool']:.1f} GiB" in lines[at + 3]
    # the backend's offload settings and the host memory they take (also in the JSON)
    off = plan["offload"]
    without = off.pop("without")
    assert off == {"param": True, "grad": True, "optimizer": True, "host_gib": mem["host"],
                   "optimizer_cpu_fraction": 1.0}
    # offload that stays on says whether it is needed: here the peaks without it do not fit
    assert without["fits"] is False and max(without["train_peak_gib"], without["rollout_peak_gib"]) > mem["capacity"]
    assert "backend.param_offload=false" in without["keys"]
    offload = line(text, "offload")
    assert "params, grads, optimizer states to the host between phases" in offload
    assert "CPU optimizer step on 100% of the states" in offload
    assert (f"host {mem['host']:.1f} GiB per device (trainer {terms['host/trainer_offload']:.1f} GiB, sleeping engine "
            f"{terms['host/sleeping_engine']:.1f} GiB)") in offload
    assert f"needed here: without it train peak {without['train_peak_gib']:.1f} GiB" in offload, offload
    _, tiny = plan_of()
    assert line(tiny, "offload") == "  offload    none (the trainer's state stays on the device)"


def test_the_score_has_a_unit():
    plan, text = plan_of(*MG397_A3)
    assert plan["cost"]["score_unit"] == layout_search.SCORE_UNIT == "s/step"
    cost = line(text, "cost")
    assert cost.startswith(f"  cost       score {plan['cost']['score']:.3g} s/step (estimated seconds per RL step")
    assert f"rollout {plan['cost']['rollout_s']:.3g}" in cost  # the components, in seconds


def test_auto_keeps_the_tested_layouts_hardware_deltas_and_shows_its_rank():
    cfg = compose(MG397_A3 + ["parallelism=auto"])
    assert cfg.hw.env.HCCL_CONNECT_TIMEOUT == "5400"  # the tested layout's delta (the platform's value is 1500)
    assert compose(["model=qwen3_5_397b_a17b", "hw=a3_16node", "backend=fsdp"]).hw.env.HCCL_CONNECT_TIMEOUT == "1500"
    # the command line still wins over the delta
    assert compose(MG397_A3 + ["parallelism=auto", "hw.env.HCCL_CONNECT_TIMEOUT=77"]).hw.env.HCCL_CONNECT_TIMEOUT == "77"
    # rollout and backend deltas too (megatron 35B on a3_1node pads nothing and batches by tokens)
    a3 = compose(["model=qwen3_5_35b_a3b", "hw=a3_1node", "backend=megatron", "parallelism=auto"])
    assert a3.backend.remove_padding is True and a3.backend.dynamic_batch_size is True

    plan, text = plan_of(*MG397_A3, "parallelism=auto")
    assert plan["worker_env"]["HCCL_CONNECT_TIMEOUT"] == "5400"
    tested = plan["auto_tested"]
    assert tested["name"] == "megatron/qwen3_5_397b_a17b@a3_16node" and tested["of"] == plan["auto_candidate_count"]
    assert tested["overrides"] == ["parallelism.tp=2", "parallelism.pp=4", "parallelism.cp=1", "parallelism.ep=64",
                                   "parallelism.etp=1", "parallelism.rollout.tp=16", "parallelism.rollout.dp=16",
                                   "parallelism.rollout.ep=256"]
    assert tested["rank"] > 1 and tested["score"] >= tested["best_score"] == plan["auto_candidates"][0]["score"]
    assert (f"  tested layout megatron/qwen3_5_397b_a17b@a3_16node ranks {tested['rank']} of {tested['of']} "
            f"(score {tested['score']:.3g} s/step)") in text
    assert f"best 5 of {tested['of']} valid layouts (score: estimated seconds per RL step" in text
    assert plan["layout_name"].startswith("auto/tp=") and plan["layout_preset"] is None


def test_each_layout_is_named_by_its_own_degrees():
    base = ["model=qwen3_5_35b_a3b", "hw=gpu_1node", "backend=megatron"]
    plan, text = plan_of(*base)
    assert plan["layout_name"] == "megatron/qwen3_5_35b_a3b@gpu_1node" and plan["layout_overrides"] == []
    plan, text = plan_of(*base, "parallelism.tp=4", "parallelism.rollout.tp=4")
    assert plan["layout_name"] == "megatron/qwen3_5_35b_a3b@gpu_1node + tp=4 rollout.tp=4"
    assert plan["layout_overrides"] == ["parallelism.tp=4", "parallelism.rollout.tp=4"]
    assert "[layout: megatron/qwen3_5_35b_a3b@gpu_1node + tp=4 rollout.tp=4]" in line(text, "train")
    # the tested layout restated value for value is the tested layout; without one the base is `default`
    assert plan_of(*base, "parallelism.tp=2")[0]["layout_name"] == "megatron/qwen3_5_35b_a3b@gpu_1node"
    assert plan_of("backend=megatron", "parallelism.tp=2")[0]["layout_name"] == "default + tp=2"
    assert plan_of()[0]["layout_name"] == "default"


def test_tested_layouts_of_an_overlay_keep_their_deltas_and_explain_a_missing_rank(tmp_path, monkeypatch):
    """A tested layout the search does not try (vpp) has no rank, and the plan says why; its delta stays."""
    (tmp_path / "parallelism" / "megatron").mkdir(parents=True)
    (tmp_path / "parallelism" / "megatron" / "qwen3_5_tiny@cpu.yaml").write_text(
        "# @package _global_\nparallelism:\n  name: megatron/qwen3_5_tiny@cpu\n  pp: 2\n  vpp: 2\n"
        "hw:\n  env:\n    QWEN35RL_TEST_DELTA: '1'\n")
    monkeypatch.setenv("QWEN35RL_CONFIG_PATH", str(tmp_path))
    plan = build_plan(compose(["backend=megatron", "parallelism=auto"]))
    text = render_text(plan)
    assert plan["worker_env"]["QWEN35RL_TEST_DELTA"] == "1"
    tested = plan["auto_tested"]
    assert tested["rank"] is None and tested["why"].startswith("outside the search space")
    assert "parallelism.vpp=2" in tested["overrides"] and tested["score"] > 0
    assert "tested layout megatron/qwen3_5_tiny@cpu is not among the" in text
    plan = build_plan(compose(["backend=megatron", "parallelism.pp=1"]))
    assert plan["layout_name"] == "megatron/qwen3_5_tiny@cpu + pp=1"


TINY = ["qwen3_5_tiny", "qwen3_5_tiny_moe", "qwen3_5_tiny_vl", "qwen3_5_tiny_vl_moe"]


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
@pytest.mark.parametrize("model", TINY)
def test_every_tiny_model_plans_valid_with_each_backend_and_algorithm(model, backend):
    for algorithm in ("grpo", "dapo", "dr_grpo"):
        plan = build_plan(compose([f"model={model}", f"backend={backend}", f"algorithm={algorithm}"]))
        assert plan["valid"], (algorithm, plan["problems"])
        # no problems but the one stating that CPU has no Transformer Engine for MoE's fused permutation
        assert {p["code"] for p in plan["problems"]} <= {"megatron_permute_fusion_needs_te"}
        assert plan["batch"]["sequence_length"] == 40 and plan["batch"]["responses_per_step"] == 128


_BIN = Path(sys.executable).parent
TRAIN = str(_BIN / "qwen35rl-train")


def train(tmp_path, *overrides):
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.run([TRAIN, *overrides, "trainer.launcher=local", "hw.devices_per_node=1",
                           "trainer.total_steps=1", "trainer.export_hf=false", f"hydra.run.dir={run}"],
                          capture_output=True, text=True, timeout=scaled(300), env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    (row,) = read_metrics(run / "metrics.jsonl")
    assert row["step"] == 1 and row["actor/grad_norm"] > 0 and row["actor/skipped_steps"] == 0
    return run


@pytest.mark.slow
def test_megatron_trains_the_embedded_default_out_of_the_box(tmp_path):
    """`qwen35rl-train backend=megatron`: megatron-core runs on CPU (gloo, its torch GDN recurrence) in one
    process."""
    run = train(tmp_path, "backend=megatron")
    meta = json.loads((run / "checkpoints" / "step_1" / "meta.json").read_text())
    assert meta["layout"]["backend"] == meta["checkpoint_layout"]["backend"] == "megatron"


@pytest.mark.slow
def test_dapo_trains_the_embedded_default_out_of_the_box(tmp_path):
    """`qwen35rl-train algorithm=dapo`: dynamic sampling and the overlong penalty (over the tiny lengths' last 2
    tokens: the responses that reach the budget of 8 get it)."""
    run = train(tmp_path, "algorithm=dapo")
    (row,) = read_metrics(run / "metrics.jsonl")
    assert row["dynamic_sampling/rounds"] >= 1
    assert row["critic/rewards/mean"] < row["critic/score/mean"]  # the penalty applied


def test_the_plan_says_what_runs_through_torch_compile():
    """On CUDA both engines compile their log-prob head, the FSDP engine its GDN convolution too, and the hf rollout
    its decode step by default (backend.compile_layers adds the FSDP layers' norms and MLPs); on CPU nothing is
    compiled, and vLLM's own compilation is named apart."""
    gpu = ("model=qwen3_5_0_8b", "model.init=random", "hw=gpu_1x", "rollout=hf")
    plan, text = plan_of(*gpu)
    assert plan["compile"] == {"log_probs": True, "conv": True, "layers": False, "decode": True}
    assert line(text, "compile") == ("  compile    log-prob head, GDN convolution, decode step (torch.compile: the "
                                     "first step compiles them)")
    plan, text = plan_of(*gpu, "backend.compile_layers=true", "rollout.compile_decode=false")
    assert plan["compile"] == {"log_probs": True, "conv": True, "layers": True, "decode": False}
    assert "layer norms and MLPs" in line(text, "compile")
    plan, text = plan_of()
    assert not any(plan["compile"].values()) and "none" in line(text, "compile")
    mg = ("model=qwen3_5_0_8b", "model.init=random", "hw=gpu_1x", "backend=megatron", "rollout=vllm")
    plan, text = plan_of(*mg)
    assert plan["compile"] == {"log_probs": True, "conv": False, "layers": False, "decode": False}
    assert line(text, "compile").startswith("  compile    log-prob head (torch.compile")
    plan, text = plan_of(*mg, "backend.use_torch_compile=false")
    assert not any(plan["compile"].values())
    assert line(text, "compile") == "  compile    none (qwen35rl's engines run eagerly; vLLM compiles by its own settings)"


def test_a_value_out_of_range_prints_no_arithmetic_over_it(capsys):
    from qwen35rl.cli.plan import main as plan_main

    assert plan_main(["rollout.n=0"]) == 2
    out = capsys.readouterr().out
    assert "[value_in_range] rollout.n" in out and "None" not in out and "not planned" in out
