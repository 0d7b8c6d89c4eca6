"""Launcher, placement and staleness: trainer.launcher=local on one host, placement=split's needs
(Ray, the hf rollout engine, the pool sizes), staleness and rollout devices only with split, the between-phase
offload split makes pointless, and importance weights that use_rollout_log_probs makes all 1."""
from __future__ import annotations

from typing import Any, List

from qwen35rl.config import capabilities, engine_specs
from qwen35rl.config.launcher import launcher_of
from qwen35rl.config.layout import Layout, placement
from qwen35rl.config.problems import WARNING, Problem
from qwen35rl.config.rules.registry import _err, _shown, _try, rule, val


@rule("config")
def local_launcher_runs_on_this_host(cfg: Any, layout: Layout) -> List[Problem]:
    """trainer.launcher=local starts its workers without Ray on this host: one in the driver's process, or one
    process per CPU device. Several accelerators would each need their device assigned, which Ray does."""
    nodes, per_node = int(val(cfg, "hw.nodes")), int(val(cfg, "hw.devices_per_node"))
    if launcher_of(cfg) != "local" or nodes * per_node == 1:
        return []
    if nodes > 1:
        return _err("local_launcher_runs_on_this_host", "trainer.launcher", f"trainer.launcher=local starts its "
                    f"workers on this host, but hw.nodes={nodes}", "try trainer.launcher=ray (any number of nodes), "
                    "or hw.nodes=1")
    if val(cfg, "hw.device") != "cpu":
        return _err("local_launcher_runs_on_this_host", "trainer.launcher", f"trainer.launcher=local runs several "
                    f"workers on CPU only; hw.device={val(cfg, 'hw.device')} with {per_node} devices needs each "
                    f"worker on its own device, which Ray assigns", "try trainer.launcher=ray, or "
                    "hw.devices_per_node=1 for a single-device run in the driver's process")
    return []


# ==================================================================================== placement and staleness
def _placement(cfg: Any, code: str) -> List[Problem]:
    """The problem `code` of the placement declaration (`capabilities.PLACEMENT`, which the runtime checks too)."""
    return [p for p in capabilities.placement_problems(cfg) if p.code == code]


@rule("config")
def split_needs_ray(cfg: Any, layout: Layout) -> List[Problem]:
    """placement=split places each pool's workers as Ray actors on their own devices: trainer.launcher=ray."""
    return _placement(cfg, "split_needs_ray")


@rule("config")
def split_rollout_needs_hf(cfg: Any, layout: Layout) -> List[Problem]:
    """placement=split loads weights sent across pools into the hf engine; vLLM would need a weight receiver on
    that communicator inside its own workers, which is not built."""
    return _placement(cfg, "split_rollout_needs_hf")


@rule("config")
def staleness_needs_split(cfg: Any, layout: Layout) -> List[Problem]:
    """algorithm.max_staleness > 0 needs placement=split: colocated phases take turns, always on-policy."""
    return _placement(cfg, "staleness_needs_split")


@rule("config")
def rollout_devices_needs_split(cfg: Any, layout: Layout) -> List[Problem]:
    """Colocated runs the rollout on every device: placement.rollout_devices stays null."""
    p = placement(cfg)
    if p["mode"] == "split" or p["rollout_devices"] is None:
        return []
    return _err("rollout_devices_needs_split", "placement.rollout_devices", f"placement.rollout_devices="
                f"{_shown(p['rollout_devices'])} gives the rollout engines devices of their own, but placement="
                f"{p['mode']} runs them on every device", "remove placement.rollout_devices, or add placement=split")


@rule("config")
def split_pool_sizes(cfg: Any, layout: Layout) -> List[Problem]:
    """placement=split: 1 <= placement.rollout_devices <= devices - 1 (each pool needs a device). Null is resolved
    by the plan before the rules see it (the best valid pool size, or with parallelism=auto the layout search's):
    still null here means no size was valid."""
    p = placement(cfg)
    devices = int(val(cfg, "hw.nodes")) * int(val(cfg, "hw.devices_per_node"))
    rd = p["rollout_devices"]
    if p["mode"] != "split":
        return []
    if devices < 2:
        return _err("split_pool_sizes", "placement.mode", f"placement=split needs a device for each pool; "
                    f"hw.nodes x hw.devices_per_node = {devices}", "try placement=colocated, or more devices "
                    "(hw.devices_per_node)")
    suggestion = _try("placement.rollout_devices", max(1, devices // 2))
    if rd is None:
        if val(cfg, "parallelism.auto"):
            return []  # the layout search picks it
        return _err("split_pool_sizes", "placement.rollout_devices", f"placement=split with "
                    f"placement.rollout_devices null: no rollout-pool size of the {devices} devices gives a valid "
                    "plan for this layout (the plan tries each)",
                    f"{suggestion} to see what that size violates, or parallelism=auto (searches the layout too)")
    if isinstance(rd, bool) or not isinstance(rd, int) or not 1 <= rd <= devices - 1:
        return _err("split_pool_sizes", "placement.rollout_devices", f"placement.rollout_devices={_shown(rd)} must "
                    f"be between 1 and {devices - 1}: the {devices} devices (hw.nodes x hw.devices_per_node) make "
                    "both pools, and each needs one", suggestion)
    return []


@rule("config")
def split_offload_pointless(cfg: Any, layout: Layout) -> List[Problem]:
    """The Megatron engine's between-phase host offload (backend.param_offload / grad_offload /
    optimizer_offload) makes room for the rollout engine on the training devices; with placement=split they never
    generate, so it only costs copies. (FSDP's offload keys are FSDP2's CPUOffloadPolicy for the whole step, a
    training-memory setting; megatron's optimizer_cpu_offload runs the optimizer on the host: both stay.)"""
    if not layout.split or not engine_specs.train_engine(layout.backend).offloads_between_phases:
        return []
    on = [k for k in ("param_offload", "grad_offload", "optimizer_offload") if val(cfg, f"backend.{k}")]
    if not on:
        return []
    keys = " ".join(f"backend.{k}=false" for k in on)
    return _err("split_offload_pointless", f"backend.{on[0]}", f"{', '.join('backend.' + k for k in on)}: the "
                "Megatron engine moves its state to the host between training and generation, but with "
                "placement=split the training devices never generate: the copies only cost time",
                f"try {keys} (backend.optimizer_cpu_offload=true offloads the optimizer for training memory)")


@rule("config")
def rollout_is_weights_are_one(cfg: Any, layout: Layout) -> List[Problem]:
    """Importance sampling by the behaviour policy with backend.use_rollout_log_probs=true: the old log-probs are
    the rollout engine's, so every weight is 1 and the correction does nothing."""
    mode = capabilities.rollout_is_mode(cfg)
    if mode not in ("token", "sequence") or not val(cfg, "backend.use_rollout_log_probs"):
        return []
    return [Problem("rollout_is_weights_are_one", "algorithm.rollout_is", f"algorithm.rollout_is={mode} weighs by "
                    "old / behaviour probabilities, but backend.use_rollout_log_probs=true makes the old log-probs "
                    "the behaviour ones: every weight is 1", "try backend.use_rollout_log_probs=false (the trainer "
                    "computes the old log-probs), or algorithm.rollout_is=off", WARNING)]
