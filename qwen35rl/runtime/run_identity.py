"""Run identity: a run directory belongs to one experiment.

Every start of a run saves its resolved config (`provenance/start-<NNN>/config.yaml`) and every checkpoint names the
start that wrote it (`meta.json` "provenance"). Before a resume, the config of this launch is compared with the
saved one, key by key, in three classes:

  experiment  what the run learns: model, data, algorithm, rollout sampling, seeds, lengths, batch sizes, learning
              rate and optimizer, ... (every key not named below). A change is refused with `trainer.resume=auto`
              (exit 2, before Ray or torch start), with the ways out: `trainer.resume=never` (start over here),
              another `trainer.run_name`, or `trainer.resume=force` (resume anyway).
  how         how and how long it runs: hardware and device counts (`hw.*`), the layout (`parallelism.*`), the
              engines' memory and speed knobs, the run's length and its checkpoint / validation cadence, file
              paths. Allowed and shown (the checkpoint's layout check, capabilities.resume_problem, still applies).
  ignored     bookkeeping: trackers, names, the output root, logging, the launcher, ray_address, timeouts, env.

A finished run (its newest checkpoint at trainer.total_steps, its final export present) launched again is not
started at all: `decide` says "already complete" and where its results are.

Stdlib and omegaconf only: `qwen35rl-train` runs this before it imports torch.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from qwen35rl.config.redact import REDACTED
from qwen35rl.exit_codes import EXIT_CONFIG
from qwen35rl.runtime import checkpoint as ckpt
from qwen35rl.runtime.report import say, shown_path, summary

log = logging.getLogger(__name__)

PROVENANCE_DIR = "provenance"
CONFIG_FILE = "config.yaml"
PROVENANCE_KEY = "provenance"
"""meta.json: the `provenance/start-<NNN>` directory (its name) of the start that wrote the checkpoint."""
FINAL_DIR = "final"
SUPERSEDED_DIR = "superseded"
OUTPUTS = ("checkpoints", "metrics.jsonl", "generations.jsonl", "tensorboard", "curves.png", FINAL_DIR, PROVENANCE_DIR,
           "mlruns")
"""What a run writes into its directory (besides the log): moved aside together when the directory starts over."""
RESUME_MODES = ("auto", "never", "force")
"""`trainer.resume`: one of these, or a checkpoint directory."""

EXPERIMENT, HOW, IGNORED = "experiment", "how", "ignored"

_IGNORED = ("trainer.trackers", "trainer.project_name", "trainer.run_name", "trainer.output_root", "trainer.resume",
            "trainer.checkpoint_dir", "trainer.log_every", "trainer.placement_timeout_s", "trainer.launcher", "trainer.log_val_generations",
            "ray_address", "format", "hw.env", "backend.env")
_HOW = ("hw", "parallelism",
        "trainer.total_steps", "trainer.total_epochs", "trainer.save_freq", "trainer.test_freq",
        "trainer.balance_batch", "trainer.val_before_train", "trainer.export_hf", "trainer.max_keep_checkpoints",
        "data.val_batch_size", "data.max_reward_failure_rate", "data.reward_failure_window",
        "data.train_files", "data.val_files", "model.path",
        # the engines' memory / speed knobs: the same math, split or scheduled differently
        "backend.micro_batch_size_per_device", "backend.max_tokens_per_device", "backend.dynamic_batch_size",
        "backend.log_prob_micro_batch_size_per_device", "backend.log_prob_max_tokens_per_device",
        "backend.remove_padding", "backend.gradient_checkpointing", "backend.param_offload",
        "backend.optimizer_offload", "backend.grad_offload", "backend.logprob_chunk_size", "backend.use_torch_compile",
        "backend.compile_layers", "backend.reshard_after_forward", "backend.offload_policy",
        "backend.entropy_from_logits_with_chunking",
        "backend.megatron_core_version", "backend.use_distributed_optimizer", "backend.recompute_granularity",
        "backend.recompute_method", "backend.recompute_num_layers", "backend.optimizer_cpu_offload",
        "backend.optimizer_offload_fraction", "backend.overlap_cpu_optimizer_d2h_h2d",
        "backend.use_precision_aware_optimizer", "backend.moe_grouped_gemm", "backend.moe_permute_fusion",
        "backend.moe_token_dispatcher_type", "backend.use_dist_checkpointing",
        # the rollout engine and its knobs (sampling itself, rollout.n / temperature / top_p / top_k, is experiment)
        "rollout.engine", "rollout.gpu_memory_utilization", "rollout.vllm_version", "rollout.max_model_len",
        "rollout.max_num_batched_tokens", "rollout.max_num_seqs", "rollout.enable_chunked_prefill",
        "rollout.enable_prefix_caching", "rollout.enforce_eager", "rollout.free_cache_engine", "rollout.sleep_level",
        "rollout.weight_sync_bucket_mb", "rollout.cudagraph_mode", "rollout.cudagraph_capture_sizes",
        "rollout.cuda_graph", "rollout.compile_decode", "rollout.engine_kwargs")
_SHOWN = 25
"""Changes listed one by one in a message; the rest are counted."""


def _under(key: str, prefixes: Sequence[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def key_class(key: str, old: Any = None, new: Any = None) -> str:
    """EXPERIMENT, HOW or IGNORED for a dotted config key (see the module docstring)."""
    if _under(key, _IGNORED) or key.endswith("timeout_s"):
        return IGNORED
    if _under(key, _HOW):
        return HOW
    if key == "model.tokenizer" and all(isinstance(v, str) and os.sep in v for v in (old, new)):
        return HOW  # a tokenizer directory moved; a built-in tokenizer name changed is another experiment
    return EXPERIMENT


@dataclass(frozen=True)
class Change:
    key: str
    old: Any
    new: Any

    def render(self) -> str:
        return f"{self.key}: {_show(self.old)} -> {_show(self.new)}"


def _show(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_show(x) for x in v) + "]"
    if isinstance(v, dict):
        return json.dumps(v, default=str)
    return str(v)


def flatten(tree: Any, prefix: str = "") -> Dict[str, Any]:
    """Dotted key -> value of a nested dict (lists are values)."""
    out: Dict[str, Any] = {}
    if isinstance(tree, dict) and tree:
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}{k}."))
    elif prefix:
        out[prefix[:-1]] = tree
    return out


def compare(saved: Dict[str, Any], current: Dict[str, Any]) -> Tuple[List[Change], List[Change]]:
    """(experiment changes, allowed changes) from the saved config to the current one. Keys only one side has (a
    setting added or removed between versions of qwen35rl) and redacted values are not compared."""
    old, new = flatten(saved), flatten(current)
    experiment, allowed = [], []
    for key in sorted(set(old) & set(new)):
        a, b = old[key], new[key]
        if a == b or REDACTED in (a, b):
            continue
        kind = key_class(key, a, b)
        if kind == EXPERIMENT:
            experiment.append(Change(key, a, b))
        elif kind == HOW:
            allowed.append(Change(key, a, b))
    return experiment, allowed


def _listed(changes: Sequence[Change], indent: str = "    ") -> str:
    lines = [indent + c.render() for c in changes[:_SHOWN]]
    if len(changes) > _SHOWN:
        lines.append(f"{indent}... and {len(changes) - _SHOWN} more")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ the run dir
def start_dirs(run_dir: Path) -> List[Path]:
    """The run's `provenance/start-<NNN>` directories, oldest first."""
    root = Path(run_dir) / PROVENANCE_DIR
    if not root.is_dir():
        return []
    found = [(int(p.name.split("-", 1)[1]), p) for p in root.glob("start-*") if p.name.split("-", 1)[1].isdigit()]
    return [p for _, p in sorted(found)]


