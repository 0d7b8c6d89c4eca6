import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from qwen35rl.config.compose import compose
from qwen35rl.models.build import build_model, save_hf
from qwen35rl.config.special_tokens import BYTE_SPECIAL_IDS
from qwen35rl.models.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def tiny():
    return compose(["model=qwen3_5_tiny"]).model


def _same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_random_init_is_deterministic_per_seed(tiny):
    a = build_model(tiny, dtype=torch.float32, seed=3)
    assert _same(a, build_model(tiny, dtype=torch.float32, seed=3))
    assert not _same(a, build_model(tiny, dtype=torch.float32, seed=4))
    assert type(a).__name__ == "Qwen3_5ForCausalLM" and a.dtype == torch.float32


def test_random_init_is_the_same_weights_in_every_dtype(tiny):
    """A bf16 reference policy must start where the fp32 policy starts (else KL is large from step 1)."""
    fp32 = build_model(tiny, dtype=torch.float32, seed=3)
    bf16 = build_model(tiny, dtype=torch.bfloat16, seed=3)
    assert bf16.dtype == torch.bfloat16
    assert _same(fp32.to(torch.bfloat16), bf16)


def test_meta_build_has_no_storage(tiny):
    m = build_model(tiny, dtype=torch.bfloat16, device="meta")
    assert all(p.is_meta for p in m.parameters())


@pytest.mark.parametrize("name", ["qwen3_5_tiny", "qwen3_5_tiny_moe"])
def test_save_hf_loads_back_with_transformers(tmp_path, name):
    m = compose([f"model={name}"]).model
    model = build_model(m, dtype=torch.float32, seed=1)
    save_hf(model, build_tokenizer(m), str(tmp_path))
    assert (tmp_path / "model.safetensors").exists() and (tmp_path / "config.json").exists()
    back = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert _same(model, back)
    assert back.generation_config.eos_token_id == [BYTE_SPECIAL_IDS["im_end"], BYTE_SPECIAL_IDS["eos"]]
    x = torch.tensor([[1, 2, 3, 4, 5, 6]])
    torch.testing.assert_close(model(x).logits, back(x).logits)
    assert AutoTokenizer.from_pretrained(tmp_path).encode("ok", add_special_tokens=False) == [111, 107]
    # and through our own loader (model.init=pretrained)
    m.init, m.path = "pretrained", str(tmp_path)
    assert _same(model, build_model(m, dtype=torch.float32))


def test_pretrained_needs_a_path(tiny):
    m = tiny.copy()
    m.init, m.path = "pretrained", None
    with pytest.raises(FileNotFoundError, match="model.path"):
        build_model(m, dtype=torch.float32)


def test_save_hf_from_exported_weights(tmp_path, tiny):
    from qwen35rl.models.build import save_hf_from_weights

    model = build_model(tiny, dtype=torch.float32, seed=2)
    named = list(model.named_parameters())
    buckets = [[(n, p.detach().clone()) for n, p in named[i:i + 7]] for i in range(0, len(named), 7)]
    save_hf_from_weights(tiny, buckets, build_tokenizer(tiny), str(tmp_path))
    back = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert _same(model, back)
    x = torch.tensor([[5, 6, 7, 8]])
    torch.testing.assert_close(model(x).logits, back(x).logits)  # rotary buffers were rebuilt, lm_head tied
    with pytest.raises(ValueError, match="not given"):
        save_hf_from_weights(tiny, buckets[:-1], build_tokenizer(tiny), str(tmp_path / "partial"))
