"""The expected wall time of one RL step and of the whole run, with the range the measured runs allow.

`layout_search.cost` ranks layouts from nominal constants and leaves out what every layout pays alike; a run's
duration needs those too. One step here is the sum of its phases (colocated; with `placement=split` and
`algorithm.max_staleness` >= 1 the longer of generation and training):

- generation: `decode steps x max(the cost model's decode step, the engine's measured floor per step)`: small models
  are not bound by reading their weights but by the engine's per-step work (scheduling, sampling, launches), which
  grows with the sequences decoded together;
- weight sync (vLLM only: the transformers rollout shares the trainer's weights): the rollout's bf16 weights per
  device over the measured copy bandwidth;
- log-prob passes: the reference's (when a KL term uses it) and the old policy's (unless the rollout's log-probs
  are used or the update is a single on-policy step), a forward each: a third of the update's compute;
- the update: the cost model's training part (compute, pipeline bubble, communication, host offload).

Each phase has a low, an expected and a high value from the measurements below (all in bench/results/); the run's
range sums the lows and the highs. The band is wide on purpose: the model's MFU is one number for every workload,
and measured MFU spans 3.5-50 %. Torch-free."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from qwen35rl.config import layout_search
from qwen35rl.config import memory as M
from qwen35rl.config.capabilities import single_on_policy_update
from qwen35rl.config.engine_specs import rollout_engine
from qwen35rl.config.layout import Layout

MFU_MEASURED: Tuple[float, float, float] = (0.035, 0.25, 0.50)
"""Training MFU (low, typical, high) measured through the trainer, as the cost model counts the work: 3.9-7.8 % in
the 0.8B + vLLM runs on an H100 (64 short responses a step in micro batches of 16: the update 1.5-2.7 s, the lowest
Megatron TP1 on images; bench/results/vllm_gpu.md), 22.9-31.8 % in the 0.8B CLI runs on an H200, 50.1 % for the 4B
with compiled layers and full micro batches (bench/results/h200.md) and about 50 % for the 4B's host-offloaded
update between 64 and 256 responses (vllm_gpu.md)."""

OFFLOAD_RANGE: Tuple[float, float, float] = (0.5, 1.0, 2.0)
"""The host offload's seconds (fast, typical, slow) against the cost model's: its PCIe rate is a Gen4 x16 link's
practical one, pinned copies over Gen5 reach twice it, pageable or shared links half. The 4B's host-offloaded update
measured 2.35 s of fixed cost against the model's 2.69 (vllm_gpu.md)."""

SYNC_GBPS: Tuple[float, float, float] = (20.0, 5.0, 0.8)
"""GB/s of the rollout's weight refresh (fast, typical, slow): 0.8 measured through the host (2.1 s for the 0.8B's
1.7 GB, bench/results/vllm_gpu.md), about 20 on the device (the transformers rollout's 0.05-0.10 s per 1.5 GB,
bench/results/h200.md). vLLM's on-device handover measured 5.9 GB/s for the 320-token 0.8B (0.17 s) and 10-12 for
the 4B (0.71-0.82 s) from FSDP, 1.3 from Megatron TP1 (0.80 s, vllm_gpu.md): the typical value sits among them."""


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step per phase, as (low, expected, high)."""

    phases: Dict[str, Tuple[float, float, float]]
    overlapped: bool

    def total(self) -> Tuple[float, float, float]:
        if self.overlapped:
            gen = [sum(self.phases[p][i] for p in ("generation", "weight_sync")) for i in range(3)]
            train = [sum(v[i] for k, v in self.phases.items() if k not in ("generation", "weight_sync"))
                     for i in range(3)]
            return tuple(max(a, b) for a, b in zip(gen, train))  # type: ignore[return-value]
        return tuple(sum(v[i] for v in self.phases.values()) for i in range(3))  # type: ignore[return-value]

    def to_dict(self, total_steps: Optional[int], devices: int) -> Dict[str, Any]:
        low, mid, high = self.total()
        out: Dict[str, Any] = {"seconds": _r(mid), "low_s": _r(low), "high_s": _r(high),
                               "phases": {k: [_r(x) for x in v] for k, v in self.phases.items()}}
        if self.overlapped:
            out["overlapped"] = True
        if total_steps:
            hours = [x * total_steps / 3600 for x in (low, mid, high)]
            out.update({"run_hours": _r(hours[1]), "run_hours_range": [_r(hours[0]), _r(hours[2])],
                        "device_hours": _r(hours[1] * devices),
                        "device_hours_range": [_r(hours[0] * devices), _r(hours[2] * devices)]})
        return out


def _r(x: float) -> float:
    return float(f"{x:.3g}")


def _scaled(seconds_at_model_mfu: float) -> Tuple[float, float, float]:
    """The cost model's compute seconds (at layout_search.MFU) at the measured MFUs, fastest first."""
    return tuple(seconds_at_model_mfu * layout_search.MFU / m for m in reversed(MFU_MEASURED))  # type: ignore