def saved_config(checkpoint: Path, run_dir: Optional[Path] = None) -> Optional[Tuple[Path, Dict[str, Any]]]:
    """(file, config) of the start that wrote `checkpoint`: the one its meta.json names, else (a checkpoint saved
    before checkpoints named it) the newest start of its run directory with a config; None when there is none.
    `run_dir`: the run that wrote it (default: the one holding `checkpoints/` above it)."""
    from omegaconf import OmegaConf

    run_dir = Path(run_dir) if run_dir is not None else Path(checkpoint).parent.parent
    try:
        named = ckpt.read_meta(checkpoint).get(PROVENANCE_KEY)
    except (OSError, ValueError):
        named = None
    candidates = [run_dir / PROVENANCE_DIR / str(named)] if named else []
    candidates += list(reversed(start_dirs(run_dir)))
    for start in candidates:
        path = start / CONFIG_FILE
        if path.is_file():
            try:
                return path, OmegaConf.to_container(OmegaConf.load(path), resolve=False)
            except Exception as e:  # noqa: BLE001 - an unreadable record compares as no record
                log.warning("run identity: %s does not load (%s: %s); not compared", path, type(e).__name__, e)
    return None


def has_outputs(run_dir: Path) -> List[str]:
    return [name for name in OUTPUTS if (Path(run_dir) / name).exists()]


