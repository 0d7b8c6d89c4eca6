"""The Qwen3.5 model (text, or vision-language) as megatron-core modules, without Transformer Engine.

megatron-core's ready-made hybrid specs assert TE, its local norm refuses zero-centred gamma, and TE's norm would
zero-centre the GDN output norm too (which Qwen3.5 keeps plain). So the layers start from megatron's own local GPT
layer spec (right for each megatron-core version) and swap in:
- `ZeroCenteredRMSNorm` (x * (1 + w), HF's Qwen3_5RMSNorm) for the input / pre-MLP / final / q / k norms,
- `PlainRMSNorm` (w * x, HF's Qwen3_5RMSNormGated before its gate) as the GDN output norm,
- `SDPACoreAttention` (torch scaled_dot_product_attention, causal) as core attention, or megatron's
  DotProductAttention where MindSpeed replaces it with its flash attention,
- GatedDeltaNet (megatron-core's, with ColumnParallelLinear in / RowParallelLinear out) for linear-attention layers,
following `layer_types` (HF's `[linear]*3 + [full]` pattern with the last layer full), not megatron's own frequency
rule. MoE layers come from the local spec: router, SequentialMLP experts, shared expert with its sigmoid gate.

The output layer hands on its input (`hidden_states_out`): the engine's log-prob head applies its weight a chunk
of response tokens at a time, so no [tokens, vocab] logits exist.

A VL model (`Qwen35VLModel`) adds transformers' vision tower to the first pipeline stage and Qwen3.5's interleaved
multimodal RoPE to every stage (`vision`).

Importing this module imports megatron: on Ascend, `ascend.prepare_platform` must run first.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from qwen35rl.engines.megatron.mapping import FULL_ATTENTION, LINEAR_ATTENTION, Qwen35Shape
from qwen35rl.engines.megatron.vision import InterleavedMRoPE, image_features


# ---------------------------------------------------------------------------------------- version workarounds
def patch_megatron_without_te() -> None:
    """megatron-core 0.16 without Transformer Engine leaves `te_general_gemm` undefined in moe_utils while the
    router's gating linear reads it (fixed in 0.17, which sets it to None): define it."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


