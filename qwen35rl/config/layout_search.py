"""`parallelism=auto`: enumerate every valid layout, drop the ones the rules reject or that do not fit, rank the
rest by a transparent cost model.

Search space (powers of two):
- megatron: training TP, PP, CP, EP (<= experts), ETP (<= TP), even pipeline splits only (an uneven split needs a
  hand-written `parallelism.pipeline_layout`); rollout TP with DP = world/TP, and for MoE models one
  DP-attention engine of TP*DP devices with EP = TP*DP;
- fsdp: fsdp_size and Ulysses SP; rollout TP with DP = world/TP.
Training options are checked once with the `train` rules, rollout options once with the `rollout` rules, and
each pair with the memory rules (the same functions `rules.check_all` runs).

Cost model: the estimated seconds of one RL step, lower is better, from nominal constants (below) - only the
ranking matters, not the absolute time. The score is those seconds times the headroom penalty: its unit is
`SCORE_UNIT`, seconds per RL step (the plan's `cost.score_unit`), comparable between layouts of one config, not a
measured time:
- compute  = 6 * tokens per step * (active params of the busiest pipeline rank, incl. the output layer, x PP)
             (* 4/3 with full recompute) / (world * hw.peak_tflops * MFU)
- bubble   = compute * b / (1 - b), b = (pp - 1) / (m + pp - 1), m = micro batches per mini batch per DP rank
- comm     = bytes each device moves per step / link bandwidth (NVLink/HCCS inside a node, the NIC across nodes),
             no overlap assumed: TP (sequence parallel: 4 all-gathers/reduce-scatters of the hidden states per
             layer, forward and backward), ETP (the same on the dispatched tokens of MoE layers), CP (K/V of
             full-attention layers, GDN head all-to-all), EP (token dispatch + combine per MoE layer), PP
             (activations across stage boundaries), DP (distributed optimizer: gradient reduce-scatter + parameter
             all-gather per optimizer step; FSDP: two all-gathers and a reduce-scatter per micro batch, HSDP
             replicas all-reduce), Ulysses SP (all-to-all of q/k/v/out per layer);
- offload  = host<->device copies over PCIe (offloaded parameters/gradients per micro batch or per phase) and the
             CPU optimizer step over the offloaded states;
- rollout  = decode steps * (the device's weight bytes / HBM bandwidth + collective latency per layer), decode
             steps = response length * waves, waves = sequences per attention replica / concurrent sequences
             (min of max_num_seqs and what the KV cache holds);
- memory headroom: score * (1 + 0.5 * (0.1 - headroom) / 0.1) when less than 10% of the device stays free.
The training part depends on the training layout only and the rollout part on the rollout layout only, so the
search computes each once per option.

With `placement=split` the two pools have their own devices: training options are laid out on the training pool
and rollout options on the rollout pool, and with `placement.rollout_devices` null the pool sizes are searched too
(`pool_size_options`: every split of one node's devices; across nodes, whole nodes per pool), each size with its
own training and rollout options, all ranked together. The training part's compute then runs on the training
pool only and the rollout part's schedulers on the rollout pool only; with `algorithm.max_staleness` >= 1 the
pools work at the same time, so a step takes the longer of the two parts instead of their sum (the weight sync
between pools is not counted). `apply` sets the chosen `placement.rollout_devices`.

With `backend.micro_batch_size_per_device=auto` / `backend.gradient_checkpointing=auto` the search picks them per
training option (`auto_batch.choose`, beside the rollout layout the training options are probed with: TP1, the
largest rollout weights per device; each pairing's fit is checked again), before that option's memory and cost:
a layout is ranked at its own best setting (recompute's extra compute, its micro batch count for the bubble and
FSDP's gathers), which choosing after the search, for the winner only, would not see; and a layout that fits
only with checkpointing or a small micro batch is not dropped. The layout rules check each option at the smallest
setting (micro 1, checkpointing on): every micro batch a choice may take divides the batches as 1 does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, Dict, Iterator, List, Optional, Tuple

from omegaconf import DictConfig, OmegaConf

from qwen35rl.config import auto_batch, log_prob_fit
from qwen35rl.config import memory as M
from qwen35rl.config import params as P
from qwen35rl.config import rules as R
from qwen35rl.config.engine_specs import TRAIN_ENGINES, declared, train_engine
from qwen35rl.config.layout import Layout, derive_layout, is_split, placement, pool_sizes
from qwen35rl.config.problems import ERROR
from qwen35rl.config.tree import at

MFU = 0.35
"""Fraction of hw.peak_tflops the trainer reaches."""
INTRA_NODE_GBPS = 100.0
"""GB/s per device inside a node (NVLink / HCCS)."""
INTER_NODE_GBPS = 25.0
"""GB/s per device across nodes (one 200 Gb/s NIC per device)."""
HBM_GBPS = 1500.0
"""GB/s of device memory: a decode step reads the device's weights once."""
LATENCY_S = 20e-6
"""Latency of one small collective inside a node (x4 across nodes)."""
PCIE_GBPS = 25.0
"""GB/s between host and device memory."""
HOST_ADAM_GBPS = 10.0
"""GB/s of optimizer state a CPU Adam step sweeps per device (reads and writes)."""
MIN_HEADROOM, HEADROOM_PENALTY = 0.10, 0.5
SCORE_UNIT = "s/step"
"""The score's unit: estimated seconds of one RL step (training + rollout), times the headroom penalty."""


