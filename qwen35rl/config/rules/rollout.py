"""The rollout layout: the rollout engine takes the requested TP/EP, rollout TP divides the heads,
rollout EP matches TP x DP and divides the experts, the replicas cover the rollout devices and a TP group stays
within a node; and placeholder weights at the engine's start only where the weight sync brings every weight used."""
from __future__ import annotations

from typing import Any, List

from qwen35rl.config import engine_specs, vllm_facts
from qwen35rl.config.layout import Layout
from qwen35rl.config.problems import Problem
from qwen35rl.config.rules.registry import _divisors, _err, _moe, _nearest, _try, rule, val


# ====================================================================================================== rollout
def _rollout_tp_ok(cfg: Any, tp: int) -> bool:
    m = val(cfg, "model")
    return all(int(m[k]) % tp == 0 for k in ("linear_num_key_heads", "linear_num_value_heads", "num_attention_heads"))


@rule("rollout")
def rollout_engine_parallelism(cfg: Any, layout: Layout) -> List[Problem]:
    """An engine without rollout TP or EP (its spec's; transformers `generate`) runs one whole model per device."""
    spec = engine_specs.rollout_engine(val(cfg, "rollout.engine"))
    tp_off = layout.rollout_tp != 1 and not spec.tensor_parallel
    ep_off = layout.rollout_ep != 1 and not spec.expert_parallel
    if not (tp_off or ep_off):
        return []
    key = "parallelism.rollout.tp" if tp_off else "parallelism.rollout.ep"
    able = next(n for n, s in engine_specs.ROLLOUT_ENGINES.items() if s.tensor_parallel and s.expert_parallel)
    return _err("rollout_engine_parallelism", key, f"rollout.engine={spec.name} generates with one whole model per "
                f"device; rollout TP{layout.rollout_tp} EP{layout.rollout_ep} needs rollout.engine={able}",
                f"try {key}=1 or rollout={able}")


@rule("rollout")
def rollout_tp_divides_heads(cfg: Any, layout: Layout) -> List[Problem]:
    """vLLM splits GDN key heads, GDN value heads and attention heads over rollout TP."""
    if _rollout_tp_ok(cfg, layout.rollout_tp):
        return []
    m = val(cfg, "model")
    best = _nearest(layout.rollout_tp, [t for t in _divisors(layout.rollout_world) if _rollout_tp_ok(cfg, t)])
    return _err("rollout_tp_divides_heads", "parallelism.rollout.tp", f"rollout TP{layout.rollout_tp} must divide "
                f"the GDN key heads ({m['linear_num_key_heads']}), GDN value heads ({m['linear_num_value_heads']}) and "
                f"attention heads ({m['num_attention_heads']})", _try("parallelism.rollout.tp", best))


@rule("rollout")
def rollout_ep_matches_tp_dp(cfg: Any, layout: Layout) -> List[Problem]:
    """With expert parallel, one vLLM engine spans TP*DP devices and its experts spread over all of them."""
    if layout.rollout_ep == 1 or layout.rollout_ep == layout.rollout_tp * layout.rollout_dp:
        return []
    return _err("rollout_ep_matches_tp_dp", "parallelism.rollout.ep", f"rollout EP{layout.rollout_ep} must equal "
                f"rollout TP{layout.rollout_tp} x DP{layout.rollout_dp} = {layout.rollout_tp * layout.rollout_dp}",
                _try("parallelism.rollout.ep", layout.rollout_tp * layout.rollout_dp))


@rule("rollout")
def rollout_ep_divides_experts(cfg: Any, layout: Layout) -> List[Problem]:
    """Rollout experts split over EP; a dense model has none."""
    if layout.rollout_ep == 1:
        return []
    if not _moe(cfg):
        return _err("rollout_ep_divides_experts", "parallelism.rollout.ep", f"rollout EP{layout.rollout_ep} on a dense "
                    f"model ({val(cfg, 'model.name')} has no experts)", _try("parallelism.rollout.ep", 1))
    experts = int(val(cfg, "model.num_experts"))
    if experts % layout.rollout_ep:
        return _err("rollout_ep_divides_experts", "parallelism.rollout.ep", f"rollout EP{layout.rollout_ep} does not "
                    f"divide the {experts} experts", "choose rollout TP x DP (= EP) among the divisors of "
                    f"{experts}")
    return []


