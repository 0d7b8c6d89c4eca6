"""The one table between verl's config tree and qwen35rl's schema, read by both directions: `qwen35rl-import verl`
(verl overrides -> an experiment overlay) and `qwen35rl-plan ... format=verl` (a composed config -> verl overrides).

Each `Key` names verl 0.9.1's key (what the exporter writes), the qwen35rl key it carries to, the backends it applies
to, other verl names the importer also accepts (the 0.8.0 line's names, and keys verl keeps in several places), the
conversion each way, whether verl's tree lacks the key (exported with `+`), and verl 0.9.1's default where the tree
states one (the importer carries it when a script relies on it and qwen35rl composes something else). Tests compose
every exported list in verl 0.9.1's own config tree and compare these defaults with it.

Keys the importer reads but does not carry are in `NOT_CARRIED` with the reason; the environment has its own policy
at the end. Standard library only."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from qwen35rl.config.capabilities import compiles_log_probs, rollout_is_mode

ACTOR = "actor_rollout_ref.actor"
ROLLOUT = "actor_rollout_ref.rollout"
REF = "actor_rollout_ref.ref"
MODEL = "actor_rollout_ref.model"
OVERRIDE_TC = f"{ACTOR}.megatron.override_transformer_config"
OVERRIDE_OPT = f"{ACTOR}.optim.override_optimizer_config"
VLLM_KWARGS = f"{ROLLOUT}.engine_kwargs.vllm"

BOTH = ("fsdp", "megatron")
FSDP = ("fsdp",)
MEGATRON = ("megatron",)
class NotCarried(Exception):
    """Raised by a conversion to qwen35rl when verl's value has no counterpart there (the message says why)."""


UNSET = object()
"""A `Key.verl_default` that verl's tree does not state (or that is not carried when a script leaves it unset)."""


def get(tree: Mapping[str, Any], dotted: str, default: Any = None) -> Any:
    """`tree[a][b][c]` for 'a.b.c' (plain dicts or DictConfigs), `default` when any part is missing."""
    node: Any = tree
    for part in dotted.split("."):
        try:
            node = node[part]
        except (KeyError, TypeError, IndexError):
            return default
    return node


def _same(v: Any, ctx: Any = None) -> Any:
    return v


def _as_list(v: Any, ctx: Any = None) -> Any:
    return [v] if isinstance(v, str) else v


def _none_is_zero(v: Any, ctx: Any = None) -> Any:
    return 0 if v is None else v


def _zero_is_none(v: Any, ctx: Any = None) -> Any:
    return None if v in (0, None) else v


def _warmup_to_qwen(v: Any, ctx: Any = None) -> Any:
    return 0 if v is None or int(v) < 0 else int(v)


def _none_is_one(v: Any, ctx: Any = None) -> Any:
    return 1 if v is None else v


@dataclass(frozen=True)
class Key:
    verl: str
    """verl 0.9.1's name: the one the exporter writes."""
    qwen: str
    """The qwen35rl key it carries to."""
    backends: Tuple[str, ...] = BOTH
    aliases: Tuple[str, ...] = ()
    """Other verl names the importer reads for the same setting (older names; the ref/rollout copies)."""
    also: Tuple[str, ...] = ()
    """Further verl keys the exporter writes with the same value (verl asks for them separately)."""
    plus: bool = False
    """verl 0.9.1's tree lacks the key: exported as `+key=value`."""
    to_verl: Callable[[Any, Any], Any] = _same
    """(qwen35rl's effective value, the composed config) -> verl's value."""
    to_qwen: Callable[[Any, Any], Any] = _same
    """(verl's value, the verl values read so far) -> qwen35rl's value."""
    verl_default: Any = UNSET
    """verl 0.9.1's value when nothing sets the key (tested against its tree)."""
    effective: Optional[Callable[[Any], Any]] = None
    """qwen35rl's effective value in a composed config when it is not simply the config value (derived layouts)."""
    canon: Optional[Callable[[Any, Any], Any]] = None
    """(a qwen35rl value, the composed config) -> the value it amounts to there, for comparing an imported value with
    the composed one (fsdp_size -1 is the world size)."""
    export_when: Optional[Callable[[Any], bool]] = None
    """Export only when this holds for the composed config (e.g. a quirk the hardware has)."""
    exported: bool = True
    """False: the importer reads it (an older verl line's key), verl 0.9.1 has nowhere to write it."""
    only_equal: str = ""
    """Set: the importer never changes the qwen35rl key for this verl key (it sets more than verl's key does); a
    script value equal to the composed one is already the default, another is not carried, with this reason."""

    def qwen_value(self, cfg: Any) -> Any:
        return self.effective(cfg) if self.effective else get(cfg, self.qwen)

    def names(self) -> Tuple[str, ...]:
        return (self.verl, *self.aliases)


# --------------------------------------------------------------------------------------- effective qwen values
def effective_remove_padding(cfg: Any) -> bool:
    """What `backend.remove_padding` does on the cluster: null packs with FSDP where it pays (CUDA, whose images
    carry flash-linear-attention, or Ulysses SP); the Megatron engine trains padded batches."""
    rp = get(cfg, "backend.remove_padding")
    if rp is not None:
        return bool(rp)
    if get(cfg, "backend.name") != "fsdp":
        return False
    return get(cfg, "hw.device") == "cuda" or int(get(cfg, "parallelism.sp", 1) or 1) > 1


def _fsdp_size(v: Any, cfg: Any) -> Any:
    world = int(get(cfg, "hw.nodes")) * int(get(cfg, "hw.devices_per_node"))
    return world if v in (-1, 0, None) else int(v)


def _budget_to_verl(v: Any, cfg: Any) -> Any:
    """verl's budget is per GPU of an SP group (its micro batch holds budget x SP tokens, split over the group);
    qwen35rl's is the micro batch before the split."""
    sp = int(get(cfg, "parallelism.sp", 1) or 1) if get(cfg, "backend.name") == "fsdp" else 1
    return int(v) // sp


def _budget_to_qwen(v: Any, ctx: Any) -> Any:
    sp = get_verl(ctx, f"{ACTOR}.ulysses_sequence_parallel_size",
                  get_verl(ctx, f"{ACTOR}.fsdp_config.ulysses_sequence_parallel_size", 1))
    return int(v) * int(sp or 1)


def _log_prob_micro_to_verl(v: Any, cfg: Any) -> Any:
    """null runs the forward-only passes in training micro batches: verl is given that value."""
    v = get(cfg, "backend.micro_batch_size_per_device") if v is None else v
    return int(v) if isinstance(v, int) else None


def _log_prob_micro_to_qwen(v: Any, ctx: Any) -> Any:
    """The actor's micro batch (or none given) is qwen35rl's null; another is the log-prob passes' own."""
    same = get_verl(ctx, f"{ACTOR}.ppo_micro_batch_size_per_gpu")
    return None if v is None or (same is not None and int(v) == int(same)) else int(v)


def _log_prob_budget_to_verl(v: Any, cfg: Any) -> Any:
    """null is the training budget."""
    v = get(cfg, "backend.max_tokens_per_device") if v is None else v
    return _budget_to_verl(v, cfg) if isinstance(v, int) else None


