"""The plan's memory estimate under vLLM's sleep mode against GRPO runs measured on an H100 and an H200 (fixture:
tests/config/data/memory_vllm_gpu_2026_12.json). The device's used memory (total - free) holds the runtime's reserve
(CUDA context, loaded kernels) beside the estimated peak; the allocator's peak in the update still counts vLLM's
sleeping pools, which the trainer's peak leaves out; just before the KV cache wakes, the engine's weights are awake
already (the weight sync woke them), beside what the trainer keeps.

The training peak is compared at the run's own prompt lengths (the runs' prompts were ~200 of 256 tokens; launched,
the plan sizes for data.max_prompt_length, which must not fall below the run). Two misses of the 4B with its states
on the host are pinned as expected failures (strict: the day the model covers them, they fail as passing) and are
measured in bench/results/vllm_gpu.md: 4.6-5.9 GiB stay on the device while the engine sleeps against the plan's
3 GiB reserve, and its update at 64 responses held ~2 GiB more than the plan."""
import json
import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from qwen35rl.config.compose import compose
from qwen35rl.config.plan import build_plan

TOLERANCE = 0.10
FIXTURE = json.loads((Path(__file__).parent / "data" / "memory_vllm_gpu_2026_12.json").read_text())
RUNS = FIXTURE["runs"]
_plans = {}


def plan_of(run):
    if run["name"] not in _plans:
        plan = build_plan(compose(FIXTURE["common_overrides"] + run["overrides"]))
        assert plan["valid"], plan["problems"]
        _plans[run["name"]] = plan
    return _plans[run["name"]]


def memory_of(run):
    return plan_of(run)["memory_gib"]


@pytest.mark.parametrize("run", RUNS, ids=[r["name"] for r in RUNS])
def test_generation_device_use_within_10_percent(run):
    m = memory_of(run)
    expected = m["rollout_peak"] + m["reserve"]
    err = expected / run["device_used_gen_gib"] - 1
    assert abs(err) <= TOLERANCE, f"{run['name']}: plan {m['rollout_peak']} + reserve {m['reserve']} GiB vs " \
                                  f"{run['device_used_gen_gib']} GiB used in generation ({err:+.1%}); {m['terms']}"


def known_miss(runs, names, reason):
    """The runs, with those in `names` marked as a measured miss of the model (strict)."""
    return [pytest.param(r, id=r["name"], marks=pytest.mark.xfail(strict=True, reason=reason))
            if r["name"] in names else pytest.param(r, id=r["name"]) for r in runs]


def at_run_lengths(run):
    """The plan's memory at the run's own prompt lengths (its mean), with the micro batch and checkpointing the run's
    plan resolved: the model's accuracy, apart from the launch's sizing for prompts of data.max_prompt_length."""
    batch = plan_of(run)["batch"]
    pinned = [f"backend.micro_batch_size_per_device={batch['micro_batch_size_per_device']}",
              f"backend.gradient_checkpointing={str(batch['gradient_checkpointing']).lower()}",
              f"data.max_prompt_length={round(run['prompt_length_mean'])}"]
    plan = build_plan(compose(FIXTURE["common_overrides"] + run["overrides"] + pinned))
    assert plan["valid"], plan["problems"]
    return plan["memory_gib"]


def trainer_peak(run):
    """The allocator's peak in the update less vLLM's sleeping pools, which it still counts."""
    return run["update_allocated_gib"] - run["sleeping_pool_gib"]


TRAINED = [r for r in RUNS if "update_allocated_gib" in r]


@pytest.mark.parametrize("run", known_miss(TRAINED, {"text-4b-fsdp"}, "with its states on the host the 4B's update "
                                           "held ~2 GiB more than the plan at 64 responses (1.5 GiB at 256)"))
def test_training_peak_at_the_runs_prompt_lengths_within_10_percent(run):
    planned = at_run_lengths(run)["train_peak"]
    err = planned / trainer_peak(run) - 1
    assert abs(err) <= TOLERANCE, f"{run['name']}: plan {planned:.2f} GiB vs {trainer_peak(run):.2f} ({err:+.1%})"


@pytest.mark.parametrize("run", TRAINED, ids=[r["name"] for r in TRAINED])
def test_training_peak_as_launched_is_not_below_the_run(run):
    """Launched, the plan sizes for prompts of data.max_prompt_length: above what shorter prompts measure (0.8B at
    32 responses without checkpointing: +12.6 %), never more than the tolerance below."""
    err = memory_of(run)["train_peak"] / trainer_peak(run) - 1
    assert err >= -TOLERANCE, f"{run['name']}: plan {memory_of(run)['train_peak']:.2f} GiB vs " \
                              f"{trainer_peak(run):.2f} ({err:+.1%})"


WOKEN = known_miss([r for r in RUNS if "device_used_before_wake_gib" in r], {"text-4b-fsdp", "text-4b-fsdp-max-h200"},
                   "the 4B with host-offloaded states leaves 4.6-5.9 GiB on the device beside the sleeping engine")


@pytest.mark.parametrize("run", WOKEN)
def test_what_the_trainer_keeps_beside_the_sleeping_engine_within_10_percent(run):
    m = memory_of(run)
    expected = m["terms"]["rollout/kept_by_trainer"] + m["reserve"]
    measured = run["device_used_before_wake_gib"] - run["engine_weights_awake_gib"]
    err = expected / measured - 1
    assert abs(err) <= TOLERANCE, f"{run['name']}: plan {expected:.2f} GiB vs {measured:.2f} GiB used before the " \
                                  f"wake, less the engine's weights the sync woke ({err:+.1%})"


def test_the_reserve_is_the_hardware_setting():
    m = memory_of(RUNS[0])
    tree = compose(FIXTURE["common_overrides"] + RUNS[0]["overrides"] + ["hw.reserve_gib=5"])
    assert build_plan(tree)["memory_gib"]["reserve"] == 5.0 != m["reserve"]
