"""Per-device memory of a run. Colocated: the trainer and the rollout engine take turns on the same devices.
With placement=split each pool holds only its own phase (`Layout.split`): the training pool's peak has no
rollout share (no sleeping engine), the rollout pool's is the engine alone (nothing kept by a trainer); each is
checked against the device's usable memory on its own.

Three phases peak separately:
- training: the trainer's weights and optimizer states, the reference model and whatever the sleeping rollout engine
  keeps, plus the larger of two moments: the backward (gradients of earlier micro batches, gathered FSDP units,
  saved activations, the log-prob head's or a recomputed layer's transient) and the optimizer step (every local
  gradient, the grad-norm and AdamW temporaries; `train/optimizer_step` is what it adds beyond the backward). On
  image data the policy and the reference include the vision tower (`trains_vision`): its weights, gradients and
  optimizer states follow each engine's rules for the text parameters (Megatron: on the first stage, replicated
  over TP), and its activations are `train/vision_activations`; `model.freeze_vision_tower` leaves weights only;
- log-probs: the old and the reference log-probs, forward-only passes in micro batches of their own
  (`backend.log_prob_*`): the trainer's resident states plus one pass's working set (`log_prob_activations_gib`);
- rollout: what the trainer keeps on the device between steps, plus the rollout engine (vLLM claims
  `gpu_memory_utilization` of the device for its weights, activations, KV cache and GDN state; the hf engine holds
  its weights, a static cache and one layer's prefill tensors).

Every term is a function below whose docstring states its assumption in one line; the training peak is the sum of
the `train/` terms and the rollout peak the sum of `rollout/kept_by_trainer` and the engine's terms. Terms are GiB
per device (the most loaded device: Megatron pipeline ranks are combined conservatively: the heaviest rank's
states, the first stage's in-flight activations and the last stage's log-prob head). capacity = (memory_gb*1e9/2^30 -
hw.reserve_gib) / (1 + hw.allocator_slack).

The FSDP and hf terms (transformers modules) were calibrated against `torch.cuda.max_memory_allocated` on an H200
(bench/results/h200.md, tests/config/test_memory_calibration.py); per-token activations were counted tensor by
tensor on the same modules. What a Gated DeltaNet layer keeps depends on its kernels (`gdn_kernels`; Megatron:
`megatron_gdn_kernels`). Megatron's per-token layer activations were counted with saved_tensors_hooks on
megatron-core 0.16.1's layers on CPU (tests/config/test_megatron_activations.py); its GDN layer on fla was read
off an H200 allocator history (megatron-core 0.19.2), and its training peaks at TP1 measured there (0.8B, 4B:
tests/config/test_memory_calibration.py). The vLLM terms are not measured."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf

from qwen35rl.config import params as P
from qwen35rl.config.engine_specs import ROLLOUT_ENGINES, rollout_engine, train_engine
from qwen35rl.config.layout import Layout, pipeline_stages

GIB = float(2 ** 30)
BF16, FP32 = 2, 4
FP64 = 8
GDN_CHUNK = 64
"""Tokens per chunk of the chunked GDN forms (transformers' torch fallback and flash-linear-attention alike)."""
_DTYPE_BYTES = {"bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "float32": 4, "fp32": 4}


def as_tree(cfg: Any) -> Any:
    """A resolved plain-dict view of the config (fast to read many times); plain dicts pass through."""
    return OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg


def dtype_bytes(name: Any) -> int:
    return _DTYPE_BYTES.get(str(name), 2)


def gib(n_bytes: float) -> float:
    return n_bytes / GIB


def capacity_gib(cfg: Any) -> float:
    """What the allocated peak may reach on one device: the nominal GB (10^9 bytes) in GiB minus what the runtime
    reserves, less the caching allocator's slack above the allocated bytes (`hw.allocator_slack`)."""
    hw = cfg["hw"]
    free = float(hw["memory_gb"]) * 1e9 / GIB - float(hw["reserve_gib"])
    return free / (1.0 + float(hw["allocator_slack"]))


# ------------------------------------------------------------------------------------------------------ shapes
def sequence_length(cfg: Any) -> int:
    return int(cfg["data"]["max_prompt_length"]) + int(cfg["data"]["max_response_length"])


def micro_batch_tokens(cfg: Any) -> int:
    """Tokens of one micro batch: max_tokens_per_device with dynamic batch size, else micro batch x the longest
    sequence (padded batches)."""
    b = cfg["backend"]
    if b["dynamic_batch_size"]:
        return int(b["max_tokens_per_device"])
    return int(b["micro_batch_size_per_device"]) * sequence_length(cfg)


def micro_batches_per_mini_batch(cfg: Any, layout: Layout) -> int:
    """Micro batches one DP rank runs per optimizer step (at least 1)."""
    responses = int(cfg["algorithm"]["mini_batch_size"]) * int(cfg["rollout"]["n"]) / max(layout.dp, 1)
    if cfg["backend"]["dynamic_batch_size"]:
        return max(1, math.ceil(responses * sequence_length(cfg) / int(cfg["backend"]["max_tokens_per_device"])))
    return max(1, int(responses // max(int(cfg["backend"]["micro_batch_size_per_device"]), 1)))


def kl_on(cfg: Any) -> bool:
    """A reference model exists when KL loss or in-reward KL is on."""
    return bool(cfg["algorithm"]["use_kl_loss"] or cfg["algorithm"]["use_kl_in_reward"])


def _model_parallel(layout: Layout) -> bool:
    """The training engine splits layers and tensors (its spec's `model_parallel`): the formulas below named
    Megatron apply, else those named FSDP (an engine that shards parameters)."""
    return train_engine(layout.backend).model_parallel


def _offload_policy_on(cfg: Any) -> bool:
    """An engine without between-phase offload (its spec's `offloads_between_phases`; FSDP) turns any of
    offload_policy / param_offload / optimizer_offload / grad_offload into one CPU offload policy (FSDP2's
    CPUOffloadPolicy): parameters, gradients and optimizer states of the policy and the reference on the host."""
    b = cfg["backend"]
    if train_engine(cfg).offloads_between_phases:
        return False
    return any(bool(b.get(k, False)) for k in ("offload_policy", "param_offload", "optimizer_offload", "grad_offload"))


def gdn_kernels(cfg: Any, override: Optional[str] = None) -> str:
    """Which Gated DeltaNet kernels the transformers modules (FSDP trainer, hf rollout) run: 'fla'
    (flash-linear-attention chunk kernels; the short convolution is torch's either way) or 'torch' (transformers'
    pure-PyTorch fallback). The plan assumes the cluster has fla on its accelerators (CUDA; the Ascend image ships it
    too) and the fallback in CPU processes; a measurement without fla passes override='torch'."""
    if override is not None:
        if override not in ("fla", "torch"):
            raise ValueError(f"gdn kernels {override!r}: expected 'fla' or 'torch'")
        return override
    return "torch" if str(cfg["hw"].get("device", "cuda")) == "cpu" else "fla"


def compute_bytes(cfg: Any) -> int:
    """Bytes of the FSDP trainer's compute dtype: backend.mixed_precision, 'auto' = bf16 on accelerators and fp32
    on CPU (the engine's rule); Megatron computes in bf16."""
    setting = str(cfg["backend"].get("mixed_precision", "auto"))
    if setting == "auto":
        return FP32 if str(cfg["hw"].get("device", "cuda")) == "cpu" else BF16
    return dtype_bytes(setting)


def trains_vision(cfg: Any) -> bool:
    """The policy and the reference (FSDP and Megatron alike) and the hf rollout engine include the vision tower
    only for a vision model on image data (`models.build.trains_vision`); otherwise they are the text model."""
    return cfg["model"].get("vision") is not None and bool(cfg["data"].get("has_images", False))


def freezes_vision(cfg: Any) -> bool:
    """The policy includes the vision tower but `model.freeze_vision_tower` keeps it fixed: no gradients, no
    optimizer state, no activations kept for backward."""
    return trains_vision(cfg) and bool(cfg["model"].get("freeze_vision_tower", False))


def largest_parameter(m: Any) -> int:
    """Elements of the largest single tensor: the embedding / lm_head [V, h], or the fused routed experts' gate_up
    [E, 2I, h] of an MoE layer."""
    experts = int(m["num_experts"]) * 2 * int(m["moe_intermediate_size"]) * int(m["hidden_size"]) if m["moe"] else 0
    return max(P.embedding_params(m), experts)


# ------------------------------------------------------------------------------------------ what a device holds
@dataclass(frozen=True)
class TrainShard:
    """The trainer's parameters on the most loaded device."""

    dense: float
    """Non-expert parameters per device (FSDP: already divided by fsdp_size)."""
    expert: float
    """Routed-expert parameters per device."""
    layers: List[str]
    """Kinds ('linear'/'full') of the decoder layers whose activations this device keeps."""
    largest_unit: float
    """FSDP: parameters of the largest decoder layer (an FSDP unit all-gathered at once); Megatron: 0."""
    root: float = 0.0
    """FSDP: parameters of the root unit (embedding, untied lm_head, final norm; with the vision tower its patch
    embedding, position table and merger), gathered for a whole pass."""
    frozen: float = 0.0
    """Parameters per device without gradients or optimizer state: the vision tower under
    `model.freeze_vision_tower` (FSDP: already divided by fsdp_size). `dense` holds a trained tower."""

    @property
    def trained(self) -> float:
        """Parameters per device that get gradients and optimizer states."""
        return self.dense + self.expert

    @property
    def held(self) -> float:
        """Every parameter per device, frozen ones included."""
        return self.dense + self.expert + self.frozen


def pipeline_ranks(cfg: Any, layout: Layout) -> List[Dict[str, Any]]:
    """What each pipeline rank holds: its layer kinds (virtual stage i on rank i % pp, layers numbered in stage
    order) and whether it has the embedding (E) or the output layer + loss (L)."""
    kinds = P.layer_kinds(cfg["model"])
    ranks = [{"layers": [], "E": False, "L": False} for _ in range(max(layout.pp, 1))]
    i = 0
    for s, stage in enumerate(pipeline_stages(cfg, layout)):
        rank, n = ranks[s % len(ranks)], stage.count("t")
        rank["layers"].extend(kinds[i:i + n])
        rank["E"] |= "E" in stage
        rank["L"] |= "L" in stage
        i += n
    return ranks


def vision_tower_params(cfg: Any) -> int:
    """Parameters of the vision tower the policy holds (`trains_vision`; 0 for the text model)."""
    return P.vision_params(cfg["model"]["vision"]) if trains_vision(cfg) else 0


def train_shard(cfg: Any, layout: Layout) -> TrainShard:
    """Megatron builds the text model (no MTP) and, on image data (`trains_vision`), the vision tower: dense
    weights / TP, experts / (EP*ETP), embedding and the whole vision tower (replicated over TP, not divided) on the
    first stage, the output layer (or the tied copy) + final norm on the last; the heaviest rank counts (by its
    bf16 weights + fp32 gradients). FSDP trains the transformers model (the text model, with the vision tower on
    image data; no MTP), every parameter / fsdp_size; its vision blocks are FSDP units and the rest of the tower
    belongs to the root. A frozen tower (`freezes_vision`) moves from `dense` to `frozen`."""
    m = cfg["model"]
    tower = vision_tower_params(cfg)
    frozen_tower = tower if freezes_vision(cfg) else 0
    if not _model_parallel(layout):
        kinds = P.layer_kinds(m)
        expert = len(kinds) * P.layer_expert_params(m)
        dense = P.count_params(m).text - expert + tower - frozen_tower
        unit = max(P.layer_dense_params(m, k) + P.layer_expert_params(m) for k in set(kinds))
        root = P.embedding_params(m) + P.lm_head_params(m) + int(m["hidden_size"])
        if tower:
            v = m["vision"]
            unit = max(unit, P.vision_block_params(v))
            root += tower - int(v["depth"]) * P.vision_block_params(v)
        f = max(layout.fsdp_size, 1)
        return TrainShard(dense=dense / f, expert=expert / f, layers=kinds, largest_unit=unit, root=root,
                          frozen=frozen_tower / f)
    h, embed = int(m["hidden_size"]), P.embedding_params(m)
    shards = []
    ranks = pipeline_ranks(cfg, layout)
    for rank in ranks:
        expert = len(rank["layers"]) * P.layer_expert_params(m)
        dense = P.layers_params(m, rank["layers"]) - expert
        # The output layer: its own weights, or a copy of the tied embedding when that lives on another stage.
        output = embed if rank["L"] and not (m["tie_word_embeddings"] and rank["E"]) else 0
        dense += (embed if rank["E"] else 0) + output + (h if rank["L"] else 0)
        on_rank = tower if rank["E"] else 0
        frozen = frozen_tower if rank["E"] else 0
        shards.append((dense / max(layout.tp, 1) + on_rank - frozen, expert / max(layout.ep * layout.etp, 1), frozen))
    dense, expert, frozen = max(shards, key=lambda s: (s[0] + s[1]) * (BF16 + FP32) + s[2] * BF16)
    most_layers = max((r["layers"] for r in ranks), key=len)
    return TrainShard(dense=dense, expert=expert, layers=most_layers, largest_unit=0.0, frozen=frozen)


# -------------------------------------------------------------------------------------------- training terms
def train_weights_gib(cfg: Any, layout: Layout, shard: TrainShard) -> float:
    """Megatron: bf16 parameters on the device while training (param_offload only moves them out between
    phases). FSDP: fp32 sharded parameters (bf16 is the compute copy), on the host with offload_policy. Frozen
    parameters count here like the trained ones."""
    if _model_parallel(layout):
        return gib(shard.held * BF16)
    return 0.0 if _offload_policy_on(cfg) else gib(shard.held * FP32)


def train_grads_gib(cfg: Any, layout: Layout, shard: TrainShard) -> float:
    """Gradients on the device at the backward's peak. Megatron: the fp32 main-grad buffer of every local
    parameter (always allocated). FSDP: the fp32 sharded gradients of the earlier micro batches of the optimizer
    step (none with a single micro batch: the peak is at the start of its backward), on the host when offloaded."""
    if _model_parallel(layout):
        return gib(shard.trained * FP32)
    if _offload_policy_on(cfg) or micro_batches_per_mini_batch(cfg, layout) <= 1:
        return 0.0
    return gib(shard.trained * FP32)


def optimizer_states_gib(cfg: Any, layout: Layout, shard: TrainShard) -> float:
    """Adam. Megatron: fp32 master + m + v (12 B/param), the distributed optimizer shards dense states over
    DP*CP and expert states over expert-DP; optimizer_cpu_offload keeps `optimizer_offload_fraction` on the host.
    FSDP: m + v (8 B/param, the fp32 parameters are the master copy) of the shard, on the host with offload_policy.
    A trained vision tower is dense (Megatron: sharded over DP*CP like the other replicated parameters); a frozen
    one has no states."""
    b = cfg["backend"]
    if not _model_parallel(layout):
        return 0.0 if _offload_policy_on(cfg) else gib(shard.trained * 2 * FP32)
    if b["use_distributed_optimizer"]:
        states = shard.dense / max(layout.dp * layout.cp, 1) + shard.expert / max(layout.edp, 1)
    else:
        states = shard.dense + shard.expert
    on_device = 1.0 - float(b["optimizer_offload_fraction"]) if b["optimizer_cpu_offload"] else 1.0
    return gib(states * 3 * FP32 * on_device)


def fsdp_gathered_params_gib(cfg: Any, layout: Layout, shard: TrainShard) -> float:
    """FSDP: unsharded compute-dtype copies: the root unit (FSDP2 never reshards the root after a forward, so it
    stays from the log-prob pass until the update's backward ends) plus the layer being computed and the one
    prefetched; without reshard_after_forward every gathered layer stays until backward (the whole model)."""
    if _model_parallel(layout):
        return 0.0
    if not cfg["backend"].get("reshard_after_forward", True):
        return gib(shard.held * max(layout.fsdp_size, 1) * compute_bytes(cfg))
    return gib((shard.root + 2 * shard.largest_unit) * compute_bytes(cfg))


def layer_activation_elems_per_token(m: Any, kind: str) -> float:
    """vLLM's profiled forward (not measured; it was the Megatron estimate until megatron's layers were measured,
    `megatron_layer_bytes_per_token`): tensors one decoder layer keeps, in elements per token (bf16): residual +
    norm outputs,
    attention q/gate/k/v/output or GDN qkv (before and after the conv), z, b/a, core and normed outputs, and the
    MLP gate/up/act (MoE: router logits in fp32, permuted tokens and top-k expert intermediates, shared expert)."""
    h = int(m["hidden_size"])
    if kind == "full":
        nq, nkv, hd = int(m["num_attention_heads"]), int(m["num_key_value_heads"]), int(m["head_dim"])
        mixer = 2 * h + 5 * nq * hd + 3 * nkv * hd
    else:
        nk, nv = int(m["linear_num_key_heads"]), int(m["linear_num_value_heads"])
        value_dim = nv * int(m["linear_value_head_dim"])
        conv_dim = 2 * nk * int(m["linear_key_head_dim"]) + value_dim
        mixer = 2 * h + 2 * conv_dim + 3 * value_dim + 2 * nv
    if m["moe"]:
        k, e = int(m["num_experts_per_tok"]), int(m["num_experts"])
        ffn = (2 * h + 2 * e + 2 * k * h + 3 * k * int(m["moe_intermediate_size"])
               + 3 * int(m["shared_expert_intermediate_size"]))
    else:
        ffn = 2 * h + 3 * int(m["intermediate_size"])
    return float(mixer + ffn)


def megatron_gdn_kernels(cfg: Any, override: Optional[str] = None) -> str:
    """Which GDN recurrence the Megatron engine trains with: 'torch' (megatron-core's `torch_chunk_gated_delta_rule`)
    when `backend.transformer_overrides.deterministic_mode` is set true, or on CPU (the engine sets it there), else
    'fla' (flash-linear-attention's chunk kernels). An assumption: the plan cannot see the nodes' Triton / TileLang,
    under which the engine itself falls back to the torch recurrence (`_gdn_fallback`; the preflight checks the
    nodes). `override` as for `gdn_kernels`."""
    if override is not None:
        return gdn_kernels(cfg, override)
    overrides = cfg["backend"].get("transformer_overrides") or {}
    if "deterministic_mode" in overrides:
        return "torch" if bool(overrides["deterministic_mode"]) else "fla"
    return "torch" if str(cfg["hw"].get("device", "cuda")) == "cpu" else "fla"


def megatron_norm_mlp_bytes_per_token(m: Any) -> float:
    """What a Megatron decoder layer (the engine's local spec, bf16) saves around its mixer, per token: the two
    zero-centred RMSNorms' fp32 input copy, normalised tensor and rstd, and their bf16 outputs (the linears'
    inputs); the dense MLP's fc1 output (2I), silu(gate), the `x_linear + glu_linear_offset` copy and the product
    (5 x I). MoE (SequentialMLP, alltoall dispatcher, no permute fusion): one more bf16 hidden state, the permuted
    tokens (k x h), 6 x I per routed token in the experts, the shared expert as a dense MLP and its sigmoid gate,
    the router's bf16 logits and bool routing map (E each), and per routed token its int64 top-k and sort indices,
    fp32 and permuted bf16 probability. Measured with saved_tensors_hooks on megatron-core 0.16.1 on CPU
    (2026-12-02, tests/config/test_megatron_activations.py): exact on the 0.8B and tiny MoE shapes."""
    h = int(m["hidden_size"])
    around = 2 * (2 * FP32 * h + FP32 + BF16 * h)
    if m["moe"]:
        k, e = int(m["num_experts_per_tok"]), int(m["num_experts"])
        shared = int(m["shared_expert_intermediate_size"])
        ffn = (BF16 * (h + k * h + 6 * k * int(m["moe_intermediate_size"]) + 5 * shared + (1 if shared else 0) + e)
               + e + k * (FP64 + FP64 + FP32 + BF16))
    else:
        ffn = BF16 * 5 * int(m["intermediate_size"])
    return float(around + ffn)


def megatron_attention_bytes_per_token(m: Any) -> float:
    """Megatron's gated full attention over the engine's SDPA core, per token: in bf16 what SDPA saves (rotated q,
    k and v repeated to the query heads, its output), the output projection's input (gated) and the rotary cos /
    sin of q and k (4 x the rotary dims); in fp32 the q and k norms' input copies and outputs, the sigmoid of the
    output gate, the norms' rstd per head and the log-sum-exp per query head. Measured like
    `megatron_norm_mlp_bytes_per_token`."""
    nq, nkv, hd = int(m["num_attention_heads"]), int(m["num_key_value_heads"]), int(m["head_dim"])
    gated = 1 if m["attn_output_gate"] else 0
    rot = hd * float(m.get("partial_rotary_factor", 1.0))
    return float(BF16 * ((4 + gated) * nq * hd + 4 * rot)
                 + FP32 * (2 * nq * hd + 2 * nkv * hd + gated * nq * hd + 2 * nq + nkv))


def megatron_gdn_bytes_per_token(m: Any, kernels: str) -> float:
    """megatron-core's GatedDeltaNet per token.
    torch (`torch_chunk_gated_delta_rule`, `deterministic_mode`: q and k repeated to the value heads nv). Around
    the recurrence: the torch conv1d's input and pre-silu output (conv dim each), the l2norm inputs of q and k and
    their rstd, sigmoid(beta), the output norm's weighted and gated tensors and the output projection's input in
    bf16; softplus input and output (value heads), the output norm's fp32 input copy, fp32 gate and silu(gate), and
    its rstd per head in fp32. The recurrence, per value head in fp32: 7 x dk (padded key, k_beta, k_beta*exp(g),
    k_cumdecay, scaled q, q*exp(g), the decayed key of the state update), 3 x dv (padded value, v_beta, v_new),
    6 x chunk (decay exp and mask, k k^T, the solved matrix, per chunk q k^T and its mask), 4 gates, the row-by-row
    triangular solve's clones ((chunk^2 - 1) / 3: row i keeps an i x i and an i-wide copy) and one dk x dv
    recurrent state per chunk. Measured with saved_tensors_hooks on megatron-core 0.16.1 on CPU (2026-12-02,
    tests/config/test_megatron_activations.py): exact on the 0.8B heads (336.7 KB a layer with its MLP, 5.1x what
    the fused-module formula `layer_activation_elems_per_token` gave) and with 32 value heads.
    fla (fla's causal_conv1d with its silu, fla's l2norm, chunk kernels; megatron-core 0.19.2), in bf16: the
    in_proj output (conv dim + z + beta and alpha: fla's convolution keeps its input, a view of it), the
    normalised q and k (key heads), the contiguous q and k (repeated to the value heads), v and z the recurrence
    and the output norm take, fla's [chunk]-wide A per value head, the recurrence's output and the gated norm's
    output (the output projection's input); in fp32 the l2norm's rstd (key heads), g, beta and the output norm's
    rstd (value heads). Read off an H200 allocator history at the update's peak (2026-12-04,
    bench/results/h200.md): the 0.8B layer's 51.4 KB a token."""
    nk, nv = int(m["linear_num_key_heads"]), int(m["linear_num_value_heads"])
    dk, dv = int(m["linear_key_head_dim"]), int(m["linear_value_head_dim"])
    qk, value_dim = nk * dk, nv * dv
    conv_dim, c = 2 * qk + value_dim, GDN_CHUNK
    if kernels == "torch":
        around = BF16 * (2 * conv_dim + 2 * qk + 2 * nk + nv + 3 * value_dim) + FP32 * (3 * nv + 3 * value_dim)
        return float(around + FP32 * nv * (7 * dk + 3 * dv + 6 * c + 4 + (c * c - 1) / 3 + dk * dv / c))
    kept = (conv_dim + value_dim + 2 * nv) + 2 * qk + 2 * nv * dk + 2 * value_dim + nv * c + 2 * value_dim
    return float(BF16 * kept + FP32 * (2 * nk + 3 * nv))


def megatron_layer_bytes_per_token(m: Any, kind: str, kernels: str) -> float:
    """Bytes one Megatron decoder layer saves for backward per token (bf16): its mixer plus the norms and MLP
    around it. Its input is not among them (the previous layer's norm keeps an fp32 copy of it)."""
    mixer = megatron_attention_bytes_per_token(m) if kind == "full" else megatron_gdn_bytes_per_token(m, kernels)
    return mixer + megatron_norm_mlp_bytes_per_token(m)


def norm_mlp_bytes_per_token(m: Any, cb: int, compiled: bool = False) -> float:
    """What a transformers decoder layer keeps around its mixer: two RMSNorms that compute in fp32 (input copy,
    normalised tensor, output in the compute dtype: 2 * (4 + 4 + cb) * h), the layer output, and the SwiGLU MLP's
    gate, up, silu(gate) and product (4 * I; MoE: router logits and probabilities in fp32, the routed copies of
    the token and their outputs, 4 * I per routed expert and for the shared expert). Counted on the 0.8B modules.
    `compiled` (backend.compile_layers): each norm keeps its input in the compute dtype instead of the fp32 copies
    (the first norm's input is the layer's input, counted by the layer before), and the dense MLP recomputes
    silu(gate) (3 * I); MoE blocks stay eager."""
    h = int(m["hidden_size"])
    around = (3 * cb if compiled else 2 * (FP32 + FP32 + cb)) * h + cb * h
    if m["moe"]:
        k = int(m["num_experts_per_tok"])
        ffn = (2 * FP32 * int(m["num_experts"]) + cb * (2 * k * h + 4 * k * int(m["moe_intermediate_size"])
                                                         + 4 * int(m["shared_expert_intermediate_size"])))
    else:
        ffn = cb * (3 if compiled else 4) * int(m["intermediate_size"])
    return float(around + ffn)


def attention_bytes_per_token(m: Any, cb: int, compiled: bool = False) -> float:
    """transformers' full attention over flash / memory-efficient SDPA (no [T, T] scores): q and k norms in fp32
    (input copy + output), rotated q and k, v, the attention output, its contiguous copy, the sigmoid output gate and
    the gated product in the compute dtype, the fp32 log-sum-exp per head. Counted on the 0.8B modules. `compiled`:
    the q and k norms keep their inputs in the compute dtype instead, views of the projections' outputs (q's is twice
    as wide with the output gate)."""
    nq, nkv, hd = int(m["num_attention_heads"]), int(m["num_key_value_heads"]), int(m["head_dim"])
    gated = 2 if m["attn_output_gate"] else 0
    norms = cb * ((1 + gated // 2) * nq * hd + nkv * hd) if compiled else FP32 * (2 * nq * hd + 2 * nkv * hd)
    return float(cb * ((3 + gated) * nq * hd + 2 * nkv * hd) + norms + FP32 * nq)


def gdn_bytes_per_token(m: Any, cb: int, kernels: str, compiled: bool = False) -> float:
    """Gated DeltaNet mixer per token. torch fallback (counted on the 0.8B modules: 189 KB): qkv projection, conv
    output and the gated norm's three outputs in the compute dtype; in fp32 the q/k copies, the l2-normed q, padded
    q/k/v, two triangular solves, decayed q/k, the gated norm's input/gate/silu, v_new, five [64, 64] intra-chunk
    matrices per head and one recurrent state per 64-token chunk. fla (what fla 0.6's chunk_gated_delta_rule saves;
    the H200 runs came within 5% of this estimate): the conv input, q and k (L2-normed by the convolution), the
    contiguous v, beta and the solved [64]-wide chunk matrix A in the compute dtype, g and the gate's intermediates in
    fp32, and the gated norm as above. `compiled`: the gated norm keeps none of its fp32 input, gate and silu(gate)."""
    nk, nv = int(m["linear_num_key_heads"]), int(m["linear_num_value_heads"])
    dk, dv = int(m["linear_key_head_dim"]), int(m["linear_value_head_dim"])
    value_dim, conv_dim = nv * dv, 2 * nk * dk + nv * dv
    gated_norm = 0 if compiled else FP32 * 3 * value_dim
    if kernels == "torch":  # the fallback expands q and k to the value heads
        qk = nv * dk
        return float(cb * (2 * conv_dim + 3 * value_dim) + gated_norm
                     + FP32 * (8 * qk + 3 * value_dim + 5 * nv * GDN_CHUNK + nv * dk * dv / GDN_CHUNK + 10 * nv))
    return float(cb * (conv_dim + 2 * nk * dk + 4 * value_dim + nv * GDN_CHUNK + nv) + gated_norm
                 + FP32 * (2 * nk + 3 * nv))


def hf_layer_bytes_per_token(m: Any, kind: str, cb: int, kernels: str, compiled: bool = False) -> float:
    """Bytes one transformers decoder layer saves for backward per token (FSDP trainer): its mixer plus the norms
    and MLP around it. 0.8B with the torch GDN fallback: 240 KB (GDN layer) and 95 KB (attention layer); with
    `compiled` parts (backend.compile_layers) 46 KB and 33 KB less."""
    mixer = (attention_bytes_per_token(m, cb, compiled) if kind == "full"
             else gdn_bytes_per_token(m, cb, kernels, compiled))
    return mixer + norm_mlp_bytes_per_token(m, cb, compiled)


def compiles_layers(cfg: Any) -> bool:
    """backend.compile_layers: the FSDP engine's layers run compiled norms and MLPs."""
    return bool(cfg["backend"].get("compile_layers", False))


def tokens_per_device(cfg: Any, layout: Layout) -> float:
    """Tokens of one micro batch each device keeps activations for: Megatron splits them over TP (sequence
    parallel) and CP, FSDP over Ulysses SP."""
    div = layout.tp * layout.cp if _model_parallel(layout) else layout.sp
    return micro_batch_tokens(cfg) / max(div, 1)


def in_flight_micro_batches(cfg: Any, layout: Layout) -> float:
    """1F1B keeps up to PP micro batches of activations on the first stage (interleaving adds
    (pp-1)/(pp*vpp)); without a pipeline one micro batch."""
    if not _model_parallel(layout) or layout.pp <= 1:
        return 1.0
    n = min(layout.pp, micro_batches_per_mini_batch(cfg, layout))
    if layout.vpp:
        n *= 1 + (layout.pp - 1) / (layout.pp * layout.vpp)
    return float(n)


def recompute_groups(cfg: Any, layout: Layout) -> Optional[Dict[str, Any]]:
    """How activations are recomputed: None (all saved), or {method: uniform|block, n: layers per group}.
    Megatron recomputes with gradient_checkpointing and a recompute_granularity (the engine's rule); its
    'selective' recompute only re-runs core attention, which flash attention never stores: counted as no
    recompute. FSDP gradient checkpointing = uniform groups of one layer."""
    b = cfg["backend"]
    if not _model_parallel(layout):
        return {"method": "uniform", "n": 1} if b["gradient_checkpointing"] else None
    if not b["gradient_checkpointing"] or b.get("recompute_granularity") != "full":  # the engine needs both
        return None
    return {"method": b.get("recompute_method") or "uniform", "n": max(int(b.get("recompute_num_layers") or 1), 1)}


def response_tokens_per_device(cfg: Any, layout: Layout) -> float:
    """Response tokens of one micro batch on a device (the log-prob head sees only these): the response share of
    the micro batch's tokens, split like the activations."""
    share = int(cfg["data"]["max_response_length"]) / sequence_length(cfg)
    return tokens_per_device(cfg, layout) * share


def final_norm_bytes_per_token(h: int, cb: int) -> float:
    """The final RMSNorm computes in fp32: its input copy and normalised tensor, and its output in `cb`."""
    return float((FP32 + FP32 + cb) * h)


def activations_gib(cfg: Any, layout: Layout, shard: TrainShard, kernels: Optional[str] = None) -> float:
    """Saved activations of the device's layers for the in-flight micro batches: all layers' tensors without
    recompute; with full recompute / checkpointing one hidden state per recompute group (block: the first n
    layers recomputed, the rest saved). Megatron adds the recomputed group's tensors and their gradients here;
    FSDP counts its recomputed layer in `backward_transient_gib`; both keep the final norm's tensors and the
    head's response hidden states besides."""
    m, h = cfg["model"], int(cfg["model"]["hidden_size"])
    if not _model_parallel(layout):
        cb, tokens, kernels = compute_bytes(cfg), tokens_per_device(cfg, layout), gdn_kernels(cfg, kernels)
        if recompute_groups(cfg, layout) is None:
            compiled = compiles_layers(cfg)
            layers = sum(hf_layer_bytes_per_token(m, k, cb, kernels, compiled) for k in shard.layers)
        else:  # non-reentrant checkpointing keeps each layer's input
            layers = len(shard.layers) * cb * h
        return gib(tokens * (layers + final_norm_bytes_per_token(h, cb)) + head_tokens_per_device(cfg, layout) * cb * h)
    tokens, flight = tokens_per_device(cfg, layout), in_flight_micro_batches(cfg, layout)
    kernels = megatron_gdn_kernels(cfg, kernels)
    per_layer = [megatron_layer_bytes_per_token(m, k, kernels) for k in shard.layers] or [0.0]
    rec = recompute_groups(cfg, layout)
    if rec is None:
        saved, working = sum(per_layer) * flight, 0.0
    elif rec["method"] == "block":
        n = min(rec["n"], len(per_layer))
        saved = (n * BF16 * h + sum(sorted(per_layer)[: len(per_layer) - n])) * flight
        working = 2 * max(per_layer)
    else:
        n = rec["n"]
        saved = math.ceil(len(per_layer) / n) * BF16 * h * flight
        working = 2 * sum(sorted(per_layer, reverse=True)[:n])
    # the last stage's final norm and head inputs, combined with the heaviest rank's layers (conservatively)
    head = tokens * final_norm_bytes_per_token(h, BF16) + head_tokens_per_device(cfg, layout) * BF16 * h
    return gib((saved + working) * tokens + head)


# ------------------------------------------------------------------------------------------ the vision tower
def image_tokens_per_micro_batch(cfg: Any) -> float:
    """Merged image tokens of one micro batch, at most. Every prompt token may be an image token: a prompt holds at
    most data.max_prompt_length tokens (longer ones are filtered or refused), and the prompts' share of a micro
    batch is max_prompt_length / (prompt + response) of its tokens (padded batches: exactly its prompts; dynamic
    batches: by that share). Neither the data config nor the processor bounds it more tightly: images per prompt
    are not limited, and the official processor's ceiling of 16,777,216 pixels per image is 16,384 tokens."""
    return micro_batch_tokens(cfg) * int(cfg["data"]["max_prompt_length"]) / sequence_length(cfg)


def vision_patches_per_micro_batch(cfg: Any) -> float:
    """Patches the vision tower embeds for one micro batch: spatial_merge_size^2 per merged image token."""
    return image_tokens_per_micro_batch(cfg) * int(cfg["model"]["vision"]["spatial_merge_size"]) ** 2


def _pixels_per_patch(v: Any) -> int:
    return int(v["in_channels"]) * int(v["temporal_patch_size"]) * int(v["patch_size"]) ** 2


def vision_block_bytes_per_patch(v: Any, cb: int) -> float:
    """Bytes one vision block (transformers' Qwen3.5 ViT block) keeps for backward per patch, its output included:
    in the compute dtype its input, the first LayerNorm's output, the fused qkv output (v stays a view of it), the
    rotated q and k, the attention output and its concatenated copy, the residual sum, the second LayerNorm's
    output, the block output (11 x hidden) and the MLP's fc1 and GELU outputs (2 x intermediate); in fp32 the
    attention's log-sum-exp per head and the LayerNorms' mean and rstd. Counted tensor by tensor on the modules
    (tests/config/test_memory_calibration.py)."""
    d, inter = int(v["hidden_size"]), int(v["intermediate_size"])
    return float(cb * (11 * d + 2 * inter) + FP32 * (int(v["num_heads"]) + 4))


def vision_stem_bytes_per_patch(v: Any, cb: int) -> float:
    """What the tower keeps for backward outside its blocks, per patch: the patch embedding's input in the compute
    dtype, the first block's input, the merger's LayerNorm output, fc1 output and GELU output (hidden each: a merged
    row is spatial_merge^2 patches wide) and its fc2 output (out_hidden per merged token); in fp32 the rotary cos
    and sin (head_dim each), the bilinear position lookup's four weights and the merger LayerNorm's mean and rstd;
    the lookup's four int64 indices."""
    d, merged = int(v["hidden_size"]), int(v["spatial_merge_size"]) ** 2
    head_dim = d // int(v["num_heads"])
    return float(cb * (_pixels_per_patch(v) + 4 * d + int(v["out_hidden_size"]) / merged)
                 + FP32 * (2 * head_dim + 4 + 2) + FP64 * 4)


def vision_recomputed(cfg: Any, layout: Layout) -> bool:
    """Whether the backward recomputes the vision blocks (each keeps only its input): whenever the decoder layers
    are recomputed (`recompute_groups`). FSDP: transformers' gradient checkpointing covers the vision blocks like
    the decoder layers. Megatron: an assumption on the engine. megatron-core's recompute does not reach the
    transformers tower the engine runs next to its decoder, so the engine has to checkpoint the tower's blocks
    itself when it recomputes, as the reference runs' bridge does (its vision blocks take the language model's
    recompute settings). Without it the tower keeps every block's tensors (`vision_block_bytes_per_patch` x depth
    per patch), which the 122B reference runs' 3240-token prompts do not fit."""
    return recompute_groups(cfg, layout) is not None


def vision_activations_gib(cfg: Any, layout: Layout) -> float:
    """The vision tower's activations for the images of the micro batches in flight (`in_flight_micro_batches`;
    Megatron: on the first stage, where the tower lives), `vision_patches_per_micro_batch` patches each, not split
    over TP, CP or SP: every rank of a model-parallel group runs the tower on all of them. Each micro batch in
    flight keeps its fp32 pixel values. A trained tower keeps what its stem and blocks save for backward
    (recomputed: each block only its input, plus one block recomputed at a time, for Megatron with its gradients
    as for the decoder's recomputed group). A frozen tower (`freezes_vision`) keeps nothing for backward: one
    block's forward tensors of one micro batch are live at a time, counted on top (conservatively: the forward
    runs before the decoder's backward)."""
    if not trains_vision(cfg):
        return 0.0
    v = cfg["model"]["vision"]
    cb = BF16 if _model_parallel(layout) else compute_bytes(cfg)
    patches, flight = vision_patches_per_micro_batch(cfg), in_flight_micro_batches(cfg, layout)
    block, pixels = vision_block_bytes_per_patch(v, cb), FP32 * _pixels_per_patch(v)
    if freezes_vision(cfg):
        return gib(patches * (pixels * flight + block))
    stem, depth = vision_stem_bytes_per_patch(v, cb), int(v["depth"])
    if vision_recomputed(cfg, layout):
        saved, working = stem + depth * cb * int(v["hidden_size"]), (2 if _model_parallel(layout) else 1) * block
    else:
        saved, working = stem + depth * block, 0.0
    return gib(patches * ((saved + pixels) * flight + working))


def head_tokens_per_device(cfg: Any, layout: Layout) -> float:
    """Response tokens of one micro batch that a device's log-prob head runs over (only these: prompt positions
    have no use for it). FSDP: split like the activations (Ulysses SP); Megatron: each TP rank runs the whole
    micro batch's tokens (the output layer's input is gathered over the sequence) over its vocabulary slice."""
    if not _model_parallel(layout):
        return response_tokens_per_device(cfg, layout)
    share = int(cfg["data"]["max_response_length"]) / sequence_length(cfg)
    return micro_batch_tokens(cfg) * share / max(layout.cp, 1)


def logits_gib(cfg: Any, layout: Layout) -> float:
    """Log-probs and entropy over the vocabulary in `logprob_chunk_size`-token chunks of response tokens
    (`engines.logprob`, both engines; the head's backward is the peak): the fp32 gradient accumulator of the
    device's vocabulary rows [V / tp, h] (Megatron splits the vocabulary over TP) plus three fp32 [chunk, V / tp]
    tensors (log-probs, probabilities, their product for the entropy)."""
    m = cfg["model"]
    vocab = int(m["vocab_size"]) / (layout.tp if _model_parallel(layout) else 1)
    chunk = min(int(cfg["backend"]["logprob_chunk_size"]), head_tokens_per_device(cfg, layout))
    return gib(vocab * int(m["hidden_size"]) * FP32 + 3 * chunk * vocab * FP32)


def recomputed_layer_gib(cfg: Any, layout: Layout, shard: TrainShard, kernels: Optional[str] = None) -> float:
    """FSDP with checkpointing: during a layer's backward its forward is re-run (its saved tensors, as without
    checkpointing; their gradients replace them as they are consumed) while the lm_head's gradient waits in the
    compute dtype for the end of the backward."""
    if _model_parallel(layout) or recompute_groups(cfg, layout) is None:
        return 0.0
    m, cb, kernels = cfg["model"], compute_bytes(cfg), gdn_kernels(cfg, kernels)
    widest = max(hf_layer_bytes_per_token(m, k, cb, kernels, compiles_layers(cfg)) for k in set(shard.layers))
    return gib(tokens_per_device(cfg, layout) * widest + P.embedding_params(m) * cb)


def backward_transient_gib(cfg: Any, layout: Layout, shard: TrainShard, kernels: Optional[str] = None) -> float:
    """The transient on top of the saved activations. FSDP: the larger of the log-prob head's backward and one
    recomputed layer (the head runs first and frees its buffers before the layers). Megatron: the last stage's
    head (its recomputed group is in `activations_gib`, combined conservatively across pipeline ranks)."""
    if _model_parallel(layout):
        return logits_gib(cfg, layout)
    return max(logits_gib(cfg, layout), recomputed_layer_gib(cfg, layout, shard, kernels))


def optimizer_step_gib(cfg: Any, layout: Layout, shard: TrainShard, backward_set: float) -> float:
    """FSDP on the device: the optimizer step holds every local fp32 gradient plus the larger temporary of the grad
    norm (an fp64 copy of a local gradient and its square: 16 B per element of the largest tensor's shard) and
    AdamW's foreach step (sqrt of the second moments: 4 B per local parameter); it raises the peak only by what
    exceeds the backward's set (`backward_set`: its gradients, gathered units, activations and transient).
    Megatron: torch's foreach Adam, megatron's choice without Transformer Engine or Apex (the plan cannot see the
    nodes' packages: assumed), allocates that sqrt for every parameter whose states are on the device (a third of
    their 12 B); its gradient buffer persists through the step, so only the activations and the transient are
    gone by then (measured on an H200, 2026-12-04: the 4B's step added 15.7 GiB, its peak)."""
    if _model_parallel(layout):
        freed = backward_set - train_grads_gib(cfg, layout, shard)
        return max(0.0, optimizer_states_gib(cfg, layout, shard) / 3 - freed)
    if _offload_policy_on(cfg):
        return 0.0
    local = shard.trained
    largest = largest_parameter(cfg["model"]) / max(layout.fsdp_size, 1)
    step = gib(local * FP32 + max(largest * (FP64 + FP64), local * FP32))
    return max(0.0, step - backward_set)


# ------------------------------------------------------------------------ the forward-only (log-prob) passes
LOG_PROB_BESIDE = ("train/weights", "train/optimizer", "train/gathered_params", "train/reference",
                   "train/sleeping_engine")
"""Training terms still on the device while the old and the reference log-probs are computed; the backward's and
the optimizer step's moments are not (FSDP's gradients are freed after each step: `log_prob/grads` is Megatron's
buffer)."""


def log_prob_tree(cfg: Any) -> Any:
    """`cfg` as the forward-only passes cut their micro batches: `backend.log_prob_micro_batch_size_per_device` and
    `backend.log_prob_max_tokens_per_device` in place of the training values (null: the training value)."""
    b = cfg["backend"]
    micro, tokens = b.get("log_prob_micro_batch_size_per_device"), b.get("log_prob_max_tokens_per_device")
    if micro is None and tokens is None:
        return cfg
    backend = dict(b)
    if micro is not None:
        backend["micro_batch_size_per_device"] = int(micro)
    if tokens is not None:
        backend["max_tokens_per_device"] = int(tokens)
    return {**cfg, "backend": backend}


def log_prob_activations_gib(cfg: Any, layout: Layout, shard: TrainShard, kernels: Optional[str] = None) -> float:
    """One log-prob micro batch's forward under no_grad keeps nothing for a backward: the hidden state between
    layers, plus the larger of the widest layer's tensors (freed when the layer ends) and the head (the response
    tokens' final hidden states and three fp32 [chunk, V / tp] tensors, no gradient accumulator). Megatron runs each
    micro batch through the pipeline on its own (no 1F1B in flight). The vision tower's forward is not counted."""
    lp, m, h = log_prob_tree(cfg), cfg["model"], int(cfg["model"]["hidden_size"])
    tokens, head_tokens = tokens_per_device(lp, layout), head_tokens_per_device(lp, layout)
    kinds = set(shard.layers)
    if _model_parallel(layout):
        cb, kernels, vocab = BF16, megatron_gdn_kernels(cfg, kernels), int(m["vocab_size"]) / max(layout.tp, 1)
        widest = max((megatron_layer_bytes_per_token(m, k, kernels) for k in kinds), default=0.0)
    else:
        cb, kernels, vocab = compute_bytes(cfg), gdn_kernels(cfg, kernels), int(m["vocab_size"])
        widest = max((hf_layer_bytes_per_token(m, k, cb, kernels, compiles_layers(cfg)) for k in kinds), default=0.0)
    chunk = min(int(cfg["backend"]["logprob_chunk_size"]), head_tokens)
    head = head_tokens * cb * h + 3 * chunk * vocab * FP32
    return gib(tokens * cb * h + max(tokens * widest, head))


def reference_model_gib(cfg: Any, layout: Layout, shard: TrainShard) -> float:
    """With KL on, a bf16 reference model sharded like the policy, its copy of the vision tower included (weights
    only: it never trains) (FSDP: plus its root unit, which stays gathered after each of its forward passes); it
    follows the policy's parameter offload (host between its forward passes) and is absent without KL."""
    if not kl_on(cfg) or cfg["backend"]["param_offload"] or (not _model_parallel(layout) and _offload_policy_on(cfg)):
        return 0.0
    root = 0.0 if _model_parallel(layout) else shard.root
    return gib((shard.held + root) * BF16)


def rollout_weights_params(cfg: Any, layout: Layout) -> float:
    """Parameters one rollout device holds: the text model without MTP, plus the vision tower on image data
    (`trains_vision`: the hf engine builds the transformers VL model only then, and vLLM skips building the tower
    when limit_mm_per_prompt is 0 for images and video, which the engine sets for text data). Dense weights,
    embeddings and vLLM's vision tower split by rollout TP (the tower replicated on each TP rank with
    engine_kwargs.mm_encoder_tp_mode=data), experts by rollout EP (one DP-attention engine) or TP."""
    m = cfg["model"]
    tp = max(layout.rollout_tp, 1)
    tower = vision_tower_params(cfg)
    replicated = rollout_engine(cfg).tensor_parallel and (cfg["rollout"].get("engine_kwargs") or {}).get(
        "mm_encoder_tp_mode") == "data"
    expert = len(P.layer_kinds(m)) * P.layer_expert_params(m)
    split_experts = layout.rollout_ep if layout.rollout_ep > 1 else layout.rollout_tp
    dense = P.count_params(m).text - expert
    return dense / tp + (tower if replicated else tower / tp) + expert / max(split_experts, 1)


def hf_engine_sleeps(cfg: Any) -> bool:
    """The hf engine moves its weights to the host between generations only with free_cache_engine and sleep
    level 2 (it has no cache to free at level 1)."""
    r = cfg["rollout"]
    return bool(r["free_cache_engine"]) and int(r["sleep_level"]) >= 2


def sleeping_engine_gib(cfg: Any, layout: Layout) -> float:
    """vLLM with free_cache_engine sleeps during training (level 1 moves weights to the host, level 2 drops
    them; the KV cache is freed): nothing stays. Without it the whole pool stays. The hf engine keeps its copy of
    its weights in the model dtype unless it sleeps (`hf_engine_sleeps`). With placement=split no engine shares
    the training devices."""
    if layout.split:
        return 0.0
    if not rollout_engine(cfg).own_weights:
        if hf_engine_sleeps(cfg):
            return 0.0
        return gib(rollout_weights_params(cfg, layout) * dtype_bytes(cfg["model"]["dtype"]))
    return 0.0 if cfg["rollout"]["free_cache_engine"] else vllm_pool_gib(cfg)


# --------------------------------------------------------------------------------------------- rollout terms
def train_state_during_rollout_gib(cfg: Any, layout: Layout, shard: TrainShard) -> float:
    """What the trainer leaves on the device while the rollout runs: weights unless param_offload, optimizer
    states unless optimizer_offload, Megatron gradients unless grad_offload (FSDP frees them after the step),
    and the reference model (see reference_model_gib). With placement=split the rollout runs on other devices:
    nothing."""
    if layout.split:
        return 0.0
    b = cfg["backend"]
    kept = 0.0 if b["param_offload"] else train_weights_gib(cfg, layout, shard)
    kept += 0.0 if b["optimizer_offload"] else optimizer_states_gib(cfg, layout, shard)
    if _model_parallel(layout) and not b["grad_offload"]:
        kept += train_grads_gib(cfg, layout, shard)
    return kept + reference_model_gib(cfg, layout, shard)


def host_offloaded_gib(cfg: Any, layout: Layout, shard: TrainShard) -> float:
    """Host memory per device for what the trainer offloads: Megatron's CPU optimizer share (12 B/param), and
    between phases weights (2 B), fp32 grads and the device optimizer share; FSDP offloaded (`_offload_policy_on`)
    keeps fp32 params + grads + Adam m, v (16 B/param; frozen parameters 4 B) there; plus an offloaded reference
    model (bf16)."""
    b = cfg["backend"]
    if train_engine(cfg).offloads_between_phases:
        host = 0.0
        if b["optimizer_cpu_offload"]:
            full = optimizer_states_gib({**cfg, "backend": {**b, "optimizer_cpu_offload": False}}, layout, shard)
            host += full * float(b["optimizer_offload_fraction"])
        host += train_weights_gib(cfg, layout, shard) if b["param_offload"] else 0.0
        host += train_grads_gib(cfg, layout, shard) if b["grad_offload"] else 0.0
        host += optimizer_states_gib(cfg, layout, shard) if b["optimizer_offload"] else 0.0
    else:
        host = gib(shard.trained * 4 * FP32 + shard.frozen * FP32) if _offload_policy_on(cfg) else 0.0
    offloaded_ref = b["param_offload"] or (not _model_parallel(layout) and _offload_policy_on(cfg))
    return host + (gib(shard.held * BF16) if kl_on(cfg) and offloaded_ref else 0.0)


AUTO = "auto"
AUTO_POOL_MAX = 0.9
"""The largest share of the device an `auto` vLLM pool takes (vLLM's own default gpu_memory_utilization)."""
AUTO_POOL_HEADROOM = 0.10
"""Share of the usable memory an `auto` pool leaves free beside what the trainer keeps: the estimate's margin, and
`layout_search.MIN_HEADROOM`, below which the search penalises a layout."""


def pool_is_auto(cfg: Any) -> bool:
    return str(cfg["rollout"]["gpu_memory_utilization"]) == AUTO


def nominal_gib(cfg: Any) -> float:
    return float(cfg["hw"]["memory_gb"]) * 1e9 / GIB


def vllm_pool_gib(cfg: Any) -> float:
    """vLLM claims gpu_memory_utilization of the device's nominal memory for weights, activations and cache. `auto`:
    here the most it may take (`AUTO_POOL_MAX`, or the usable memory less the headroom when that is less);
    `assemble` sizes it from what the trainer leaves (`auto_pool_gib`)."""
    if pool_is_auto(cfg):
        return min(AUTO_POOL_MAX * nominal_gib(cfg), capacity_gib(cfg))
    return float(cfg["rollout"]["gpu_memory_utilization"]) * nominal_gib(cfg)


def auto_pool_gib(cfg: Any, kept: float, minimal: float) -> float:
    """`rollout.gpu_memory_utilization=auto`: the pool from the memory the trainer leaves during the rollout
    (`kept`): the usable memory less `AUTO_POOL_HEADROOM` less `kept`, at most `AUTO_POOL_MAX` of the device; where
    that cannot hold the engine (`minimal`: weights, activations, one sequence), every byte left. Whole hundredths
    of the device (the value the plan writes into the config), at least one."""
    nominal, cap = nominal_gib(cfg), capacity_gib(cfg)
    pool = min(AUTO_POOL_MAX * nominal, (1.0 - AUTO_POOL_HEADROOM) * cap - kept)
    if pool < minimal:
        pool = cap - kept
    return max(math.floor(pool / nominal * 100 + 1e-9), 1) / 100 * nominal


def auto_pool_fraction(cfg: Any, layout: Layout) -> float:
    """The gpu_memory_utilization an `auto` pool resolves to under `layout` (sized as for vLLM whatever the engine:
    the value the verl export and the engine read)."""
    tree = as_tree(cfg)
    if not rollout_engine(tree).kv_pool:
        pooled = next(s.name for s in ROLLOUT_ENGINES.values() if s.kv_pool)
        tree = {**tree, "rollout": {**tree["rollout"], "engine": pooled}}
    est = estimate(tree, layout)
    return round(est.rollout_pool_gib / nominal_gib(tree), 2)


def rollout_max_model_len(cfg: Any) -> int:
    return int(cfg["rollout"]["max_model_len"] or sequence_length(cfg))


def kv_cache_bytes_per_token(cfg: Any, layout: Layout) -> float:
    """Full-attention layers only: L_full * 2 (K,V) * KV heads per device * head_dim * dtype; KV heads split by
    rollout TP and replicated when TP exceeds them."""
    m = cfg["model"]
    n_full = P.layer_kinds(m).count("full")
    kv_heads = max(int(m["num_key_value_heads"]) / max(layout.rollout_tp, 1), 1)
    return n_full * 2 * kv_heads * int(m["head_dim"]) * dtype_bytes(m["dtype"])


def gdn_state_bytes_per_sequence(cfg: Any, layout: Layout) -> float:
    """GDN layers keep a constant state per sequence: fp32 recurrent L_lin*nv*dk*dv plus the conv window
    L_lin*(2*nk*dk + nv*dv)*(kernel-1) in the model dtype, heads split by rollout TP."""
    m = cfg["model"]
    n_lin = P.layer_kinds(m).count("linear")
    nk, nv = int(m["linear_num_key_heads"]), int(m["linear_num_value_heads"])
    dk, dv = int(m["linear_key_head_dim"]), int(m["linear_value_head_dim"])
    recurrent = n_lin * nv * dk * dv * FP32
    conv = n_lin * (2 * nk * dk + nv * dv) * (int(m["linear_conv_kernel_dim"]) - 1) * dtype_bytes(m["dtype"])
    return (recurrent + conv) / max(layout.rollout_tp, 1)


def sequence_cache_gib(cfg: Any, layout: Layout) -> float:
    """Cache of one sequence of max_model_len tokens: its KV cache plus one GDN state."""
    return gib(rollout_max_model_len(cfg) * kv_cache_bytes_per_token(cfg, layout)
               + gdn_state_bytes_per_sequence(cfg, layout))


def rollout_activations_gib(cfg: Any, layout: Layout) -> float:
    """vLLM's profiled forward of max_num_batched_tokens: one layer's transient tensors (split by rollout TP) plus
    the residual stream, and the sampler's fp32 logits and probabilities for max_num_seqs sequences."""
    m, r = cfg["model"], cfg["rollout"]
    layer = max(layer_activation_elems_per_token(m, k) for k in ("linear", "full"))
    per_token = layer / max(layout.rollout_tp, 1) + 2 * int(m["hidden_size"])
    sampler = int(r["max_num_seqs"]) * int(m["vocab_size"]) * 2 * FP32
    return gib(int(r["max_num_batched_tokens"]) * per_token * BF16 + sampler)


def hf_engine_sequences(cfg: Any, layout: Layout) -> int:
    """Sequences the transformers-generate engine holds at once on a device: its share of the step's responses
    (over the rollout devices: every device when colocated, the rollout pool with placement=split)."""
    return math.ceil(int(cfg["data"]["train_batch_size"]) * int(cfg["rollout"]["n"]) / max(layout.rollout_world, 1))


def hf_static_cache_gib(cfg: Any, layout: Layout) -> float:
    """transformers' StaticCache of the hf engine, per row: K and V of every full-attention layer for the prompt
    width plus max_new_tokens, and per GDN layer the fp32 recurrent state and `linear_conv_kernel_dim` conv
    columns in the model dtype."""
    m = cfg["model"]
    nk, nv = int(m["linear_num_key_heads"]), int(m["linear_num_value_heads"])
    dk, dv = int(m["linear_key_head_dim"]), int(m["linear_value_head_dim"])
    conv = (2 * nk * dk + nv * dv) * int(m["linear_conv_kernel_dim"]) * dtype_bytes(m["dtype"])
    per_row = (sequence_length(cfg) * kv_cache_bytes_per_token(cfg, layout)
               + P.layer_kinds(m).count("linear") * (nv * dk * dv * FP32 + conv))
    return gib(hf_engine_sequences(cfg, layout) * per_row)


def hf_prefill_gib(cfg: Any, layout: Layout, kernels: Optional[str] = None) -> float:
    """The hf engine's prefill of all rows (no autograd, one layer at a time): a GDN layer's live tensors, which
    exceed an attention layer's, plus the [rows, 1, prompt, prompt + new] boolean mask. torch fallback (counted on
    the 0.8B modules, 106 KB per prompt token there): conv output, z and the residual stream in the model dtype;
    in fp32 3 value-sized and 6 key-sized tensors and three [64]-wide chunk matrices per head and token, and per
    row four recurrent states and two chunk temporaries. fla (not measured): the conv output and contiguous q/k/v,
    normed q and k, z, w, u, v_new, the kernel output, A, the per-chunk states and the residual stream in the model
    dtype, g in fp32, one fp32 final state per row."""
    m = cfg["model"]
    rows, width = hf_engine_sequences(cfg, layout), int(cfg["data"]["max_prompt_length"])
    h, cb = int(m["hidden_size"]), dtype_bytes(m["dtype"])
    nk, nv = int(m["linear_num_key_heads"]), int(m["linear_num_value_heads"])
    dk, dv = int(m["linear_key_head_dim"]), int(m["linear_value_head_dim"])
    value_dim, conv_dim, state = nv * dv, 2 * nk * dk + nv * dv, nv * dk * dv
    if gdn_kernels(cfg, kernels) == "torch":
        per_token = cb * (conv_dim + value_dim + 2 * h) + FP32 * (3 * value_dim + 6 * nv * dk + 3 * nv * GDN_CHUNK)
        per_row = FP32 * (4 * state + 2 * nv * GDN_CHUNK * dv)
    else:
        per_token = (cb * (2 * conv_dim + 2 * nk * dk + 4 * value_dim + nv * dk + nv * GDN_CHUNK + state / GDN_CHUNK
                           + 2 * h) + FP32 * nv)
        per_row = FP32 * state
    mask = width * sequence_length(cfg)
    return gib(rows * (width * per_token + per_row + mask))


def hf_sampler_gib(cfg: Any, layout: Layout) -> float:
    """A decode step's sampling over the vocabulary for every row: the last position's logits in the model dtype,
    and in fp32 the scaled logits, log-softmax, probabilities, the exponential race draw and their ratio."""
    m = cfg["model"]
    return gib(hf_engine_sequences(cfg, layout) * int(m["vocab_size"]) * (dtype_bytes(m["dtype"]) + 5 * FP32))


def hf_rollout_activations_gib(cfg: Any, layout: Layout, kernels: Optional[str] = None) -> float:
    """The hf engine's transient: the prefill or a decode step's sampler, whichever is larger (they never
    overlap)."""
    return max(hf_prefill_gib(cfg, layout, kernels), hf_sampler_gib(cfg, layout))


# ------------------------------------------------------------------------------------------------ the estimate
@dataclass
class MemoryEstimate:
    train_peak_gib: float
    rollout_peak_gib: float
    capacity_gib: float
    fits: bool
    terms: Dict[str, float] = field(default_factory=dict)
    """Every term in GiB, prefixed `train/` or `rollout/`."""
    rollout_pool_gib: Optional[float] = None
    """vLLM's share of the device (None for the hf engine)."""
    rollout_min_gib: float = 0.0
    """What the rollout engine needs at least: weights + activations + one max_model_len sequence."""
    rollout_sequences: Optional[int] = None
    """Full-length sequences the vLLM cache holds at once (0: not even one)."""
    log_prob_peak_gib: float = 0.0
    """The forward-only passes (old and reference log-probs): `LOG_PROB_BESIDE` plus the `log_prob/` terms."""
    reserve_gib: float = 0.0
    """What the runtime keeps beside every peak (`hw.reserve_gib`: CUDA/CANN context, loaded kernels, communicators).
    The peaks leave it out; a device's used memory (total - free) is held against a peak plus this."""

    @property
    def host_gib(self) -> float:
        """Host memory per device for offloaded state (reported, not checked: hw does not state host memory)."""
        return sum(v for k, v in self.terms.items() if k.startswith("host/"))

    @property
    def headroom(self) -> float:
        """Free fraction of the capacity at the higher of the two peaks (negative: does not fit)."""
        peak = max(self.train_peak_gib, self.rollout_peak_gib, self.log_prob_peak_gib)
        return 1.0 - peak / max(self.capacity_gib, 1e-9)

    @property
    def rollout_engine_fits(self) -> bool:
        return self.rollout_pool_gib is None or self.rollout_min_gib <= self.rollout_pool_gib

    def to_dict(self) -> Dict[str, Any]:
        r = lambda x: None if x is None else round(float(x), 3)  # noqa: E731
        return {"train_peak": r(self.train_peak_gib), "rollout_peak": r(self.rollout_peak_gib),
                "log_prob_peak": r(self.log_prob_peak_gib),
                "capacity": r(self.capacity_gib), "fits": self.fits, "headroom": r(self.headroom),
                "rollout_pool": r(self.rollout_pool_gib), "rollout_min": r(self.rollout_min_gib),
                "rollout_sequences": self.rollout_sequences, "host": r(self.host_gib), "reserve": r(self.reserve_gib), "terms": {k: r(v) for k, v in self.terms.items()}}


def train_terms(cfg: Any, layout: Layout, gdn: Optional[str] = None) -> Dict[str, float]:
    """The training phase's terms (they depend on the training layout only); `gdn` overrides `gdn_kernels`."""
    shard = train_shard(cfg, layout)
    backward = {
        "train/grads": train_grads_gib(cfg, layout, shard),
        "train/gathered_params": fsdp_gathered_params_gib(cfg, layout, shard),
        "train/activations": activations_gib(cfg, layout, shard, gdn),
        "train/vision_activations": vision_activations_gib(cfg, layout),
        "train/backward_transient": backward_transient_gib(cfg, layout, shard, gdn),
    }
    return {
        "train/weights": train_weights_gib(cfg, layout, shard),
        "train/optimizer": optimizer_states_gib(cfg, layout, shard),
        **backward,
        "train/optimizer_step": optimizer_step_gib(cfg, layout, shard, sum(backward.values())),
        "train/reference": reference_model_gib(cfg, layout, shard),
        "log_prob/grads": train_grads_gib(cfg, layout, shard) if _model_parallel(layout) else 0.0,
        "log_prob/activations": log_prob_activations_gib(cfg, layout, shard, gdn),
        "rollout/kept_by_trainer": train_state_during_rollout_gib(cfg, layout, shard),
        "host/trainer_offload": host_offloaded_gib(cfg, layout, shard),
    }


def rollout_terms(cfg: Any, layout: Layout, gdn: Optional[str] = None) -> Dict[str, float]:
    """The rollout engine's terms (they depend on the rollout layout only); `gdn` overrides `gdn_kernels` (hf
    engine; vLLM brings its own kernels)."""
    weights = gib(rollout_weights_params(cfg, layout) * dtype_bytes(cfg["model"]["dtype"]))
    terms = {"rollout/weights": weights, "train/sleeping_engine": sleeping_engine_gib(cfg, layout)}
    sleeps = not layout.split  # with placement=split the engine has its devices to itself: it never sleeps
    if (sleeps and rollout_engine(cfg).own_weights and cfg["rollout"]["free_cache_engine"]
            and int(cfg["rollout"]["sleep_level"]) == 1):
        terms["host/sleeping_engine"] = weights  # sleep level 1 parks the weights in host memory
    if not rollout_engine(cfg).kv_pool:
        if sleeps and hf_engine_sleeps(cfg):
            terms["host/sleeping_engine"] = weights
        terms["rollout/kv_cache"] = hf_static_cache_gib(cfg, layout)
        terms["rollout/activations"] = hf_rollout_activations_gib(cfg, layout, gdn)
    else:
        terms["rollout/activations"] = rollout_activations_gib(cfg, layout)
        terms["rollout/pool"] = vllm_pool_gib(cfg)
        terms["rollout/sequence_cache"] = sequence_cache_gib(cfg, layout)
    return terms


def assemble(cfg: Any, train: Dict[str, float], rollout: Dict[str, float]) -> MemoryEstimate:
    """Combine the two phases' terms into peaks and the fit verdict."""
    terms = {**train, **rollout}
    train_peak = sum(v for k, v in terms.items() if k.startswith("train/"))
    kept = terms["rollout/kept_by_trainer"]
    cap = capacity_gib(cfg)
    if "rollout/pool" in terms:
        per_seq = terms["rollout/sequence_cache"]
        minimal = terms["rollout/weights"] + terms["rollout/activations"] + per_seq
        if pool_is_auto(cfg):
            awake = terms.get("train/sleeping_engine", 0.0) > 0  # free_cache_engine off: the pool stays in training
            beside = max(kept, train_peak - terms["train/sleeping_engine"]) if awake else kept
            terms["rollout/pool"] = auto_pool_gib(cfg, beside, minimal)
            if awake:
                terms["train/sleeping_engine"] = terms["rollout/pool"]
                train_peak = sum(v for k, v in terms.items() if k.startswith("train/"))
        pool = terms["rollout/pool"]
        sequences = max(0, int((pool - minimal + per_seq) // per_seq)) if per_seq > 0 else None
        rollout_peak = kept + pool
    else:
        pool, sequences = None, None
        minimal = terms["rollout/weights"] + terms["rollout/kv_cache"] + terms["rollout/activations"]
        rollout_peak = kept + minimal
    log_prob_peak = sum(terms.get(k, 0.0) for k in LOG_PROB_BESIDE) + sum(
        v for k, v in terms.items() if k.startswith("log_prob/"))
    fits = max(train_peak, rollout_peak, log_prob_peak) <= cap and (pool is None or minimal <= pool)
    return MemoryEstimate(train_peak_gib=train_peak, rollout_peak_gib=rollout_peak, capacity_gib=cap, fits=fits,
                          terms=terms, rollout_pool_gib=pool, rollout_min_gib=minimal, rollout_sequences=sequences,
                          log_prob_peak_gib=log_prob_peak, reserve_gib=float(cfg["hw"]["reserve_gib"]))


def estimate(cfg: Any, layout: Layout, gdn: Optional[str] = None) -> MemoryEstimate:
    """Per-device memory of both phases of `cfg` under `layout`; `gdn` ('fla' / 'torch') overrides the GDN kernels
    the plan assumes (`gdn_kernels`). With placement=split `train_peak_gib` is a training-pool device's and
    `rollout_peak_gib` a rollout-pool device's."""
    tree = as_tree(cfg)
    return assemble(tree, train_terms(tree, layout, gdn), rollout_terms(tree, layout, gdn))


# ------------------------------------------------------------------------------------------------- on disk
def checkpoint_gib(cfg: Any) -> float:
    """Size of one checkpoint of the policy (the reference is rebuilt, not saved): the trained parameters (the
    vision tower when the run sees images) times what the engine's checkpoint holds per parameter (its spec's
    `checkpoint_bytes_per_param`)."""
    count = P.count_params(cfg["model"])
    trained = count.text + (count.vision if cfg["data"].get("has_images") else 0)
    return gib(trained * train_engine(cfg).checkpoint_bytes_per_param)