@rule("rollout")
def rollout_replicas_cover_devices(cfg: Any, layout: Layout) -> List[Problem]:
    """Every rollout device runs an engine (colocated: every device; placement=split: the rollout pool). EP=1: DP
    replicas of TP devices, TP*DP = the rollout devices; EP>1: engines of TP*DP devices, and the rollout devices
    divide by that."""
    replica, world = layout.rollout_replica_size, layout.rollout_world
    devices = f"{world} devices of the rollout pool" if layout.split else f"{world} devices"
    if layout.rollout_ep == 1 and layout.rollout_tp * layout.rollout_dp != world:
        if world % layout.rollout_tp:
            best = _nearest(layout.rollout_tp, [t for t in _divisors(world) if _rollout_tp_ok(cfg, t)])
            return _err("rollout_replicas_cover_devices", "parallelism.rollout.tp", f"rollout TP{layout.rollout_tp} "
                        f"does not divide the {devices}", _try("parallelism.rollout.tp", best))
        return _err("rollout_replicas_cover_devices", "parallelism.rollout.dp", f"rollout DP{layout.rollout_dp} x "
                    f"TP{layout.rollout_tp} = {layout.rollout_dp * layout.rollout_tp} replicas' devices, but every one of "
                    f"the {devices} hosts the rollout", _try("parallelism.rollout.dp", world // layout.rollout_tp))
    if world % replica:
        return _err("rollout_replicas_cover_devices", "parallelism.rollout.dp", f"a rollout engine of TP"
                    f"{layout.rollout_tp} x DP{layout.rollout_dp} = {replica} devices does not divide the {devices}",
                    _try("parallelism.rollout.dp", _nearest(layout.rollout_dp,
                                                                      _divisors(world // layout.rollout_tp)
                                                                      if world % layout.rollout_tp == 0 else [1])))
    return []


@rule("rollout")
def rollout_tp_within_node(cfg: Any, layout: Layout) -> List[Problem]:
    """A rollout TP group stays inside one node (its all-reduces run every decode step), unless
    hw.multi_node_rollout_tp allows spanning nodes."""
    per_node, tp = int(val(cfg, "hw.devices_per_node")), layout.rollout_tp
    if val(cfg, "hw.multi_node_rollout_tp"):
        return []
    if not (tp <= per_node and per_node % tp == 0):
        best = _nearest(tp, [t for t in _divisors(per_node) if _rollout_tp_ok(cfg, t)])
        return _err("rollout_tp_within_node", "parallelism.rollout.tp", f"rollout TP{tp} does not fit the "
                    f"{per_node} devices of a node", f"{_try('parallelism.rollout.tp', best)} or "
                    "hw.multi_node_rollout_tp=true")
    starts = range(layout.world, layout.world + layout.rollout_world - tp + 1, tp) if layout.split else ()
    if any(a // per_node != (a + tp - 1) // per_node for a in starts):  # the rollout pool starts after `world`
        return _err("rollout_tp_within_node", "parallelism.rollout.tp", f"the rollout pool starts at device "
                    f"{layout.world} of its node-major order, so groups of rollout TP{tp} from there cross nodes of "
                    f"{per_node} devices", f"a placement.rollout_devices that leaves a multiple of {tp} training "
                    "devices, or hw.multi_node_rollout_tp=true")
    return []


@rule("rollout")
def placeholder_weights_need_a_sync(cfg: Any, layout: Layout) -> List[Problem]:
    """rollout.load_format=dummy starts vLLM on placeholder weights and the weight sync brings the policy's. Neither
    a speculative decoding draft (MTP: no part of the policy) nor what vLLM derives at load for images (the vision
    tower's input normalisation) arrives that way."""
    if (not engine_specs.rollout_engine(val(cfg, "rollout.engine")).own_weights
            or not vllm_facts.starts_on_placeholders(cfg)):
        return []
    if "speculative_config" in (val(cfg, "rollout.engine_kwargs") or {}):
        why = ("rollout.engine_kwargs.speculative_config decodes with draft weights that only the checkpoint holds "
               "(the weight sync brings the policy's)")
    elif val(cfg, "data.has_images"):
        why = ("on image data vLLM derives part of the vision tower at load (its input normalisation), which "
               "placeholders overwrite and no weight sync restores")
    else:
        return []
    return _err("placeholder_weights_need_a_sync", "rollout.load_format",
                f"{why}, but rollout.load_format=dummy starts vLLM without reading the checkpoint",
                _try("rollout.load_format", "auto"))