@dataclass
class Candidate:
    layout: Layout
    score: float
    """Estimated seconds per RL step with the headroom penalty (`SCORE_UNIT`; lower is better)."""
    memory: M.MemoryEstimate
    overrides: List[str]
    """Command-line overrides that select this layout, e.g. ["parallelism.tp=2", ...]."""
    cost: Dict[str, float] = field(default_factory=dict)
    """The cost model's components (seconds) and inputs."""
    settings: Dict[str, Any] = field(default_factory=dict)
    """The same as `overrides`, as dotted key -> value."""
    batch: Optional[auto_batch.Choice] = None
    """What the `auto` micro batch / checkpointing resolved to for this layout (None: neither is auto)."""
    variant: Dict[str, Any] = field(default_factory=dict)
    """The trainer settings `backend_variants` changed for this candidate ({}: the config's own)."""

    def to_dict(self) -> Dict[str, Any]:
        out = {"score": round(self.score, 4), "score_unit": SCORE_UNIT, "overrides": list(self.overrides),
               "train": self.layout.train_dict(),
               "rollout": self.layout.rollout_dict(), "memory_gib": self.memory.to_dict(),
               "cost": {k: round(v, 4) for k, v in self.cost.items()},
               "auto_batch": None if self.batch is None else self.batch.to_dict()}
        if self.layout.split:
            out["pools"] = {"training": self.layout.world, "rollout": self.layout.rollout_world}
        return out


# ------------------------------------------------------------------------------------------------- the space
def _pow2_upto(n: int) -> List[int]:
    return [2 ** i for i in range(int(math.log2(n)) + 1)] if n >= 1 else []