# --------------------------------------------------------------------------------------------------------- norms
def _param_device(config: TransformerConfig):
    return "cpu" if config.use_cpu_initialization else torch.cuda.current_device()


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm storing its scale around 0: y = norm(x) * (1 + w), computed in fp32 like transformers' Qwen3.5.

    The weight is marked `sequence_parallel` (megatron then sums its gradient over TP ranks under sequence
    parallelism, where each rank normalises a different slice of tokens or, for q/k norms, of heads)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **_: Any):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype, device=_param_device(config)))
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class PlainRMSNorm(ZeroCenteredRMSNorm):
    """RMSNorm with a plain scale, y = w * norm(x) cast back to x's dtype first (transformers' RMSNormGated;
    GatedDeltaNet multiplies by silu(gate) itself). Initialised to ones. Each TP rank normalises its own GDN heads
    with the same weight, so its gradient must be summed over TP: the engine turns on sequence parallelism
    whenever TP > 1, and the `sequence_parallel` mark does the rest."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **kw: Any):
        super().__init__(config, hidden_size, eps, **kw)
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


# ------------------------------------------------------------------------------------------------- attention
class SDPACoreAttention(MegatronModule):
    """Causal attention through torch's scaled_dot_product_attention (flash / memory-efficient kernels) in
    megatron's core-attention interface: q [s, b, np, d], k/v [s, b, ng, d] -> [s, b, np * d].

    Causal masking is all a right-padded batch needs: a valid token never attends to the padding after it. Packed
    sequences and context parallelism need Transformer Engine attention instead."""

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: Any = None,
                 attention_type: str = "self", attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None, pg_collection: Any = None,
                 **_: Any):
        super().__init__(config=config)
        if config.context_parallel_size > 1:
            raise NotImplementedError("SDPACoreAttention has no context parallelism")
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **_: Any):
        if packed_seq_params is not None:
            raise NotImplementedError("packed sequences need Transformer Engine attention")
        s, b, heads, d = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        if k.shape[1] != heads:  # query heads of a group are contiguous, as in megatron's DotProductAttention
            k = k.repeat_interleave(heads // k.shape[1], dim=1)
            v = v.repeat_interleave(heads // v.shape[1], dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(s, b, heads * d)


# ------------------------------------------------------------------------------------------------------ specs
def layer_spec(shape: Qwen35Shape, kind: str, megatron_attention: bool = False) -> ModuleSpec:
    """TransformerLayer spec of one layer type (`full_attention` or `linear_attention`)."""
    base = get_gpt_layer_local_spec(num_experts=shape.num_experts or None, moe_grouped_gemm=False,
                                    qk_layernorm=True, normalization="RMSNorm")
    sub = base.submodules
    if kind == FULL_ATTENTION:
        attn = sub.self_attention
        core = DotProductAttention if megatron_attention else SDPACoreAttention
        mixer = ModuleSpec(module=attn.module, params=dict(attn.params), submodules=dataclasses.replace(
            attn.submodules, core_attention=core, q_layernorm=ZeroCenteredRMSNorm, k_layernorm=ZeroCenteredRMSNorm))
    elif kind == LINEAR_ATTENTION:
        mixer = ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=PlainRMSNorm, out_proj=RowParallelLinear))
    else:
        raise ValueError(f"unknown layer type {kind!r}")
    # the local spec's key map renames norms for TE-style distributed checkpoints: our names stay as built
    return ModuleSpec(module=base.module, submodules=dataclasses.replace(
        sub, input_layernorm=ZeroCenteredRMSNorm, self_attention=mixer, pre_mlp_layernorm=ZeroCenteredRMSNorm,
        sharded_state_dict_keys_map={}))


def stage_layer_ids(config: TransformerConfig, vp_stage: Optional[int] = None) -> List[int]:
    """Global (0-based) ids of the decoder layers this pipeline rank builds for virtual stage `vp_stage`
    (an explicit `pipeline_model_parallel_layout`, or megatron's even split with uneven first/last options)."""
    if config.pipeline_model_parallel_layout is not None:
        return list(config.pipeline_model_parallel_layout.get_layer_id_list(
            layer_type=LayerType.decoder, vp_stage=vp_stage, pp_rank=parallel_state.get_pipeline_model_parallel_rank()))
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    return list(range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage)))


def block_spec(config: TransformerConfig, shape: Qwen35Shape, vp_stage: Optional[int] = None,
               megatron_attention: bool = False) -> TransformerBlockSubmodules:
    specs = {kind: layer_spec(shape, kind, megatron_attention) for kind in set(shape.layer_types)}
    return TransformerBlockSubmodules(layer_specs=[specs[shape.layer_types[i]] for i in stage_layer_ids(config, vp_stage)],
                                      layer_norm=ZeroCenteredRMSNorm)


