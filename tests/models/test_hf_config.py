import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from qwen35rl.config.compose import compose
from qwen35rl.models.hf_config import hf_model_class, layer_types, to_hf_config

MODELS = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "conf" / "model").glob("*.yaml"))


def test_all_twelve_models_listed():
    assert len(MODELS) == 12  # the eight official checkpoints and four tiny ones


@pytest.mark.parametrize("name", MODELS)
def test_builds_on_meta_with_every_field(name):
    m = compose([f"model={name}"]).model
    for text_only in (True, False):
        hf = to_hf_config(m, text_only=text_only)
        text = hf if text_only or m.vision is None else hf.text_config
        assert text.hidden_size == m.hidden_size and text.num_hidden_layers == m.num_hidden_layers
        assert text.num_attention_heads == m.num_attention_heads and text.num_key_value_heads == m.num_key_value_heads
        assert text.head_dim == m.head_dim and text.vocab_size == m.vocab_size
        assert text.linear_num_value_heads == m.linear_num_value_heads
        assert text.tie_word_embeddings == m.tie_word_embeddings
        assert text.rope_parameters["mrope_section"] == list(m.mrope_section)
        assert text.rope_parameters["partial_rotary_factor"] == m.partial_rotary_factor
        assert text.rope_parameters["rope_theta"] == m.rope_theta
        assert text.layer_types[-1] == "full_attention"
        assert text.layer_types.count("full_attention") == m.num_hidden_layers // m.full_attention_interval
        if m.moe:
            assert (text.num_experts, text.num_experts_per_tok) == (m.num_experts, m.num_experts_per_tok)
        with torch.device("meta"):
            model = hf_model_class(m, text_only)._from_config(hf)
        layers = model.model.language_model.layers if hasattr(model.model, "language_model") else model.model.layers
        assert len(layers) == m.num_hidden_layers
        assert hasattr(model.model, "visual") == (not text_only and m.vision is not None)
        q = layers[-1].self_attn.q_proj.weight  # attention output gate: q_proj maps h -> 2 * heads * head_dim
        assert tuple(q.shape) == (2 * m.num_attention_heads * m.head_dim, m.hidden_size)


def test_official_total_matches_name():
    # The HF total (text + vision, no MTP) is what the checkpoint name says, e.g. 0.8B and 397B.
    for name, billions in [("qwen3_5_0_8b", 0.8), ("qwen3_5_9b", 9), ("qwen3_5_397b_a17b", 397)]:
        m = compose([f"model={name}"]).model
        with torch.device("meta"):
            model = hf_model_class(m, False)._from_config(to_hf_config(m))
        total = sum(p.numel() for p in model.parameters()) / 1e9
        assert abs(total - billions) / billions < 0.08, (name, total)


def test_layer_types_last_layer_full():
    assert layer_types(6, 4) == ["linear_attention"] * 3 + ["full_attention", "linear_attention", "full_attention"]


@pytest.mark.parametrize("name", ["qwen3_5_tiny", "qwen3_5_tiny_moe", "qwen3_5_tiny_vl"])
def test_tiny_config_round_trips(tmp_path, name):
    hf = to_hf_config(compose([f"model={name}"]).model)
    hf.save_pretrained(tmp_path)
    back = AutoConfig.from_pretrained(tmp_path)
    assert type(back) is type(hf)
    a, b = hf.to_dict(), back.to_dict()
    a.pop("_name_or_path", None), b.pop("_name_or_path", None)
    assert a == b
