"""Parameter counts from the config fields equal what transformers builds (meta device), for every checkpoint."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from qwen35rl.config.compose import compose
from qwen35rl.config.params import count_params, layer_kinds, mtp_params

CHECKPOINTS = {  # config name -> (total in the official name, active in the name or None), in billions
    "qwen3_5_0_8b": (0.8, None), "qwen3_5_2b": (2, None), "qwen3_5_4b": (4, None), "qwen3_5_9b": (9, None),
    "qwen3_5_27b": (27, None), "qwen3_5_35b_a3b": (35, 3), "qwen3_5_122b_a10b": (122, 10),
    "qwen3_5_397b_a17b": (397, 17),
}
TINY = ["qwen3_5_tiny", "qwen3_5_tiny_moe", "qwen3_5_tiny_vl"]


def model_cfg(name):
    return compose([f"model={name}"]).model


def transformers_count(m):
    """sum(numel) of the transformers model built on the meta device from the same config."""
    torch = pytest.importorskip("torch")
    from qwen35rl.models.hf_config import hf_model_class, to_hf_config

    with torch.device("meta"):
        model = hf_model_class(m, text_only=False)(to_hf_config(m))
    vision = sum(p.numel() for n, p in model.named_parameters() if ".visual." in f".{n}")
    return sum(p.numel() for p in model.parameters()), vision


@pytest.mark.parametrize("name", list(CHECKPOINTS) + TINY)
def test_total_and_vision_equal_transformers(name):
    m = model_cfg(name)
    total, vision = transformers_count(m)
    count = count_params(m)
    assert count.total == total
    assert count.vision == vision
    assert count.text == total - vision


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_official_size_names(name):
    count, (total_b, active_b) = count_params(model_cfg(name)), CHECKPOINTS[name]
    assert abs(count.total / 1e9 - total_b) < max(0.6, 0.02 * total_b)
    if active_b is not None:
        assert abs(count.active / 1e9 - active_b) < max(0.6, 0.02 * active_b)
        assert count.active < count.text / 5
    else:  # dense: active = text (every weight is used)
        assert count.active == count.text


def test_active_counts_top_k_experts_and_embeddings():
    m = model_cfg("qwen3_5_397b_a17b")
    c = count_params(m)
    h, e, k, inter, layers = 4096, 512, 10, 1024, 60
    assert c.text - c.active == layers * (e - k) * 3 * h * inter
    assert c.embedding == 2 * 248320 * h  # untied: embedding + lm_head
    tied = count_params(model_cfg("qwen3_5_0_8b"))
    assert tied.embedding == 248320 * 1024


def test_mtp_is_one_full_attention_decoder_layer_plus_projection():
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer

    from qwen35rl.models.hf_config import to_hf_config

    m = model_cfg("qwen3_5_35b_a3b")
    text = to_hf_config(m, text_only=True)
    full = text.layer_types.index("full_attention")
    with torch.device("meta"):
        layer = Qwen3_5MoeDecoderLayer(text, full)
    h = m.hidden_size
    expected = sum(p.numel() for p in layer.parameters()) + 2 * h + 2 * h * h + h  # 2 norms, fc 2h->h, final norm
    assert mtp_params(m) == expected == count_params(m).mtp
    assert count_params(model_cfg("qwen3_5_tiny")).mtp == 0  # the tiny models have no MTP layer


def test_layer_pattern_ends_in_full_attention():
    m = model_cfg("qwen3_5_397b_a17b")
    kinds = layer_kinds(m)
    assert kinds[:4] == ["linear", "linear", "linear", "full"] and kinds.count("full") == 15
    assert set(count_params(m).to_dict()) == {"total", "active", "text", "text_active", "vision", "mtp", "embedding"}