# ----------------------------------------------------------------------------------------------------- config
def transformer_config(model_cfg: Any, shape: Qwen35Shape, *, tp: int, pp: int, ep: int, etp: int, cp: int = 1,
                       vpp: Optional[int] = None, pipeline_layout: Optional[str] = None, dtype: torch.dtype,
                       recompute: Optional[Dict[str, Any]] = None, moe: Optional[Dict[str, Any]] = None,
                       overrides: Optional[Dict[str, Any]] = None, vision: bool = False) -> TransformerConfig:
    """TransformerConfig of the Qwen3.5 text model. `recompute`: recompute_granularity / method / num_layers;
    `moe`: router and dispatcher settings; `overrides`: extra TransformerConfig fields (backend.transformer_overrides,
    platform quirks), applied last. `vision`: the VL model (3-D positions, `mrope_section`)."""
    m = model_cfg
    kw: Dict[str, Any] = dict(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.intermediate_size or shape.moe_intermediate_size,
        num_attention_heads=shape.num_attention_heads, num_query_groups=shape.num_key_value_heads,
        kv_channels=shape.head_dim, normalization="RMSNorm", layernorm_epsilon=float(m.rms_norm_eps),
        layernorm_zero_centered_gamma=True, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=False, qk_layernorm=True, attention_output_gate=bool(m.attn_output_gate),
        hidden_dropout=0.0, attention_dropout=0.0,
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=[1 if t == LINEAR_ATTENTION else 0 for t in shape.layer_types],
        linear_conv_kernel_dim=shape.linear_conv_kernel_dim, linear_key_head_dim=shape.linear_key_head_dim,
        linear_value_head_dim=shape.linear_value_head_dim, linear_num_key_heads=shape.linear_num_key_heads,
        linear_num_value_heads=shape.linear_num_value_heads,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
        # TP > 1 always with sequence parallelism: MoE requires it, and it is what sums the gradients of norms
        # whose TP ranks see different heads (q/k norms by name, the GDN output norm by its mark)
        sequence_parallel=tp > 1, pipeline_model_parallel_layout=pipeline_layout,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        # micro batches of different lengths; megatron refuses that with its (default) allgather dispatcher
        variable_seq_lengths=True, moe_token_dispatcher_type="alltoall", gradient_accumulation_fusion=False, masked_softmax_fusion=False,
        bias_activation_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        # initialisation stays on although every weight then comes from the HF state: megatron's linears and
        # embeddings mark themselves tensor-parallel (what grad-norm and checkpoint code read) only there
        perform_initialization=True,
    )
    if vpp and pp == 2:
        # with virtual stages on two ranks each is the other's previous and next stage: one batched p2p call then
        # carries an activation and a gradient between the same two ranks, matched in issue order and so swapped
        # (silently: same shapes). Unbatched sends on two groups keep them apart; Megatron-LM's own argument check
        # refuses interleaving at PP2 without overlap_p2p_comm for this reason.
        kw.update(overlap_p2p_comm=True, batch_p2p_comm=False)
    if vision:
        kw.update(mrope_section=[int(x) for x in m.mrope_section])
    if shape.moe:
        kw.update(num_moe_experts=shape.num_experts, moe_router_topk=int(m.num_experts_per_tok),
                  moe_ffn_hidden_size=shape.moe_intermediate_size,
                  moe_shared_expert_intermediate_size=shape.shared_expert_intermediate_size or None,
                  moe_shared_expert_gate=shape.shared_expert_intermediate_size > 0,
                  # HF: softmax over all experts, top-k, renormalise == softmax over the top-k logits
                  moe_router_score_function="softmax", moe_router_pre_softmax=False, moe_layer_freq=1,
                  moe_grouped_gemm=False, moe_permute_fusion=False)
        kw.update(moe or {})
    kw.update(recompute or {})
    kw.update(overrides or {})
    return TransformerConfig(**kw)


# ------------------------------------------------------------------------------------------------------- model
class Qwen35VLModel(GPTModel):
    """GPTModel with Qwen3.5's interleaved M-RoPE on every stage (positions [3, b, s]) and, on the chunk that
    embeds (`pre_process`), transformers' vision tower: its image features replace the embeddings of the image
    tokens before the decoder, and so before sequence parallelism hands each TP rank its slice of the sequence.

    The tower is replicated, not sharded, over TP: every TP rank runs it on the same images (the tower is a few
    percent of the model's FLOPs) and keeps its slice of the features. The backward of that scatter all-gathers the
    features' gradient, so every TP rank gets the same full gradient and the copies stay identical without an extra
    reduction; gradient norms count the (unmarked, replicated) tower once, on TP rank 0."""

    def __init__(self, *, vision_tower: Optional[torch.nn.Module], **kw: Any):
        super().__init__(position_embedding_type="mrope", **kw)
        cfg = self.config
        self.rotary_pos_emb = InterleavedMRoPE(cfg.kv_channels, kw["rotary_percent"], kw["rotary_base"],
                                               cfg.mrope_section, device=_param_device(cfg))
        if self.pre_process and vision_tower is not None:
            self.visual = vision_tower

    def forward(self, input_ids, position_ids, attention_mask, pixel_values=None, image_grid_thw=None,
                image_mask=None, **kw):
        """`image_mask` [b, s]: the tokens the features of `pixel_values` / `image_grid_thw` replace, in order."""
        decoder_input = None
        if self.pre_process and pixel_values is not None:
            decoder_input = self._embed_with_images(input_ids, pixel_values, image_grid_thw, image_mask)
        return super().forward(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                               decoder_input=decoder_input, **kw)

    def _embed_with_images(self, input_ids: torch.Tensor, pixel_values: torch.Tensor, grid_thw: torch.Tensor,
                           is_image: torch.Tensor) -> torch.Tensor:
        from megatron.core import tensor_parallel

        emb = self.embedding(input_ids=input_ids, position_ids=None)  # [s, b, h] ([s / tp, b, h] under SP)
        feats = image_features(self.visual, pixel_values, grid_thw)
        if int(is_image.sum()) != feats.shape[0]:
            raise ValueError(f"{int(is_image.sum())} image tokens for {feats.shape[0]} image features")
        full = emb.new_zeros((*input_ids.shape, emb.shape[-1])).masked_scatter(is_image[..., None], feats.to(emb.dtype))
        full, mask = full.transpose(0, 1).contiguous(), is_image.t()
        if self.config.sequence_parallel:
            full = tensor_parallel.scatter_to_sequence_parallel_region(full)
            tp = parallel_state.get_tensor_model_parallel_world_size()
            mask = mask.chunk(tp, dim=0)[parallel_state.get_tensor_model_parallel_rank()]
        return torch.where(mask[..., None], full, emb).contiguous()  # strides follow the (transposed) mask


