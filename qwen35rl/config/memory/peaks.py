"""The estimate: `MemoryEstimate`, the training and rollout phases' terms, their peaks and fit verdict (`assemble`),
the entry point `estimate`, and the gpu_memory_utilization an `auto` pool resolves to."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from qwen35rl.config.engine_specs import ROLLOUT_ENGINES, rollout_engine
from qwen35rl.config.layout import Layout
from qwen35rl.config.memory.common import _model_parallel, as_tree, capacity_gib, dtype_bytes, gib
from qwen35rl.config.memory.hf_rollout import hf_rollout_activations_gib, hf_static_cache_gib
from qwen35rl.config.memory.host import host_offloaded_gib
from qwen35rl.config.memory.log_prob import LOG_PROB_BESIDE, log_prob_activations_gib
from qwen35rl.config.memory.rollout import (auto_pool_gib, hf_engine_sleeps, nominal_gib, pool_is_auto,
                                            rollout_activations_gib, rollout_weights_params, sequence_cache_gib,
                                            sleeping_engine_gib, train_state_during_rollout_gib, vllm_pool_gib)
from qwen35rl.config.memory.shard import train_shard
from qwen35rl.config.memory.training import (activations_gib, backward_transient_gib, fsdp_gathered_params_gib,
                                             optimizer_states_gib, optimizer_step_gib, reference_model_gib,
                                             train_grads_gib, train_weights_gib)
from qwen35rl.config.memory.vision import vision_activations_gib


@dataclass
class MemoryEstimate:
    train_peak_gib: float
    rollout_peak_gib: float
    capacity_gib: float
    fits: bool
    terms: Dict[str, float] = field(default_factory=dict)
    """Every term in GiB, prefixed `train/` or `rollout/`."""
    rollout_pool_gib: Optional[float] = None
    """vLLM's share of the device (None for the hf engine)."""
    rollout_min_gib: float = 0.0
    """What the rollout engine needs at least: weights + activations + one max_model_len sequence."""
    rollout_sequences: Optional[int] = None
    """Full-length sequences the vLLM cache holds at once (0: not even one)."""
    log_prob_peak_gib: float = 0.0
    """The forward-only passes (old and reference log-probs): `LOG_PROB_BESIDE` plus the `log_prob/` terms."""
    reserve_gib: float = 0.0
    """What the runtime keeps beside every peak (`hw.reserve_gib`: CUDA/CANN context, loaded kernels, communicators).
    The peaks leave it out; a device's used memory (total - free) is held against a peak plus this."""

    @property
    def host_gib(self) -> float:
        """Host memory per device for offloaded state (reported, not checked: hw does not state host memory)."""
        return sum(v for k, v in self.terms.items() if k.startswith("host/"))

    @property
    def headroom(self) -> float:
        """Free fraction of the capacity at the higher of the two peaks (negative: does not fit)."""
        peak = max(self.train_peak_gib, self.rollout_peak_gib, self.log_prob_peak_gib)
        return 1.0 - peak / max(self.capacity_gib, 1e-9)

    @property
    def rollout_engine_fits(self) -> bool:
        return self.rollout_pool_gib is None or self.rollout_min_gib <= self.rollout_pool_gib

    def to_dict(self) -> Dict[str, Any]:
        r = lambda x: None if x is None else round(float(x), 3)  # noqa: E731
        return {"train_peak": r(self.train_peak_gib), "rollout_peak": r(self.rollout_peak_gib),
                "log_prob_peak": r(self.log_prob_peak_gib),
                "capacity": r(self.capacity_gib), "fits": self.fits, "headroom": r(self.headroom),
                "rollout_pool": r(self.rollout_pool_gib), "rollout_min": r(self.rollout_min_gib),
                "rollout_sequences": self.rollout_sequences, "host": r(self.host_gib), "reserve": r(self.reserve_gib), "terms": {k: r(v) for k, v in self.terms.items()}}


def train_terms(cfg: Any, layout: Layout, gdn: Optional[str] = None) -> Dict[str, float]:
    """The training phase's terms (they depend on the training layout only); `gdn` overrides `gdn_kernels`."""
    shard = train_shard(cfg, layout)
    backward = {
        "train/grads": train_grads_gib(cfg, layout, shard),
        "train/gathered_params": fsdp_gathered_params_gib(cfg, layout, shard),
        "train/activations": activations_gib(cfg, layout, shard, gdn),
        "train/vision_activations": vision_activations_gib(cfg, layout),
        "train/backward_transient": backward_transient_gib(cfg, layout, shard, gdn),
    }
    return {
        "train/weights": train_weights_gib(cfg, layout, shard),
        "train/optimizer": optimizer_states_gib(cfg, layout, shard),
        **backward,
        "train/optimizer_step": optimizer_step_gib(cfg, layout, shard, sum(backward.values())),
        "train/reference": reference_model_gib(cfg, layout, shard),
        "log_prob/grads": train_grads_gib(cfg, layout, shard) if _model_parallel(layout) else 0.0,
        "log_prob/activations": log_prob_activations_gib(cfg, layout, shard, gdn),
        "rollout/kept_by_trainer": train_state_during_rollout_gib(cfg, layout, shard),
        "host/trainer_offload": host_offloaded_gib(cfg, layout, shard),
    }


