"""What each training engine builds, and what each placement (`PLACEMENT`: launchers, rollout engines,
staleness) runs, declared once.

The plan's rules, `parallelism=auto`, sweep pruning and the preflight read this declaration; the engines check
the same declaration when they are constructed and refuse with the plan's own problem code and message. So a
config the plan calls valid is one the engine builds, and a setting an engine accepts without applying it is a
plan warning, not a silent difference.

Each `Support` entry names a setting (`key`), when the config asks for it (`asked`), and, for the software stack
the run will meet (`Stack`), whether the engine refuses it (`REFUSED`: an error before launch) or runs without it
(`NOT_APPLIED`: a warning that says what runs instead). At plan time the stack is what the config declares
(`hw.device`, `backend.megatron_core_version`); facts it cannot know there (is Transformer Engine installed?) stay
unknown and are decided by the preflight's probe of the nodes and by the engine on its own process.

Standard library only.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from qwen35rl.config.engine_specs import ROLLOUT_ENGINES, TRAIN_ENGINES, declared, train_engine
from qwen35rl.config.launcher import launcher_of
from qwen35rl.config.layout import placement
from qwen35rl.config.problems import ERROR, WARNING, Problem

REFUSED = ERROR
NOT_APPLIED = WARNING

AXES: Dict[str, Tuple[str, ...]] = {name: spec.layout_axes for name, spec in TRAIN_ENGINES.items()}
"""The `parallelism.*` layout axes each engine reads (its spec's); the others must keep their defaults."""


@dataclass(frozen=True)
class Stack:
    """The installed software an engine meets. None: not known here (the plan cannot see the nodes)."""

    device: str
    """cpu | cuda | npu"""
    transformer_engine: Optional[bool] = None
    fla: Optional[bool] = None
    """flash-linear-attention (the GDN kernels)."""

    @classmethod
    def declared(cls, cfg: Any) -> "Stack":
        """What the config says about the nodes: only the device type (CPU and NPU nodes have no Transformer
        Engine for these engines)."""
        device = str(cfg["hw"]["device"])
        return cls(device=device, transformer_engine=False if device in ("cpu", "npu") else None,
                   fla=False if device == "cpu" else None)

    @classmethod
    def installed(cls, device: str) -> "Stack":
        """This process's stack (the engines and the preflight probe call it)."""
        def found(name: str) -> bool:
            return importlib.util.find_spec(name) is not None

        return cls(device=device, transformer_engine=device == "cuda" and found("transformer_engine"),
                   fla=found("fla"))


Predicate = Callable[[Any, Any], bool]
"""(cfg, layout) -> bool"""


@dataclass(frozen=True)
class Support:
    code: str
    """The problem code the plan and the engine both report."""
    engine: str
    key: str
    asked: Predicate
    verdict: str
    """REFUSED or NOT_APPLIED"""
    why: Union[str, Callable[[Any], str]]
    """What the engine does instead (NOT_APPLIED) or why it cannot (REFUSED); a function of the config where that
    depends on it (a version)."""
    hint: Union[str, Callable[[Any], str]]
    stack_needs: Optional[Callable[[Stack], Optional[bool]]] = None
    """Only for entries that depend on the stack: True where the stack provides the setting (then it applies and
    nothing is reported), False where it does not, None where that is unknown (nothing reported yet)."""


def _compiles(setting: Optional[bool], device_type: str) -> bool:
    """A torch.compile switch of the engines: null compiles on CUDA (Inductor's Triton kernels) and runs eagerly on
    CPU (where the first compilation costs more than it saves) and NPU."""
    return device_type == "cuda" if setting is None else bool(setting)


def compiles_log_probs(setting: Optional[bool], device_type: str) -> bool:
    """backend.use_torch_compile as the engines apply it to the log-prob head (`_compiles`)."""
    return _compiles(setting, device_type)


def compiles_decode(setting: Optional[bool], device_type: str) -> bool:
    """rollout.compile_decode as the hf rollout engine applies it (`_compiles`; on CUDA the compiled step is then
    captured into the CUDA graph)."""
    return _compiles(setting, device_type)


def _b(key: str) -> Predicate:
    return lambda cfg, layout: bool(cfg["backend"].get(key, False))


def _moe_and(key: str) -> Predicate:
    return lambda cfg, layout: bool(cfg["model"]["moe"]) and bool(cfg["backend"].get(key, False))


def _te(stack: Stack) -> Optional[bool]:
    return stack.transformer_engine


DECLARATION: List[Support] = [
    # ------------------------------------------------------------------------------------------------ Megatron
    Support("megatron_context_parallel", "megatron", "parallelism.cp", lambda cfg, layout: layout.cp > TRAIN_ENGINES["megatron"].degree_limit("cp"),
            REFUSED, lambda cfg: _cp_why(cfg), lambda cfg: _cp_hint(cfg)),
    Support("megatron_pads_sequences", "megatron", "backend.remove_padding",
            lambda cfg, layout: cfg["backend"]["remove_padding"] is True, NOT_APPLIED,
            "the Megatron engine trains padded (right-aligned) batches: packed THD sequences need Transformer "
            "Engine's attention", "try backend.remove_padding=false (the same padded batches, without this warning)"),
    Support("megatron_grouped_gemm", "megatron", "backend.moe_grouped_gemm", _moe_and("moe_grouped_gemm"), NOT_APPLIED,
            "experts run as megatron-core's SequentialMLP (the local layer spec); Transformer Engine's grouped GEMM "
            "is not built", "try backend.moe_grouped_gemm=false (the same experts, without this warning)"),
    Support("megatron_permute_fusion_needs_te", "megatron", "backend.moe_permute_fusion", _moe_and("moe_permute_fusion"),
            NOT_APPLIED, "the fused token permutation is Transformer Engine's: turned off where it is not installed",
            "try backend.moe_permute_fusion=false, or install transformer-engine on the nodes", _te),
    Support("megatron_precision_aware_optimizer", "megatron", "backend.use_precision_aware_optimizer",
            _b("use_precision_aware_optimizer"), NOT_APPLIED, "plain Adam runs: Transformer Engine's precision-aware "
            "FusedAdam keeps its state in another layout than the torch Adam state the engine's checkpoints and "
            "offloads read", "try backend.use_precision_aware_optimizer=false (the same optimizer, without this "
            "warning)"),
    Support("megatron_gdn_kernels_need_fla", "megatron", "backend.transformer_overrides.deterministic_mode",
            lambda cfg, layout: (cfg["backend"].get("transformer_overrides") or {}).get("deterministic_mode") is False,
            REFUSED, "with deterministic_mode false megatron-core's Gated DeltaNet runs flash-linear-attention's "
            "kernels, which this stack does not have", "remove backend.transformer_overrides.deterministic_mode (the "
            "engine then runs megatron-core's torch recurrence), or install flash-linear-attention",
            lambda stack: None if stack.device == "npu" else stack.fla),
    Support("megatron_no_compile_layers", "megatron", "backend.compile_layers", _b("compile_layers"), NOT_APPLIED,
            "megatron-core's layer specs build their own norms and MLPs (fused where Transformer Engine is installed);"
            " the FSDP engine compiles transformers' layer parts", "try backend.compile_layers=false"),
    Support("megatron_own_checkpoints", "megatron", "backend.use_dist_checkpointing", _b("use_dist_checkpointing"),
            NOT_APPLIED, "checkpoints are torch.distributed.checkpoint shards of the engine's own state "
            "(trainer.save_freq)", "try backend.use_dist_checkpointing=false"),
    # ---------------------------------------------------------------------------------------------------- FSDP
    Support("sp_requires_remove_padding", "fsdp", "backend.remove_padding",
            lambda cfg, layout: layout.sp > 1 and cfg["backend"]["remove_padding"] is False, REFUSED,
            "Ulysses SP splits packed rows of documents between its ranks; padded rows are not split",
            "try backend.remove_padding=null (packs where it pays; SP always packs) or parallelism.sp=1"),
    Support("fsdp_chunked_entropy", "fsdp", "backend.entropy_from_logits_with_chunking",
            lambda cfg, layout: not cfg["backend"].get("entropy_from_logits_with_chunking", True), NOT_APPLIED,
            "log-probs and entropy are always computed in chunks of backend.logprob_chunk_size tokens",
            "try backend.entropy_from_logits_with_chunking=true"),
]


def _core_version(cfg: Any) -> str:
    return str(cfg["backend"].get("megatron_core_version") or "")


def _cp_why(cfg: Any) -> str:
    """Why the Megatron engine builds no context parallelism, for the configured megatron-core: before 0.18 its
    Gated DeltaNet has none either; from 0.18 GDN has it, and only the full-attention layers lack it here."""
    from qwen35rl.config import megatron_versions as mv
    from qwen35rl.config.quirks import version_below

    v, first = _core_version(cfg), ".".join(map(str, mv.GDN_PACKED_AND_CP))
    attention = ("the engine's full-attention layers are megatron-core's local spec with torch SDPA, which has no "
                 "CP (Transformer Engine's attention has it; the engine does not build it)")
    if version_below(v, first):
        return (f"megatron-core {v}'s Gated DeltaNet has no context parallelism (its TransformerConfig asserts "
                f"context_parallel_size == 1 for gated_delta_net; GDN runs CP from megatron-core {first}.0, "
                f"NVIDIA/Megatron-LM PR #2642), and {attention}")
    return (f"megatron-core {v} runs the Gated DeltaNet layers with context parallelism (from {first}.0: an "
            f"all-to-all from sequence to head shards), but {attention}")


def _cp_hint(cfg: Any) -> str:
    from qwen35rl.config import megatron_versions as mv
    from qwen35rl.config.quirks import version_below

    more = (f" (GDN's own CP needs megatron-core >= {'.'.join(map(str, mv.GDN_PACKED_AND_CP))})"
            if version_below(_core_version(cfg), ".".join(map(str, mv.GDN_PACKED_AND_CP))) else "")
    return ("try parallelism.cp=1; long sequences split over parallelism.tp (sequence parallel) or "
            "backend.dynamic_batch_size=true" + more)


def _reported(entry: Support, cfg: Any, layout: Any, stack: Stack) -> bool:
    if entry.engine != str(cfg["backend"]["name"]) or not entry.asked(cfg, layout):
        return False
    if entry.stack_needs is None:
        return True
    return entry.stack_needs(stack) is False


def problems(cfg: Any, layout: Any, stack: Optional[Stack] = None) -> List[Problem]:
    """What the engine of `cfg` refuses (errors) or does not apply (warnings) on `stack` (default: the declared)."""
    stack = stack or Stack.declared(cfg)
    return [Problem(e.code, e.key, _message(e, cfg), _text(e.hint, cfg), e.verdict)
            for e in DECLARATION if _reported(e, cfg, layout, stack)]


def _message(entry: Support, cfg: Any) -> str:
    node = cfg
    for part in entry.key.split("."):
        node = node[part]
    value = str(node).lower() if isinstance(node, bool) else node
    verdict = "is not built" if entry.verdict == REFUSED else "is accepted but not applied"
    return f"{entry.key}={value} {verdict}: {_text(entry.why, cfg)}"


def _text(text: Union[str, Callable[[Any], str]], cfg: Any) -> str:
    return text(cfg) if callable(text) else text


class Unsupported(RuntimeError):
    """An engine was asked to build what the declaration refuses (the plan reports the same problems)."""

    def __init__(self, refused: List[Problem]):
        self.problems = refused
        super().__init__("the training engine cannot build this run:\n" + "\n".join(p.render() for p in refused))


def check_engine(cfg: Any, layout: Any, stack: Stack) -> List[Problem]:
    """For an engine's constructor: raises Unsupported with the refused settings; returns the warnings (settings
    accepted but not applied) for the engine to log."""
    found = problems(cfg, layout, stack)
    refused = [p for p in found if p.severity == REFUSED]
    if refused:
        raise Unsupported(refused)
    return found


# -------------------------------------------------------------------------------------- placement and staleness
@dataclass(frozen=True)
class PlacementSupport:
    """What runs under one `placement.mode`."""

    launchers: Tuple[str, ...]
    """trainer.launcher values that start its workers."""
    own_rollout_pool: bool
    """The rollout engine runs on devices of its own: only engines whose spec has `split_pool` are built there
    (both training engines build under either placement: the rollout side reads their weights through the same
    `export_weights`)."""
    max_staleness: Optional[int]
    """The largest algorithm.max_staleness it runs (None: any)."""


PLACEMENT: Dict[str, PlacementSupport] = {
    "colocated": PlacementSupport(launchers=("ray", "local"), own_rollout_pool=False, max_staleness=0),
    # Training rank 0 sends the exported weights (each engine's `export_weights`, gathered from its TP / PP / EP
    # shards) to every rollout worker over a communicator of its own (runtime/weight_sync.py).
    "split": PlacementSupport(launchers=("ray",), own_rollout_pool=True, max_staleness=None),
}
"""What each placement builds, read by the plan's rules and by the runtime (`check_placement`)."""

SPLIT_WHY = {
    "launcher": "the two pools are Ray actors placed on their own devices; the local launcher starts one pool "
                "of workers on this host",
    "rollout": "a vLLM engine keeps its own torch.distributed world: loading weights sent from the training pool "
               "needs a weight receiver inside vLLM's workers on the cross-pool communicator, which is not built",
    "staleness": "with colocated devices the phases take turns, so every batch is generated by the current policy",
}


def single_on_policy_update(cfg: Any) -> bool:
    """One update per batch on the policy that generated it: the old log-probs are the current policy's, so the
    trainer computes no old log-prob pass."""
    a = cfg["algorithm"]
    return (int(a["ppo_epochs"]) == 1 and int(a["mini_batch_size"]) >= int(cfg["data"]["train_batch_size"])
            and not a["use_kl_in_reward"] and rollout_is_mode(cfg) == "off")


def rollout_is_mode(cfg: Any) -> str:
    """`algorithm.rollout_is` resolved: token | sequence | off. `auto` is token when the run trains on samples
    of older policies (max_staleness > 0) and the old log-probs are the trainer's (backend.use_rollout_log_probs
    false: with it the old log-probs are the behaviour ones and every weight would be 1), else off."""
    a = cfg["algorithm"]
    mode = str(a.get("rollout_is", "auto"))
    if mode != "auto":
        return mode
    return "token" if _staleness(cfg) > 0 and not bool(cfg["backend"]["use_rollout_log_probs"]) else "off"


def _staleness(cfg: Any) -> int:
    """algorithm.max_staleness (0 in a config saved before it existed)."""
    return int(cfg["algorithm"].get("max_staleness", 0))


def placement_problems(cfg: Any) -> List[Problem]:
    """What the placement of `cfg` does not build (errors): the launcher, the rollout engine, the staleness."""
    mode = placement(cfg)["mode"]
    support = PLACEMENT.get(mode)
    if support is None:
        return []  # known_choice reports the mode
    out = []
    launcher, engine = launcher_of(cfg), str(cfg["rollout"]["engine"])
    if launcher not in support.launchers:
        out.append(Problem("split_needs_ray", "trainer.launcher", f"placement={mode} with trainer.launcher="
                           f"{launcher}: {SPLIT_WHY['launcher']}", "try trainer.launcher=ray", REFUSED))
    spec = declared(ROLLOUT_ENGINES, engine)
    if spec is None or (support.own_rollout_pool and not spec.split_pool):
        out.append(Problem("split_rollout_needs_hf", "rollout.engine", f"placement={mode} with rollout.engine="
                           f"{engine}: {SPLIT_WHY['rollout']}", "try rollout=hf, or placement=colocated", REFUSED))
    staleness = _staleness(cfg)
    if support.max_staleness is not None and staleness > support.max_staleness:
        out.append(Problem("staleness_needs_split", "algorithm.max_staleness", f"algorithm.max_staleness={staleness} "
                           f"needs placement=split: {SPLIT_WHY['staleness']}", "try placement=split "
                           "placement.rollout_devices=N (the rollout pool), or algorithm.max_staleness=0", REFUSED))
    return out


def check_placement(cfg: Any) -> None:
    """For the runtime before it places workers: raises Unsupported with what the placement does not build (the
    plan reports the same problems)."""
    refused = [p for p in placement_problems(cfg) if p.severity == REFUSED]
    if refused:
        raise Unsupported(refused)


# ----------------------------------------------------------------------------------------------------- resume
RUN_SHAPE_DEFAULTS: Dict[str, Any] = {"placement": "colocated", "rollout_devices": None, "max_staleness": 0}
"""What a checkpoint written before it recorded placement and staleness ran with."""


def run_shape(cfg: Any, layout: Any) -> Dict[str, Any]:
    """Placement and staleness: what the batches in flight of a checkpoint and its sampling streams depend on."""
    return {"placement": "split" if layout.split else "colocated",
            "rollout_devices": layout.rollout_world if layout.split else None,
            "max_staleness": _staleness(cfg)}


def checkpoint_layout(cfg: Any, layout: Any) -> Dict[str, Any]:
    """What decides which tensors each rank of the engine saves, under which keys and shapes, and what the loop
    state holds (`run_shape`). FSDP's checkpoints are DTensor shards that torch.distributed.checkpoint reshards onto
    any world / fsdp_size / sp: only the engine counts. The Megatron engine saves each rank's own shards of its
    model chunks and optimizer under keys of its coordinates, which only the same split reads back (a moved
    pipeline boundary could even load wrong layers); with placement=split its world is the training pool."""
    if train_engine(layout.backend).reshardable_checkpoints:
        return {"backend": layout.backend, **run_shape(cfg, layout)}
    b = cfg["backend"]
    return {"backend": "megatron", "world": layout.world, "tp": layout.tp, "pp": layout.pp, "vpp": layout.vpp,
            "cp": layout.cp, "ep": layout.ep, "etp": layout.etp,
            "pipeline_layout": cfg["parallelism"]["pipeline_layout"] or None,
            "use_distributed_optimizer": b["use_distributed_optimizer"],
            "optimizer_cpu_offload": b["optimizer_cpu_offload"],
            "optimizer_offload_fraction": b["optimizer_offload_fraction"] if b["optimizer_cpu_offload"] else None,
            **run_shape(cfg, layout)}


def _shape_problem(saved: Dict[str, Any], current: Dict[str, Any]) -> Optional[Problem]:
    """A change of staleness or placement between the checkpoint and this run (records without them: colocated,
    staleness 0)."""
    was = {k: saved.get(k, d) for k, d in RUN_SHAPE_DEFAULTS.items()}
    now = {k: current.get(k, d) for k, d in RUN_SHAPE_DEFAULTS.items()}
    start_over = "or start over: trainer.resume=never (or another trainer.run_name)"
    if was["max_staleness"] != now["max_staleness"]:
        return Problem("resume_staleness_changed", "algorithm.max_staleness", f"the checkpoint was written with "
                       f"algorithm.max_staleness={was['max_staleness']}, this run has {now['max_staleness']}: a "
                       "checkpoint holds the batches in flight (samples, behaviour log-probs, policy versions) of its "
                       "staleness and the run continues from exactly those, so another staleness is another run",
                       f"resume with algorithm.max_staleness={was['max_staleness']}, {start_over}")
    if (was["placement"], was["rollout_devices"]) != (now["placement"], now["rollout_devices"]):
        def shown(d: Dict[str, Any]) -> str:
            return d["placement"] + (f" with {d['rollout_devices']} rollout device(s)" if d["placement"] == "split"
                                     else "")
        back = f"placement={was['placement']}" + (f" placement.rollout_devices={was['rollout_devices']}"
                                                   if was["placement"] == "split" else "")
        key = "placement.mode" if was["placement"] != now["placement"] else "placement.rollout_devices"
        return Problem("resume_placement_changed", key, f"the checkpoint was written with placement {shown(was)}, this "
                       f"run has {shown(now)}: the sampling streams follow the rollout pool and the batches in flight "
                       "were generated by it, so another pool continues another run", f"resume with {back}, "
                       f"{start_over}")
    return None


def resume_problem(saved: Optional[Dict[str, Any]], current: Dict[str, Any],
                   key: str = "trainer.resume") -> Optional[Problem]:
    """Why a checkpoint saved with `checkpoint_layout` `saved` (None: not recorded) cannot resume on `current`. A
    record without placement and staleness (written before they were recorded) was colocated with staleness 0."""
    if saved and saved.get("backend") == current.get("backend"):
        shape = _shape_problem(saved, current)
        if shape is not None:
            return shape
    if not saved:
        if train_engine(str(current.get("backend"))).reshardable_checkpoints:
            return _shape_problem({}, current)  # FSDP's DTensor shards load onto any layout
        return Problem("resume_layout_unknown", key, "the checkpoint records no shard layout (written before "
                       "checkpoints recorded one), and Megatron shards load only on the layout that wrote them",
                       "start afresh (trainer.resume=never or another trainer.run_name), or from exported HF "
                       "weights (model.init=pretrained model.path=<run>/final)")
    if saved.get("backend") != current.get("backend"):
        return Problem("resume_across_engines", key, f"the checkpoint holds backend={saved.get('backend')} state; "
                       f"this run trains with backend={current.get('backend')}", "resume with the backend it was "
                       "saved with, or start afresh: trainer.resume=never or another trainer.run_name")
    changed = [k for k in current if k not in RUN_SHAPE_DEFAULTS and saved.get(k) != current.get(k)]
    if not changed:
        return None
    diff = ", ".join(f"{k}: {saved.get(k)} -> {current.get(k)}" for k in changed)
    return Problem("resume_needs_saved_layout", key, f"the checkpoint was saved with another layout ({diff}); "
                   f"{current['backend']} checkpoints are per-rank shards of their layout and cannot be resharded",
                   "resume with the saved layout (parallelism.*, hw.nodes x hw.devices_per_node, the optimizer "
                   "offload), or start afresh: trainer.resume=never or another trainer.run_name")
