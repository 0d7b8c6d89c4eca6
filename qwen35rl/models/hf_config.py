"""Our `ModelConfig` (conf/model/*.yaml) as a transformers config.

Every field is set explicitly: the transformers class defaults match no Qwen3.5 checkpoint. Fields transformers
does not model (`attn_output_gate`, `mtp_num_hidden_layers`, `full_attention_interval`) are still written so a
saved `config.json` reads like an official one (vLLM reads them).
"""
from __future__ import annotations

from typing import Any, Dict, List

from transformers import (
    PretrainedConfig,
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
)

from qwen35rl.config.special_tokens import special_token_ids


def layer_types(num_layers: int, full_attention_interval: int) -> List[str]:
    """`[linear, linear, linear, full]` repeated; the last layer is always full attention."""
    types = ["full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention" for i in range(num_layers)]
    types[-1] = "full_attention"
    return types


def rope_parameters(m: Any) -> Dict[str, Any]:
    return {
        "rope_type": "default",
        "rope_theta": float(m.rope_theta),
        "partial_rotary_factor": float(m.partial_rotary_factor),
        "mrope_section": [int(s) for s in m.mrope_section],
        "mrope_interleaved": bool(m.mrope_interleaved),
    }


def _text_kwargs(m: Any) -> Dict[str, Any]:
    ids = special_token_ids(m)
    kw: Dict[str, Any] = dict(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        num_hidden_layers=m.num_hidden_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_key_value_heads,
        head_dim=m.head_dim,
        hidden_act=m.hidden_act,
        rms_norm_eps=float(m.rms_norm_eps),
        max_position_embeddings=m.max_position_embeddings,
        tie_word_embeddings=bool(m.tie_word_embeddings),
        attention_bias=False,
        attention_dropout=0.0,
        initializer_range=0.02,
        use_cache=True,
        rope_parameters=rope_parameters(m),
        layer_types=layer_types(m.num_hidden_layers, m.full_attention_interval),
        linear_conv_kernel_dim=m.linear_conv_kernel_dim,
        linear_key_head_dim=m.linear_key_head_dim,
        linear_value_head_dim=m.linear_value_head_dim,
        linear_num_key_heads=m.linear_num_key_heads,
        linear_num_value_heads=m.linear_num_value_heads,
        bos_token_id=None,
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
        dtype=m.dtype,
        # Not modelled by transformers; kept for config.json readers (vLLM, Megatron bridges).
        attn_output_gate=bool(m.attn_output_gate),
        full_attention_interval=m.full_attention_interval,
        mtp_num_hidden_layers=m.mtp_num_hidden_layers,
    )
    if m.moe:
        kw.update(
            num_experts=m.num_experts,
            num_experts_per_tok=m.num_experts_per_tok,
            moe_intermediate_size=m.moe_intermediate_size,
            shared_expert_intermediate_size=m.shared_expert_intermediate_size,
            router_aux_loss_coef=float(m.router_aux_loss_coef),
            output_router_logits=False,
        )
    else:
        kw.update(intermediate_size=m.intermediate_size)
    return kw


def _vision_kwargs(v: Any) -> Dict[str, Any]:
    return dict(
        depth=v.depth,
        hidden_size=v.hidden_size,
        intermediate_size=v.intermediate_size,
        num_heads=v.num_heads,
        patch_size=v.patch_size,
        temporal_patch_size=v.temporal_patch_size,
        spatial_merge_size=v.spatial_merge_size,
        in_channels=v.in_channels,
        num_position_embeddings=v.num_position_embeddings,
        out_hidden_size=v.out_hidden_size,
        hidden_act=v.hidden_act,
        initializer_range=0.02,
    )


def to_hf_config(model_cfg: Any, text_only: bool = False) -> PretrainedConfig:
    """The transformers config of `model_cfg`: `Qwen3_5[Moe]TextConfig` for a text-only model (or when
    `text_only`), `Qwen3_5[Moe]Config` with `vision_config` when the model has a vision tower."""
    text_cls = Qwen3_5MoeTextConfig if model_cfg.moe else Qwen3_5TextConfig
    text = text_cls(**_text_kwargs(model_cfg))
    if model_cfg.vision is None or text_only:
        return text
    if model_cfg.vision.out_hidden_size != model_cfg.hidden_size:
        raise ValueError(
            f"model.vision.out_hidden_size={model_cfg.vision.out_hidden_size} must equal model.hidden_size={model_cfg.hidden_size}"
        )
    ids = special_token_ids(model_cfg)
    vl_cls = Qwen3_5MoeConfig if model_cfg.moe else Qwen3_5Config
    return vl_cls(
        text_config=text.to_dict(),
        vision_config=_vision_kwargs(model_cfg.vision),
        image_token_id=ids["image_pad"],
        video_token_id=ids["video_pad"],
        vision_start_token_id=ids["vision_start"],
        vision_end_token_id=ids["vision_end"],
        tie_word_embeddings=bool(model_cfg.tie_word_embeddings),
        dtype=model_cfg.dtype,
    )


def hf_model_class(model_cfg: Any, text_only: bool = True) -> type:
    """The transformers model class: `*ForCausalLM` for text, `*ForConditionalGeneration` with the vision tower."""
    if model_cfg.vision is None or text_only:
        return Qwen3_5MoeForCausalLM if model_cfg.moe else Qwen3_5ForCausalLM
    return Qwen3_5MoeForConditionalGeneration if model_cfg.moe else Qwen3_5ForConditionalGeneration