def _log_prob_budget_to_qwen(v: Any, ctx: Any) -> Any:
    """verl's default is the actor's budget, which is qwen35rl's null."""
    if v is None:
        return None
    actor = get_verl(ctx, f"{ACTOR}.ppo_max_token_len_per_gpu", 16384)
    budget = _budget_to_qwen(v, ctx)
    return None if budget == _budget_to_qwen(actor, ctx) else budget


def _strategy_to_verl(v: Any, cfg: Any) -> Any:
    return "fsdp2" if v == "fsdp" else v


def _strategy_to_qwen(v: Any, ctx: Any) -> Any:
    if v == "fsdp":
        raise NotCarried("verl's strategy fsdp is FSDP1; qwen35rl's FSDP engine is FSDP2 (verl's fsdp2)")
    return "fsdp" if v == "fsdp2" else v


def _rollout_dp(cfg: Any) -> int:
    """vLLM data parallel inside one rollout engine: qwen35rl's rollout dp counts engines when EP is 1 (each
    engine TP devices), and is vLLM's DP-attention degree of the one EP engine when EP > 1."""
    par = get(cfg, "parallelism.rollout")
    if int(par["ep"]) > 1:
        from qwen35rl.config.layout import derive_layout

        return derive_layout(cfg).rollout_dp
    return 1


def _rollout_dp_to_qwen(v: Any, ctx: Any) -> Any:
    ep = int(get_verl(ctx, f"{ROLLOUT}.expert_parallel_size", 1) or 1)
    if ep == 1 and int(v or 1) > 1:
        raise NotCarried("with rollout EP 1 qwen35rl runs world/TP separate vLLM engines; vLLM data parallel "
                         "inside one engine comes with EP (set expert_parallel_size = TP x DP)")
    return int(v) if ep > 1 else None


def _metric_to_qwen(v: Any, ctx: Any) -> Any:
    """verl's filter_groups.metric: `reward` (the reward as the trainer uses it, shaping included) and `score`
    (the reward function's score) are qwen35rl's two group-filter signals of the same names."""
    if v not in ("reward", "score"):
        raise NotCarried(f"verl's filter_groups.metric={v!r}: qwen35rl filters groups on the reward function's "
                         "score (score) or the shaped reward (reward)")
    return v


def _rollout_is_to_verl(v: Any, cfg: Any) -> Any:
    """verl's rollout_correction.rollout_is: token | sequence, null for off."""
    return None if v == "off" else v


def _rollout_is_to_qwen(v: Any, ctx: Any) -> Any:
    if v is None:
        return "off"
    if v not in ("token", "sequence"):
        raise NotCarried(f"verl's rollout_is={v!r}: qwen35rl weighs per token or per sequence")
    return v


def _is_threshold_to_qwen(v: Any, ctx: Any) -> Any:
    try:
        return float(v)
    except (TypeError, ValueError):
        raise NotCarried(f"verl's rollout_is_threshold={v!r} (lower_upper bounds, IcePop): qwen35rl truncates "
                         "the weight at one upper bound") from None


def _recompute(cfg: Any) -> Any:
    return get(cfg, "backend.recompute_granularity") if get(cfg, "backend.gradient_checkpointing") else None


def _min_lr_to_verl(ratio: Any, cfg: Any) -> Any:
    return float(ratio) * float(get(cfg, "backend.lr"))


def _min_lr_to_qwen(v: Any, ctx: Any) -> Any:
    lr = float(get_verl(ctx, f"{ACTOR}.optim.lr", 1e-6))
    return 0.0 if not v else float(v) / lr


def _etp_to_qwen(v: Any, ctx: Any) -> Any:
    """megatron-core's expert TP of null means 'the dense TP'."""
    return int(get_verl(ctx, f"{ACTOR}.megatron.tensor_model_parallel_size", 1) or 1) if v is None else int(v)


def _trackers_to_verl(v: Any, cfg: Any) -> Any:
    return [t for t in v if t != "jsonl"]


def _trackers_to_qwen(v: Any, ctx: Any) -> Any:
    """verl's loggers qwen35rl has, plus `jsonl` (the run's own metrics.jsonl record, always kept)."""
    from qwen35rl.names import TRACKERS

    out = [str(t) for t in ([v] if isinstance(v, str) else v) if str(t) in TRACKERS]
    if "jsonl" not in out:
        out.insert(1 if out[:1] == ["console"] else 0, "jsonl")
    return out


def _resume_to_verl(v: Any, cfg: Any) -> Any:
    return {"auto": "auto", "never": "disable", "force": "auto"}.get(str(v), "resume_path")  # verl never compares


def _resume_to_qwen(v: Any, ctx: Any) -> Any:
    if v == "disable":
        return "never"
    if v == "resume_path":
        return get_verl(ctx, "trainer.resume_from_path", None) or "auto"
    return "auto"


def _resume_path(cfg: Any) -> Any:
    r = str(get(cfg, "trainer.resume"))
    return None if r in ("auto", "never", "force") else r


def _bf16_to_verl(v: Any, cfg: Any) -> Any:
    return "bfloat16" if v else None


def _bf16_to_qwen(v: Any, ctx: Any) -> Any:
    """verl's Megatron engine trains in bfloat16 or float16; qwen35rl's in bf16 (backend.bf16) or fp32."""
    if v != "bfloat16":
        raise NotCarried(f"verl's Megatron dtype {v!r}: qwen35rl's Megatron engine trains in bfloat16 "
                         "(backend.bf16=true) or float32")
    return True


CUSTOM_REWARD = "reward.custom_reward_function"
"""verl 0.9.1's custom reward function; the top-level `custom_reward_function` is its older form (verl moves a
non-null one here when it starts)."""
LEGACY_CUSTOM_REWARD = "custom_reward_function"


def _custom_reward(ctx: Any, field: str) -> Any:
    return get_verl(ctx, f"{CUSTOM_REWARD}.{field}", get_verl(ctx, f"{LEGACY_CUSTOM_REWARD}.{field}"))


_DEFAULT_REWARD = ("verl then scores with its built-in reward of each row's data_source; set data.reward to "
                   "qwen35rl's counterpart (math, exact_match, ...)")


def _reward_path_to_qwen(v: Any, ctx: Any) -> Any:
    """custom_reward_function (path, name) is `data.reward=verl:PATH:NAME`: verl's function, called with verl's
    arguments (`qwen35rl.rewards.verl_signature`)."""
    from qwen35rl.names import verl_reward

    if not v:
        raise NotCarried(f"no custom reward file (path is null): {_DEFAULT_REWARD}")
    return verl_reward(str(v), _custom_reward(ctx, "name"))


def _reward_name_to_qwen(v: Any, ctx: Any) -> Any:
    from qwen35rl.names import verl_reward

    path = _custom_reward(ctx, "path")
    if not path:
        raise NotCarried(f"a reward function name without custom_reward_function.path: {_DEFAULT_REWARD}")
    return verl_reward(str(path), v)


def _verl_reward_part(i: int) -> Callable[[Any, Any], Any]:
    def to_verl(v: Any, cfg: Any) -> Any:
        from qwen35rl.names import parse_verl_reward

        parsed = parse_verl_reward(str(v))
        return parsed[i] if parsed else None

    return to_verl


