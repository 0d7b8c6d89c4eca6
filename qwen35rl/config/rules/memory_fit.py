"""Memory: the training phase's, the log-prob passes' and the rollout phase's per-device peaks
(`memory.estimate`) fit the usable memory. `train_memory_problems` and `rollout_memory_problems` are shared with
the layout search."""
from __future__ import annotations

from typing import Any, List

from qwen35rl.config import engine_specs, memory
from qwen35rl.config.layout import Layout, is_split
from qwen35rl.config.problems import Problem
from qwen35rl.config.rules.registry import _err, rule, val


def train_memory_problems(cfg: Any, est: memory.MemoryEstimate) -> List[Problem]:
    """The training peak fits the device (shared by the rule and the layout search)."""
    if est.train_peak_gib <= est.capacity_gib:
        return []
    big = max((k for k in est.terms if k.startswith("train/")), key=lambda k: est.terms[k])
    b = val(cfg, "backend")
    if engine_specs.train_engine(b["name"]).offloads_between_phases:  # it has a host optimizer step
        hint = ("enable backend.optimizer_cpu_offload=true" if not b["optimizer_cpu_offload"] else
                "try more parallelism.pp or parallelism.ep, or parallelism=auto")
    else:
        hint = ("enable backend.param_offload=true backend.optimizer_offload=true backend.offload_policy=true"
                if not b.get("offload_policy") else "try backend=megatron or more devices (hw.nodes)")
    if big in ("train/activations", "train/vision_activations"):
        hint = "turn on recompute / backend.gradient_checkpointing or lower backend.micro_batch_size_per_device; " + hint
    split = is_split(cfg)
    if split:
        hint += ", or more training devices (a smaller placement.rollout_devices)"
    return _err("train_memory_fits", "parallelism", f"training needs {est.train_peak_gib:.1f} GiB per "
                f"{'training-pool ' if split else ''}device (largest: {big.split('/')[1]} {est.terms[big]:.1f} GiB) "
                f"but {est.capacity_gib:.1f} GiB are usable", hint)


def rollout_memory_problems(cfg: Any, est: memory.MemoryEstimate) -> List[Problem]:
    """The rollout engine fits its memory share, and with what the trainer keeps, the device."""
    out = []
    if not est.rollout_engine_fits:
        out += _err("rollout_memory_fits", "rollout.gpu_memory_utilization", f"vLLM's share of "
                    f"{est.rollout_pool_gib:.1f} GiB cannot hold the rollout weights "
                    f"({est.terms['rollout/weights']:.1f} GiB), activations and one sequence of max_model_len "
                    f"({est.rollout_min_gib:.1f} GiB together)", "raise rollout.gpu_memory_utilization or "
                    "parallelism.rollout.tp (or rollout EP)")
    if est.rollout_peak_gib > est.capacity_gib and is_split(cfg):
        out += _err("rollout_memory_fits", "placement.rollout_devices", f"a rollout-pool device needs "
                    f"{est.rollout_peak_gib:.1f} GiB ({_engine_terms(est)}) > {est.capacity_gib:.1f} GiB usable",
                    "more rollout devices (placement.rollout_devices: fewer sequences per device), or lower "
                    "data.train_batch_size / data.max_response_length")
    elif est.rollout_peak_gib > est.capacity_gib:
        kept = est.terms["rollout/kept_by_trainer"]
        out += _err("rollout_memory_fits", "rollout.gpu_memory_utilization", f"during rollout the trainer keeps "
                    f"{kept:.1f} GiB and the engine takes {est.rollout_peak_gib - kept:.1f} GiB: "
                    f"{est.rollout_peak_gib:.1f} GiB > {est.capacity_gib:.1f} GiB usable",
                    "enable backend.param_offload / backend.optimizer_offload, or lower "
                    "rollout.gpu_memory_utilization")
    return out


def _engine_terms(est: memory.MemoryEstimate) -> str:
    names = {"rollout/weights": "weights", "rollout/kv_cache": "cache", "rollout/activations": "activations",
             "rollout/pool": "vLLM's share"}
    return ", ".join(f"{n} {est.terms[k]:.1f} GiB" for k, n in names.items() if est.terms.get(k))


@rule("train")
def train_memory_fits(cfg: Any, layout: Layout) -> List[Problem]:
    """The training phase's per-device peak fits the usable memory."""
    return train_memory_problems(cfg, memory.estimate(cfg, layout))


@rule("train")
def log_prob_memory_fits(cfg: Any, layout: Layout) -> List[Problem]:
    """The forward-only log-prob passes' per-device peak fits the usable memory (their own micro batch)."""
    from qwen35rl.config import log_prob_fit

    est = memory.estimate(cfg, layout)
    return [] if est.train_peak_gib > est.capacity_gib else log_prob_fit.problems(cfg, layout, est)


@rule("colocated")
def rollout_memory_fits(cfg: Any, layout: Layout) -> List[Problem]:
    """The rollout phase fits: vLLM's share holds weights + activations + one full sequence, and the trainer's
    leftovers plus that share fit the device."""
    return rollout_memory_problems(cfg, memory.estimate(cfg, layout))
