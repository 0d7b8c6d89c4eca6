import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import json

import numpy as np
import pytest
import torch
from PIL import Image

from qwen35rl.config.compose import compose
from qwen35rl.models.build import build_model, save_hf
from qwen35rl.models.processor import SMALL_MAX_TOKENS, build_processor
from qwen35rl.config.special_tokens import BYTE_SPECIAL_IDS
from qwen35rl.models.tokenizer import build_tokenizer

IMAGE_PAD = BYTE_SPECIAL_IDS["image_pad"]


@pytest.fixture(scope="module")
def tiny_vl():
    return compose(["model=qwen3_5_tiny_vl"]).model


def _image(h, w, seed=0):
    return Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8"))


def _encode(proc, images):
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    return proc(text=[text] * len(images), images=images, return_tensors="pt", padding=True)


def test_tiny_vl_processor_feeds_the_model(tiny_vl):
    proc = build_processor(tiny_vl, build_tokenizer(tiny_vl))
    enc = _encode(proc, [_image(50, 70), _image(200, 120, seed=1)])
    tokens_per_image = (enc["input_ids"] == IMAGE_PAD).sum(1)
    assert ((tokens_per_image >= 1) & (tokens_per_image <= SMALL_MAX_TOKENS)).all()
    merge = tiny_vl.vision.spatial_merge_size ** 2
    assert tokens_per_image.tolist() == (enc["image_grid_thw"].prod(-1) // merge).tolist()
    model = build_model(tiny_vl, dtype=torch.float32, text_only=False)
    logits = model(**enc).logits
    assert logits.shape == (*enc["input_ids"].shape, tiny_vl.vocab_size) and torch.isfinite(logits).all()


def test_processor_saves_and_loads_back(tiny_vl, tmp_path):
    tok = build_tokenizer(tiny_vl)
    proc = build_processor(tiny_vl, tok)
    save_hf(build_model(tiny_vl, dtype=torch.float32, text_only=False), tok, str(tmp_path), processor=proc)
    assert json.loads((tmp_path / "processor_config.json").read_text())["processor_class"] == "Qwen3VLProcessor"
    m = tiny_vl.copy()
    m.init, m.path, m.tokenizer = "pretrained", str(tmp_path), "checkpoint"
    back = build_processor(m, build_tokenizer(m))
    a, b = _encode(proc, [_image(90, 40)]), _encode(back, [_image(90, 40)])
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["pixel_values"], b["pixel_values"])
    loaded = build_model(m, dtype=torch.float32, text_only=False)
    assert type(loaded).__name__ == "Qwen3_5ForConditionalGeneration"


def test_text_model_has_no_processor():
    m = compose(["model=qwen3_5_tiny"]).model
    with pytest.raises(ValueError, match="no vision tower"):
        build_processor(m, build_tokenizer(m))
