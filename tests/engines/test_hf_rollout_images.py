"""The transformers rollout engine on image prompts (tiny VL model on CPU): image features at the image tokens,
3-D (mrope) positions, n samples per prompt, log-probs equal to the train engine's recompute on the same images."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import pytest
import torch
from PIL import Image

from qwen35rl.config.layout import derive_layout
from qwen35rl.config.compose import compose
from qwen35rl.engines.base import RolloutRequest
from qwen35rl.engines.fsdp_engine import FsdpTrainEngine
from qwen35rl.engines.hf_rollout import HfRolloutEngine
from qwen35rl.models.build import build_model
from qwen35rl.models.processor import build_processor, prompt_ids
from qwen35rl.config.special_tokens import BYTE_SPECIAL_IDS
from qwen35rl.models.tokenizer import build_tokenizer
from qwen35rl.runtime.batching import Sequences, build_batch, response_values

PAD, IM_END, EOS = BYTE_SPECIAL_IDS["pad"], BYTE_SPECIAL_IDS["im_end"], BYTE_SPECIAL_IDS["eos"]


def _image(h, w, seed):
    return Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8"))


@pytest.fixture(scope="module")
def setup():
    cfg = compose(["model=qwen3_5_tiny_vl", "hw.devices_per_node=1", "data.has_images=true",
                   "backend.gradient_checkpointing=false",
                   "rollout.temperature=1.0"])
    tok = build_tokenizer(cfg.model)
    proc = build_processor(cfg.model, tok)
    images = [[_image(40, 70, 0)], [_image(90, 30, 1), _image(64, 64, 2)], []]
    texts = ["what is the angle?", "compare them", "no picture here"]
    messages = [[{"role": "user", "content": [{"type": "image"}] * len(imgs) + [{"type": "text", "text": t}]}]
                for imgs, t in zip(images, texts)]
    prompts = [prompt_ids(proc, m, imgs) for m, imgs in zip(messages, images)]
    return cfg, tok, proc, images, prompts


def _engine(cfg, tok, proc, seed=0):
    model = build_model(cfg.model, dtype=torch.float32, seed=seed, text_only=False)
    return HfRolloutEngine(model, tok, device="cpu", pad_token_id=PAD, eos_token_id=[IM_END, EOS], processor=proc)


def test_image_prompts_generate_n_samples_and_the_images_matter(setup):
    cfg, tok, proc, images, prompts = setup
    eng = _engine(cfg, tok, proc)
    assert sum(t == cfg_image_token(eng) for t in prompts[1]) >= 2
    req = RolloutRequest(prompt_ids=prompts, n=2, temperature=0.0, max_new_tokens=6, images=images)
    out = eng.generate(req)
    assert len(out.response_ids) == 6 and out.response_ids[0] == out.response_ids[1]   # greedy: n equal samples
    # greedy continuation of prompt 0, step by step through the full model (no cache, no padding)
    enc = proc.image_processor(images=images[0], return_tensors="pt")
    ids = list(prompts[0])
    with torch.no_grad():
        for _ in range(len(out.response_ids[0])):
            x = torch.tensor([ids])
            logits = eng.model(input_ids=x, pixel_values=enc["pixel_values"], image_grid_thw=enc["image_grid_thw"],
                               mm_token_type_ids=(x == cfg_image_token(eng)).long()).logits
            ids.append(int(logits[0, -1].argmax()))
    assert ids[len(prompts[0]):] == out.response_ids[0]
    # other images, other log-probs
    blank = [[Image.new("RGB", im.size) for im in imgs] for imgs in images]
    other = eng.generate(RolloutRequest(prompt_ids=prompts, n=2, temperature=0.0, max_new_tokens=6, images=blank))
    assert other.log_probs[0] != out.log_probs[0] and other.log_probs[4] == pytest.approx(out.log_probs[4], abs=1e-5)


def cfg_image_token(eng):
    return eng.model.config.image_token_id


def test_rollout_log_probs_match_the_train_engine_on_images(setup):
    cfg, tok, proc, images, prompts = setup
    train = FsdpTrainEngine(cfg, layout=derive_layout(cfg), rank=0, world_size=1, device="cpu")
    eng = _engine(cfg, tok, proc, seed=123)
    eng.load_weights(train.export_weights(bucket_mb=1))
    out = eng.generate(RolloutRequest(prompt_ids=prompts, n=3, temperature=1.0, max_new_tokens=8, images=images,
                                      seed=3))
    rows = [p for p in prompts for _ in range(3)]
    seqs = Sequences(rows, out.response_ids, images=[imgs for imgs in images for _ in range(3)])
    batch = build_batch(seqs, PAD, "cpu", proc.image_processor)
    assert batch.multimodal["image_grid_thw"].shape[0] == 3 * 3  # 3 images per prompt group of 3 rows
    recomputed = response_values(train.compute_log_probs(batch)[0], batch)
    for a, b in zip(out.log_probs, recomputed):
        assert a == pytest.approx(b, abs=2e-4)
