"""Build a Qwen3.5 transformers model from our ModelConfig (random init or a checkpoint) and save it back in the
Hugging Face layout (safetensors + config + generation config + tokenizer [+ processor])."""
from __future__ import annotations

import os
from typing import Any, Iterable, List, Optional, Tuple, Union

import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, GenerationConfig, PreTrainedModel

from qwen35rl.models.hf_config import hf_model_class, to_hf_config
from qwen35rl.models.tokenizer import trusts_remote_code
from qwen35rl.config.special_tokens import special_token_ids

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def torch_dtype(dtype: Union[str, torch.dtype]) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: expected one of {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def generation_config(model_cfg: Any) -> GenerationConfig:
    """Stop on <|im_end|> (end of a chat turn) and <|endoftext|>, pad with the tokenizer's pad, as the official
    checkpoints' generation_config.json does."""
    ids = special_token_ids(model_cfg)
    return GenerationConfig(eos_token_id=[ids["im_end"], ids["eos"]], pad_token_id=ids["pad"], do_sample=True)


def build_model(
    model_cfg: Any,
    *,
    dtype: Union[str, torch.dtype],
    device: Union[str, torch.device] = "cpu",
    seed: int = 0,
    text_only: bool = True,
) -> PreTrainedModel:
    """The model of `model_cfg`: `*ForCausalLM` when `text_only` (or the model has no vision tower), else
    `*ForConditionalGeneration`.

    `model.init=random`: fresh weights, the same for the same seed whatever `device` and `dtype` are (drawn in fp32
    on CPU, then cast and moved). `device="meta"` builds the structure without memory (FSDP fills the shards later).
    `model.init=pretrained`: weights from `model.path` (a VL checkpoint also loads as text-only).
    """
    dtype = torch_dtype(dtype)
    cls = hf_model_class(model_cfg, text_only)
    if str(device) == "meta":
        with torch.device("meta"):
            model = cls._from_config(_config_for(model_cfg, text_only), dtype=dtype)
    elif model_cfg.init == "random":
        # Always draw in fp32, then cast: initialisers draw different numbers per dtype, and a bf16 reference
        # policy must start from the same weights as the fp32 policy.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = cls._from_config(_config_for(model_cfg, text_only), dtype=torch.float32).to(dtype)
        model.generation_config = generation_config(model_cfg)
        model.to(device)
    elif model_cfg.init == "pretrained":
        if not model_cfg.path or not os.path.isdir(model_cfg.path):
            raise FileNotFoundError(f"model.init=pretrained needs model.path to be a checkpoint directory (got {model_cfg.path!r})")
        auto = AutoModelForCausalLM if cls is hf_model_class(model_cfg, True) else AutoModelForImageTextToText
        model = auto.from_pretrained(model_cfg.path, dtype=dtype,
                                     trust_remote_code=trusts_remote_code(model_cfg)).to(device)
    else:
        raise ValueError(f"model.init={model_cfg.init!r}: expected random or pretrained")
    return model


def trains_vision(model_cfg: Any, data_cfg: Any) -> bool:
    """Whether the policy includes the vision tower: a vision model on image data. Otherwise a VL checkpoint trains
    as its text model, and its vision tower is carried over unchanged into the export."""
    from qwen35rl.config.memory import trains_vision as planned  # the rule the memory estimate plans with

    return planned({"model": model_cfg, "data": data_cfg})


def _config_for(model_cfg: Any, text_only: bool):
    """The transformers config: a pretrained checkpoint's own (its token ids and fields beyond ours), else ours."""
    if model_cfg.init == "pretrained" and model_cfg.path and os.path.isfile(os.path.join(model_cfg.path, "config.json")):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_cfg.path, trust_remote_code=trusts_remote_code(model_cfg))
        if text_only:
            config = config.get_text_config()
    else:
        config = to_hf_config(model_cfg, text_only=text_only)
    config._attn_implementation = "sdpa"
    return config


def enable_activation_checkpointing(model: PreTrainedModel) -> None:
    """Recompute each layer / block in the backward (non-reentrant)."""
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.2x; older: gradient_*
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def init_rotary_buffers(model: PreTrainedModel) -> None:
    """Recompute the non-persistent rotary `inv_freq` buffers (in no state dict) after building on `meta`."""
    with torch.no_grad():
        for module in model.modules():
            if "RotaryEmbedding" in type(module).__name__ and hasattr(module, "original_inv_freq"):
                model._init_weights(module)


def save_hf(model: PreTrainedModel, tokenizer: Any, out_dir: str, processor: Optional[Any] = None) -> None:
    """Write `out_dir` so that `from_pretrained` (transformers, vLLM) loads the model, tokenizer and processor."""
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    if processor is not None:
        processor.save_pretrained(out_dir)  # includes the tokenizer
    else:
        tokenizer.save_pretrained(out_dir)


def save_hf_config(model_cfg: Any, tokenizer: Any, out_dir: str, *, text_only: bool = True,
                   processor: Optional[Any] = None) -> None:
    """Write `out_dir` as `save_hf` would, without weight files: what an engine that starts on placeholder weights
    reads (vLLM's `load_format=dummy`: config, generation config, tokenizer, processor)."""
    model = build_model(model_cfg, dtype=model_cfg.dtype, device="meta", text_only=text_only)
    config = model.config
    config.architectures = [type(model).__name__]  # what save_pretrained records
    config.dtype = torch_dtype(model_cfg.dtype)
    os.makedirs(out_dir, exist_ok=True)
    config.save_pretrained(out_dir)
    generation_config(model_cfg).save_pretrained(out_dir)
    (processor or tokenizer).save_pretrained(out_dir)


def save_hf_from_weights(
    model_cfg: Any,
    weights: Iterable[List[Tuple[str, torch.Tensor]]],
    tokenizer: Any,
    out_dir: str,
    *,
    processor: Optional[Any] = None,
    text_only: bool = True,
) -> None:
    """Save buckets of full HF-named tensors (`TrainEngine.export_weights`) as a checkpoint in `model.dtype`,
    without initialising a model first. Every parameter must be given."""
    model = build_model(model_cfg, dtype=model_cfg.dtype, device="meta", text_only=text_only)
    model.to_empty(device="cpu")
    model.tie_weights()
    init_rotary_buffers(model)
    params = dict(model.named_parameters())
    missing = set(params)
    with torch.no_grad():
        for bucket in weights:
            for name, tensor in bucket:
                if name not in params:
                    raise KeyError(f"save_hf_from_weights: the model has no parameter {name!r}")
                params[name].copy_(tensor)
                missing.discard(name)
    if missing:
        raise ValueError(f"save_hf_from_weights: {len(missing)} parameters were not given, e.g. {sorted(missing)[:3]}")
    model.generation_config = generation_config(model_cfg)
    save_hf(model, tokenizer, out_dir, processor)