def build_chunks(config: TransformerConfig, model_cfg: Any, shape: Qwen35Shape, megatron_attention: bool = False,
                 vision_tower: Any = None) -> List[GPTModel]:
    """This rank's model chunks (one per virtual pipeline stage), on the current device, weights unset.
    `vision_tower`: a callable building the transformers vision tower (VL model; the chunk that embeds holds it)."""
    patch_megatron_without_te()
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    chunks = []
    for stage in range(vpp or 1):
        vp_stage = stage if vpp else None
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        kw = dict(
            config=config, transformer_layer_spec=block_spec(config, shape, vp_stage, megatron_attention),
            vocab_size=shape.vocab_size, max_sequence_length=int(model_cfg.max_position_embeddings),
            pre_process=pre_process,
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            parallel_output=True, share_embeddings_and_output_weights=shape.tie_word_embeddings,
            rotary_percent=float(model_cfg.partial_rotary_factor), rotary_base=int(model_cfg.rope_theta),
            vp_stage=vp_stage)
        if vision_tower is None:
            model = GPTModel(position_embedding_type="rope", **kw)
        else:
            model = Qwen35VLModel(vision_tower=vision_tower() if pre_process else None, **kw)
        if model.post_process:
            hidden_states_out(model)
        chunks.append(model)
    return chunks


def hidden_states_out(model: GPTModel) -> None:
    """The model returns the output layer's input ([b, s, h], gathered over the sequence) instead of logits.
    `engines.logprob.chunked_logprobs_entropy` then applies the weight (`step.head_weight`) a chunk of response tokens
    at a time: bf16 logits of a 16 x 768-token micro batch over the 248k vocabulary take 5.7 GiB, and autograd's
    slice-by-slice gradient of them three times that. The layer keeps its parameter, so DDP, the optimizer and
    checkpoints see it unchanged. Under TP the input takes the path ColumnParallelLinear gives it: all-gathered
    over the sequence with sequence parallelism (its gradient reduce-scattered), else copied into the TP region
    (its gradient all-reduced), since each rank's vocabulary slice adds its part of that gradient."""
    from megatron.core import tensor_parallel

    layer = model.output_layer

    def forward(hidden_states, weight=None, runtime_gather_output=None):
        if parallel_state.get_tensor_model_parallel_world_size() == 1:
            return hidden_states, None
        if layer.sequence_parallel:
            return tensor_parallel.gather_from_sequence_parallel_region(hidden_states), None
        return tensor_parallel.copy_to_tensor_model_parallel_region(hidden_states), None

    layer.forward = forward


def chunk_layer_ids(config: TransformerConfig, chunks: Sequence[GPTModel]) -> List[List[int]]:
    """Global decoder-layer ids of each chunk, in the chunk's local order."""
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    return [stage_layer_ids(config, i if vpp else None) for i in range(len(chunks))]