def _is_verl_reward(cfg: Any) -> bool:
    from qwen35rl.names import parse_verl_reward

    return parse_verl_reward(str(get(cfg, "data.reward"))) is not None


RAY_RUNTIME_ENV = "ray_kwargs.ray_init.runtime_env"
"""verl hands `ray_kwargs.ray_init` to ray.init; qwen35rl's counterpart of its runtime_env is hw.ray_runtime_env."""


def _py_executable_to_qwen(v: Any, ctx: Any) -> Any:
    """Ray's py_executable: an interpreter path or a command prefix ending in one (a string); null is Ray's default."""
    if v is None or v == "":
        return None
    if not isinstance(v, str):
        raise NotCarried(f"py_executable={v!r} is not a string: Ray takes an interpreter path or a command prefix "
                         "that ends in one (hw.ray_runtime_env.py_executable)")
    return v


def _quirk(name: str) -> Callable[[Any], bool]:
    return lambda cfg: get(cfg, f"hw.megatron_quirks.{name}") is not None


def get_verl(ctx: Any, key: str, default: Any = None) -> Any:
    """A verl value read so far by the importer (a flat {dotted key: value} dict)."""
    return ctx.get(key, default) if isinstance(ctx, dict) else default


# --------------------------------------------------------------------------------------------------- the table
KEYS: List[Key] = [
    # model and data
    Key(f"{MODEL}.path", "model.path", effective=lambda c: get(c, "model.path") or get(c, "model.hf_id")),
    # one setting for every place the checkpoint is loaded (verl's driver reads data.trust_remote_code for its
    # tokenizer and processor, its workers model.trust_remote_code): exported to both
    Key(f"{MODEL}.trust_remote_code", "model.trust_remote_code", aliases=("data.trust_remote_code",),
        also=("data.trust_remote_code",), verl_default=False,
        export_when=lambda c: bool(get(c, "model.trust_remote_code"))),
    Key(f"{ACTOR}.freeze_vision_tower", "model.freeze_vision_tower", verl_default=False),
    Key("data.train_files", "data.train_files", to_qwen=_as_list),
    Key("data.val_files", "data.val_files", to_qwen=_as_list),
    Key("data.prompt_key", "data.prompt_key", verl_default="prompt"),
    Key("data.image_key", "data.image_key", verl_default="images"),
    Key("data.train_batch_size", "data.train_batch_size", verl_default=1024),
    Key("data.val_batch_size", "data.val_batch_size"),
    Key("data.max_prompt_length", "data.max_prompt_length", verl_default=512),
    Key("data.max_response_length", "data.max_response_length", verl_default=512),
    Key("data.truncation", "data.truncation", verl_default="error"),
    Key("data.filter_overlong_prompts", "data.filter_overlong_prompts", verl_default=False),
    Key("data.seed", "data.seed"),
    Key("data.shuffle", "data.shuffle", verl_default=True),
    # the reward: verl's custom reward function (both of its fields make one data.reward value)
    Key(f"{CUSTOM_REWARD}.path", "data.reward", aliases=(f"{LEGACY_CUSTOM_REWARD}.path",),
        to_qwen=_reward_path_to_qwen, to_verl=_verl_reward_part(0), export_when=_is_verl_reward),
    Key(f"{CUSTOM_REWARD}.name", "data.reward", aliases=(f"{LEGACY_CUSTOM_REWARD}.name",),
        to_qwen=_reward_name_to_qwen, to_verl=_verl_reward_part(1), export_when=_is_verl_reward),
    # rollout
    Key(f"{ROLLOUT}.name", "rollout.engine"),
    Key(f"{ROLLOUT}.n", "rollout.n", verl_default=1),
    Key(f"{ROLLOUT}.temperature", "rollout.temperature", verl_default=1.0),
    Key(f"{ROLLOUT}.top_p", "rollout.top_p", verl_default=1),
    Key(f"{ROLLOUT}.top_k", "rollout.top_k", verl_default=-1),
    Key(f"{ROLLOUT}.gpu_memory_utilization", "rollout.gpu_memory_utilization", verl_default=0.5),
    Key(f"{ROLLOUT}.max_model_len", "rollout.max_model_len", verl_default=None),
    Key(f"{ROLLOUT}.max_num_batched_tokens", "rollout.max_num_batched_tokens", verl_default=8192),
    Key(f"{ROLLOUT}.max_num_seqs", "rollout.max_num_seqs", verl_default=256),
    Key(f"{ROLLOUT}.enable_chunked_prefill", "rollout.enable_chunked_prefill", verl_default=True),
    Key(f"{ROLLOUT}.enable_prefix_caching", "rollout.enable_prefix_caching", verl_default=True),
    Key(f"{ROLLOUT}.enforce_eager", "rollout.enforce_eager", verl_default=False),
    Key(f"{ROLLOUT}.free_cache_engine", "rollout.free_cache_engine", verl_default=True),
    Key(f"{ROLLOUT}.cudagraph_capture_sizes", "rollout.cudagraph_capture_sizes", verl_default=None),
    # vLLM serves in model.dtype (`engines.vllm_rollout.engine_dtype`); model.dtype also sets the training engine's
    # weights, so a rollout dtype of its own is not carried there
    Key(f"{ROLLOUT}.dtype", "model.dtype",
        only_equal="qwen35rl serves the rollout in model.dtype, which also sets the dtype of the training engine's "
                   "weights: set model.dtype to change both"),
    Key(f"{VLLM_KWARGS}.compilation_config.cudagraph_mode", "rollout.cudagraph_mode", plus=True,
        export_when=lambda c: get(c, "rollout.cudagraph_mode") is not None),
    Key(f"{ROLLOUT}.val_kwargs.temperature", "rollout.val_temperature", verl_default=0),
    Key(f"{ROLLOUT}.checkpoint_engine.update_weights_bucket_megabytes", "rollout.weight_sync_bucket_mb",
        aliases=(f"{ROLLOUT}.update_weights_bucket_megabytes",), verl_default=2048),
    Key(f"{ROLLOUT}.tensor_model_parallel_size", "parallelism.rollout.tp", verl_default=2),
    Key(f"{ROLLOUT}.expert_parallel_size", "parallelism.rollout.ep", verl_default=1),
    Key(f"{ROLLOUT}.data_parallel_size", "parallelism.rollout.dp", verl_default=1, effective=_rollout_dp,
        to_qwen=_rollout_dp_to_qwen),
    # batches
    Key(f"{ACTOR}.ppo_mini_batch_size", "algorithm.mini_batch_size", verl_default=256),
    Key(f"{ACTOR}.ppo_micro_batch_size_per_gpu", "backend.micro_batch_size_per_device"),
    # the forward-only passes: verl sizes the rollout's (old log-probs) and the reference's separately, qwen35rl
    # has one setting for both; a ref value unlike the rollout's is not carried (`_carry` names it)
    Key(f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu", "backend.log_prob_micro_batch_size_per_device",
        aliases=(f"{REF}.log_prob_micro_batch_size_per_gpu",), also=(f"{REF}.log_prob_micro_batch_size_per_gpu",),
        to_verl=_log_prob_micro_to_verl, to_qwen=_log_prob_micro_to_qwen),
    Key(f"{ACTOR}.use_dynamic_bsz", "backend.dynamic_batch_size", verl_default=False,
        aliases=(f"{REF}.log_prob_use_dynamic_bsz", f"{ROLLOUT}.log_prob_use_dynamic_bsz")),
    Key(f"{ACTOR}.ppo_max_token_len_per_gpu", "backend.max_tokens_per_device", verl_default=16384,
        to_verl=_budget_to_verl, to_qwen=_budget_to_qwen),
    Key(f"{ROLLOUT}.log_prob_max_token_len_per_gpu", "backend.log_prob_max_tokens_per_device",
        aliases=(f"{REF}.log_prob_max_token_len_per_gpu",), also=(f"{REF}.log_prob_max_token_len_per_gpu",),
        to_verl=_log_prob_budget_to_verl, to_qwen=_log_prob_budget_to_qwen,
        export_when=lambda c: get(c, "backend.log_prob_max_tokens_per_device") is not None),
    Key(f"{ACTOR}.strategy", "backend.name", to_verl=_strategy_to_verl, to_qwen=_strategy_to_qwen),
    # the loss
    Key("algorithm.adv_estimator", "algorithm.adv_estimator", verl_default="gae"),
    Key("algorithm.norm_adv_by_std_in_grpo", "algorithm.norm_adv_by_std", verl_default=True),
    Key("algorithm.use_kl_in_reward", "algorithm.use_kl_in_reward", verl_default=False),
    Key("algorithm.filter_groups.enable", "algorithm.dynamic_sampling.enable", verl_default=False),
    Key("algorithm.filter_groups.max_num_gen_batches", "algorithm.dynamic_sampling.max_rounds",
        to_verl=lambda v, c: int(v) + 1, to_qwen=lambda v, x: max(int(v) - 1, 0)),
    Key("algorithm.filter_groups.metric", "algorithm.dynamic_sampling.metric", to_qwen=_metric_to_qwen),
    Key("algorithm.rollout_correction.bypass_mode", "backend.use_rollout_log_probs", verl_default=False),
    # truncated importance sampling by the rollout policy: the same weights (old / behaviour, capped) on both sides
    Key("algorithm.rollout_correction.rollout_is", "algorithm.rollout_is", verl_default=None,
        effective=rollout_is_mode, to_verl=_rollout_is_to_verl, to_qwen=_rollout_is_to_qwen),
    Key("algorithm.rollout_correction.rollout_is_threshold", "algorithm.rollout_is_threshold", verl_default=2.0,
        to_qwen=_is_threshold_to_qwen),
    Key(f"{ACTOR}.ppo_epochs", "algorithm.ppo_epochs", verl_default=1),
    Key(f"{ACTOR}.shuffle", "algorithm.shuffle", verl_default=False),
    Key(f"{ACTOR}.clip_ratio_low", "algorithm.clip_ratio_low", verl_default=0.2),
    Key(f"{ACTOR}.clip_ratio_high", "algorithm.clip_ratio_high", verl_default=0.2),
    Key(f"{ACTOR}.clip_ratio_c", "algorithm.clip_ratio_c", verl_default=3.0),
    Key(f"{ACTOR}.loss_agg_mode", "algorithm.loss_agg_mode", verl_default="token-mean"),
    Key(f"{ACTOR}.loss_scale_factor", "algorithm.loss_scale_factor", verl_default=None),
    Key(f"{ACTOR}.entropy_coeff", "algorithm.entropy_coef", verl_default=0),
    Key(f"{ACTOR}.use_kl_loss", "algorithm.use_kl_loss", verl_default=False),
    Key(f"{ACTOR}.kl_loss_coef", "algorithm.kl_loss_coef", verl_default=0.001),
    Key(f"{ACTOR}.kl_loss_type", "algorithm.kl_loss_type", verl_default="low_var_kl"),
    # the optimizer
    Key(f"{ACTOR}.optim.lr", "backend.lr", verl_default=1e-6),
    Key(f"{ACTOR}.optim.lr_warmup_steps", "backend.lr_warmup_steps", verl_default=-1, to_qwen=_warmup_to_qwen),
    Key(f"{ACTOR}.optim.weight_decay", "backend.weight_decay", verl_default=0.01),
    Key(f"{ACTOR}.optim.betas", "backend.betas", verl_default=[0.9, 0.999]),
    Key(f"{ACTOR}.optim.clip_grad", "backend.grad_clip", aliases=(f"{ACTOR}.grad_clip",), verl_default=1.0),
    Key(f"{ACTOR}.optim.lr_scheduler_type", "backend.lr_scheduler", FSDP, aliases=(f"{ACTOR}.optim.warmup_style",),
        verl_default="constant"),
    Key(f"{ACTOR}.optim.min_lr_ratio", "backend.min_lr_ratio", FSDP, verl_default=0.0),
    Key(f"{ACTOR}.optim.lr_decay_style", "backend.lr_scheduler", MEGATRON, verl_default="constant"),
    Key(f"{ACTOR}.optim.min_lr", "backend.min_lr_ratio", MEGATRON, to_verl=_min_lr_to_verl, to_qwen=_min_lr_to_qwen,
        verl_default=0.0),
    Key(f"{ACTOR}.optim.use_precision_aware_optimizer", "backend.use_precision_aware_optimizer", MEGATRON,
        aliases=(f"{OVERRIDE_OPT}.use_precision_aware_optimizer",), verl_default=False),
    Key(f"{OVERRIDE_OPT}.optimizer_cpu_offload", "backend.optimizer_cpu_offload", MEGATRON, plus=True),
    Key(f"{OVERRIDE_OPT}.optimizer_offload_fraction", "backend.optimizer_offload_fraction", MEGATRON, plus=True),
    Key(f"{OVERRIDE_OPT}.overlap_cpu_optimizer_d2h_h2d", "backend.overlap_cpu_optimizer_d2h_h2d", MEGATRON, plus=True),
    Key("actor_rollout_ref.nccl_timeout", "backend.dist_timeout_s", verl_default=600),
    # an implementation detail: verl's default stays on import; null is what the engine does on the composed device
    Key(f"{ACTOR}.use_torch_compile", "backend.use_torch_compile",
        effective=lambda c: compiles_log_probs(get(c, "backend.use_torch_compile"), get(c, "hw.device"))),
    # FSDP
    Key(f"{ACTOR}.fsdp_config.fsdp_size", "parallelism.fsdp_size", FSDP, verl_default=-1, canon=_fsdp_size),
    Key(f"{ACTOR}.ulysses_sequence_parallel_size", "parallelism.sp", FSDP, verl_default=1,
        aliases=(f"{ACTOR}.fsdp_config.ulysses_sequence_parallel_size",),
        also=(f"{ACTOR}.fsdp_config.ulysses_sequence_parallel_size",)),
    Key(f"{ACTOR}.fsdp_config.param_offload", "backend.param_offload", FSDP, verl_default=False,
        aliases=(f"{REF}.fsdp_config.param_offload",), also=(f"{REF}.fsdp_config.param_offload",)),
    Key(f"{ACTOR}.fsdp_config.optimizer_offload", "backend.optimizer_offload", FSDP, verl_default=False),
    Key(f"{ACTOR}.fsdp_config.offload_policy", "backend.offload_policy", FSDP, verl_default=False),
    Key(f"{ACTOR}.fsdp_config.reshard_after_forward", "backend.reshard_after_forward", FSDP, verl_default=True),
    Key(f"{MODEL}.use_remove_padding", "backend.remove_padding", FSDP, verl_default=True,
        effective=effective_remove_padding),
    Key(f"{MODEL}.enable_gradient_checkpointing", "backend.gradient_checkpointing", FSDP, verl_default=True),
    Key(f"{ACTOR}.entropy_from_logits_with_chunking", "backend.entropy_from_logits_with_chunking", FSDP),
    # Megatron
    Key(f"{ACTOR}.megatron.tensor_model_parallel_size", "parallelism.tp", MEGATRON, verl_default=1,
        aliases=(f"{REF}.megatron.tensor_model_parallel_size",)),
    Key(f"{ACTOR}.megatron.pipeline_model_parallel_size", "parallelism.pp", MEGATRON, verl_default=1,
        aliases=(f"{REF}.megatron.pipeline_model_parallel_size",)),
    Key(f"{ACTOR}.megatron.context_parallel_size", "parallelism.cp", MEGATRON, verl_default=1,
        aliases=(f"{REF}.megatron.context_parallel_size",)),
    Key(f"{ACTOR}.megatron.expert_model_parallel_size", "parallelism.ep", MEGATRON, verl_default=1,
        aliases=(f"{REF}.megatron.expert_model_parallel_size",)),
    Key(f"{ACTOR}.megatron.expert_tensor_parallel_size", "parallelism.etp", MEGATRON, verl_default=None,
        aliases=(f"{REF}.megatron.expert_tensor_parallel_size",), to_qwen=_etp_to_qwen),
    Key(f"{ACTOR}.megatron.virtual_pipeline_model_parallel_size", "parallelism.vpp", MEGATRON, verl_default=None,
        aliases=(f"{REF}.megatron.virtual_pipeline_model_parallel_size",)),
    Key(f"{ACTOR}.megatron.param_offload", "backend.param_offload", MEGATRON, verl_default=False,
        aliases=(f"{REF}.megatron.param_offload",)),
    Key(f"{ACTOR}.megatron.optimizer_offload", "backend.optimizer_offload", MEGATRON, verl_default=False),
    Key(f"{ACTOR}.megatron.grad_offload", "backend.grad_offload", MEGATRON, exported=False),
    Key(f"{ACTOR}.megatron.use_distributed_optimizer", "backend.use_distributed_optimizer", MEGATRON,
        verl_default=True),
    Key(f"{ACTOR}.megatron.use_dist_checkpointing", "backend.use_dist_checkpointing", MEGATRON, verl_default=False),
    Key(f"{ACTOR}.megatron.dtype", "backend.bf16", MEGATRON, verl_default="bfloat16", to_verl=_bf16_to_verl,
        to_qwen=_bf16_to_qwen, export_when=lambda c: bool(get(c, "backend.bf16"))),
    # verl's engine workers set the Megatron engine's use_remove_padding from model.use_remove_padding
    Key(f"{MODEL}.use_remove_padding", "backend.remove_padding", MEGATRON, verl_default=True,
        aliases=(f"{ACTOR}.megatron.use_remove_padding",), also=(f"{ACTOR}.megatron.use_remove_padding",),
        effective=effective_remove_padding),
    Key(f"{OVERRIDE_TC}.recompute_granularity", "backend.recompute_granularity", MEGATRON, verl_default=None,
        effective=_recompute),
    Key(f"{OVERRIDE_TC}.recompute_method", "backend.recompute_method", MEGATRON, verl_default=None),
    Key(f"{OVERRIDE_TC}.recompute_num_layers", "backend.recompute_num_layers", MEGATRON, verl_default=None,
        to_qwen=_none_is_one),
    Key(f"{OVERRIDE_TC}.moe_grouped_gemm", "backend.moe_grouped_gemm", MEGATRON, plus=True),
    Key(f"{OVERRIDE_TC}.moe_permute_fusion", "backend.moe_permute_fusion", MEGATRON, plus=True),
    Key(f"{OVERRIDE_TC}.moe_aux_loss_coeff", "backend.moe_aux_loss_coeff", MEGATRON, plus=True),
    Key(f"{OVERRIDE_TC}.moe_z_loss_coeff", "backend.moe_z_loss_coeff", MEGATRON, plus=True),
    Key(f"{OVERRIDE_TC}.moe_token_dispatcher_type", "backend.moe_token_dispatcher_type", MEGATRON, plus=True),
    # MindSpeed switches (Ascend) that qwen35rl's platform quirks name; other MindSpeed switches: hw.mindspeed
    Key(f"{OVERRIDE_TC}.use_flash_attn", "hw.megatron_quirks.use_flash_attn", MEGATRON, plus=True,
        export_when=_quirk("use_flash_attn")),
    Key(f"{OVERRIDE_TC}.use_naive_l2norm", "hw.megatron_quirks.gdn_naive_l2norm", MEGATRON, plus=True,
        export_when=_quirk("gdn_naive_l2norm")),
    # Ray: the runtime environment verl passes to ray.init (its workers inherit it)
    Key(f"{RAY_RUNTIME_ENV}.py_executable", "hw.ray_runtime_env.py_executable", verl_default=None,
        to_qwen=_py_executable_to_qwen, export_when=lambda c: get(c, "hw.ray_runtime_env.py_executable") is not None),
    # the trainer loop
    Key("trainer.total_epochs", "trainer.total_epochs", verl_default=30),
    Key("trainer.balance_batch", "trainer.balance_batch", verl_default=True),
    Key("trainer.total_training_steps", "trainer.total_steps", verl_default=None),
    Key("trainer.save_freq", "trainer.save_freq", verl_default=-1),
    Key("trainer.test_freq", "trainer.test_freq", verl_default=-1),
    Key("trainer.val_before_train", "trainer.val_before_train", verl_default=True),
    Key("trainer.project_name", "trainer.project_name"),
    Key("trainer.log_val_generations", "trainer.log_val_generations"),  # logging only: verl's default of 0 stays
    Key("trainer.experiment_name", "trainer.run_name"),
    Key("trainer.logger", "trainer.trackers", to_verl=_trackers_to_verl, to_qwen=_trackers_to_qwen,
        verl_default=["console", "wandb"]),
    Key("trainer.max_actor_ckpt_to_keep", "trainer.max_keep_checkpoints", to_verl=_zero_is_none,
        to_qwen=_none_is_zero, verl_default=None),
    # where checkpoints go: exported only when set (null is the run directory's checkpoints/, which verl's default,
    # checkpoints/<project_name>/<experiment_name>, is not)
    Key("trainer.default_local_dir", "trainer.checkpoint_dir",
        export_when=lambda c: get(c, "trainer.checkpoint_dir") is not None),
    Key("trainer.resume_mode", "trainer.resume", to_verl=_resume_to_verl, to_qwen=_resume_to_qwen,
        verl_default="auto"),
    Key("trainer.resume_from_path", "trainer.resume", effective=_resume_path,
        export_when=lambda c: _resume_path(c) is not None, to_qwen=lambda v, x: v or "auto"),
]
"""Every setting both sides have. The hardware (trainer.nnodes / n_gpus_per_node / device) and the choice of
checkpoint, backend, rollout engine and dataset pick config groups instead: see `CHOICE_KEYS`."""