def start_over(run_dir: Path, checkpoints: Optional[Path] = None) -> Optional[Path]:
    """Move what an earlier run left in `run_dir` (checkpoints, metrics, TensorBoard events, curves, export,
    provenance) to `superseded/<time>/`, so a run starting from step 0 here never mixes with it; returns where
    they went (None when there was nothing). A checkpoint directory elsewhere (`trainer.checkpoint_dir`) keeps its
    place: its `step_<N>` directories move into its own `superseded/<time>/`."""
    run_dir = Path(run_dir)
    names = has_outputs(run_dir)
    elsewhere = checkpoints is not None and Path(checkpoints) != run_dir / ckpt.CHECKPOINTS
    steps = ckpt.CheckpointManager(checkpoints).step_dirs() if elsewhere else []
    if steps:
        aside = _superseded(Path(checkpoints))
        for path in steps:
            shutil.move(str(path), str(aside / path.name))
        if names:
            say(f"the earlier run's checkpoints in {shown_path(checkpoints)} moved to {shown_path(aside)}/")
    if not names:
        return aside if steps else None
    dest = _superseded(run_dir)
    for name in names:
        shutil.move(str(run_dir / name), str(dest / name))
    return dest


def _superseded(root: Path) -> Path:
    """A new `root/superseded/<time>/` directory."""
    dest = root / SUPERSEDED_DIR / time.strftime("%Y%m%d-%H%M%S")
    n = 1
    while dest.exists():
        n += 1
        dest = dest.with_name(f"{dest.name.split('.')[0]}.{n}")
    dest.mkdir(parents=True)
    return dest


def _total_steps(cfg: Any, saved: Optional[Dict[str, Any]], meta: Dict[str, Any]) -> Optional[int]:
    """trainer.total_steps of this launch, or (null: epochs over the train set, which needs the data) the saved
    run's when the epochs and the data did not change; None when unknown without loading the data."""
    total = cfg["trainer"]["total_steps"]
    if total is not None:
        return int(total)
    if saved is None or "total_steps" not in meta:
        return None
    same = (saved.get("trainer", {}).get("total_steps") is None
            and saved.get("trainer", {}).get("total_epochs") == cfg["trainer"]["total_epochs"])
    return int(meta["total_steps"]) if same else None


# -------------------------------------------------------------------------------------------------- decision
@dataclass
class Decision:
    """What a launch does with its run directory."""

    exit_code: Optional[int] = None
    """Set when the launch ends here: EXIT_CONFIG (refused) or 0 (already complete)."""
    checkpoint: Optional[Path] = None
    """The newest finished checkpoint the launch resumes from (not yet verified: the driver verifies it)."""
    complete: Optional[Tuple[int, int]] = None
    """(step, total steps) of a finished run."""
    experiment: List[Change] = field(default_factory=list)
    allowed: List[Change] = field(default_factory=list)
    saved_file: Optional[Path] = None


