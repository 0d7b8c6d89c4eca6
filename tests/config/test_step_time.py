"""The plan's step time and run hours: the recorded GPU runs fall inside its range, its phases follow the config
(weight sync only for vLLM, log-prob passes only where the trainer computes them), and the plan prints them."""
import json
from pathlib import Path

import pytest

from qwen35rl.cli.plan import main as plan
from qwen35rl.config import memory, step_time
from qwen35rl.config.compose import compose
from qwen35rl.config.layout import derive_layout
from qwen35rl.config.plan import build_plan

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "vllm_gpu"

# What bench/gpu/vllm_runs.sh ran for the records in bench/results/vllm_gpu/ (`common` + data + `SMALL`, with that
# day's rollout log-probs and checkpointing, which the recorded plan.json's batch section confirms below).
RECORDED = ["model=qwen3_5_0_8b", "model.init=random", "model.tokenizer=byte", "hw=gpu_1x", "hw.memory_gb=85",
            "rollout=vllm", "trainer.total_steps=50", "trainer.launcher=local", "backend.lr=2e-5",
            "data.train_batch_size=8", "algorithm.mini_batch_size=8", "rollout.n=8", "data.max_prompt_length=256",
            "data.max_response_length=128", "backend.micro_batch_size_per_device=16",
            "backend.gradient_checkpointing=true", "backend.use_rollout_log_probs=true",
            "rollout.gpu_memory_utilization=0.6", "data.train_files=[/x/train.jsonl]", "data.val_files=[/x/test.jsonl]"]


def _estimate(overrides):
    cfg = compose(overrides)
    layout = derive_layout(cfg)
    return step_time.estimate(cfg, layout, memory.estimate(cfg, layout))


@pytest.mark.parametrize("run, data", [("text-0.8b-fsdp", "gsm8k"), ("images-0.8b-fsdp", "geo3k")])
def test_the_recorded_gpu_runs_fall_inside_the_range(run, data):
    recorded_plan = json.loads((RESULTS / run / "plan.json").read_text())
    summary = _summary(run)
    overrides = [*RECORDED, f"data={data}"]
    batch = build_plan(compose(overrides))["batch"]
    for key in ("micro_batches_per_device", "gradient_checkpointing", "sequence_length", "responses_per_step"):
        assert batch[key] == recorded_plan["batch"][key], key  # the workload the record measured
    estimate = _estimate(overrides)
    low, mid, high = estimate.total()
    measured = summary["timing_s/step"]["median_after_first"]
    assert low < mid < high and low <= measured <= high, (low, mid, high, measured)
    _phases_inside(estimate.phases, summary)


def _summary(run):
    return json.loads((RESULTS / run / "summary.txt").read_text().split("SUMMARY ", 1)[1].splitlines()[0])


def _phases_inside(phases, summary):
    """The run's generation and update (median after the first step) lie within the plan's ranges for them."""
    for phase, key in (("generation", "timing_s/gen"), ("update", "timing_s/update_actor")):
        low, _, high = phases[phase]
        assert low <= summary[key]["median_after_first"] <= high, (phase, phases, summary)


# The later runs of bench/results/vllm_gpu.md, by their overrides in the memory calibration's fixture
CALIBRATION = json.loads((Path(__file__).parent / "data" / "memory_vllm_gpu_2026_12.json").read_text())
LATER = {"text-0.8b-fsdp-learn": "text-0.8b-fsdp-learn", "text-4b-fsdp": "text-4b-fsdp-50",
         "text-4b-fsdp-max-h200": "text-4b-max", "images-0.8b-megatron": "images-0.8b-megatron",
         "text-0.8b-fsdp-auto": "text-0.8b-fsdp-auto"}