@dataclass(frozen=True)
class Fixed:
    """A verl key qwen35rl has no setting for because it always does one thing: a script value that asks for that
    thing is nothing lost (reported as such), any other value is not carried, with `does` as the reason."""

    verl: str
    does: str
    """What qwen35rl does, in words (the reason when the script asks for something else)."""
    holds: Callable[[Any, str], bool]
    """(verl's value, the run's backend) -> the value asks for what qwen35rl does."""
    backends: Tuple[str, ...] = BOTH
    export: Any = UNSET
    """What the exporter writes, where verl's default is not what qwen35rl does (UNSET: verl's default is)."""


def _is(want: Any) -> Callable[[Any, str], bool]:
    return lambda v, backend: v is want if isinstance(want, bool) else (v == want and not isinstance(v, bool))


FIXED: List[Fixed] = [
    Fixed(f"{ACTOR}.megatron.use_mbridge", "qwen35rl loads the Hugging Face checkpoint into Megatron and converts "
          "the weights itself (what use_mbridge=True does; a pre-converted Megatron checkpoint is not read)",
          _is(True), MEGATRON),
    Fixed(f"{ACTOR}.checkpoint.save_contents", "qwen35rl's checkpoints hold the model, the optimizer and the loop "
          "state (verl's model, optimizer and extra), and no Hugging Face copy (that is written once, at the end)",
          lambda v, b: isinstance(v, list) and sorted(map(str, v)) == ["extra", "model", "optimizer"]),
    Fixed("trainer.critic_warmup", "qwen35rl updates the policy from the first step (GRPO has no critic to warm up)",
          _is(0)),
    Fixed(f"{ROLLOUT}.calculate_log_probs", "qwen35rl's rollout always returns the sampled tokens' log-probs (the "
          "rollout/logprob_diff metrics, backend.use_rollout_log_probs and algorithm.rollout_is use them)", _is(True)),
    Fixed("data.validation_shuffle", "qwen35rl validates on the validation rows in their order", _is(False)),
    Fixed(f"{ROLLOUT}.ignore_eos", "qwen35rl's rollout ends a response at the end-of-sequence token", _is(False)),
    Fixed(f"{REF}.strategy", "the reference model runs on the actor's engine (fsdp2 with backend=fsdp, megatron "
          "with backend=megatron)", lambda v, b: v == ("fsdp2" if b == "fsdp" else b)),
    Fixed(f"{ROLLOUT}.mode", "verl 0.9.1 runs its rollout in async mode only (vLLM behind a server per engine): how "
          "verl drives vLLM, not what it generates", _is("async")),
]
"""verl keys answered by what qwen35rl always does. Each is still listed in NOT_CARRIED (with `does`) for the
values that ask for something else, and for `qwen35rl-plan`'s hint when one is given as a qwen35rl override."""