def decide(cfg: Any, run_dir: Path) -> Decision:
    """Compare this launch with the run in `run_dir` (nothing heavy imported; nothing written) and say so: a
    refusal with the diff and the ways out, "already complete", the allowed changes of a resume."""
    from omegaconf import OmegaConf

    run_dir = Path(run_dir)
    resume = str(cfg["trainer"]["resume"])
    if resume == "never":
        return Decision()
    if resume in ("auto", "force"):
        checkpoint = ckpt.CheckpointManager(ckpt.checkpoint_dir(run_dir, cfg)).latest(verified=False)
    else:
        checkpoint = Path(resume).expanduser()
        if not (checkpoint / ckpt.META_FILE).is_file():
            return Decision()  # the driver refuses it, naming what is wrong
    if checkpoint is None:
        return Decision()
    try:
        meta = ckpt.read_meta(checkpoint)
    except (OSError, ValueError):
        return Decision(checkpoint=checkpoint)  # damaged: the driver names it and takes the newest intact one
    found = saved_config(checkpoint, run_dir if resume in ("auto", "force") else None)
    current = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)
    decision = Decision(checkpoint=checkpoint)
    if found is not None:
        decision.saved_file, saved = found
        decision.experiment, decision.allowed = compare(saved, current)
    else:
        saved = None
    if decision.experiment:
        if resume == "auto":
            log.error("%s", refusal(run_dir, decision))
            decision.exit_code = EXIT_CONFIG
            return decision
        log.warning("resuming %s with trainer.resume=%s although the experiment changed (saved in %s -> now):\n%s",
                    shown_path(checkpoint), "force" if resume == "force" else "<dir>",
                    shown_path(decision.saved_file), _listed(decision.experiment))
    if decision.allowed:
        log.info("resuming with changes the run allows (saved in %s -> now):\n%s", shown_path(decision.saved_file),
                 _listed(decision.allowed))
    step = int(meta.get("step", -1))
    total = _total_steps(cfg, saved, meta)
    exported = not cfg["trainer"]["export_hf"] or (run_dir / FINAL_DIR / "config.json").is_file()
    if total is not None and step >= total and exported and checkpoint.parent.parent.resolve() == run_dir.resolve():
        decision.complete = (step, total)
        decision.exit_code = 0
    return decision


def refusal(run_dir: Path, d: Decision) -> str:
    """The block a refused resume prints: what changed, what may change, the ways out."""
    step = ckpt.read_meta(d.checkpoint).get("step", "?") if d.checkpoint else "?"
    text = (f"[resume_config_changed] trainer.resume: {shown_path(run_dir)} holds a run made with another config; "
            f"resuming its checkpoint step_{step} with this one would mix two experiments in one run directory\n"
            f"  changed (saved in {shown_path(d.saved_file)} -> now):\n{_listed(d.experiment)}")
    if d.allowed:
        text += ("\n  also changed, which a resume allows (hardware, layout, engine knobs, length, paths):\n"
                 + _listed(d.allowed))
    text += (f"\n  hint: start over in this directory: trainer.resume=never (the earlier run's outputs move to "
             f"{shown_path(Path(run_dir) / SUPERSEDED_DIR)}/); or another run directory: trainer.run_name=<name>; or "
             "resume it anyway: trainer.resume=force")
    return text


def settle(cfg: Any, run_dir: Path) -> Decision:
    """`decide` on `run_dir`, and what it prints: the refusal (logged by `decide`), or "already
    complete" with where the results are."""
    decision = decide(cfg, run_dir)
    if decision.complete is not None:
        from qwen35rl.runtime.tracking import METRICS_FILE, read_metrics

        step, total = decision.complete
        head = (f"already complete (step {step} of {total}): nothing to train; raise trainer.total_steps to train "
                f"further, or trainer.resume=never to start over")
        say(summary(run_dir, read_metrics(Path(run_dir) / METRICS_FILE), total, head=head))
    return decision
