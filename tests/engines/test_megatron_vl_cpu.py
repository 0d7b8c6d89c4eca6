"""The Megatron engine on image + text batches (Qwen3.5-VL) on CPU with real megatron-core over 2 gloo processes:
log-probs, gradients of vision and language weights, grad norm and a few GRPO steps against transformers' VL model
at TP2, PP2 + VPP2, EP2 and TP2 + ETP2, and the frozen vision tower.

Images have patch grids with H != W (equal axes would hide a wrong M-RoPE axis), rows hold zero, one or two
images, and every row is left-padded as `runtime.batching` builds them."""
import tests.megatron_cpu  # noqa: F401  first: the prelude (skips without megatron)

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from PIL import Image

from qwen35rl.engines.base import Batch
from qwen35rl.models.build import build_model
from qwen35rl.models.image_tokens import prompt_image_mask
from qwen35rl.models.processor import build_processor, vision_inputs
from qwen35rl.config.special_tokens import special_token_ids
from qwen35rl.models.tokenizer import build_tokenizer
from qwen35rl.runtime.cluster import free_port
from tests.engines.test_megatron_engine_cpu import _check, _config, _worker, reference_loss
from tests.shared_results import result_dict

pytestmark = pytest.mark.slow

# (width, height) in pixels: patch grids 2 x 4, 4 x 2 and 4 x 4 (merged: 1 x 2, 2 x 1, 2 x 2 image tokens)
IMAGE_SIZES = [(32, 64), (64, 32), (64, 64)]