CHOICE_KEYS: Dict[str, str] = {
    "trainer.nnodes": "hw.nodes",
    "trainer.n_gpus_per_node": "hw.devices_per_node",
    "trainer.device": "hw.device",
    "model_engine": "backend.name",
}
"""verl keys that pick qwen35rl's `hw=` / `backend=` option rather than set a value."""

IN_VERL_TREE: Dict[str, Tuple[str, ...]] = {
    OVERRIDE_TC: ("recompute_granularity", "recompute_modules", "recompute_method", "recompute_num_layers",
                  "attention_backend"),
    VLLM_KWARGS: (),
    OVERRIDE_OPT: (),
}
"""The keys verl 0.9.1's tree already holds under each pass-through prefix (tested against the tree): those are
exported without `+` (Hydra refuses `+key` for a key the tree has), every other one with it."""


def needs_plus(prefix: str, key: str) -> bool:
    """Whether `prefix.key` is absent from verl 0.9.1's tree (exported as `+prefix.key=...`)."""
    return key.split(".", 1)[0] not in IN_VERL_TREE.get(prefix, ())


PASS_THROUGH: Dict[str, str] = {
    f"{VLLM_KWARGS}.": "rollout.engine_kwargs.",
    f"{OVERRIDE_TC}.": "backend.transformer_overrides.",
}
"""verl prefixes whose remaining keys go into a qwen35rl pass-through dict under the same name (after the table's
own entries under the prefix); the plan checks the names. On NPU an override_transformer_config key that is not a
megatron-core TransformerConfig field is a MindSpeed switch (verl hands the dict to MindSpeed there): it goes to
hw.mindspeed. vLLM arguments qwen35rl sets through a rollout key of its own go to that key."""