def rollout_terms(cfg: Any, layout: Layout, gdn: Optional[str] = None) -> Dict[str, float]:
    """The rollout engine's terms (they depend on the rollout layout only); `gdn` overrides `gdn_kernels` (hf
    engine; vLLM brings its own kernels)."""
    weights = gib(rollout_weights_params(cfg, layout) * dtype_bytes(cfg["model"]["dtype"]))
    terms = {"rollout/weights": weights, "train/sleeping_engine": sleeping_engine_gib(cfg, layout)}
    sleeps = not layout.split  # with placement=split the engine has its devices to itself: it never sleeps
    if (sleeps and rollout_engine(cfg).own_weights and cfg["rollout"]["free_cache_engine"]
            and int(cfg["rollout"]["sleep_level"]) == 1):
        terms["host/sleeping_engine"] = weights  # sleep level 1 parks the weights in host memory
    if not rollout_engine(cfg).kv_pool:
        if sleeps and hf_engine_sleeps(cfg):
            terms["host/sleeping_engine"] = weights
        terms["rollout/kv_cache"] = hf_static_cache_gib(cfg, layout)
        terms["rollout/activations"] = hf_rollout_activations_gib(cfg, layout, gdn)
    else:
        terms["rollout/activations"] = rollout_activations_gib(cfg, layout)
        terms["rollout/pool"] = vllm_pool_gib(cfg)
        terms["rollout/sequence_cache"] = sequence_cache_gib(cfg, layout)
    return terms


def assemble(cfg: Any, train: Dict[str, float], rollout: Dict[str, float]) -> MemoryEstimate:
    """Combine the two phases' terms into peaks and the fit verdict."""
    terms = {**train, **rollout}
    train_peak = sum(v for k, v in terms.items() if k.startswith("train/"))
    kept = terms["rollout/kept_by_trainer"]
    cap = capacity_gib(cfg)
    if "rollout/pool" in terms:
        per_seq = terms["rollout/sequence_cache"]
        minimal = terms["rollout/weights"] + terms["rollout/activations"] + per_seq
        if pool_is_auto(cfg):
            awake = terms.get("train/sleeping_engine", 0.0) > 0  # free_cache_engine off: the pool stays in training
            beside = max(kept, train_peak - terms["train/sleeping_engine"]) if awake else kept
            terms["rollout/pool"] = auto_pool_gib(cfg, beside, minimal)
            if awake:
                terms["train/sleeping_engine"] = terms["rollout/pool"]
                train_peak = sum(v for k, v in terms.items() if k.startswith("train/"))
        pool = terms["rollout/pool"]
        sequences = max(0, int((pool - minimal + per_seq) // per_seq)) if per_seq > 0 else None
        rollout_peak = kept + pool
    else:
        pool, sequences = None, None
        minimal = terms["rollout/weights"] + terms["rollout/kv_cache"] + terms["rollout/activations"]
        rollout_peak = kept + minimal
    log_prob_peak = sum(terms.get(k, 0.0) for k in LOG_PROB_BESIDE) + sum(
        v for k, v in terms.items() if k.startswith("log_prob/"))
    fits = max(train_peak, rollout_peak, log_prob_peak) <= cap and (pool is None or minimal <= pool)
    return MemoryEstimate(train_peak_gib=train_peak, rollout_peak_gib=rollout_peak, capacity_gib=cap, fits=fits,
                          terms=terms, rollout_pool_gib=pool, rollout_min_gib=minimal, rollout_sequences=sequences,
                          log_prob_peak_gib=log_prob_peak, reserve_gib=float(cfg["hw"]["reserve_gib"]))


def estimate(cfg: Any, layout: Layout, gdn: Optional[str] = None) -> MemoryEstimate:
    """Per-device memory of both phases of `cfg` under `layout`; `gdn` ('fla' / 'torch') overrides the GDN kernels
    the plan assumes (`gdn_kernels`). With placement=split `train_peak_gib` is a training-pool device's and
    `rollout_peak_gib` a rollout-pool device's."""
    tree = as_tree(cfg)
    return assemble(tree, train_terms(tree, layout, gdn), rollout_terms(tree, layout, gdn))


def auto_pool_fraction(cfg: Any, layout: Layout) -> float:
    """The gpu_memory_utilization an `auto` pool resolves to under `layout` (sized as for vLLM whatever the engine:
    the value the verl export and the engine read)."""
    tree = as_tree(cfg)
    if not rollout_engine(tree).kv_pool:
        pooled = next(s.name for s in ROLLOUT_ENGINES.values() if s.kv_pool)
        tree = {**tree, "rollout": {**tree["rollout"], "engine": pooled}}
    est = estimate(tree, layout)
    return round(est.rollout_pool_gib / nominal_gib(tree), 2)
