"""One run as resolved before anything starts: the config with every `auto` made concrete, its layout, the memory
estimate and the vLLM facts, built once (`resolve_run`). The plan renders it; `qwen35rl-train` builds it before
Hydra starts the job and passes it, as it is, through the driver and the preflight to the workers (each gets its
typed config and layout), so that nothing downstream derives the layout again or types the config again.
Torch-free, and picklable (Ray ships it)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from omegaconf import DictConfig

from qwen35rl.config import auto_batch, engine_specs, layout_search, memory, rules, vllm_facts
from qwen35rl.config.auto_batch import Choice
from qwen35rl.config.launcher import launcher_of
from qwen35rl.config.layout import Layout, derive_layout, is_split, placement
from qwen35rl.config.problems import Problem
from qwen35rl.config.quirks import effective_engine_kwargs


@dataclass(frozen=True)
class ResolvedRun:
    cfg: DictConfig
    """The config with its `auto` settings resolved, typed on `schema.RunConfig` as `compose` makes it (the form the
    workers read). Not set read-only: the config layer's helpers edit copies, and a copy keeps that flag."""
    layout: Layout
    memory: Optional[memory.MemoryEstimate]
    """The plan's per-device estimate for `layout`; None where values out of range or an empty pool leave nothing to
    compute with (the rules say why)."""
    vllm: Optional[vllm_facts.Resolution]
    """What was decided about vLLM for a vLLM rollout (version and where it came from, GDN prefill, checkpoint form),
    else None."""
    engine_kwargs: Dict[str, Any]
    """The rollout engine's arguments: `rollout.engine_kwargs` with the applying platform quirks merged in."""
    run_dir: Optional[str] = None
    """Where the run writes, where the caller knows it (`qwen35rl-train`: Hydra's job directory)."""
    candidates: Tuple[Any, ...] = ()
    """`parallelism=auto`: the searched layouts, best first."""
    choice: Optional[Choice] = None
    """What an `auto` micro batch / checkpointing resolved to."""
    problems: Tuple[Problem, ...] = field(default=())
    """What the resolution itself found (no valid layout); the rules' findings are the caller's to add."""


def resolve_run(cfg: DictConfig, run_dir: Optional[str] = None) -> ResolvedRun:
    """`cfg` (composed, interpolations resolved) with `auto` resolved once (`resolve_auto`), and what follows."""
    configured = cfg
    cfg, candidates, choice, problems, layout = _resolve_auto(cfg)
    # values out of range, or an empty pool of placement=split: the estimate would divide by them
    computable = not rules.gate_problems(memory.as_tree(cfg)) and min(layout.world, layout.rollout_world) >= 1
    return ResolvedRun(
        cfg=cfg, layout=layout, memory=memory.estimate(cfg, layout) if computable else None,
        vllm=vllm_resolution(configured),
        engine_kwargs=effective_engine_kwargs(cfg), run_dir=run_dir, candidates=tuple(candidates), choice=choice,
        problems=tuple(problems))


def resolve_auto(cfg: DictConfig) -> Tuple[DictConfig, List[Any], Optional[Choice], List[Problem]]:
    """Everything `auto` resolved once, here, so that rules, estimate, engines, run identity and the verl export
    only see concrete values: (the config, the ranked candidates of `parallelism=auto`, what an `auto` micro batch /
    checkpointing resolved to, a problem when no layout is valid). `parallelism=auto` applies the best searched
    layout, which carries its own micro batch / checkpointing choice (`layout_search.search` chooses per layout);
    otherwise (or when no layout is valid) they are chosen for the config's own layout (`auto_batch`). A value out
    of its range leaves the config as it is: the gate rules report it and nothing computes with it. The vLLM facts
    come first (`vllm_facts.resolve`: `rollout.vllm_version=auto`, the GDN prefill kernel)."""
    return _resolve_auto(cfg)[:4]


def _resolve_auto(cfg: DictConfig) -> Tuple[DictConfig, List[Any], Optional[Choice], List[Problem], Layout]:
    """`resolve_auto`, and the layout of the config it returns: derived once the degrees and pools are settled
    (the micro batch, checkpointing and vLLM pool resolved after it change none of them)."""
    cfg = vllm_facts.resolve(cfg)
    if cfg.trainer.launcher == "auto":
        cfg = cfg.copy()
        cfg.trainer.launcher = launcher_of(cfg)
    if rules.gate_problems(memory.as_tree(cfg)):
        return cfg, [], None, [], derive_layout(cfg)
    candidates: List[Any] = []
    problems: List[Problem] = []
    choice = None
    if cfg.parallelism.auto:
        candidates = layout_search.search(cfg)
        if candidates:  # the tested layout unless the model says another is better beyond its error
            chosen = layout_search.pick(cfg, candidates)
            cfg, choice = layout_search.apply(cfg, chosen), chosen.batch
        else:
            problems.append(Problem("no_valid_layout", "parallelism", "no layout of this model fits this hardware "
                                    "with this backend", "use more devices (hw.nodes), offload, or another backend"))
    elif is_split(cfg) and placement(cfg)["rollout_devices"] is None:  # the pool size alone, for this layout
        size = layout_search.best_pool_size(cfg)
        if size is not None:
            cfg = cfg.copy()
            cfg.placement.rollout_devices = size
    layout = derive_layout(cfg)
    if auto_batch.auto_keys(cfg):
        cfg, choice = auto_batch.resolve(cfg, layout)
    if memory.pool_is_auto(cfg):  # the vLLM pool from what this layout's trainer leaves on the device
        cfg = cfg.copy()
        cfg.rollout.gpu_memory_utilization = memory.auto_pool_fraction(cfg, layout)
    return cfg, candidates, choice, problems, layout


def vllm_resolution(configured: DictConfig) -> Optional[vllm_facts.Resolution]:
    """What was decided about vLLM for a vLLM rollout (`configured`: before `resolve_auto`, so that an `auto`
    version says where it came from); None otherwise, or when the version is not one."""
    return vllm_facts.resolution(configured) if engine_specs.rollout_uses(configured, "vllm") else None