NOT_CARRIED: Dict[str, str] = {
    "hydra.": "Hydra's own settings for verl's process (qwen35rl sets its run directory itself)",
    "actor_rollout_ref.hybrid_engine": "verl-internal: qwen35rl colocates rollout and training on every device "
                                       "unless placement=split",
    f"{ROLLOUT}.load_format": "qwen35rl picks vLLM's weights at start itself (rollout.load_format: placeholders "
                              "on text data, the weight sync brings the policy's; the checkpoint's on image data)",
    f"{ROLLOUT}.layered_summon": "verl-internal weight-sync detail (qwen35rl syncs in rollout.weight_sync_bucket_mb buckets)",
    f"{ROLLOUT}.multi_stage_wake_up": "verl-internal: qwen35rl wakes the engine in one step",
    f"{ROLLOUT}.agent.": "verl's agent loop: qwen35rl generates single-turn responses",
    f"{ROLLOUT}.multi_turn.": "verl's multi-turn tool use: qwen35rl generates single-turn responses",
    f"{ROLLOUT}.skip_tokenizer_init": "verl-internal",
    f"{ROLLOUT}.prompt_length": "qwen35rl takes it from data.max_prompt_length",
    f"{ROLLOUT}.response_length": "qwen35rl takes it from data.max_response_length",
    f"{ROLLOUT}.val_kwargs.": "qwen35rl validates with one greedy sample per prompt at rollout.val_temperature",
    f"{ROLLOUT}.do_sample": "qwen35rl always samples (rollout.temperature 0 is greedy)",
    f"{ROLLOUT}.pipeline_model_parallel_size": "qwen35rl's vLLM engines run TP x DP x EP, no pipeline",
    f"{ROLLOUT}.nnodes": "verl's standalone rollout pool (its one-step-off and async trainers): qwen35rl's is "
                         "placement=split placement.rollout_devices=N",
    f"{ROLLOUT}.n_gpus_per_node": "verl's standalone rollout pool (its one-step-off and async trainers): qwen35rl's "
                                  "is placement=split placement.rollout_devices=N",
    f"{ROLLOUT}.checkpoint_engine.": "verl's weight-sync engine: qwen35rl syncs through its own buckets",
    f"{ROLLOUT}.": "no counterpart in qwen35rl's rollout settings",
    f"{REF}.": "the reference model runs on the actor's engine and layout (qwen35rl has one set of these settings)",
    f"{ACTOR}.ppo_micro_batch_size": "verl's deprecated global micro batch: set ppo_micro_batch_size_per_gpu",
    f"{ACTOR}.checkpoint.strict": "verl reads it when it saves a Hugging Face copy into a checkpoint (hf_model); "
                                  "qwen35rl's checkpoints hold none, and it loads them strictly",
    f"{ACTOR}.checkpoint.": "qwen35rl always checkpoints the model, optimizer and loop state together",
    f"{ACTOR}.profiler.": "no counterpart in qwen35rl",
    f"{ACTOR}.policy_loss.loss_mode": "qwen35rl's loss is PPO-clip (verl's vanilla)",
    f"{ACTOR}.policy_loss.": "no counterpart in qwen35rl",
    f"{ACTOR}.clip_ratio": "verl's fallback for clip_ratio_low/high: qwen35rl sets both explicitly",
    f"{ACTOR}.entropy_checkpointing": "no counterpart in qwen35rl",
    f"{ACTOR}.entropy_from_logits_chunk_size": "qwen35rl chunks log-probs by backend.logprob_chunk_size",
    f"{ACTOR}.use_fused_kernels": "no counterpart in qwen35rl",
    f"{ACTOR}.optim.lr_warmup_steps_ratio": "set backend.lr_warmup_steps (steps, not a ratio)",
    f"{ACTOR}.optim.total_training_steps": "verl fills it in at run time",
    f"{ACTOR}.optim.": "no counterpart in qwen35rl's optimizer settings",
    f"{ACTOR}.fsdp_config.wrap_policy.": "qwen35rl wraps every decoder layer",
    f"{ACTOR}.fsdp_config.model_dtype": "qwen35rl picks dtypes from model.dtype and backend.mixed_precision",
    f"{ACTOR}.fsdp_config.dtype": "qwen35rl picks dtypes from model.dtype and backend.mixed_precision",
    f"{ACTOR}.fsdp_config.": "no counterpart in qwen35rl's FSDP engine",
    f"{ACTOR}.megatron.vanilla_mbridge": "which library verl converts HF <-> Megatron weights with (mbridge or "
                                         "Megatron-Bridge): qwen35rl converts them itself",
    f"{ACTOR}.megatron.sequence_parallel": "qwen35rl turns Megatron sequence parallel on whenever TP > 1",
    f"{ACTOR}.megatron.seed": "qwen35rl seeds from trainer.seed",
    f"{ACTOR}.megatron.": "no counterpart in qwen35rl's Megatron engine",
    f"{ACTOR}.": "no counterpart in qwen35rl",
    f"{MODEL}.external_lib": "qwen35rl builds Qwen3.5 from transformers' own classes",
    f"{MODEL}.override_config.": "qwen35rl reads the architecture from model= and the checkpoint",
    f"{MODEL}.": "no counterpart in qwen35rl",
    "critic.": "GRPO has no critic",
    "reward_model.": "no reward model: qwen35rl scores responses with data.reward",
    "reward.custom_reward_function.reward_kwargs.": "extra keyword arguments verl adds to every compute_score call: "
                                                    "data.reward=verl:FILE:FUNCTION passes verl's four arguments "
                                                    "only (give the function these as defaults)",
    "reward.custom_reward_function.": "path and name carry to data.reward=verl:PATH:NAME; verl's other fields of "
                                      "the custom reward function have no counterpart",
    "reward.": "no reward model: qwen35rl scores responses with data.reward",
    "custom_reward_function.reward_kwargs.": "extra keyword arguments verl adds to every compute_score call: "
                                             "data.reward=verl:FILE:FUNCTION passes verl's four arguments only "
                                             "(give the function these as defaults)",
    "custom_reward_function.": "path and name carry to data.reward=verl:PATH:NAME; verl's other fields of the "
                               "custom reward function have no counterpart",
    "data.return_raw_chat": "verl-internal",
    "data.return_raw_input_ids": "verl-internal",
    "data.return_full_prompt": "verl-internal",
    "data.return_multi_modal_inputs": "verl-internal",
    "data.dataloader_num_workers": "qwen35rl tokenizes in the driver",
    "data.filter_overlong_prompts_workers": "how many processes verl filters with: qwen35rl filters in the "
                                            "driver (the same prompts are dropped)",
    "data.reward_fn_key": "qwen35rl scores every row with data.reward",
    "data.custom_cls.": "qwen35rl reads parquet/jsonl rows itself (data.prompt_key, data.answer_key)",
    "data.tokenizer": "qwen35rl uses the checkpoint's tokenizer (model.tokenizer)",
    "data.": "no counterpart in qwen35rl's data settings",
    "algorithm.kl_ctrl.": "qwen35rl has no in-reward KL controller (algorithm.use_kl_in_reward)",
    "algorithm.kl_penalty": "qwen35rl has no in-reward KL controller (algorithm.use_kl_in_reward)",
    "algorithm.gamma": "GRPO advantages do not discount",
    "algorithm.lam": "GRPO advantages have no GAE lambda",
    "algorithm.rollout_correction.": "no counterpart in qwen35rl (bypass_mode is backend.use_rollout_log_probs, "
                                     "rollout_is / rollout_is_threshold are algorithm.rollout_is / "
                                     "rollout_is_threshold)",
    "algorithm.": "no counterpart in qwen35rl's algorithm settings",
    "trainer.default_hdfs_dir": "no counterpart in qwen35rl",
    "trainer.ray_wait_register_center_timeout": "qwen35rl waits trainer.placement_timeout_s for its workers",
    "trainer.": "no counterpart in qwen35rl's trainer settings",
    f"{RAY_RUNTIME_ENV}.": "py_executable carries to hw.ray_runtime_env.py_executable; Ray's other runtime_env "
                           "fields have no qwen35rl setting",
    "ray_kwargs.": "launcher plumbing: qwen35rl starts or joins Ray itself (ray_address)",
    "global_profiler.": "no counterpart in qwen35rl",
    "transfer_queue.": "no counterpart in qwen35rl",
    "distillation.": "no counterpart in qwen35rl (an enabled distillation is refused)",
}
"""verl keys (exact, or a prefix ending with '.') the importer does not carry, with why; the longest match wins."""
NOT_CARRIED.update({f.verl: f.does for f in FIXED})