def _images():
    rng = np.random.default_rng(0)
    return [Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")) for w, h in IMAGE_SIZES]


def vl_batch(cfg, sampled_image_token: bool = False) -> Batch:
    """Rows: one image; text only; two images. Left padding on the prompt side, right padding after responses.
    `sampled_image_token`: the text-only row's response holds the image-token id (text, not an image slot)."""
    ids = special_token_ids(cfg.model)
    proc = build_processor(cfg.model, build_tokenizer(cfg.model))
    vision = vision_inputs(proc.image_processor, _images())
    tokens = (vision["image_grid_thw"].prod(-1) // 4).tolist()
    g = torch.Generator().manual_seed(0)

    def text(n):
        return torch.randint(3, 256, (n,), generator=g).tolist()

    def image(k):
        return [ids["vision_start"]] + [ids["image_pad"]] * tokens[k] + [ids["vision_end"]]

    prompts = [text(4) + image(0) + text(3), text(5), text(2) + image(1) + text(1) + image(2) + text(2)]
    responses = [text(6), text(4), text(5)]
    if sampled_image_token:
        responses[1][1] = ids["image_pad"]
    width = max(len(p) + len(r) for p, r in zip(prompts, responses)) + 2
    input_ids = torch.zeros(3, width, dtype=torch.long)
    mask, resp = torch.zeros_like(input_ids), torch.zeros_like(input_ids)
    prompt_width = max(len(p) for p in prompts)
    for row, (p, r) in enumerate(zip(prompts, responses)):
        start = prompt_width - len(p)
        input_ids[row, start:start + len(p) + len(r)] = torch.tensor(p + r)
        mask[row, start:start + len(p) + len(r)] = 1
        resp[row, prompt_width:prompt_width + len(r)] = 1
    adv = (torch.tensor([[1.0], [-0.5], [-1.0]]).expand_as(resp) * resp).contiguous()
    old = -torch.rand(resp.shape, generator=g) * 5 * resp
    return Batch(input_ids=input_ids, attention_mask=mask, response_mask=resp, advantages=adv, old_log_probs=old,
                 ref_log_probs=old.clone(), multimodal=vision)


def vl_reference(cfg, batch):
    """transformers' VL model: log-probs and the GRPO loss gradient of one rank holding the whole batch."""
    hf = build_model(cfg.model, dtype=torch.float32, seed=int(cfg.trainer.seed), text_only=False)
    init = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    image_mask = prompt_image_mask(batch.input_ids, batch.attention_mask, batch.response_mask, hf.config.image_token_id)
    if bool(((batch.input_ids == hf.config.image_token_id) & ~image_mask).any()):
        # transformers' forward would take a sampled image-token id for an image slot: its pieces, by hand
        core = hf.model
        feats = torch.cat(core.get_image_features(**batch.multimodal, return_dict=True).pooler_output)
        embeds = core.get_input_embeddings()(batch.input_ids).masked_scatter(image_mask[..., None], feats)
        pos, _ = core.get_rope_index(batch.input_ids, mm_token_type_ids=image_mask.long(),
                                     image_grid_thw=batch.multimodal["image_grid_thw"],
                                     attention_mask=batch.attention_mask)
        logits = hf(inputs_embeds=embeds, attention_mask=batch.attention_mask, position_ids=pos).logits.float()
    else:
        logits = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask, mm_token_type_ids=image_mask.long(),
                    **batch.multimodal).logits.float()
    logp, grads, agg = reference_loss(cfg, hf, batch, logits)
    if cfg.model.freeze_vision_tower:
        grads = {k: torch.zeros_like(g) if k.startswith("model.visual.") else g for k, g in grads.items()}
    init.pop("lm_head.weight")  # tied: exported once, as the embedding
    return init, logp, grads, agg


def _run(model, parallel, sampled_image_token=False):
    cfg = _config(model, ["data.has_images=true", *parallel])
    batch = vl_batch(cfg, sampled_image_token)
    init, logp, grads, agg = vl_reference(cfg, batch)
    out = result_dict()
    mp.start_processes(_worker, args=(2, free_port(), cfg, batch, agg, out), nprocs=2, join=True, start_method="spawn")
    return init, logp, grads, dict(out)


@pytest.mark.parametrize("model,parallel", [
    ("qwen3_5_tiny_vl", ["parallelism.tp=2"]),
    ("qwen3_5_tiny_vl", ["parallelism.pp=2", "parallelism.vpp=2"]),
    ("qwen3_5_tiny_vl_moe", ["parallelism.ep=2"]),
    ("qwen3_5_tiny_vl_moe", ["parallelism.tp=2", "parallelism.etp=2"]),
    ("qwen3_5_tiny_vl", ["parallelism.tp=2", "backend.gradient_checkpointing=true", "backend.recompute_granularity=full"]),
], ids=["dense-tp2", "dense-pp2-vpp2", "moe-ep2", "moe-tp2-etp2", "dense-tp2-recompute"])
def test_vl_engine_matches_transformers(model, parallel):
    init, logp, grads, out = _run(model, parallel)
    # the tower's blocks are recomputed exactly when the decoder's layers are (on the stage that holds it)
    recompute = "backend.gradient_checkpointing=true" in parallel
    assert all(res["tower_checkpointed"] in ([], [recompute]) for res in out.values())
    assert any(res["tower_checkpointed"] for res in out.values())
    assert any(k.startswith("model.visual.") for k in init)
    assert all(k.startswith(("model.visual.", "model.language_model.")) for k in init)
    for res in out.values():  # the vision tower learns from the loss
        assert any(res["grads"][k].abs().max() > 0 for k in res["grads"] if k.startswith("model.visual."))
    _check(init, logp, grads, out)
    # every rank's own copy of the (replicated) tower is the same after the steps, and moved
    vision = [k for k in init if k.startswith("model.visual.")]
    assert all(torch.equal(out[0]["trained"][k], out[1]["trained"][k]) for k in vision)
    assert not all(torch.equal(out[0]["trained"][k], init[k]) for k in vision)


def test_frozen_vision_tower_gets_no_update():
    """With a response that sampled the image-token id, which stays text."""
    init, logp, grads, out = _run("qwen3_5_tiny_vl", ["parallelism.tp=2", "model.freeze_vision_tower=true"],
                                  sampled_image_token=True)
    _check(init, logp, grads, out)
    for res in out.values():
        trained = res["trained"]
        assert all(torch.equal(trained[k], init[k]) for k in init if k.startswith("model.visual."))
        assert not all(torch.equal(trained[k], init[k]) for k in init if k.startswith("model.language_model."))


def test_vl_checkpoint_resumes(tmp_path):
    """Checkpoint + resume with the vision tower (PP2: the tower on one stage): the step after resuming equals the
    step the first engine took after saving, weights and Adam moments included."""
    from tests.engines.test_megatron_engine_cpu import _checkpoint_worker

    cfg = _config("qwen3_5_tiny_vl", ["data.has_images=true", "parallelism.pp=2", "backend.lr_warmup_steps=3"])
    out = result_dict()
    mp.start_processes(_checkpoint_worker, args=(2, free_port(), cfg, vl_batch(cfg), str(tmp_path / "ckpt"), out),
                       nprocs=2, join=True, start_method="spawn")
    for rank, (expected, resumed, steps, weight_diff) in out.items():
        assert steps == 2
        assert resumed == pytest.approx(expected, rel=1e-6), rank
        assert weight_diff < 1e-7