def estimate(cfg: Any, layout: Layout, est: M.MemoryEstimate) -> Optional[StepTime]:
    """The step's phases, or None on a CPU (nothing here is calibrated for it; bench/results/train_cpu.md measures
    the embedded default there)."""
    tree = M.as_tree(cfg)
    if str(tree["hw"]["device"]) == "cpu":
        return None
    train = layout_search.train_cost(tree, layout)
    compute = train["compute_s"]
    comm = sum(v for k, v in train.items() if k.startswith("comm_"))
    update = tuple(c / (1 - train["bubble_fraction"]) + comm + train["offload_s"] * f  # the bubble scales too
                   for c, f in zip(_scaled(compute), OFFLOAD_RANGE))
    a, backend = tree["algorithm"], tree["backend"]
    passes = int(bool(a["use_kl_loss"] or a["use_kl_in_reward"]))
    passes += int(not backend["use_rollout_log_probs"] and not single_on_policy_update(tree))
    forward = tuple(passes * c / 3 for c in _scaled(compute))
    engine = rollout_engine(tree)
    model_step = _decode_step_s(tree, layout, est)
    steps = layout_search.decode_steps(tree, layout, est)
    batch = _decode_batch(tree, layout, est)
    floor = (base + per_sequence * batch for base, per_sequence in zip(engine.decode_floor_s,
                                                                         engine.decode_per_sequence_s))
    generation = tuple(steps * max(model_step, f) for f in floor)
    phases: Dict[str, Tuple[float, float, float]] = {"generation": generation}  # type: ignore[dict-item]
    if engine.own_weights:  # refreshed from the trainer after every update
        gb = est.terms["rollout/weights"] * M.GIB / 1e9
        phases["weight_sync"] = tuple(gb / bw for bw in SYNC_GBPS)  # type: ignore[assignment]
    phases["log_prob_passes"] = forward  # type: ignore[assignment]
    phases["update"] = update  # type: ignore[assignment]
    return StepTime(phases, overlapped=layout_search.overlaps(tree))


def _decode_batch(tree: Any, layout: Layout, est: M.MemoryEstimate) -> int:
    """Sequences one decode step of a scheduler carries (its first wave's)."""
    return min(layout_search.decode_schedule(tree, layout, est))


def _decode_step_s(tree: Any, layout: Layout, est: M.MemoryEstimate) -> float:
    """The cost model's seconds per decode step (weights read once, plus the collectives)."""
    return layout_search.rollout_seconds(tree, layout, est) / max(layout_search.decode_steps(tree, layout, est), 1)


_KIND = {"cuda": "GPU", "npu": "NPU"}


def render(step: Optional[Dict[str, Any]], device: str = "cuda") -> str:
    """One line for the plan: the step, and the run's hours and device hours when its steps are known."""
    if not step:
        return "  step time  not estimated on a CPU (bench/results/train_cpu.md measures the embedded default)"
    line = f"  step time  ~{_t(step['seconds'])} ({_t(step['low_s'])}-{_t(step['high_s'])})"
    if "run_hours" in step:
        lo, hi = step["run_hours_range"]
        dlo, dhi = step["device_hours_range"]
        line += (f"; the run ~{_h(step['run_hours'])} ({_h(lo)}-{_h(hi)}) = {step['device_hours']:.3g} "
                 f"{_KIND.get(device, device.upper())}-hours ({dlo:.3g}-{dhi:.3g})")
    parts = ", ".join(f"{k.replace('_', ' ')} {_t(v[1])}" for k, v in step["phases"].items() if v[1] > 0)
    low, _, high = MFU_MEASURED
    return line + (f"\n             per step: {parts} (range: measured MFU {low:.1%}-{high:.0%}, engine floors; "
                   "qwen35rl/config/step_time.py)")


def _t(s: float) -> str:
    return f"{s:.3g} s" if s < 600 else f"{s / 60:.3g} min"


def _h(h: float) -> str:
    return f"{h * 60:.2g} min" if h < 1 else f"{h:.3g} h"