def _longest_match(table: Dict[str, str], key: str, default: str) -> str:
    """The reason of `table`'s entry for `key`: an exact key, or the longest prefix ending with '.'."""
    best = ""
    for k in table:
        if (key == k or (k.endswith(".") and key.startswith(k))) and len(k) > len(best):
            best = k
    return table[best] if best else default


def why_not_carried(key: str) -> str:
    return _longest_match(NOT_CARRIED, key, "no counterpart in qwen35rl")


def keys_for(backend: str) -> List[Key]:
    return [k for k in KEYS if backend in k.backends]


# ---------------------------------------------------------------------------------------------- environment
ENV_CARRIED_PREFIXES = ("NCCL_", "HCCL_", "GLOO_", "VLLM_", "CUDA_", "PYTORCH_", "TORCH_", "NVTE_", "RAY_", "OMP_",
                        "MKL_", "TOKENIZERS_", "HF_", "TRANSFORMERS_", "ASCEND_", "ACL_", "LCCL_", "MINDSPEED_",
                        "TASK_QUEUE_ENABLE", "COMBINED_ENABLE", "CPU_AFFINITY_CONF", "MULTI_STREAM_MEMORY_REUSE",
                        "INF_NAN_MODE_ENABLE", "WANDB_", "MLFLOW_", "NDEVICES_PER_NODE", "UCX_", "NVSHMEM_",
                        "TP_SOCKET_IFNAME", "PYTHONHASHSEED")