def train_options(cfg: Any, world: int) -> Iterator[Dict[str, Any]]:
    """Training degrees to try (parallelism.* values)."""
    fixed = {"vpp": None, "pipeline_layout": None}
    if not train_engine(cfg).model_parallel:
        for f in _pow2_upto(world):
            for sp in _pow2_upto(world):
                yield {**fixed, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "etp": 1, "fsdp_size": f, "sp": sp}
        return
    experts = int(cfg["model"]["num_experts"]) if cfg["model"]["moe"] else 1
    cp_max = train_engine(cfg).degree_limit("cp") or world
    for tp in _pow2_upto(world):
        for cp in _pow2_upto(min(world // tp, cp_max)):
            for pp in _pow2_upto(world // (tp * cp)):
                stage_world = world // pp
                for ep in _pow2_upto(min(stage_world, experts)):
                    for etp in _pow2_upto(min(tp, stage_world // ep)):
                        yield {**fixed, "tp": tp, "pp": pp, "cp": cp, "ep": ep, "etp": etp, "fsdp_size": -1, "sp": 1}


def rollout_options(cfg: Any, world: int) -> Iterator[Dict[str, int]]:
    """Rollout degrees to try (parallelism.rollout.* values)."""
    dp_attention = train_engine(cfg).expert_parallel_rollout and bool(cfg["model"]["moe"])
    for tp in _pow2_upto(world):
        yield {"tp": tp, "dp": world // tp, "ep": 1}
        if dp_attention:
            for dp in _pow2_upto(world // tp):
                if tp * dp > 1:
                    yield {"tp": tp, "dp": dp, "ep": tp * dp}


def _with(tree: Dict[str, Any], train: Dict[str, Any], rollout: Dict[str, int]) -> Dict[str, Any]:
    par = {**tree["parallelism"], **train, "rollout": dict(rollout)}
    return {**tree, "parallelism": par}


def pool_size_options(cfg: Any) -> List[int]:
    """Rollout-pool sizes to try with placement=split: the one placement.rollout_devices sets (none when it is
    outside 1 .. devices - 1: `split_pool_sizes` reports it), else every size from 1 to devices - 1 on one node and
    whole nodes (1 .. nodes - 1 of them) across nodes."""
    nodes, per_node = int(cfg["hw"]["nodes"]), int(cfg["hw"]["devices_per_node"])
    devices = nodes * per_node
    fixed = placement(cfg)["rollout_devices"]
    if fixed is not None:
        ok = isinstance(fixed, int) and not isinstance(fixed, bool) and 1 <= fixed <= devices - 1
        return [int(fixed)] if ok else []
    if nodes == 1:
        return list(range(1, devices))
    return [k * per_node for k in range(1, nodes)]


def _with_pool(tree: Dict[str, Any], rollout_devices: int) -> Dict[str, Any]:
    return {**tree, "placement": {**tree["placement"], "rollout_devices": rollout_devices}}


_MEMORY_RULES = (R.train_memory_fits, R.log_prob_memory_fits, R.rollout_memory_fits)


def _layout_problems(tree: Dict[str, Any], layout: Layout, scope: str) -> bool:
    """True when a rule of `scope` (memory aside: the search assembles it per pair) reports an error."""
    return bool(R.run_rules(tree, layout, [scope], stop_at_error=True, skip=_MEMORY_RULES, errors_only=True))


def best_pool_size(cfg: Any) -> Optional[int]:
    """placement=split with placement.rollout_devices null and the layout given (no parallelism=auto): the rollout
    pool size (of `pool_size_options`) whose plan is valid and fits with the lowest estimated step time; None when
    none is."""
    tree = M.as_tree(cfg)
    best: Optional[Tuple[float, int]] = None
    for rd in pool_size_options(tree):
        t = _with_pool(tree, rd)
        layout = derive_layout(t)
        if any(p.severity == ERROR for p in R.check_all(t, layout)):
            continue
        score = cost(t, layout, M.estimate(t, layout))["score"]
        if best is None or score < best[0]:
            best = (score, rd)
    return None if best is None else best[1]


# ------------------------------------------------------------------------------------------------ the search
def search(cfg: Any) -> List[Candidate]:
    """Every valid, fitting layout of `cfg`'s model x hw x backend (with placement=split: on each rollout-pool
    size of `pool_size_options`), best (lowest score) first."""
    tree = M.as_tree(cfg)
    if not is_split(tree):
        out = _search_pools(tree, {})
    else:
        searched = placement(tree)["rollout_devices"] is None
        out = [c for rd in pool_size_options(tree)
               for c in _search_pools(_with_pool(tree, rd), {"placement.rollout_devices": rd} if searched else {})]
    out.sort(key=lambda c: (c.score, -c.memory.headroom))
    return out


def backend_variants(tree: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The trainer settings the search ranks each layout with: the config's own ({}), offload toggled (all of
    the engine spec's `offload_keys` on when any is off, else all off) and recomputation toggled (backend.gradient_checkpointing,
    unless `auto`, which `auto_batch` chooses per layout). Each is costed: the host copies and the CPU optimizer
    step (`offload_seconds`), recomputation's extra third of the compute. With placement=split the training pool
    never shares its devices, so offload is not toggled there."""
    backend = str(tree["backend"]["name"])
    out: List[Dict[str, Any]] = [{}]
    spec = declared(TRAIN_ENGINES, backend)
    keys = [k for k in (spec.offload_keys if spec else ()) if k.split(".", 1)[1] in tree["backend"]]
    if keys and not is_split(tree):
        on = all(bool(at(tree, k)) for k in keys)
        out.append({k: not on for k in keys})
    ckpt = at(tree, "backend.gradient_checkpointing")
    if ckpt in (True, False):
        out.append({"backend.gradient_checkpointing": not ckpt})
    return out


def _with_settings(tree: Dict[str, Any], settings: Dict[str, Any]) -> Dict[str, Any]:
    if not settings:
        return tree
    out = {**tree, "backend": dict(tree["backend"])}
    for key, value in settings.items():
        out["backend"][key.split(".", 1)[1]] = value
    return out


def _search_pools(tree: Dict[str, Any], pool: Dict[str, Any]) -> List[Candidate]:
    """The candidates on the pools of `tree` (`pool`: the searched placement settings to add to each), each layout
    with every trainer variant of `backend_variants`."""
    out: List[Candidate] = []
    for variant in backend_variants(tree):
        found = _search_variant(_with_settings(tree, variant), {**pool, **variant})
        out += [replace(c, variant=dict(variant)) for c in found] if variant else found
    return out


def _search_variant(tree: Dict[str, Any], pool: Dict[str, Any]) -> List[Candidate]:
    """The candidates on the pools of `tree` with its trainer settings (`pool`: the searched settings to add to
    each)."""
    world, rollout_world = pool_sizes(tree)
    if world < 1 or rollout_world < 1:
        return []
    capacity = M.capacity_gib(tree)

    trains: List[Tuple[Dict[str, Any], Dict[str, Any], Optional[auto_batch.Choice], Dict[str, float],
                       Dict[str, float]]] = []
    probe_rollout = {"tp": 1, "dp": rollout_world, "ep": 1}
    leanest = auto_batch.smallest(tree)
    for opt in train_options(tree, world):
        t = _with(leanest, opt, probe_rollout)
        layout = derive_layout(t)
        if _layout_problems(t, layout, "train"):
            continue
        choice = auto_batch.choose(_with(tree, opt, probe_rollout), layout) if leanest is not tree else None
        own = auto_batch.chosen(tree, choice)  # this option's settings (the tree itself without auto)
        t = _with(own, opt, probe_rollout)
        terms = M.train_terms(t, layout)
        if sum(v for k, v in terms.items() if k.startswith("train/")) > capacity:
            continue  # the engine can only add to it: train_memory_fits would reject every pairing
        trains.append((opt, own, choice, terms, train_cost(t, layout)))
    if not trains:
        return []

    rollouts: List[Tuple[Dict[str, int], Dict[str, float]]] = []
    for ropt in rollout_options(tree, rollout_world):
        t = _with(trains[0][1], trains[0][0], ropt)
        layout = derive_layout(t)
        if _layout_problems(t, layout, "rollout"):
            continue
        rterms = M.rollout_terms(t, layout)
        if "rollout/pool" in rterms and (rterms["rollout/weights"] + rterms["rollout/activations"]
                                         + rterms["rollout/sequence_cache"] > rterms["rollout/pool"]):
            continue  # the engine alone does not fit its share: rollout_memory_fits rejects every pairing
        rollouts.append((ropt, rterms))

    out = []
    rollout_costs: Dict[int, float] = {}
    for opt, own, choice, tterms, tcost in trains:
        for i, (ropt, rterms) in enumerate(rollouts):
            t = _with(own, opt, ropt)
            layout = derive_layout(t)
            est = M.assemble(t, tterms, rterms)
            if (R.train_memory_problems(t, est) or log_prob_fit.problems(t, layout, est)
                    or R.rollout_memory_problems(t, est) or _layout_problems(t, layout, "colocated")):
                continue
            if i not in rollout_costs:
                rollout_costs[i] = rollout_seconds(t, layout, est)
            c = combine_cost(tcost, rollout_costs[i], est, overlaps(t))
            settings = {**_settings(tree, opt, ropt), **pool, **(choice.settings() if choice else {})}
            batch = None if choice is None else replace(choice, train_peak_gib=est.train_peak_gib)  # this pairing's
            out.append(Candidate(layout=layout, score=c["score"], memory=est, cost=c, settings=settings,
                                 overrides=[f"{k}={_fmt(v)}" for k, v in settings.items()], batch=batch))
    return out


def _settings(tree: Dict[str, Any], opt: Dict[str, Any], ropt: Dict[str, int]) -> Dict[str, Any]:
    keys = train_engine(tree).layout_keys
    s: Dict[str, Any] = {f"parallelism.{k}": opt[k] for k in keys}
    s.update({f"parallelism.rollout.{k}": v for k, v in ropt.items()})
    return s


def _fmt(v: Any) -> str:
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def apply(cfg: Any, candidate: Candidate) -> DictConfig:
    """A copy of `cfg` with the candidate's layout set (parallelism.auto off, the name records the choice:
    `auto/tp=2 pp=4 ...`), its searched placement.rollout_devices, and its `auto` micro batch / checkpointing
    resolved."""
    out = cfg.copy() if isinstance(cfg, DictConfig) else OmegaConf.create(cfg)
    for key, value in candidate.settings.items():
        OmegaConf.update(out, key, value, merge=False)
    degrees = [o[len("parallelism."):] for o in candidate.overrides if o.startswith("parallelism.")]
    for key, value in (("parallelism.vpp", None), ("parallelism.pipeline_layout", None),
                       ("parallelism.auto", False),
                       ("parallelism.name", "auto/" + " ".join(degrees))):
        OmegaConf.update(out, key, value, merge=False)
    return out


# ------------------------------------------------------------------------------------------ keep or replace
KEEP_TESTED_MARGIN = 0.4
"""`parallelism=auto` replaces the tested layout of a model x hw x backend only when the best searched candidate's
score is lower by more than this share of it (the tested one takes more than 1.4x as long). The model's own error
between layouts is about this large: it prices every layout at one MFU, while the same rows measured on an H200
ran the update at 29.1% MFU under Megatron TP1 and 22.4% under FSDP on the 0.8B, 20.9% and 15.3% on the 4B
(bench/results/h200.md): 30-37% apart for the same work."""


def tested_candidate(cfg: Any, candidates: List[Candidate]) -> Optional[Candidate]:
    """The candidate that is the tested layout of this model x hw x backend with the config's own trainer settings
    (None: no tested layout, or it is not among the candidates: refused, not fitting, or outside the space)."""
    name = tested_name(cfg)
    if name is None:
        return None
    preset = preset_degrees(name)
    if preset is None or preset["pipeline_layout"] is not None or preset["vpp"] is not None:
        return None
    out = cfg.copy() if isinstance(cfg, DictConfig) else OmegaConf.create(cfg)
    for key, value in preset.items():
        OmegaConf.update(out, f"parallelism.{key}", value, merge=False)
    layout = derive_layout(out)
    return next((c for c in candidates if c.layout == layout and not c.variant), None)


def pick(cfg: Any, candidates: List[Candidate]) -> Candidate:
    """The candidate `parallelism=auto` applies: the tested layout unless the best is better by more than
    `KEEP_TESTED_MARGIN`, else the best."""
    best, tested = candidates[0], tested_candidate(cfg, candidates)
    if tested is not None and best.score * (1 + KEEP_TESTED_MARGIN) >= tested.score:
        return tested
    return best


def _parts(c: Candidate) -> str:
    train = sum(v for k, v in c.cost.items() if k.endswith("_s") and k != "rollout_s")
    return f"train {train:.3g} s + rollout {c.cost.get('rollout_s', 0.0):.3g} s"


def _label(c: Candidate) -> str:
    return " ".join(o.replace("parallelism.", "") for o in c.overrides)


_PART_NAMES = {"compute_s": "compute", "bubble_s": "pipeline bubble", "offload_s": "host offload",
               "rollout_s": "rollout"}


def _why_slower(c: Candidate, ref: Candidate) -> str:
    """What makes `c` slower than `ref`: its largest part that grew, and the headroom penalty."""
    keys = {k for k in (*c.cost, *ref.cost) if k.endswith("_s")}
    diffs = sorted(((c.cost.get(k, 0.0) - ref.cost.get(k, 0.0), k) for k in keys), reverse=True)
    parts = []
    if diffs and diffs[0][0] > 0:
        d, k = diffs[0]
        name = _PART_NAMES.get(k, k[:-2].replace("comm_", "") + " communication")
        parts.append(f"more {name} (+{d:.3g} s)")
    if c.cost.get("headroom_penalty", 1.0) > ref.cost.get("headroom_penalty", 1.0):
        parts.append(f"less than {MIN_HEADROOM:.0%} memory free (x{c.cost['headroom_penalty']:.2f})")
    return ", ".join(parts) or "the same estimate within rounding"


def explain(cfg: Any, candidates: List[Candidate]) -> Optional[Dict[str, Any]]:
    """`parallelism=auto`'s choice and the runner-up, one line each, with whether the tested layout was kept and
    the margin (None without candidates)."""
    if not candidates:
        return None
    chosen, tested = pick(cfg, candidates), tested_candidate(cfg, candidates)
    best = candidates[0]
    name = tested_name(cfg)
    kept = tested is not None and chosen is tested
    line = (f"{_label(chosen)}: {chosen.score:.3g} {SCORE_UNIT} ({_parts(chosen)}), "
            f"{max(chosen.memory.headroom, 0.0):.0%} of the memory free")
    if kept and best is not chosen:
        line += (f"; the tested layout {name} is kept: the best searched is {tested.score / best.score:.2f}x faster "
                 f"by the model, within its error (margin {KEEP_TESTED_MARGIN:.0%})")
    elif kept:
        line += f"; the tested layout {name}, also the best searched"
    elif name is not None:
        line += (f"; the lowest estimate, replacing the tested layout {name} " +
                 (f"({tested.score / chosen.score:.2f}x slower by the model, beyond its {KEEP_TESTED_MARGIN:.0%} "
                  "margin)" if tested is not None else "(not a candidate here: refused or does not fit)"))
    else:
        line += "; the lowest estimate (no tested layout for this model x hw x backend)"
    runner = next((c for c in candidates if c is not chosen), None)
    second = None
    if runner is not None:
        rel = runner.score / chosen.score - 1.0
        second = (f"{_label(runner)}: {runner.score:.3g} {SCORE_UNIT} ({rel:+.0%}"
                  + (f": {_why_slower(runner, chosen)})" if rel > 0 else
                     f"; not taken: within the {KEEP_TESTED_MARGIN:.0%} margin of the tested layout)"))
    return {"chosen": line, "runner_up": second, "kept_tested": kept, "tested": name,
            "margin": KEEP_TESTED_MARGIN, "chosen_overrides": list(chosen.overrides),
            "runner_up_overrides": list(runner.overrides) if runner is not None else None}


# ------------------------------------------------------------------------------------------------ cost model
def _bandwidth(group: int, stride: int, per_node: int) -> float:
    """Bytes/s of a group of `group` ranks `stride` apart: inside one node or across nodes."""
    return (INTRA_NODE_GBPS if group * stride <= per_node else INTER_NODE_GBPS) * 1e9


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


def train_comm_seconds(cfg: Any, layout: Layout, shard: M.TrainShard, micro_batches: float,
                       optimizer_steps: float) -> Dict[str, float]:
    """Seconds per step each device spends moving bytes, by kind (see the module docstring)."""
    m, per_node = cfg["model"], int(cfg["hw"]["devices_per_node"])
    h, tokens = int(m["hidden_size"]), M.micro_batch_tokens(cfg)
    out: Dict[str, float] = {}
    if train_engine(layout.backend).model_parallel:
        layers = len(shard.layers)
        n_full, n_lin = shard.layers.count("full"), shard.layers.count("linear")
        t_cp = tokens / layout.cp
        out["tp"] = 8 * layers * t_cp * h * 2 * _ring(layout.tp) * micro_batches / _bandwidth(layout.tp, 1, per_node)
        kv = 2 * int(m["num_key_value_heads"]) * int(m["head_dim"])
        gdn = 2 * int(m["linear_num_key_heads"]) * int(m["linear_key_head_dim"]) + \
            int(m["linear_num_value_heads"]) * int(m["linear_value_head_dim"])
        cp_bytes = 2 * (n_full * tokens * kv + n_lin * 2 * t_cp * gdn) * 2 / layout.tp * _ring(layout.cp)
        out["cp"] = cp_bytes * micro_batches / _bandwidth(layout.cp, layout.tp, per_node)
        if m["moe"]:
            routed = layers * (t_cp / layout.tp) * int(m["num_experts_per_tok"]) * h * 2
            out["ep"] = 4 * routed * _ring(layout.ep) * micro_batches / _bandwidth(layout.ep, layout.etp, per_node)
            out["etp"] = 4 * routed * _ring(layout.etp) * micro_batches / _bandwidth(layout.etp, 1, per_node)
        pp_bytes = 2 * (t_cp / layout.tp) * h * 2 if layout.pp > 1 else 0.0
        out["pp"] = pp_bytes * micro_batches / _bandwidth(2, layout.world // layout.pp, per_node)
        dp_bytes = 6 * (shard.dense * _ring(layout.dp * layout.cp) + shard.expert * _ring(layout.edp))
        out["dp"] = dp_bytes * optimizer_steps / _bandwidth(layout.dp, layout.tp * layout.cp, per_node)
    else:
        f = max(layout.fsdp_size, 1)
        full = (shard.dense + shard.expert) * f
        out["fsdp"] = 8 * full * _ring(f) * micro_batches / _bandwidth(f, layout.sp, per_node)
        replicas = max(layout.dp // f, 1)
        out["hsdp"] = 8 * full / f * _ring(replicas) * optimizer_steps / _bandwidth(replicas, f, per_node)
        sp_bytes = 2 * 4 * len(shard.layers) * (tokens / layout.sp) * h * 2 * _ring(layout.sp)
        out["sp"] = sp_bytes * micro_batches / _bandwidth(layout.sp, 1, per_node)
    return out


def offload_seconds(cfg: Any, layout: Layout, shard: M.TrainShard, micro_batches: float,
                    optimizer_steps: float) -> float:
    """PCIe copies and the CPU optimizer step of what the trainer offloads (see the module docstring)."""
    b, n = cfg["backend"], shard.dense + shard.expert
    pcie, adam = PCIE_GBPS * 1e9, HOST_ADAM_GBPS * 1e9
    if train_engine(layout.backend).model_parallel:
        cpu_states = 0.0
        if b["optimizer_cpu_offload"]:
            div = (layout.dp * layout.cp, layout.edp) if b["use_distributed_optimizer"] else (1, 1)
            cpu_states = (shard.dense / max(div[0], 1) + shard.expert / max(div[1], 1)) * \
                float(b["optimizer_offload_fraction"])
        per_step = cpu_states * (16 / adam + 6 / pcie) * optimizer_steps
        phases = n * (2 * bool(b["param_offload"]) + 4 * bool(b["grad_offload"])) * 2 / pcie
        return per_step + phases
    if b.get("offload_policy"):
        return n * 8 / pcie * micro_batches + n * 16 / adam * optimizer_steps
    return n * (4 * bool(b["param_offload"]) + 8 * bool(b["optimizer_offload"])) * 2 / pcie


def stage_active_params(cfg: Any, layout: Layout) -> float:
    """Active parameters of the busiest pipeline rank (its layers + the output layer) x PP: the pipeline moves at
    the pace of its slowest stage (without a pipeline: the model's active parameters minus the embedding lookup)."""
    m = cfg["model"]
    ranks = M.pipeline_ranks(cfg, layout)
    busiest = max(P.layers_params(m, r["layers"], active=True) + (P.embedding_params(m) if r["L"] else 0)
                  for r in ranks)
    return busiest * len(ranks)


def train_cost(cfg: Any, layout: Layout) -> Dict[str, float]:
    """The training part of the cost (seconds per RL step): compute, bubble, communication, offload."""
    responses = int(cfg["data"]["train_batch_size"]) * int(cfg["rollout"]["n"])
    epochs = int(cfg["algorithm"]["ppo_epochs"])
    tokens = responses * M.sequence_length(cfg) * epochs
    recompute = 4 / 3 if M.recompute_groups(cfg, layout) else 1.0
    peak = float(cfg["hw"]["peak_tflops"]) * 1e12 * MFU * layout.world
    compute = 6 * stage_active_params(cfg, layout) * tokens * recompute / peak
    per_mini = M.micro_batches_per_mini_batch(cfg, layout)
    mini_batches = max(int(cfg["data"]["train_batch_size"]) // max(int(cfg["algorithm"]["mini_batch_size"]), 1), 1)
    bubble_frac = (layout.pp - 1) / (per_mini + layout.pp - 1)
    shard = M.train_shard(cfg, layout)
    micro, steps = per_mini * mini_batches * epochs, mini_batches * epochs
    comm = train_comm_seconds(cfg, layout, shard, micro, steps)
    return {"compute_s": compute, "bubble_s": compute * bubble_frac / (1 - bubble_frac),
            "bubble_fraction": bubble_frac, **{f"comm_{k}_s": v for k, v in comm.items()},
            "offload_s": offload_seconds(cfg, layout, shard, micro, steps)}


def decode_schedule(cfg: Any, layout: Layout, est: M.MemoryEstimate) -> Tuple[int, int]:
    """(sequences each rollout scheduler generates in a step, how many of them it decodes at once)."""
    r = cfg["rollout"]
    sequences = int(cfg["data"]["train_batch_size"]) * int(r["n"])
    schedulers = max(layout.rollout_world // max(layout.rollout_tp, 1), 1)
    room = est.rollout_sequences if est.rollout_sequences is not None else M.hf_engine_sequences(cfg, layout)
    return math.ceil(sequences / schedulers), max(1, min(int(r["max_num_seqs"]), room))


def decode_steps(cfg: Any, layout: Layout, est: M.MemoryEstimate) -> int:
    """Decode steps of one generation: response length x the waves of sequences each scheduler runs."""
    sequences, concurrent = decode_schedule(cfg, layout, est)
    return math.ceil(sequences / concurrent) * int(cfg["data"]["max_response_length"])


def rollout_seconds(cfg: Any, layout: Layout, est: M.MemoryEstimate) -> float:
    """Decode-bound generation time of one step (see the module docstring)."""
    m, per_node = cfg["model"], int(cfg["hw"]["devices_per_node"])
    steps = decode_steps(cfg, layout, est)
    weight_read = est.terms["rollout/weights"] * M.GIB / (HBM_GBPS * 1e9)
    layers = len(P.layer_kinds(m))
    spans = lambda group: 1 if group <= per_node else 4  # noqa: E731
    collectives = 2 * layers * LATENCY_S * spans(layout.rollout_tp) if layout.rollout_tp > 1 else 0.0
    if layout.rollout_ep > 1:
        collectives += 2 * layers * LATENCY_S * spans(layout.rollout_ep)
    return steps * (weight_read + collectives)


def overlaps(cfg: Any) -> bool:
    """The two parts of a step run at the same time: placement=split with algorithm.max_staleness >= 1."""
    return is_split(cfg) and int(cfg["algorithm"]["max_staleness"]) >= 1


def combine_cost(train: Dict[str, float], rollout_s: float, est: M.MemoryEstimate,
                 overlapped: bool = False) -> Dict[str, float]:
    """Training + rollout seconds (the longer of the two when they overlap), times the headroom penalty: the
    score."""
    penalty = 1 + HEADROOM_PENALTY * max(0.0, MIN_HEADROOM - est.headroom) / MIN_HEADROOM
    train_s = sum(v for k, v in train.items() if k.endswith("_s"))
    total = max(train_s, rollout_s) if overlapped else train_s + rollout_s
    out = {**train, "rollout_s": rollout_s, "headroom": est.headroom, "headroom_penalty": penalty,
           "score": total * penalty}
    if overlapped:
        out["overlapped"] = 1.0
    return out


def cost(cfg: Any, layout: Layout, est: M.MemoryEstimate) -> Dict[str, float]:
    """The cost model's components for `layout` (seconds per RL step) and the final score."""
    tree = M.as_tree(cfg)
    return combine_cost(train_cost(tree, layout), rollout_seconds(tree, layout, est), est, overlaps(tree))


# ------------------------------------------------------------------------------------------ the tested layouts
DEGREE_KEYS = ("tp", "pp", "cp", "ep", "etp", "vpp", "pipeline_layout", "fsdp_size", "sp", "rollout.tp", "rollout.dp",
               "rollout.ep")
"""The `parallelism.*` keys that make a layout (name and auto aside)."""


def _degrees(par: Any) -> Dict[str, Any]:
    return {k: OmegaConf.select(par, k) if isinstance(par, DictConfig) else at(par, k) for k in DEGREE_KEYS}


@lru_cache(maxsize=64)
def _load_preset(name: str, overlays: Tuple[str, ...]) -> Optional[Tuple[Tuple[str, Any], ...]]:
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path
    from hydra.types import RunMode

    from qwen35rl.config.paths import config_dir
    from qwen35rl.config.schema import ParallelismConfig
    from qwen35rl.config.store import register

    base = OmegaConf.structured(ParallelismConfig)
    if name != "default":
        register()
        path = create_config_search_path(str(config_dir()))
        anchor = "main"
        for d in overlays:  # where hydra.searchpath puts them: after the packaged tree, in order
            path.append("qwen35rl-overlay", f"file://{d}", anchor=anchor)
            anchor = "qwen35rl-overlay"
        try:  # Hydra's own loading (defaults lists, overlays): no global Hydra state, so safe inside a sweep job
            loaded = ConfigLoaderImpl(config_search_path=path).load_configuration(
                config_name=f"parallelism/{name}", overrides=[], run_mode=RunMode.RUN)
        except Exception:  # not a config on the search path (a hand-set parallelism.name): nothing to compare
            return None
        if "parallelism" not in loaded:
            return None
        base = OmegaConf.merge(base, loaded.parallelism)
    return tuple(_degrees(base).items())


def preset_degrees(name: str) -> Optional[Dict[str, Any]]:
    """The degrees of the tested layout `parallelism/<name>.yaml` (its values over the schema's defaults; `default`:
    the schema's defaults), or None where no such config is on the search path."""
    from qwen35rl.config.paths import extra_config_dirs

    found = _load_preset(str(name), tuple(str(d) for d in extra_config_dirs()))
    return None if found is None else dict(found)


def _value(v: Any) -> str:
    return "null" if v is None else str(v)


def layout_origin(cfg: Any) -> Tuple[Optional[str], List[str]]:
    """(the tested layout the config's layout starts from, or `default`; the degrees set apart from it, as
    `parallelism.<key>=<value>`). (None, []) for a searched layout (`auto/...`) or a name that is no config."""
    name = str(cfg["parallelism"]["name"])
    if name == "auto" or name.startswith("auto/"):
        return None, []
    preset = preset_degrees(name)
    if preset is None:
        return None, []
    own = _degrees(cfg["parallelism"])
    return name, [f"parallelism.{k}={_value(own[k])}" for k in DEGREE_KEYS if own[k] != preset[k]]


def layout_label(cfg: Any) -> str:
    """The layout's name as the plan shows it: the tested layout's name, `+` the degrees set apart from it (a sweep
    over parallelism.tp is not labelled with the tested layout alone)."""
    name, changed = layout_origin(cfg)
    if name is None:
        return str(cfg["parallelism"]["name"])
    return name if not changed else f"{name} + " + " ".join(c[len("parallelism."):] for c in changed)


def tested_name(cfg: Any) -> Optional[str]:
    """`<backend>/<model>@<hw>` when that tested layout exists (the one `parallelism=auto` keeps the deltas of)."""
    name = f"{cfg['backend']['name']}/{cfg['model']['name']}@{cfg['hw']['name']}"
    return name if preset_degrees(name) is not None and name != "default" else None


def tested_rank(cfg: Any, candidates: List[Candidate]) -> Optional[Dict[str, Any]]:
    """Where the tested layout of this model x hw x backend ranks among the searched candidates: {name, overrides,
    rank (1 = best; None when it is not a candidate), of, score, score_unit, best_score, why (when not ranked)}.
    None without a tested layout."""
    name = tested_name(cfg)
    if name is None:
        return None
    preset = preset_degrees(name)
    out = cfg.copy() if isinstance(cfg, DictConfig) else OmegaConf.create(cfg)
    for key, value in preset.items():
        OmegaConf.update(out, f"parallelism.{key}", value, merge=False)
    OmegaConf.update(out, "parallelism.auto", False, merge=False)
    OmegaConf.update(out, "parallelism.name", name, merge=False)
    if is_split(out) and placement(out)["rollout_devices"] is None and candidates:  # the searched pools
        OmegaConf.update(out, "placement.rollout_devices",
                         candidates[0].settings.get("placement.rollout_devices"), merge=False)
    layout = derive_layout(out)
    out, _ = auto_batch.resolve(out, layout)  # the tested layout at its own best micro batch / checkpointing
    keys = train_engine(layout.backend).layout_keys
    shown = [*keys, *(k for k in ("vpp", "pipeline_layout") if preset[k] is not None), "rollout.tp", "rollout.dp",
             "rollout.ep"]
    info: Dict[str, Any] = {"name": name, "overrides": [f"parallelism.{k}={_value(preset[k])}" for k in shown],
                            "rank": None, "of": len(candidates), "score": None, "score_unit": SCORE_UNIT,
                            "best_score": round(candidates[0].score, 4) if candidates else None}
    if preset["pipeline_layout"] is None:
        for i, c in enumerate(candidates, 1):
            if c.layout == layout and not c.variant:  # with the config's own trainer settings
                info.update(rank=i, score=round(c.score, 4))
                return info
    refused = sorted({p.code for p in R.check_all(out, layout) if p.severity == "error"})
    info["why"] = (f"the rules refuse it here: {', '.join(refused)}" if refused else
                   "outside the search space (powers of two, even pipeline splits, no vpp)")
    if not refused:
        est = M.estimate(out, layout)
        info["score"] = round(cost(out, layout, est)["score"], 4)
    return info
