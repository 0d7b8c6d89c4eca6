"""The training layout: the engines are known, the parallel degrees are positive and belong to the
training engine, and TP/PP/CP/EP/ETP (Megatron) or SP and the FSDP size (FSDP) fit the world, the attention, KV and
GDN heads, the experts and the layers."""
from __future__ import annotations

import math
from typing import Any, List

from qwen35rl.config import engine_specs
from qwen35rl.config.layout import Layout, even_pipeline_layout, format_pipeline_layout, parse_pipeline_layout
from qwen35rl.config.problems import Problem
from qwen35rl.config.rules.declared import DEGREES, _range_problems, declared_ranges
from qwen35rl.config.rules.registry import (_divisors, _err, _model_parallel, _moe, _nearest, _reads, _try, rule,
                                            val)
from qwen35rl.names import did_you_mean


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