"""Variables the training stack on a worker reads (communication, allocators, vLLM, Ray, trackers)."""

ENV_NOT_CARRIED: Dict[str, str] = {
    "PYTHONUNBUFFERED": "qwen35rl's launcher streams worker output itself",
    "PYTHONPATH": "installation plumbing: install qwen35rl and its stack in the image instead",
    "LD_LIBRARY_PATH": "image plumbing: the cluster image sets it",
    "PATH": "image plumbing: the cluster image sets it",
    "VIRTUAL_ENV": "installation plumbing",
    "MASTER_ADDR": "launcher plumbing: qwen35rl's Ray workers find each other",
    "MASTER_PORT": "launcher plumbing: qwen35rl's Ray workers find each other",
    "CUDA_VISIBLE_DEVICES": "Ray assigns the devices of each worker",
    "ASCEND_RT_VISIBLE_DEVICES": "Ray assigns the devices of each worker",
    "RAY_ADDRESS": "set ray_address (or cluster=) instead",
}


def env_reason(name: str) -> Optional[str]:
    """Why a launch-environment variable is not carried, or None when it goes to the worker environment."""
    from qwen35rl.config.redact import is_secret_name

    if is_secret_name(name):
        return "a secret: keep it in the launch environment, not in a committed overlay"
    if name in ENV_NOT_CARRIED:
        return ENV_NOT_CARRIED[name]
    if name.startswith(ENV_CARRIED_PREFIXES):
        return None
    return "a script variable: not read by the training stack (it shaped the override list)"


def worker_env(cfg: Any) -> Dict[str, str]:
    """The environment every worker of a composed config gets: hw.env under backend.env."""
    out = {str(k): str(v) for k, v in (get(cfg, "hw.env") or {}).items()}
    out.update({str(k): str(v) for k, v in (get(cfg, "backend.env") or {}).items()})
    return out


# ------------------------------------------------------------------------------------ qwen35rl settings verl lacks
NOT_EXPORTED: Dict[str, str] = {
    "model.init": "verl starts from the checkpoint's weights (model.init=random has no counterpart)",
    "model.tokenizer": "verl uses the checkpoint's tokenizer",
    "model.dtype": "exported as rollout.dtype; verl picks the training engine's dtypes itself",
    "model.": "architecture: verl reads it from the checkpoint's config.json",
    "hw.env": "exported as the worker environment",
    "hw.vllm_quirks": "exported as rollout engine_kwargs while they apply",
    "hw.megatron_quirks.": "a MindSpeed patch qwen35rl applies on Ascend (no verl key)",
    "hw.mindspeed": "MindSpeed switches act on the Megatron engine on Ascend (exported there as "
                    "override_transformer_config entries)",
    "hw.": "a hardware fact of qwen35rl's plan (memory, FLOP/s, Ray resource, collectives)",
    "backend.megatron_core_version": "a fact of the cluster image (qwen35rl's plan applies its version facts)",
    "backend.bf16": "verl's Megatron engine trains in bfloat16 or float16 (megatron.dtype), not float32",
    "backend.mixed_precision": "verl picks dtypes itself",
    "backend.logprob_chunk_size": "no counterpart in verl",
    "backend.grad_offload": "verl 0.9.1's Megatron param_offload offloads the gradients with the parameters; "
                            "grad_offload unlike param_offload has no verl 0.9.1 key (the 0.8.0 line's and "
                            "newer lines' actor.megatron.grad_offload)",
    "backend.env": "exported as the worker environment",
    "backend.transformer_overrides": "exported as override_transformer_config entries",
    "backend.gradient_checkpointing": "verl's Megatron recomputes by override_transformer_config.recompute_*",
    "backend.": "no counterpart in verl",
    "rollout.vllm_version": "a fact of the cluster image",
    "rollout.engine_kwargs": "exported as engine_kwargs.vllm entries",
    "rollout.": "no counterpart in verl (qwen35rl's transformers rollout or engine detail)",
    "algorithm.name": "qwen35rl's algorithm= preset name",
    "algorithm.max_staleness": "verl's main_ppo trains on-policy; its one-step-off and fully async trainers (other "
                               "entry points with their own config) bound staleness",
    "algorithm.overlong_shaping.": "verl's DAPO recipe sets it in its reward manager, outside the main config tree",
    "algorithm.": "no counterpart in verl",
    "data.reward": "a reward of qwen35rl's signature, fn(response, answer, example), has no verl key (verl's "
                   "custom_reward_function takes compute_score(data_source, solution_str, ground_truth, "
                   "extra_info); data.reward=verl:FILE:FUNCTION is exported as it)",
    "data.": "qwen35rl's data format: verl reads preprocessed parquet (answer in reward_model.ground_truth, "
             "instruction inside the prompt)",
    "parallelism.": "no counterpart in verl",
    "placement.": "verl's main_ppo colocates rollout and training (hybrid engine); its split pools are the "
                  "one-step-off and fully async trainers, other entry points with their own config",
    "trainer.checkpoint_dir": "null: checkpoints/ in qwen35rl's run directory (verl's default_local_dir is "
                              "checkpoints/<project_name>/<experiment_name>; set trainer.checkpoint_dir to export one)",
    "trainer.": "no counterpart in verl",
    "ray_address": "verl joins Ray from the environment (RAY_ADDRESS)",
}
"""qwen35rl settings the exporter cannot write (exact key, or a prefix ending with '.'; the longest match wins)."""

IMPLIED: Dict[str, Callable[[Any], bool]] = {
    "model.trust_remote_code": lambda c: not get(c, "model.trust_remote_code"),
    "hw.ray_runtime_env.py_executable": lambda c: get(c, "hw.ray_runtime_env.py_executable") is None,
    "backend.log_prob_max_tokens_per_device": lambda c: get(c, "backend.log_prob_max_tokens_per_device") is None,
    "placement.mode": lambda c: get(c, "placement.mode") == "colocated",
    "placement.rollout_devices": lambda c: get(c, "placement.mode") == "colocated",
    "algorithm.max_staleness": lambda c: int(get(c, "algorithm.max_staleness", 0) or 0) == 0,
    "backend.grad_offload": lambda c: get(c, "backend.name") == "megatron" and (
        bool(get(c, "backend.grad_offload")) == bool(get(c, "backend.param_offload"))),
}
"""qwen35rl settings that verl's main_ppo runs as they are without a key of its own, while the predicate holds (its
hybrid engine colocates, it trains on-policy); otherwise they are listed with `NOT_EXPORTED`'s reason."""

UNUSED_BY_BACKEND = {
    "fsdp": ("parallelism.tp", "parallelism.pp", "parallelism.cp", "parallelism.ep", "parallelism.etp",
             "parallelism.vpp", "parallelism.pipeline_layout"),
    "megatron": ("parallelism.fsdp_size", "parallelism.sp"),
}
"""Settings the backend does not read: not part of the run, so not listed as unexported."""


def why_not_exported(key: str) -> str:
    return _longest_match(NOT_EXPORTED, key, "no counterpart in verl")
