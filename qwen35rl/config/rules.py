"""Named validation rules: everything knowable before launch.

Each rule is a small pure function `(cfg, layout) -> list[Problem]` registered with the part of the config it
reads (its scope):
- `config`: the config alone (enums, ranges, batch sizes vs lengths, version facts, pass-through dicts);
- `train`: the training layout (TP/PP/CP/EP/ETP, FSDP size, SP, DP-dependent batch arithmetic);
- `rollout`: the rollout layout (rollout TP/DP/EP);
- `colocated`: both layouts at once (the rollout phase's memory depends on what the trainer keeps).
`check_all` runs them all; the layout search runs each scope where it changes. Problems carry a stable code (the
rule's name), the key to change, a message with the numbers and a hint with a valid alternative.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import re
import math
import typing
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from qwen35rl.config import capabilities, engine_specs, known_keys, memory, quirks, schema
from qwen35rl.names import REWARDS, TRACKERS, did_you_mean, parse_verl_reward, reward_is_file
from qwen35rl.config.layout import (Layout, even_pipeline_layout, format_pipeline_layout, is_split,
                                    parse_pipeline_layout, placement)
from qwen35rl.config.launcher import LAUNCHERS, launcher_of
from qwen35rl.config.problems import ERROR, WARNING, Problem
from qwen35rl.config.megatron_versions import EXPERT_GROUPS_WITHOUT_EP  # the version facts, stated once

Rule = Callable[[Any, Layout], List[Problem]]
SCOPES = ("config", "train", "rollout", "colocated")
RULES: List[Tuple[str, Rule]] = []
"""(scope, rule) in the order they run: cheap arithmetic first, memory last."""


def rule(scope: str) -> Callable[[Rule], Rule]:
    assert scope in SCOPES, scope

    def register(fn: Rule) -> Rule:
        RULES.append((scope, fn))
        return fn

    return register


def val(cfg: Any, dotted: str) -> Any:
    """`cfg["a"]["b"]` for "a.b": works on a DictConfig and on a plain dict tree."""
    node = cfg
    for part in dotted.split("."):
        node = node[part]
    return node


def _err(code: str, key: str, message: str, hint: str = "") -> List[Problem]:
    return [Problem(code, key, message, hint, ERROR)]


def _try(key: str, value: Any) -> str:
    return f"try {key}={value}"


def _divisors(n: int) -> List[int]:
    """The divisors of n in increasing order, in O(sqrt n)."""
    n = max(int(n), 1)
    small, large = [], []
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            small.append(d)
            if d != n // d:
                large.append(n // d)
    return small + large[::-1]


def _nearest(value: int, options: Iterable[int]) -> Optional[int]:
    """The option closest to value on a log scale (ties: the smaller)."""
    opts = sorted(set(options))
    if not opts:
        return None
    return min(opts, key=lambda o: (abs(math.log2(o) - math.log2(max(value, 1))), o))


def _reads(layout: Layout, axis: str) -> bool:
    """The training engine reads `parallelism.<axis>` (its spec's layout axes): the rules over that axis apply."""
    return axis in engine_specs.train_engine(layout.backend).layout_axes


def _model_parallel(layout: Layout) -> bool:
    """The world is TP*PP*CP*DP (model parallel) rather than shards of every layer (`TrainEngineSpec`)."""
    return engine_specs.train_engine(layout.backend).model_parallel


def _megatron_core(layout: Layout) -> bool:
    """The training engine builds on megatron-core: its version facts and TransformerConfig apply."""
    return engine_specs.train_engine(layout.backend).uses("megatron")


def _vllm(cfg: Any) -> bool:
    """The rollout engine runs vLLM: its version facts and platform quirks apply."""
    return engine_specs.rollout_uses(str(val(cfg, "rollout.engine")), "vllm")


def _moe(cfg: Any) -> bool:
    return bool(val(cfg, "model.moe"))


# ======================================================================================== degrees & the world
@rule("config")
def engine_known(cfg: Any, layout: Layout) -> List[Problem]:
    """The training and rollout engines are ones qwen35rl has (engine_specs): every other rule asks them."""
    out = []
    for key, table in (("backend.name", engine_specs.TRAIN_ENGINES), ("rollout.engine", engine_specs.ROLLOUT_ENGINES)):
        v = val(cfg, key)
        if v not in table:
            out += _err("engine_known", key, f"{key}={v!r} is not one of {', '.join(table)}",
                        did_you_mean(str(v), table) or _try(key, next(iter(table))))
    return out


@rule("config")
def degrees_positive(cfg: Any, layout: Layout) -> List[Problem]:
    """Every parallel degree is a positive integer (the other layout rules assume it)."""
    return _range_problems(cfg, "degrees_positive", [k for k in declared_ranges() if k in DEGREES])


DEGREES = ("parallelism.tp", "parallelism.pp", "parallelism.cp", "parallelism.ep", "parallelism.etp", "parallelism.sp",
           "parallelism.vpp", "parallelism.fsdp_size", "parallelism.rollout.tp", "parallelism.rollout.dp",
           "parallelism.rollout.ep", "hw.nodes", "hw.devices_per_node")
"""Ranged keys the layout is derived from: out of range, the layout rules do not run (they would divide by them)."""


AXIS_DEFAULTS = {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "etp": 1, "vpp": None, "pipeline_layout": None, "fsdp_size": -1,
                 "sp": 1}
_OTHER_ENGINE_HINT = {
    "sp": "Megatron splits sequences with TP (sequence parallel)",
    "fsdp_size": "Megatron shards with the distributed optimizer over DP",
    "vpp": "backend=fsdp has no pipeline", "pipeline_layout": "backend=fsdp has no pipeline",
}


@rule("train")
def degrees_match_backend(cfg: Any, layout: Layout) -> List[Problem]:
    """Each engine reads its own layout axes (its spec's `layout_axes`); the other engine's keep their defaults."""
    par, engine = val(cfg, "parallelism"), layout.backend
    mine = engine_specs.train_engine(engine).layout_axes
    axes = {name: spec.layout_axes for name, spec in engine_specs.TRAIN_ENGINES.items()}
    for key in (k for other, keys in axes.items() if other != engine for k in keys if k not in mine):
        if par[key] != AXIS_DEFAULTS[key]:
            owner = next(e for e, keys in axes.items() if key in keys)
            why = _OTHER_ENGINE_HINT.get(key, "backend=fsdp shards parameters over parallelism.fsdp_size instead")
            default = "null" if AXIS_DEFAULTS[key] is None else AXIS_DEFAULTS[key]
            return _err("degrees_match_backend", f"parallelism.{key}", f"parallelism.{key}={par[key]} applies to "
                        f"backend={owner}, not backend={engine} ({why})",
                        f"try parallelism.{key}={default}, or backend={owner}")
    return []


def _train_ok(cfg: Any, world: int, tp: int, pp: int, cp: int) -> bool:
    """TP/CP against heads and the world (used to suggest a valid alternative)."""
    m = val(cfg, "model")
    kv = int(m["num_key_value_heads"])
    return (world % (tp * pp * cp) == 0 and int(m["num_attention_heads"]) % tp == 0 and (kv % tp == 0 or tp % kv == 0)
            and int(m["linear_num_key_heads"]) % (tp * cp) == 0 and int(m["linear_num_value_heads"]) % (tp * cp) == 0)


def _suggest_tp(cfg: Any, layout: Layout) -> str:
    best = _nearest(layout.tp, [t for t in _divisors(layout.world) if _train_ok(cfg, layout.world, t, layout.pp,
                                                                                 layout.cp)])
    return _try("parallelism.tp", best) if best else "reduce parallelism.pp or parallelism.cp"


def _world_text(cfg: Any, layout: Layout) -> str:
    """Where the training world comes from: "the world of 8 devices (1 node(s) x 8 devices)", or with
    placement=split "the training pool of 6 devices (1 node(s) x 8 devices less placement.rollout_devices=2)"."""
    hw = f"{val(cfg, 'hw.nodes')} node(s) x {val(cfg, 'hw.devices_per_node')} devices"
    if layout.split:
        return (f"the training pool of {layout.world} devices ({hw} less placement.rollout_devices="
                f"{layout.rollout_world})")
    return f"the world of {layout.world} devices ({hw})"


@rule("train")
def world_size_matches_devices(cfg: Any, layout: Layout) -> List[Problem]:
    """world = TP*PP*CP*DP (FSDP: SP*DP) = nodes x devices per node (placement=split: the training pool)."""
    if not _model_parallel(layout):
        if layout.world % layout.sp:
            best = _nearest(layout.sp, [s for s in _divisors(layout.world) if _sp_ok(cfg, s)])
            return _err("world_size_matches_devices", "parallelism.sp", f"SP{layout.sp} does not divide "
                        f"{_world_text(cfg, layout)}", _try("parallelism.sp", best))
        return []
    model_par = layout.tp * layout.pp * layout.cp
    if layout.world % model_par == 0:
        return []
    return _err("world_size_matches_devices", "parallelism.tp", f"TP{layout.tp} x PP{layout.pp} x CP{layout.cp} = "
                f"{model_par} does not divide {_world_text(cfg, layout)}: world = TP*PP*CP*DP",
                _suggest_world_fix(cfg, layout))


def _suggest_world_fix(cfg: Any, layout: Layout) -> str:
    """Change one of PP, CP, TP (in that order) to the closest value that makes a valid layout."""
    for key in ("pp", "cp", "tp"):
        current = getattr(layout, key)
        for v in sorted(_divisors(layout.world), key=lambda d: (abs(math.log2(d) - math.log2(current)), d)):
            degrees = {"tp": layout.tp, "pp": layout.pp, "cp": layout.cp, key: v}
            if _train_ok(cfg, layout.world, degrees["tp"], degrees["pp"], degrees["cp"]):
                return _try(f"parallelism.{key}", v)
    if layout.split:
        return "use a training pool that TP*PP*CP divides (placement.rollout_devices, hw.nodes)"
    return "use a device count that TP*PP*CP divides (hw.nodes)"


# ============================================================================================ heads and experts
@rule("train")
def tp_divides_attention_heads(cfg: Any, layout: Layout) -> List[Problem]:
    """Megatron (and vLLM) split attention heads over TP."""
    heads = int(val(cfg, "model.num_attention_heads"))
    if heads % layout.tp:
        return _err("tp_divides_attention_heads", "parallelism.tp", f"TP{layout.tp} does not divide the {heads} "
                    "attention heads", _suggest_tp(cfg, layout))
    return []


@rule("train")
def tp_fits_kv_heads(cfg: Any, layout: Layout) -> List[Problem]:
    """KV heads are split over TP, or replicated when TP is a multiple of them."""
    kv = int(val(cfg, "model.num_key_value_heads"))
    if kv % layout.tp and layout.tp % kv:
        return _err("tp_fits_kv_heads", "parallelism.tp", f"TP{layout.tp} is neither a multiple nor a divisor of the "
                    f"{kv} KV heads", _suggest_tp(cfg, layout))
    return []


@rule("train")
def tp_cp_divide_gdn_heads(cfg: Any, layout: Layout) -> List[Problem]:
    """Gated DeltaNet splits its key and value heads over TP*CP."""
    nk, nv = int(val(cfg, "model.linear_num_key_heads")), int(val(cfg, "model.linear_num_value_heads"))
    split = layout.tp * layout.cp
    if nk % split or nv % split:
        key = "parallelism.cp" if layout.cp > 1 else "parallelism.tp"
        return _err("tp_cp_divide_gdn_heads", key, f"TP{layout.tp} x CP{layout.cp} = {split} does not divide the GDN "
                    f"key heads ({nk}) and value heads ({nv})",
                    _try("parallelism.cp", 1) if layout.cp > 1 else _suggest_tp(cfg, layout))
    return []


@rule("train")
def ep_divides_experts(cfg: Any, layout: Layout) -> List[Problem]:
    """Experts are split over EP; a dense model has none to split."""
    if not _reads(layout, "ep") or layout.ep == 1:
        return []
    if not _moe(cfg):
        return _err("ep_divides_experts", "parallelism.ep", f"EP{layout.ep} on a dense model "
                    f"({val(cfg, 'model.name')} has no experts)", _try("parallelism.ep", 1))
    experts = int(val(cfg, "model.num_experts"))
    if experts % layout.ep:
        best = _nearest(layout.ep, [e for e in _divisors(experts) if (layout.world // max(layout.pp, 1))
                                    % (e * layout.etp) == 0])
        return _err("ep_divides_experts", "parallelism.ep", f"EP{layout.ep} does not divide the {experts} experts",
                    _try("parallelism.ep", best))
    return []


@rule("train")
def ep_etp_divide_stage_world(cfg: Any, layout: Layout) -> List[Problem]:
    """EP*ETP must divide the devices of one pipeline stage (world / PP): experts are laid out within a stage."""
    if not _reads(layout, "ep") or layout.world % layout.pp:
        return []
    stage_world = layout.world // layout.pp
    if stage_world % (layout.ep * layout.etp):
        experts = int(val(cfg, "model.num_experts")) if _moe(cfg) else 1
        best = _nearest(layout.ep, [e for e in _divisors(stage_world) if experts % e == 0
                                    and stage_world % (e * layout.etp) == 0])
        if best is None or stage_world % layout.etp:  # ETP itself does not fit: it is ETP to change
            etp = _nearest(layout.etp, [t for t in _divisors(stage_world) if stage_world % (t * layout.ep) == 0
                                        and t <= max(layout.tp, 1)]) or 1
            return _err("ep_etp_divide_stage_world", "parallelism.etp", f"EP{layout.ep} x ETP{layout.etp} = "
                        f"{layout.ep * layout.etp} does not divide the {stage_world} devices of a pipeline stage "
                        f"(world {layout.world} / PP{layout.pp})", _try("parallelism.etp", etp))
        return _err("ep_etp_divide_stage_world", "parallelism.ep", f"EP{layout.ep} x ETP{layout.etp} = "
                    f"{layout.ep * layout.etp} does not divide the {stage_world} devices of a pipeline stage "
                    f"(world {layout.world} / PP{layout.pp})", _try("parallelism.ep", best))
    return []


# ===================================================================================================== pipeline
@rule("train")
def pipeline_splits_layers(cfg: Any, layout: Layout) -> List[Problem]:
    """Layers split evenly over PP (x VPP) stages, or an explicit `parallelism.pipeline_layout` says how."""
    if not _reads(layout, "pp"):
        return []
    layers, vpp, text = int(val(cfg, "model.num_hidden_layers")), layout.vpp, val(cfg, "parallelism.pipeline_layout")
    stages = layout.pp * (vpp or 1)
    if vpp is not None and layout.pp == 1:
        return _err("pipeline_splits_layers", "parallelism.vpp", f"VPP{vpp} interleaves pipeline stages but PP is 1",
                    _try("parallelism.vpp", "null"))
    if text:
        try:
            parsed = parse_pipeline_layout(text)
        except ValueError as e:
            return _err("pipeline_splits_layers", "parallelism.pipeline_layout", str(e),
                        f"e.g. parallelism.pipeline_layout='{format_pipeline_layout(even_pipeline_layout(layers, stages))}'")
        n_t = sum(st.count("t") for st in parsed)
        if len(parsed) != stages or n_t != layers:
            return _err("pipeline_splits_layers", "parallelism.pipeline_layout", f"the layout has {len(parsed)} "
                        f"stages and {n_t} decoder layers; PP{layout.pp} x VPP{vpp or 1} needs {stages} stages and the "
                        f"model has {layers} layers",
                        f"e.g. parallelism.pipeline_layout='{format_pipeline_layout(even_pipeline_layout(layers, stages))}'")
        return []
    if layers % stages:
        even = [p for p in _divisors(layers) if layout.world % (layout.tp * p * layout.cp) == 0]
        uneven = format_pipeline_layout(even_pipeline_layout(layers, stages))
        return _err("pipeline_splits_layers", "parallelism.pp", f"{layers} layers do not split evenly over "
                    f"PP{layout.pp} x VPP{vpp or 1} = {stages} stages",
                    f"{_try('parallelism.pp', _nearest(layout.pp, even))} or set an uneven split, e.g. "
                    f"parallelism.pipeline_layout='{uneven}'")
    return []


# ========================================================================================================= FSDP
# Ranks: FSDP shard groups are fsdp_size consecutive ranks (replicated world / fsdp_size times: HSDP), Ulysses SP
# groups are sp consecutive ranks taking the same micro batches (DP = world / sp). Both divide the world; neither
# need divide the other (FSDP averages gradients over the whole world, SP ranks included).
def _sp_ok(cfg: Any, sp: int) -> bool:
    """What the engine's Ulysses all-to-all needs (engines/ulysses.py): each rank takes whole query heads and whole
    GDN value heads; KV heads and GDN key heads fewer than sp are replicated on the ranks that read them."""
    m = val(cfg, "model")
    return int(m["num_attention_heads"]) % sp == 0 and int(m["linear_num_value_heads"]) % sp == 0


@rule("train")
def fsdp_size_divides_world(cfg: Any, layout: Layout) -> List[Problem]:
    """FSDP shard groups (HSDP when smaller than the world) tile the world."""
    if not _reads(layout, "fsdp_size") or layout.world % layout.fsdp_size == 0:
        return []
    where = "training pool" if layout.split else "world"
    return _err("fsdp_size_divides_world", "parallelism.fsdp_size", f"FSDP size {layout.fsdp_size} does not divide the "
                f"{where} of {layout.world} devices", _try("parallelism.fsdp_size",
                                                         _nearest(layout.fsdp_size, _divisors(layout.world))))


@rule("train")
def sp_divides_heads(cfg: Any, layout: Layout) -> List[Problem]:
    """Ulysses SP scatters heads: SP divides the attention (query) heads and the GDN value heads; KV heads and GDN
    key heads may be fewer than SP (replicated)."""
    if not _reads(layout, "sp") or layout.sp == 1 or _sp_ok(cfg, layout.sp):
        return []
    m = val(cfg, "model")
    best = _nearest(layout.sp, [s for s in _divisors(layout.world) if _sp_ok(cfg, s)])
    return _err("sp_divides_heads", "parallelism.sp", f"SP{layout.sp} must divide the {m['num_attention_heads']} "
                f"attention heads and the {m['linear_num_value_heads']} GDN value heads (KV and GDN key heads may "
                "be fewer: they are replicated)", _try("parallelism.sp", best))


# ===================================================================================== what the engines build
@rule("train")
def engine_builds_setting(cfg: Any, layout: Layout) -> List[Problem]:
    """The declaration of what each engine builds (`config.capabilities`): settings it refuses are errors, settings
    it accepts without applying them warnings that say what runs instead. The engines check the same entries."""
    return capabilities.problems(cfg, layout)


# ============================================================================================ megatron-core
@rule("train")
def expert_grads_need_ep_or_etp_equal_tp(cfg: Any, layout: Layout) -> List[Problem]:
    """megatron-core < 0.19 reduces expert gradients like dense ones when EP = 1 and ETP != TP: wrong gradients."""
    if not (_megatron_core(layout) and _moe(cfg) and layout.ep == 1 and layout.etp != layout.tp):
        return []
    first = ".".join(map(str, EXPERT_GROUPS_WITHOUT_EP))
    if not quirks.version_below(val(cfg, "backend.megatron_core_version"), first):
        return []
    return _err("expert_grads_need_ep_or_etp_equal_tp", "parallelism.etp", f"EP1 with ETP{layout.etp} != TP{layout.tp}:"
                f" megatron-core {val(cfg, 'backend.megatron_core_version')} reduces such expert gradients like dense "
                f"ones and misses the sum over the TP ranks (fixed in {first})", _try("parallelism.etp", layout.tp))


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


# ====================================================================================================== batches
@rule("config")
def rollout_n_at_least_2(cfg: Any, layout: Layout) -> List[Problem]:
    """GRPO compares the responses of one prompt: groups of at least two."""
    n = int(val(cfg, "rollout.n"))
    if n >= 2:
        return []
    return _err("rollout_n_at_least_2", "rollout.n", f"rollout.n={n}: GRPO normalises rewards within each prompt's "
                "group of responses, which needs at least 2", _try("rollout.n", 2))


@rule("config")
def overlong_buffer_within_response(cfg: Any, layout: Layout) -> List[Problem]:
    """DAPO's overlong penalty ramps over the last `buffer_len` tokens of the response budget: it must fit in it."""
    shaping = val(cfg, "algorithm.overlong_shaping")
    budget = int(val(cfg, "data.max_response_length"))
    if not shaping["enable"] or 0 < int(shaping["buffer_len"]) <= budget:
        return []
    return _err("overlong_buffer_within_response", "algorithm.overlong_shaping.buffer_len",
                f"buffer_len={shaping['buffer_len']} must be between 1 and data.max_response_length={budget}",
                _try("algorithm.overlong_shaping.buffer_len", max(1, budget // 4)))


def _batch(cfg: Any) -> Tuple[int, int, int, int, bool]:
    return (int(val(cfg, "data.train_batch_size")), int(val(cfg, "algorithm.mini_batch_size")),
            int(val(cfg, "rollout.n")), int(val(cfg, "backend.micro_batch_size_per_device")),
            bool(val(cfg, "backend.dynamic_batch_size")))


def _multiple_at_least(x: int, unit: int) -> int:
    return max(unit, (x + unit - 1) // unit * unit)


def _valid_multiple(x: int, unit: int, high: int = schema.INT_MAX) -> Optional[int]:
    """The multiple of `unit` nearest above x that is still <= high (the field's range), else the largest one
    below; None when no multiple fits."""
    up = _multiple_at_least(x, unit)
    if up <= high:
        return up
    down = high // unit * unit
    return down if down >= 1 else None


@rule("config")
def mini_batch_within_batch(cfg: Any, layout: Layout) -> List[Problem]:
    """mini_batch_size <= train_batch_size (prompts)."""
    batch, mini, *_ = _batch(cfg)
    if mini <= batch:
        return []
    return _err("mini_batch_within_batch", "algorithm.mini_batch_size", f"mini batch of {mini} prompts exceeds the "
                f"train batch of {batch} prompts", _try("algorithm.mini_batch_size", batch))


@rule("config")
def batch_divisible_by_mini_batch(cfg: Any, layout: Layout) -> List[Problem]:
    """A rollout batch splits into whole mini batches (train_batch_size % mini_batch_size == 0)."""
    batch, mini, *_ = _batch(cfg)
    if mini < 1 or mini > batch or batch % mini == 0:
        return []
    best = _nearest(mini, _divisors(batch))
    return _err("batch_divisible_by_mini_batch", "algorithm.mini_batch_size", f"train batch of {batch} prompts does "
                f"not split into mini batches of {mini}", _try("algorithm.mini_batch_size", best))


@rule("train")
def batch_divisible_by_dp_micro(cfg: Any, layout: Layout) -> List[Problem]:
    """The step's responses (train_batch_size * n) split evenly over DP ranks and micro batches."""
    batch, _, n, micro, dynamic = _batch(cfg)
    unit = layout.dp * (1 if dynamic else micro)
    if unit < 1 or (batch * n) % unit == 0:
        return []
    per = unit // math.gcd(unit, n)
    fix = _valid_multiple(batch, per)
    hint = (_try("data.train_batch_size", fix) if fix is not None else
            _try("backend.micro_batch_size_per_device", 1) if not dynamic and micro > 1 else
            f"fewer DP ranks: no data.train_batch_size up to {schema.INT_MAX} splits over DP{layout.dp}")
    return _err("batch_divisible_by_dp_micro", "data.train_batch_size", f"{batch} prompts x n={n} = {batch * n} "
                f"responses do not split over DP{layout.dp}" + ("" if dynamic else f" x micro batch {micro}"), hint)


@rule("train")
def mini_batch_divisible_by_dp(cfg: Any, layout: Layout) -> List[Problem]:
    """Each mini batch's responses (mini_batch_size * n) split evenly over the DP ranks."""
    _, mini, n, *_ = _batch(cfg)
    if layout.dp < 1 or (mini * n) % layout.dp == 0:
        return []
    per = layout.dp // math.gcd(layout.dp, n)
    fix = _valid_multiple(mini, per)
    return _err("mini_batch_divisible_by_dp", "algorithm.mini_batch_size", f"{mini} prompts x n={n} = {mini * n} "
                f"responses per mini batch do not split over DP{layout.dp}",
                _try("algorithm.mini_batch_size", fix) if fix is not None else "use fewer DP ranks")


@rule("train")
def mini_batch_divisible_by_micro(cfg: Any, layout: Layout) -> List[Problem]:
    """Without dynamic batch size, a DP rank's share of a mini batch is whole micro batches."""
    _, mini, n, micro, dynamic = _batch(cfg)
    if dynamic or layout.dp < 1 or (mini * n) % layout.dp:
        return []
    per_rank = mini * n // layout.dp
    if per_rank % micro == 0:
        return []
    return _err("mini_batch_divisible_by_micro", "backend.micro_batch_size_per_device", f"{per_rank} responses per "
                f"DP rank per mini batch are not whole micro batches of {micro}",
                _try("backend.micro_batch_size_per_device", _nearest(micro, _divisors(per_rank))))


def _seq_len(cfg: Any) -> int:
    return int(val(cfg, "data.max_prompt_length")) + int(val(cfg, "data.max_response_length"))


@rule("config")
def sequence_within_max_position(cfg: Any, layout: Layout) -> List[Problem]:
    """Prompt + response fit the model's position embeddings."""
    seq, limit = _seq_len(cfg), int(val(cfg, "model.max_position_embeddings"))
    if seq <= limit:
        return []
    prompt, response = int(val(cfg, "data.max_prompt_length")), int(val(cfg, "data.max_response_length"))
    message = f"prompt {prompt} + response {response} = {seq} tokens exceed the model's {limit} positions"
    if limit - prompt >= 1:
        return _err("sequence_within_max_position", "data.max_response_length", message,
                    _try("data.max_response_length", limit - prompt))
    if limit - response >= 1:  # the prompt alone is too long: shortening the response cannot help
        return _err("sequence_within_max_position", "data.max_prompt_length", message,
                    _try("data.max_prompt_length", limit - response))
    return _err("sequence_within_max_position", "data.max_prompt_length", message,
                f"try data.max_prompt_length={max(limit // 2, 1)} data.max_response_length={max(limit - limit // 2, 1)}")


@rule("config")
def sequence_within_max_model_len(cfg: Any, layout: Layout) -> List[Problem]:
    """Prompt + response fit the rollout engine's max_model_len when it is set."""
    limit = val(cfg, "rollout.max_model_len")
    seq = _seq_len(cfg)
    if limit is None or seq <= int(limit):
        return []
    return _err("sequence_within_max_model_len", "rollout.max_model_len", f"prompt + response = {seq} tokens exceed "
                f"rollout.max_model_len={limit}", _try("rollout.max_model_len", seq))


@rule("config")
def dynamic_batch_holds_a_sequence(cfg: Any, layout: Layout) -> List[Problem]:
    """With dynamic batch size a micro batch of max_tokens_per_device (and of the log-prob passes' budget) must hold
    the longest sequence."""
    if not val(cfg, "backend.dynamic_batch_size"):
        return []
    out, seq = [], _seq_len(cfg)
    for key in ("backend.max_tokens_per_device", "backend.log_prob_max_tokens_per_device"):
        budget = val(cfg, key)
        if budget is not None and int(budget) < seq:
            out += _err("dynamic_batch_holds_a_sequence", key, f"a micro batch of {budget} tokens cannot hold one "
                        f"prompt + response of {seq} tokens", _try(key, seq))
    return out


@rule("config")
def images_need_vision_model(cfg: Any, layout: Layout) -> List[Problem]:
    """Image data needs a model with a vision tower."""
    if not val(cfg, "data.has_images") or val(cfg, "model.vision") is not None:
        return []
    return _err("images_need_vision_model", "model", f"data={val(cfg, 'data.name')} has images but model="
                f"{val(cfg, 'model.name')} has no vision tower (model.vision is null)",
                "choose a VL checkpoint (every official Qwen3.5 size, or qwen3_5_tiny_vl) or text data")


@rule("config")
def megatron_dispatcher_takes_variable_lengths(cfg: Any, layout: Layout) -> List[Problem]:
    """The Megatron engine feeds micro batches of different lengths (variable_seq_lengths); megatron-core's
    allgather MoE dispatcher refuses that at start-up."""
    if (not _megatron_core(layout) or not val(cfg, "model.moe")
            or val(cfg, "backend.moe_token_dispatcher_type") != "allgather"):
        return []
    return _err("megatron_dispatcher_takes_variable_lengths", "backend.moe_token_dispatcher_type",
                "backend.moe_token_dispatcher_type=allgather cannot take micro batches of different lengths, which "
                "the Megatron engine feeds (megatron-core refuses it when the model is built)",
                "try backend.moe_token_dispatcher_type=alltoall (or flex with DeepEP)")


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


# ================================================================================================ enums, ranges
CHOICES: Dict[str, Sequence[Any]] = {
    "placement.mode": tuple(capabilities.PLACEMENT),
    "algorithm.rollout_is": ("auto", "token", "sequence", "off"),
    "rollout.engine": tuple(engine_specs.ROLLOUT_ENGINES),
    "algorithm.adv_estimator": ("grpo",),
    "algorithm.loss_agg_mode": ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
    "algorithm.kl_loss_type": ("kl", "mse", "low_var_kl", "abs"),
    "data.truncation": ("error", "left", "right"),
    "data.kind": ("synthetic", "text", "multimodal"),
    "model.init": ("pretrained", "random"),
    "model.dtype": ("bfloat16", "float16", "float32"),
    "backend.name": tuple(engine_specs.TRAIN_ENGINES),
    "backend.lr_scheduler": ("constant", "cosine"),
    "backend.mixed_precision": ("auto", "bf16", "fp32"),
    "backend.recompute_granularity": ("full", "selective", None),
    "backend.recompute_method": ("uniform", "block", None),
    "backend.moe_token_dispatcher_type": ("allgather", "alltoall", "flex"),
    "hw.device": ("cpu", "cuda", "npu"),
    "hw.collective_backend": ("gloo", "nccl", "hccl"),
    "rollout.sleep_level": (1, 2),
    "rollout.cudagraph_mode": ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE", None),
    "format": ("text", "json", "verl"),
    "trainer.launcher": LAUNCHERS,
}


def _get(cfg: Any, dotted: str, default: Any = KeyError) -> Any:
    try:
        return val(cfg, dotted)
    except (KeyError, AttributeError, TypeError):  # TypeError: a null group on the way (model.vision)
        return default


@rule("config")
def known_choice(cfg: Any, layout: Layout) -> List[Problem]:
    """Enum-like fields take one of their documented values."""
    out = []
    for key, allowed in CHOICES.items():
        v = _get(cfg, key)
        if v is KeyError or v in allowed:
            continue
        names = [str(a) for a in allowed if a is not None]
        out += _err("known_choice", key, f"{key}={v!r} is not one of {', '.join(names)}" +
                    (" (or null)" if None in allowed else ""), did_you_mean(str(v), names) or _try(key, names[0]))
    reward = str(val(cfg, "data.reward"))
    if reward not in REWARDS and ":" not in reward:
        out += _err("known_choice", "data.reward", f"data.reward={reward!r} is neither a built-in reward "
                    f"({', '.join(REWARDS)}) nor a `pkg.module:function` path",
                    did_you_mean(reward, REWARDS) or "e.g. data.reward=mypkg.rewards:score")
    return out


def declared_fields() -> Dict[str, Any]:
    """key -> metadata of every schema field that declares something about its values (a range: `schema.at_least`,
    `positive`, `between`; `integer`, `choices`: `schema.int_or_auto`, `bool_or_auto`), over every group (both
    backends)."""
    global _FIELDS
    if _FIELDS is None:
        _FIELDS = {}
        todo = [(name, cls) for name, cls in typing.get_type_hints(schema.RunConfig).items()
                if dataclasses.is_dataclass(cls)]
        todo += [("backend", cls) for cls in schema.BACKENDS.values()]
        while todo:
            prefix, cls = todo.pop(0)
            hints = typing.get_type_hints(cls)
            for f in dataclasses.fields(cls):
                kind = hints[f.name]
                inner = [a for a in typing.get_args(kind) if dataclasses.is_dataclass(a)]
                if dataclasses.is_dataclass(kind) or inner:
                    todo.append((f"{prefix}.{f.name}", kind if dataclasses.is_dataclass(kind) else inner[0]))
                elif f.metadata:
                    default = None if f.default is dataclasses.MISSING else f.default
                    _FIELDS[f"{prefix}.{f.name}"] = {**f.metadata, "default": default}
    return _FIELDS


def declared_ranges() -> Dict[str, Tuple[Tuple[float, float, bool, bool], Tuple[Any, ...], bool, Any]]:
    """key -> ((low, high, low open, high open), special values, nullable, default): the ranges the schema declares
    beside its fields (`schema.at_least`, `positive`, `between`), over every group (both backends)."""
    global _RANGES
    if _RANGES is None:
        _RANGES = {k: (m["range"], m["also"], m["nullable"], m["default"]) for k, m in declared_fields().items()
                   if "range" in m}
    return _RANGES


_RANGES: Optional[Dict[str, Any]] = None
_FIELDS: Optional[Dict[str, Any]] = None


def _in_span(v: float, span: Tuple[float, float, bool, bool]) -> bool:
    lo, hi, lo_open, hi_open = span
    if not math.isfinite(v):
        return False
    return (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)


def _span_text(span: Tuple[float, float, bool, bool], also: Sequence[Any], nullable: bool) -> str:
    lo, hi, lo_open, hi_open = span
    fmt = lambda x: f"{x:g}" if isinstance(x, float) else str(x)
    if hi in (math.inf, schema.INT_MAX):
        text = f"{'>' if lo_open else '>='} {fmt(lo)}"
    else:
        text = f"in {'(' if lo_open else '['}{fmt(lo)}, {fmt(hi)}{')' if hi_open else ']'}"
    extra = [str(a) for a in also] + (["null"] if nullable else [])
    return text + (f" (or {' or '.join(extra)})" if extra else "")


def _valid_example(span: Tuple[float, float, bool, bool], default: Any, v: float) -> Any:
    """A value inside the span for the hint: the field's default when it is inside, else the nearest bound."""
    if isinstance(default, (int, float)) and not isinstance(default, bool) and _in_span(default, span):
        return default
    lo, hi, lo_open, hi_open = span
    integer = isinstance(v, int) or (isinstance(lo, int) and not isinstance(lo, bool))
    step = 1 if integer else (abs(lo) * 0.01 or 1e-3)
    below = not (isinstance(v, (int, float)) and math.isfinite(v)) or v <= lo
    if below:
        return lo + step if lo_open else lo
    return hi - step if hi_open else hi


def _range_problems(cfg: Any, code: str, keys: Iterable[str]) -> List[Problem]:
    out = []
    for key in keys:
        span, also, nullable, default = declared_ranges()[key]
        v = _get(cfg, key)
        integer = bool(declared_fields()[key].get("integer"))
        if v is KeyError or (isinstance(v, bool) and not integer) or (v is None and nullable) or _among(v, also):
            continue
        allowed = _span_text(span, also, nullable)
        if integer and (isinstance(v, bool) or not isinstance(v, int)):  # an `Any` field (int_or_auto): the type too
            out += _err(code, key, f"{key}={_shown(v)} must be an integer {allowed}",
                        _try(key, _valid_example(span, default, math.nan)))
            continue
        if isinstance(v, (int, float)) and _in_span(v, span):
            continue
        if isinstance(v, (int, float)) and v > span[1] and span[1] == schema.INT_MAX:
            allowed = f"at most {schema.INT_MAX}"
        shown = "null" if v is None else v
        out += _err(code, key, f"{key}={shown} must be {allowed}",
                    _try(key, _valid_example(span, default, v if isinstance(v, (int, float)) else math.nan)))
    return out


def _among(v: Any, allowed: Sequence[Any]) -> bool:
    """v is one of `allowed` by type and value (True is not 1, "1" is not 1)."""
    return any(type(v) is type(a) and v == a for a in allowed)


def _shown(v: Any) -> str:
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def _choice_problems(cfg: Any, code: str) -> List[Problem]:
    """Fields typed `Any` that take a few values (`schema.bool_or_auto`): one of them, by type."""
    out = []
    for key, meta in declared_fields().items():
        v = _get(cfg, key)
        if "choices" not in meta or v is KeyError or _among(v, meta["choices"]):
            continue
        names = [_shown(c) for c in meta["choices"]]
        out += _err(code, key, f"{key}={_shown(v)} must be {', '.join(names[:-1])} or {names[-1]}",
                    _try(key, _shown(meta["default"])))
    return out


@rule("config")
def value_in_range(cfg: Any, layout: Layout) -> List[Problem]:
    """Counts, sizes, rates and coefficients within the range their field declares in qwen35rl/config/schema.py
    (e.g. 0 < rollout.gpu_memory_utilization <= 1, algorithm.clip_ratio_c > 1); the `Any` fields that also take
    `auto` of their type (an integer, or true / false)."""
    return (_range_problems(cfg, "value_in_range", [k for k in declared_ranges() if k not in DEGREES])
            + _choice_problems(cfg, "value_in_range"))


# =========================================================================================== pass-through dicts
@rule("config")
def vllm_version_valid(cfg: Any, layout: Layout) -> List[Problem]:
    """`rollout.vllm_version` is `auto` or a release number: quirks and engine facts compare versions."""
    from qwen35rl.config import vllm_facts

    v = val(cfg, "rollout.vllm_version")
    if str(v) == vllm_facts.AUTO or vllm_facts.valid_version(v):
        return []
    return _err("vllm_version_valid", "rollout.vllm_version", f"rollout.vllm_version={_shown(v)} is not a vLLM "
                "release number", "set rollout.vllm_version=auto (the installed vLLM's) or a release such as 0.26.0")


@rule("config")
def megatron_core_version_valid(cfg: Any, layout: Layout) -> List[Problem]:
    """`backend.megatron_core_version` is a release the Megatron backend supports: its version facts (GDN packing
    and CP, expert gradients) are compared against it."""
    from qwen35rl.config import megatron_versions as mv
    from qwen35rl.config.vllm_facts import valid_version  # a release number, whichever package's

    if not _megatron_core(layout):
        return []
    v, oldest = val(cfg, "backend.megatron_core_version"), ".".join(map(str, mv.MIN_SUPPORTED))
    hint = f"set the cluster's megatron-core release, e.g. backend.megatron_core_version={oldest}.0 (pip show megatron-core)"
    if not valid_version(v):
        return _err("megatron_core_version_valid", "backend.megatron_core_version", f"backend.megatron_core_version="
                    f"{_shown(v) or repr('')} is not a megatron-core release number", hint)
    if quirks.version_tuple(v)[:2] < mv.MIN_SUPPORTED:
        return _err("megatron_core_version_valid", "backend.megatron_core_version", f"megatron-core {v} is older "
                    f"than {oldest}, the oldest the Qwen3.5 backend supports (GDN layers)", hint)
    return []


@rule("config")
def vllm_loads_rollout_checkpoint(cfg: Any, layout: Layout) -> List[Problem]:
    """vLLM releases before 0.27 load no text-only Qwen3.5 checkpoint (`Qwen3_5ForCausalLM`): the rollout then starts
    from the vision-language form, which a model without a vision tower (or a text-only model.path) cannot give."""
    from qwen35rl.config import vllm_facts

    version = vllm_facts.version_of(cfg)
    if not _vllm(cfg) or version is None:
        return []
    install = vllm_facts.installed_vllm()
    same = install is not None and vllm_facts.version_tuple(install.version) == vllm_facts.version_tuple(version)
    if vllm_facts.loads_text_checkpoint(version, install if same else None):
        return []
    path = _get(cfg, "model.path", None)
    if _get(cfg, "model.init", "pretrained") == "pretrained" and path:
        archs = _checkpoint_architectures(str(path))
        if archs and not any(a.endswith("ForConditionalGeneration") for a in archs):
            return _err("vllm_loads_rollout_checkpoint", "model.path", f"model.path={str(path)!r} is a text-only "
                        f"checkpoint ({', '.join(archs)}), which vLLM {version} does not load (its Qwen3.5 classes "
                        f"are the vision-language ones; text-only checkpoints load from "
                        f"{vllm_facts.TEXT_CHECKPOINT_FROM})", "use the vision-language checkpoint of this model "
                        f"(text data runs it without images), vLLM >= {vllm_facts.TEXT_CHECKPOINT_FROM}, or rollout=hf")
        return []
    if _get(cfg, "model.vision", None) is None:
        return _err("vllm_loads_rollout_checkpoint", "model", f"model={val(cfg, 'model.name')} has no vision "
                    f"tower, and vLLM {version} loads only the vision-language form of a Qwen3.5 checkpoint",
                    f"pick a model with a vision tower (e.g. model=qwen3_5_tiny_vl), vLLM >= "
                    f"{vllm_facts.TEXT_CHECKPOINT_FROM}, or rollout=hf")
    return []


def _checkpoint_architectures(path: str) -> List[str]:
    """`architectures` of the checkpoint's config.json here ([] where it cannot be read)."""
    import json

    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            archs = json.load(f).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return []
    return [str(a) for a in archs] if isinstance(archs, list) else []


@rule("config")
def vllm_prefix_caching_on_gdn(cfg: Any, layout: Layout) -> List[Problem]:
    """`rollout.enable_prefix_caching` on Qwen3.5's hybrid GDN layers: the plan states what the vLLM found does
    (`vllm_facts.gdn_prefix_caching`); its 'align' mode needs chunked prefill (vLLM asserts it at start-up)."""
    from qwen35rl.config import vllm_facts

    version = vllm_facts.version_of(cfg)
    if not _vllm(cfg) or not val(cfg, "rollout.enable_prefix_caching") or version is None:
        return []
    install = vllm_facts.installed_vllm()
    mode = vllm_facts.gdn_prefix_caching(version, install)
    key = "rollout.enable_prefix_caching"
    if mode == "align" and not val(cfg, "rollout.enable_chunked_prefill"):
        return _err("vllm_prefix_caching_on_gdn", key, f"vLLM {version} caches the GDN layers' prefix state only in "
                    "its 'align' mode, which needs chunked prefill (the engine start fails without it)",
                    "set rollout.enable_chunked_prefill=true, or rollout.enable_prefix_caching=false")
    what = {"align": "in its experimental 'align' mode: the GDN state is cached only where a scheduler step ends "
                     "on a block boundary, so the n samples of a prompt share less of their prefill than a "
                     "transformer's would",
            "all": "in its 'all' mode (the GDN state at every block boundary)"}.get(
        mode, "in a way not known here for this release (no vLLM of it installed)")
    return [Problem("vllm_prefix_caching_on_gdn", key, f"vLLM {version} caches prefixes of Qwen3.5's GDN layers "
                    f"{what}", "rollout.enable_prefix_caching=false skips it (the default)", WARNING)]


@rule("config")
def engine_kwargs_known(cfg: Any, layout: Layout) -> List[Problem]:
    """`rollout.engine_kwargs` keys are vLLM EngineArgs fields (a typo would fail only on the cluster), whatever
    engine this run picks (the same overrides often go to a vLLM run next): the installed vLLM's own fields when it
    is the configured version, else the names qwen35rl knows from 0.11 - 0.32."""
    from qwen35rl.config import vllm_facts

    install, version = vllm_facts.installed_vllm(), vllm_facts.version_of(cfg)
    if install is not None and (version is None
                                or vllm_facts.version_tuple(install.version) != vllm_facts.version_tuple(version)):
        install = None
    names, origin = vllm_facts.engine_arg_names(install)
    out = []
    for key in val(cfg, "rollout.engine_kwargs") or {}:
        if key not in names:
            out += _err("engine_kwargs_known", f"rollout.engine_kwargs.{key}", f"'{key}' is not a vLLM engine "
                        f"argument (checked against {origin})", did_you_mean(key, names)
                        or "see vllm.engine.arg_utils.EngineArgs for the names")
    return out


def _owned(section: str, key: str, owner: str) -> List[Problem]:
    if " " in owner:  # not a config key: the launcher decides it
        return _err(f"{section.split('.')[-1]}_not_owned", f"{section}.{key}", f"'{key}' is set by qwen35rl: {owner}",
                    f"remove {section}.{key}")
    return _err(f"{section.split('.')[-1]}_not_owned", f"{section}.{key}", f"'{key}' is set by qwen35rl from {owner}",
                f"remove it and set {owner} instead")


@rule("config")
def engine_kwargs_not_owned(cfg: Any, layout: Layout) -> List[Problem]:
    """Engine arguments qwen35rl derives from its own config are set there, once."""
    out = []
    for key in val(cfg, "rollout.engine_kwargs") or {}:
        if key in known_keys.VLLM_OWNED:
            out += _owned("rollout.engine_kwargs", key, known_keys.VLLM_OWNED[key])
    return out


@rule("config")
def transformer_overrides_known(cfg: Any, layout: Layout) -> List[Problem]:
    """`backend.transformer_overrides` keys are megatron-core TransformerConfig fields."""
    if not _megatron_core(layout):
        return []
    out = []
    for key in val(cfg, "backend.transformer_overrides") or {}:
        if key not in known_keys.MEGATRON_TRANSFORMER_CONFIG:
            out += _err("transformer_overrides_known", f"backend.transformer_overrides.{key}", f"'{key}' is not a "
                        "megatron-core TransformerConfig field", did_you_mean(key, known_keys.MEGATRON_TRANSFORMER_CONFIG)
                        or "see megatron/core/transformer/transformer_config.py for the names")
    return out


@rule("config")
def transformer_overrides_not_owned(cfg: Any, layout: Layout) -> List[Problem]:
    """TransformerConfig fields qwen35rl derives (architecture, layout, engine knobs) are set at their source."""
    if not _megatron_core(layout):
        return []
    out = []
    for key in val(cfg, "backend.transformer_overrides") or {}:
        if key in known_keys.MEGATRON_OWNED:
            out += _owned("backend.transformer_overrides", key, known_keys.MEGATRON_OWNED[key])
    return out


@rule("config")
def compile_decode_is_hf_only(cfg: Any, layout: Layout) -> List[Problem]:
    """rollout.compile_decode compiles the hf engine's decode step (the specs' `compiles_decode`); vLLM compiles
    by its own configuration."""
    engine = val(cfg, "rollout.engine")
    if engine_specs.rollout_engine(engine).compiles_decode or not val(cfg, "rollout.compile_decode"):
        return []
    takers = ", ".join(n for n, s in engine_specs.ROLLOUT_ENGINES.items() if s.compiles_decode)
    return [Problem("compile_decode_is_hf_only", "rollout.compile_decode", f"rollout.compile_decode applies to "
                    f"rollout.engine={takers}; rollout.engine={engine} ignores it",
                    "remove rollout.compile_decode; vLLM takes rollout.engine_kwargs.compilation_config", WARNING)]


@rule("config")
def quirk_overridden(cfg: Any, layout: Layout) -> List[Problem]:
    """A user value for a key a platform quirk sets wins over the quirk: warn, with the quirk's reason."""
    if not _vllm(cfg):
        return []
    user = val(cfg, "rollout.engine_kwargs") or {}
    out = []
    for q in quirks.applying_quirks(cfg):
        if q["key"] in user and user[q["key"]] != q["value"]:
            out.append(Problem("quirk_overridden", f"rollout.engine_kwargs.{q['key']}", f"{q['key']}={user[q['key']]!r} "
                               f"replaces the {val(cfg, 'hw.name')} quirk {q['key']}={q['value']!r} for vLLM "
                               f"{val(cfg, 'rollout.vllm_version')} (< {q.get('below_version')}): {q['why']}",
                               f"remove rollout.engine_kwargs.{q['key']} unless you know the quirk no longer applies",
                               WARNING))
    return out


# ================================================================================================= architecture
# Overrides can make any model.* value: what no Qwen3.5 checkpoint (and no engine) can be is refused here, before
# the engines build it (they would fail deep inside, or route, rotate or embed wrongly without failing).
def _gqa_problems(m: Dict[str, Any]) -> List[Problem]:
    out = []
    heads, kv = int(m["num_attention_heads"]), int(m["num_key_value_heads"])
    if heads % kv:
        best = _nearest(kv, _divisors(heads))
        out += _err("architecture_consistent", "model.num_key_value_heads", f"{kv} KV heads do not divide the "
                    f"{heads} attention heads (grouped-query attention shares each KV head among whole groups)",
                    _try("model.num_key_value_heads", best))
    nk, nv = int(m["linear_num_key_heads"]), int(m["linear_num_value_heads"])
    if nv % nk:
        out += _err("architecture_consistent", "model.linear_num_value_heads", f"{nv} GDN value heads are not a "
                    f"multiple of the {nk} GDN key heads (model.linear_num_key_heads)",
                    _try("model.linear_num_value_heads", max(nk, nv // nk * nk)))
    return out


def _expert_problems(m: Dict[str, Any]) -> List[Problem]:
    if not m["moe"]:
        return []
    experts, top_k = int(m["num_experts"]), int(m["num_experts_per_tok"])
    if experts < 1:
        return _err("architecture_consistent", "model.num_experts", "an MoE model (model.moe=true) with no experts",
                    "set model.num_experts, or pick a dense model (model.moe=false)")
    if not 1 <= top_k <= experts:
        return _err("architecture_consistent", "model.num_experts_per_tok", f"each token is routed to {top_k} "
                    f"experts, but the router picks among {experts} (model.num_experts), at least one",
                    _try("model.num_experts_per_tok", min(max(top_k, 1), experts)))
    return []


def _rope_problems(m: Dict[str, Any]) -> List[Problem]:
    section = [int(x) for x in m["mrope_section"] or []]
    rotary = float(m["head_dim"]) * float(m["partial_rotary_factor"])
    if rotary != int(rotary) or int(rotary) % 2:
        return _err("architecture_consistent", "model.partial_rotary_factor", f"head_dim {m['head_dim']} x "
                    f"partial_rotary_factor {m['partial_rotary_factor']} = {rotary:g} rotary dimensions, not an even "
                    "whole number", "choose them so that head_dim * partial_rotary_factor is even")
    half = int(rotary) // 2
    if len(section) != 3 or min(section) < 0 or sum(section) != half:
        even = [half - 2 * (half // 3), half // 3, half // 3]
        return _err("architecture_consistent", "model.mrope_section", f"M-RoPE sections {section} must be three "
                    f"(temporal, height, width) summing to the {half} rotary frequency pairs (head_dim "
                    f"{m['head_dim']} x partial_rotary_factor {m['partial_rotary_factor']} / 2)",
                    f"try model.mrope_section=[{','.join(map(str, even))}]")
    return []


def tokenizer_size(m: Dict[str, Any]) -> Optional[Tuple[int, str]]:
    """(ids the tokenizer `model.tokenizer` uses, which one) where that is known without loading it: the byte
    tokenizer's, the Qwen3.5 specials' highest id, or a directory's tokenizer.json."""
    from qwen35rl.config.special_tokens import NUM_BYTES, QWEN_SPECIAL_IDS, SPECIAL_TOKENS

    kind = str(m["tokenizer"])
    if kind == "byte":
        return NUM_BYTES + len(SPECIAL_TOKENS), "the byte tokenizer"
    if kind == "qwen":
        return max(QWEN_SPECIAL_IDS.values()) + 1, "the Qwen3.5 tokenizer (its special tokens)"
    folder = m.get("path") if kind == "checkpoint" else kind
    found = os.path.join(str(folder), "tokenizer.json") if folder else ""
    if not found or not os.path.isfile(found):
        return None
    size = _tokenizer_json_size(found, os.stat(found).st_mtime_ns)
    return (size, found) if size else None


@functools.lru_cache(maxsize=8)
def _tokenizer_json_size(path: str, mtime_ns: int) -> int:
    """Token ids a tokenizer.json uses (0: unreadable, the loader says why). Cached: the layout search asks often."""
    import json

    try:
        with open(path, encoding="utf-8") as f:
            tree = json.load(f)
        ids = list(((tree.get("model") or {}).get("vocab") or {}).values())
        ids += [t["id"] for t in tree.get("added_tokens") or []]
        return max(int(i) for i in ids) + 1
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return 0


def _vocab_problems(m: Dict[str, Any]) -> List[Problem]:
    size = tokenizer_size(m)
    if size is None or int(m["vocab_size"]) >= size[0]:
        return []
    return _err("architecture_consistent", "model.vocab_size", f"{m['vocab_size']} embedding rows, but "
                f"{size[1]} uses token ids up to {size[0] - 1}", _try("model.vocab_size", size[0]))


@rule("config")
def architecture_consistent(cfg: Any, layout: Layout) -> List[Problem]:
    """Heads, experts, rotary sections and the vocabulary agree with each other and with the tokenizer."""
    m = val(cfg, "model")
    return _gqa_problems(m) + _expert_problems(m) + _rope_problems(m) + _vocab_problems(m)


# ======================================================================================================= memory
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


# ========================================================================================================= entry
GATES = ("engine_known", "degrees_positive", "value_in_range")
"""Rules that run first, whatever the scopes: while they find a value out of its range no other rule runs (the
other rules, the layout search and the memory model compute with these values)."""


def gate_problems(cfg: Any, layout: Optional[Layout] = None) -> List[Problem]:
    """The out-of-range values (an empty list: the config's numbers are safe to compute with)."""
    return engine_known(cfg, layout) + degrees_positive(cfg, layout) + value_in_range(cfg, layout)


def run_rules(cfg: Any, layout: Layout, scopes: Iterable[str] = SCOPES, stop_at_error: bool = False,
              skip: Sequence[Rule] = (), errors_only: bool = False) -> List[Problem]:
    """Problems of the rules in `scopes` (minus `skip`). The other rules are skipped while a value is out of range."""
    wanted = set(scopes)
    if layout is not None and layout.split and min(layout.world, layout.rollout_world) < 1:
        wanted &= {"config"}  # an empty pool: split_pool_sizes says so, no layout rule computes over it
    gates = [(scope, fn) for scope, fn in RULES if fn.__name__ in GATES]
    out: List[Problem] = []
    for scope, fn in gates + [r for r in RULES if r[1].__name__ not in GATES]:
        if fn.__name__ in GATES:
            found = fn(cfg, layout)
            if found:
                wanted = set()
            if "config" not in scopes or fn in skip:
                found = []
        elif scope not in wanted or fn in skip:
            continue
        else:
            found = fn(cfg, layout)
        if errors_only:
            found = [p for p in found if p.severity == ERROR]
        out += found
        if stop_at_error and any(p.severity == ERROR for p in found):
            break
    return out


def check_all(cfg: Any, layout: Layout) -> List[Problem]:
    """Every rule's problems for `cfg` (a resolved DictConfig or plain dict tree) and its derived layout."""
    return run_rules(memory.as_tree(cfg), layout)


# ============================================================================ names, paths, packages (before launch)
TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
BUILTIN_TOKENIZERS = ("checkpoint", "byte", "qwen")
RAY_ADDRESS = re.compile(r"^(auto|(ray://)?[A-Za-z0-9]([A-Za-z0-9.\-]*[A-Za-z0-9])?:\d{1,5})$")
NAME_MAX = 255
"""Bytes per file-name component on common file systems."""


def is_local_run(cfg: Any) -> bool:
    """The run executes on this machine, so its files are this machine's files and a missing path is an error here:
    no Ray cluster to join (ray_address null, RAY_ADDRESS unset) and either trainer.launcher=local or a CPU target
    (a local Ray cluster of this host). A GPU/NPU target is usually planned on a login node: warnings there, and
    the preflight checks every node."""
    if _get(cfg, "ray_address", None) not in (None, "") or os.environ.get("RAY_ADDRESS"):
        return False
    return launcher_of(cfg) == "local" or _get(cfg, "hw.device", "cpu") == "cpu"


def _find_module(name: str) -> bool:
    """Whether `a.b.c` is importable, without importing anything (not even the parent packages)."""
    import sys
    from importlib.machinery import PathFinder

    if name.rpartition(".")[0] in sys.modules:  # the parent is imported already (os.path): nothing new is imported
        try:
            return importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            return False
    path = None
    for i, part in enumerate(name.split(".")):
        if not part.isidentifier():
            return False
        spec = importlib.util.find_spec(part) if i == 0 else PathFinder.find_spec(part, path)
        if spec is None:
            return False
        path = spec.submodule_search_locations
        if path is None and i < len(name.split(".")) - 1:
            return False
    return True


def _data_file_hint(path: str, key: str, data_name: Any) -> str:
    """The way to the missing data file: the `qwen35rl-data prepare` command that writes it, when it is one."""
    from qwen35rl.config.datasets import prepare_command

    command = prepare_command(path, None if data_name is None else str(data_name))
    if command:
        return f"{command} (README: Data); or fix the path, or remove it from {key}"
    return (f"fix the path, or remove it from {key}; for GSM8K or Geometry3K, `qwen35rl-data prepare gsm8k|geo3k "
            "--out DIR` writes DIR/<name>/train.parquet and test.parquet (README: Data)")


def path_findings(cfg: Any) -> List[Tuple[str, str, str, str]]:
    """(code, key, message, hint) for each file-system fact this machine contradicts: tokenizer and checkpoint
    directories, local data files, the output root and a resume directory. The plan reports them (errors when the
    run is local); the preflight's node probe runs the same function on every node."""
    out: List[Tuple[str, str, str, str]] = []
    tok, path, init = str(_get(cfg, "model.tokenizer", "checkpoint")), _get(cfg, "model.path", None), \
        _get(cfg, "model.init", "pretrained")
    if tok not in BUILTIN_TOKENIZERS and not os.path.isdir(tok):
        out.append(("tokenizer_dir_missing", "model.tokenizer", f"model.tokenizer={tok!r} is neither a built-in "
                    f"tokenizer ({', '.join(BUILTIN_TOKENIZERS)}) nor a directory here",
                    did_you_mean(tok, BUILTIN_TOKENIZERS) or "give a tokenizer directory, or model.tokenizer=byte"))
    if path is not None and init == "pretrained" and "://" not in str(path) and not os.path.isdir(str(path)):
        hint = "give the Hugging Face checkpoint directory, or model.init=random"
        if re.fullmatch(r"[\w.-]+/[\w.-]+", str(path)) and not str(path).startswith("."):
            name = str(path).split("/")[1]
            hint = (f"give the checkpoint directory; if '{path}' is a Hugging Face hub id, qwen35rl does not fetch it "
                    f"(the nodes need not reach the hub): `huggingface-cli download {path} --local-dir "
                    f"/shared/models/{name}` where the nodes can read it, then model.path=/shared/models/{name}")
        out.append(("checkpoint_dir_missing", "model.path", f"model.init=pretrained loads model.path={path!r}, "
                    "which is not a directory here", hint))
    for key in ("data.train_files", "data.val_files"):
        for f in _get(cfg, key, None) or []:
            if "://" not in str(f) and not os.path.exists(str(f)):
                out.append(("data_file_missing", key, f"{key} lists {str(f)!r}, which does not exist here",
                            _data_file_hint(str(f), key, _get(cfg, "data.name", None))))
    root = str(_get(cfg, "trainer.output_root", "runs"))
    probe = os.path.abspath(root)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        what = "is not a directory" if os.path.exists(probe) and not os.path.isdir(probe) else "is not writable"
        out.append(("output_root_unwritable", "trainer.output_root", f"trainer.output_root={root!r}: {probe} {what}",
                    "try trainer.output_root=runs (a directory you can write)"))
    resume = str(_get(cfg, "trainer.resume", "auto"))
    if resume not in ("auto", "never", "force") and not os.path.isfile(os.path.join(resume, "meta.json")):
        out.append(("resume_not_a_checkpoint", "trainer.resume", f"trainer.resume={resume!r} is neither auto, never, "
                    "force nor a finished checkpoint directory here (one with meta.json)",
                    did_you_mean(resume, ("auto", "never", "force")) or "try trainer.resume=auto"))
    reward = str(_get(cfg, "data.reward", "exact_match"))
    verl = parse_verl_reward(reward)
    if verl is not None:
        out += _verl_reward_findings(reward, *verl)
    elif ":" in reward and reward not in REWARDS:
        module = reward.partition(":")[0]
        if reward_is_file(module):
            if not os.path.isfile(module):
                out.append(("reward_not_importable", "data.reward", f"data.reward={reward!r}: the file {module} "
                            "does not exist here", "give an existing .py file, or a pkg.module:function path"))
        elif not _find_module(module):
            out.append(("reward_not_importable", "data.reward", f"data.reward={reward!r}: module {module!r} is not "
                        "importable here", "install the package that provides it (pip install ...), or set "
                        "PYTHONPATH; e.g. data.reward=exact_match"))
    return out


def _verl_reward_findings(reward: str, target: str, name: str) -> List[Tuple[str, str, str, str]]:
    """A verl-signature reward (`data.reward=verl:FILE.py:FUNCTION`, verl's custom_reward_function): the file
    exists and defines the function at module level, read without running it (user code may import anything)."""
    if not reward_is_file(target):
        if _find_module(target):
            return []
        return [("reward_not_importable", "data.reward", f"data.reward={reward!r}: module {target!r} is not "
                 "importable here", "install the package that provides it, or give verl's file: "
                 "data.reward=verl:path/to/file.py:compute_score")]
    if not os.path.isfile(target):
        return [("reward_not_importable", "data.reward", f"data.reward={reward!r} (verl's "
                 f"custom_reward_function.path): the file {target} does not exist here", "give the existing .py "
                 "file that defines the function: data.reward=verl:path/to/file.py:compute_score")]
    defined = _defines(target, name)
    if defined is None or defined:
        return []
    return [("reward_function_missing", "data.reward", f"data.reward={reward!r} (verl's "
             f"custom_reward_function.name): {target} defines no function {name!r} at module level",
             f"name a function the file defines: data.reward=verl:{target}:FUNCTION (verl's default name is "
             f"compute_score)")]


def _defines(path: str, name: str) -> Optional[bool]:
    """Whether the Python file binds `name` at module level (def, class, assignment, import); None when that
    cannot be told without running it (a star import, a file that does not parse or read)."""
    import ast

    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    return None
                if (alias.asname or alias.name.split(".")[0]) == name:
                    return True
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            if any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(t)):
                return True
        if isinstance(node, (ast.If, ast.Try, ast.With)):  # a definition inside a guard: not told statically
            if any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name for n in ast.walk(node)):
                return True
    return False


@rule("config")
def model_path_missing(cfg: Any, layout: Layout) -> List[Problem]:
    """model.init=pretrained needs model.path (the checkpoint to load): an error for a run on this machine; a
    warning for a run planned for a cluster (qwen35rl-train refuses it before launch either way)."""
    if _get(cfg, "model.init", "pretrained") != "pretrained" or _get(cfg, "model.path", None) not in (None, ""):
        return []
    return [Problem("model_path_missing", "model.path", "model.init=pretrained needs the checkpoint directory, "
                    "and model.path is null", "set model.path=/path/to/hf/checkpoint, or model.init=random",
                    ERROR if is_local_run(cfg) else WARNING)]


@rule("config")
def paths_exist(cfg: Any, layout: Layout) -> List[Problem]:
    """Tokenizer/checkpoint directories, data files, the output root, a resume directory and a custom reward's
    module, on this machine: errors for a local run; for a run on a cluster, warnings (a login node need not see the
    cluster's storage; the preflight checks them on every node)."""
    local = is_local_run(cfg)
    out = []
    for code, key, message, hint in path_findings(cfg):
        if not local:
            message += " (the run joins a Ray cluster: its nodes' preflight checks this there)"
        out.append(Problem("paths_exist", key, f"{message} [{code}]", hint, ERROR if local else WARNING))
    return out


@rule("config")
def data_unusable(cfg: Any, layout: Layout) -> List[Problem]:
    """The first rows of every data file here read as the run reads them (`data_check`: file type, columns, nulls,
    images, <image> placeholders; verl's preprocessed parquet is read too): a file that cannot make prompts is
    refused before launch, a bad row too unless data.skip_bad_rows=true (then a warning)."""
    from qwen35rl.config import data_check

    return data_check.problems(cfg)


@rule("config")
def names_valid(cfg: Any, layout: Layout) -> List[Problem]:
    """Trackers, the run name, ray_address and the optimizer's betas."""
    out = []
    trackers = [str(t) for t in _get(cfg, "trainer.trackers", None) or []]
    for t in trackers:
        if t not in TRACKERS:
            out += _err("names_valid", "trainer.trackers", f"trainer.trackers lists {t!r}, which is not one of "
                        f"{', '.join(TRACKERS)}", did_you_mean(t, TRACKERS) or "try trainer.trackers=[console,jsonl]")
        elif t in TRACKER_PACKAGES and importlib.util.find_spec(TRACKER_PACKAGES[t]) is None:
            # the driver builds the trackers: a plan on a login node without them only warns; train refuses
            out.append(Problem("names_valid", "trainer.trackers", f"trainer.trackers lists {t!r} but the "
                               f"{TRACKER_PACKAGES[t]} package is not installed here", f"pip install "
                               f"{TRACKER_PACKAGES[t]} (or pip install 'qwen35rl[trackers]'), or drop {t!r} from "
                               "trainer.trackers", ERROR if is_local_run(cfg) else WARNING))
    name = str(_get(cfg, "trainer.run_name", "run"))
    size = len(name.encode("utf-8", "surrogatepass"))
    if not name or name in (".", "..") or "/" in name or "\0" in name or size > NAME_MAX:
        why = (f"is {size} bytes; a file name holds at most {NAME_MAX}" if size > NAME_MAX else
               "contains '/'" if "/" in name else "is not a usable directory name")
        out += _err("names_valid", "trainer.run_name", f"trainer.run_name names the run directory and {why}",
                    f"try trainer.run_name={re.sub(r'[^A-Za-z0-9._-]', '-', name)[:64].strip('.') or 'run'}")
    addr = _get(cfg, "ray_address", None)
    if addr not in (None, "") and not RAY_ADDRESS.match(str(addr)):
        out += _err("names_valid", "ray_address", f"ray_address={str(addr)[:80]!r} is not null, 'auto', "
                    "'host:port' or 'ray://host:port'", "e.g. ray_address=auto or ray_address=10.0.0.1:6379")
    elif addr not in (None, "", "auto") and not 0 < int(str(addr).rsplit(":", 1)[1]) < 65536:
        out += _err("names_valid", "ray_address", f"ray_address={addr!r}: the port is outside 1-65535",
                    "e.g. ray_address=10.0.0.1:6379")
    betas = _get(cfg, "backend.betas", None)
    if betas is not None:
        b = list(betas)
        if len(b) != 2 or not all(isinstance(x, (int, float)) and 0 <= x < 1 for x in b):
            out += _err("names_valid", "backend.betas", f"backend.betas={b} must be two numbers in [0, 1) "
                        "(Adam's beta1, beta2)", "try backend.betas=[0.9,0.999]")
    return out