@pytest.mark.parametrize("name", sorted(LATER))
def test_the_later_gpu_runs_step_and_phases_fall_inside_the_range(name):
    run = next(r for r in CALIBRATION["runs"] if r["name"] == name)
    plan = build_plan(compose([*CALIBRATION["common_overrides"], *run["overrides"], "data.train_files=[/x/t.jsonl]"]))
    recorded_plan = json.loads((RESULTS / LATER[name] / "plan.json").read_text())
    assert plan["batch"]["micro_batch_size_per_device"] == recorded_plan["batch"]["micro_batch_size_per_device"]
    summary = _summary(LATER[name])
    st = plan["step_time"]
    assert st["low_s"] <= summary["timing_s/step"]["median_after_first"] <= st["high_s"], (st, summary)
    _phases_inside(st["phases"], summary)


def test_decoding_more_sequences_at_once_takes_longer_per_step():
    """The engine's work per sequence: 256 sequences in one wave cost more per decode step than 64."""
    base = [*RECORDED, "data=gsm8k"]
    small = _estimate(base).phases["generation"][1]
    wide = _estimate([*base, "data.train_batch_size=32", "algorithm.mini_batch_size=32"]).phases["generation"][1]
    assert wide > 2 * small  # one wave each: the same number of decode steps


def test_phases_follow_the_config():
    base = [*RECORDED, "data=gsm8k"]
    vllm = _estimate(base)
    assert set(vllm.phases) == {"generation", "weight_sync", "log_prob_passes", "update"}
    hf = _estimate([*base, "rollout=hf"])
    assert "weight_sync" not in hf.phases  # the transformers rollout runs on the trainer's own weights
    # one on-policy update with the rollout's log-probs and no KL: no log-prob pass at all
    none = _estimate([*base, "algorithm.use_kl_loss=false"])
    assert none.phases["log_prob_passes"] == (0.0, 0.0, 0.0)
    # the KL reference, then the old policy's pass too (two optimizer steps per batch, the trainer's log-probs)
    ref = _estimate(base).phases["log_prob_passes"]
    both = _estimate([*base, "algorithm.mini_batch_size=4", "backend.use_rollout_log_probs=false"])
    assert ref[1] > 0 and both.phases["log_prob_passes"][1] == pytest.approx(2 * ref[1], rel=1e-6)
    for lo, mid, hi in vllm.phases.values():
        assert lo <= mid <= hi
    assert _estimate(["hw=cpu"]) is None  # nothing is calibrated for a CPU


def test_longer_responses_take_longer_and_the_run_scales_with_steps():
    short, long_ = _estimate([*RECORDED, "data=gsm8k"]), _estimate([*RECORDED, "data=gsm8k", "data.max_response_length=512"])
    assert long_.phases["generation"][1] > 3 * short.phases["generation"][1]
    d = short.to_dict(total_steps=100, devices=8)
    assert d["run_hours"] == pytest.approx(short.total()[1] * 100 / 3600, rel=1e-2)
    assert d["device_hours"] == pytest.approx(8 * d["run_hours"], rel=1e-2)
    assert "run_hours" not in short.to_dict(total_steps=None, devices=8)


def test_overlapped_pools_take_the_longer_part():
    st = step_time.StepTime({"generation": (1, 2, 3), "weight_sync": (0, 1, 1), "log_prob_passes": (1, 1, 1),
                             "update": (1, 1, 5)}, overlapped=True)
    assert st.total() == (2, 3, 6)
    assert step_time.StepTime(st.phases, overlapped=False).total() == (3, 5, 10)


def test_the_plan_prints_the_step_and_the_runs_device_hours(capsys):
    assert plan(["model=qwen3_5_9b", "hw=gpu_1node", "data=gsm8k", "trainer.total_steps=500"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("  step time"))
    assert " s (" in line and "the run ~" in line and "GPU-hours" in line
    assert plan(["model=qwen3_5_9b", "hw=gpu_1node", "data=gsm8k", "trainer.total_steps=500", "format=json"]) == 0
    st = json.loads(capsys.readouterr().out)["step_time"]
    assert st["low_s"] < st["seconds"] < st["high_s"] and st["device_hours"] == pytest.approx(8 * st["run_hours"], rel=0.01)
    assert plan([]) == 0
    assert "step time  not estimated on a CPU" in capsys.readouterr().out
