import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import math
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qwen35rl.algo.loss import ActorLoss, LossScale
from qwen35rl.algo.lr_schedule import lr_lambda
from qwen35rl.config.compose import compose
from qwen35rl.config.layout import derive_layout
from qwen35rl.engines.base import GLOBAL_SEQS, GLOBAL_TOKENS, Batch
from qwen35rl.engines.fsdp_engine import FsdpTrainEngine
from qwen35rl.runtime.batching import Sequences, build_batch

PAD = 259
AGG_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def _loss(engine):
    """The run's GRPO loss, as the worker hands it to the engine."""
    return ActorLoss.from_config(engine.cfg)


def _cfg(*overrides, world=1):
    # grad_clip off: the comparisons below look at raw gradients
    return compose(["model=qwen3_5_tiny", "hw=cpu", f"hw.devices_per_node={world}", "backend.lr=1e-3", "backend.gradient_checkpointing=false", "backend.grad_clip=0",
                    "algorithm.use_kl_loss=true", "algorithm.entropy_coef=0.01", "backend.lr_warmup_steps=0",
                    *overrides])


def _sequences(n=4, seed=0) -> Sequences:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 256, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]
    resps = [torch.randint(0, 256, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]
    adv = torch.randn(n, generator=g).tolist()
    old = [(-5.5 + 0.3 * torch.randn(len(r), generator=g)).tolist() for r in resps]
    ref = [(-5.5 + 0.3 * torch.randn(len(r), generator=g)).tolist() for r in resps]
    return Sequences(prompts, resps, old_log_probs=old, ref_log_probs=ref, advantages=adv)


def _micro_batches(seqs: Sequences, size: int):
    return [build_batch(seqs.select(i, i + size), PAD) for i in range(0, len(seqs), size)]


def _engine(cfg, **kw):
    return FsdpTrainEngine(cfg, layout=derive_layout(cfg), **kw)


def _full_grads(engine):
    out = {}
    for name, p in engine.lm.named_parameters():
        g = p.grad
        out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def _step_capturing_grads(engine, micro_batches, global_scale=None, loss_fn=None):
    """One train_mini_batch (of the run's loss unless `loss_fn`); returns (metrics, grads just before the optimizer
    step, weights after)."""
    captured = {}
    hook = engine.optimizer.register_step_pre_hook(lambda *_: captured.update(_full_grads(engine)))
    metrics = engine.train_mini_batch(micro_batches, loss_fn or _loss(engine), global_scale)
    hook.remove()
    weights = {n: t for bucket in engine.export_weights(1) for n, t in bucket}
    return metrics, captured, weights


def _assert_same_update(w_a, w_b, grad, msg):
    # Adam's first step is about lr * sign(grad): where a gradient sits at fp32 rounding noise its sign (and the
    # update) is arbitrary, so updates are compared where the gradient is well above that noise.
    sure = grad.abs() > 1e-5
    torch.testing.assert_close(w_a[sure], w_b[sure], rtol=1e-5, atol=1e-6, msg=msg)


def _run(engine_cfg, seqs, micro, world=1, rank=0):
    engine = _engine(engine_cfg, rank=rank, world_size=world, device="cpu")
    share = seqs.select(rank * len(seqs) // world, (rank + 1) * len(seqs) // world)
    return _step_capturing_grads(engine, _micro_batches(share, micro))


# ----------------------------------------------------------------------------------------- single process
def test_log_probs_zero_outside_response_and_match_hf_logits():
    cfg = _cfg()
    engine = _engine(cfg, rank=0, world_size=1, device="cpu")
    batch = build_batch(_sequences(), PAD)
    logp, ent = engine.compute_log_probs(batch, with_entropy=True)
    mask = batch.response_mask.bool()
    assert (logp[~mask] == 0).all() and (ent[~mask] == 0).all() and (logp[mask] < 0).all()
    # reference: full logits of the HF model, temperature-scaled
    with torch.no_grad():
        logits = engine.lm(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                           position_ids=batch.position_ids).logits.float() / cfg.rollout.temperature
    ref = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(logp[:, 1:][mask[:, 1:]], ref[mask[:, 1:]], rtol=1e-5, atol=1e-5)


def test_temperature_is_applied_to_training_log_probs():
    batch = build_batch(_sequences(), PAD)
    lp1, _ = _engine(_cfg("rollout.temperature=1.0"), rank=0, world_size=1, device="cpu").compute_log_probs(batch)
    lp2, _ = _engine(_cfg("rollout.temperature=0.5"), rank=0, world_size=1, device="cpu").compute_log_probs(batch)
    mask = batch.response_mask.bool()
    assert not torch.allclose(lp1[mask], lp2[mask])


def test_loss_decreases_on_a_fixed_batch():
    # positive advantages on fixed responses: the policy must raise their likelihood
    engine = _engine(_cfg("backend.lr=1e-3", "algorithm.use_kl_loss=false"), rank=0, world_size=1, device="cpu")
    seqs = _sequences()
    seqs.advantages = [1.0] * len(seqs)
    seqs.old_log_probs = seqs.ref_log_probs = None
    batch = build_batch(seqs, PAD)
    mask = batch.response_mask.bool()
    nll = [-engine.compute_log_probs(batch)[0][mask].mean().item()]
    for _ in range(8):
        m = engine.train_mini_batch([batch], _loss(engine))
        nll.append(-engine.compute_log_probs(batch)[0][mask].mean().item())
    assert nll[-1] < nll[0] - 1.0, nll
    assert all(b < a for a, b in zip(nll, nll[1:])), nll
    assert m["actor/lr"] == pytest.approx(1e-3) and m["actor/skipped_steps"] == 0


def test_metrics_follow_the_loss_definitions():
    cfg = _cfg("algorithm.loss_agg_mode=token-mean")
    engine = _engine(cfg, rank=0, world_size=1, device="cpu")
    batch = build_batch(_sequences(), PAD)
    logp, ent = engine.compute_log_probs(batch, with_entropy=True)
    mask = batch.response_mask.bool()
    m = engine.train_mini_batch([batch], _loss(engine))
    delta = (logp - batch.old_log_probs)[mask]
    ratio = delta.exp()
    adv = batch.advantages[mask]
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    pg = torch.where(adv < 0, torch.minimum(pg, -adv * 3.0), pg)
    assert m["actor/pg_loss"] == pytest.approx(pg.mean().item(), rel=1e-5)
    assert m["actor/ppo_kl"] == pytest.approx((-delta).mean().item(), rel=1e-5)
    assert m["actor/entropy"] == pytest.approx(ent[mask].mean().item(), rel=1e-5)
    u = -(logp - batch.ref_log_probs)[mask]
    assert m["actor/kl_loss"] == pytest.approx((u.exp() - u - 1).mean().item(), rel=1e-4)
    assert set(m) >= {"actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl",
                      "actor/grad_norm", "actor/lr", "actor/skipped_steps"}


def test_on_policy_update_logs_its_gap_to_the_rollout_log_probs():
    """A single on-policy update given the rollout engine's log-probs logs |trainer - rollout| over the response
    tokens from its own pass (before the step), split into micro batches or not; without them it logs nothing."""
    engine = _engine(_cfg("algorithm.use_kl_loss=false"), rank=0, world_size=1, device="cpu")
    seqs = _sequences()
    seqs.old_log_probs = seqs.ref_log_probs = None
    logp = engine.compute_log_probs(build_batch(seqs, PAD))[0]
    mask = build_batch(seqs, PAD).response_mask.bool()
    trainer = [row[m].tolist() for row, m in zip(logp, mask)]
    shift = [[0.01 * (i + 1) * (-1) ** j for j in range(len(r))] for i, r in enumerate(trainer)]
    seqs.rollout_log_probs = [[a + d for a, d in zip(r, s)] for r, s in zip(trainer, shift)]
    m = engine.train_mini_batch(_micro_batches(seqs, 2), _loss(engine))
    gaps = [abs(d) for s in shift for d in s]
    assert m["rollout/logprob_diff_mean"] == pytest.approx(sum(gaps) / len(gaps), abs=1e-5)
    assert m["rollout/logprob_diff_max"] == pytest.approx(max(gaps), abs=1e-5)
    seqs.rollout_log_probs = None
    assert "rollout/logprob_diff_mean" not in engine.train_mini_batch([build_batch(seqs, PAD)], _loss(engine))


def test_non_finite_loss_skips_the_step():
    engine = _engine(_cfg(), rank=0, world_size=1, device="cpu")
    batch = build_batch(_sequences(), PAD)
    before = {n: t.clone() for n, t in engine.lm.state_dict().items()}
    batch.advantages = batch.advantages.masked_fill(batch.response_mask.bool(), float("nan"))
    m = engine.train_mini_batch([batch], _loss(engine))
    assert m["actor/skipped_steps"] == 1
    assert all(torch.equal(before[n], t) for n, t in engine.lm.state_dict().items())
    assert engine.train_mini_batch([build_batch(_sequences(), PAD)], _loss(engine))["actor/skipped_steps"] == 1


class _ZeroLoss(ActorLoss):
    """The run's loss statistics with nothing to back-propagate; records what the engine hands it."""

    def __init__(self, cfg):
        super().__init__(cfg.algorithm, cfg.data.max_response_length)
        self.calls = []

    def __call__(self, inputs, scale):
        self.calls.append((inputs, scale))
        loss, stats = super().__call__(inputs, scale)
        return loss * 0.0, stats


def test_the_engine_minimises_the_loss_function_it_is_given():
    """A zero loss gives zero gradients and leaves the weights as they were (no weight decay); the loss function
    sees the engine's log-probs with their gradients, each micro batch's mask and the mini batch's normalisers."""
    engine = _engine(_cfg("backend.weight_decay=0"), rank=0, world_size=1, device="cpu")
    seqs = _sequences()
    batches = _micro_batches(seqs, 2)
    before = {n: t.clone() for bucket in engine.export_weights(1) for n, t in bucket}
    zero = _ZeroLoss(engine.cfg)
    m, grads, after = _step_capturing_grads(engine, batches, loss_fn=zero)
    assert grads and all(not g.any() for g in grads.values())
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert m["actor/grad_norm"] == 0 and m["actor/skipped_steps"] == 0 and m["actor/pg_loss"] != 0
    tokens = float(sum(len(r) for r in seqs.response_ids))
    assert [scale for _, scale in zero.calls] == [LossScale(tokens, float(len(seqs)), 1)] * len(batches)
    for (inputs, _), batch in zip(zero.calls, batches):
        assert inputs.log_probs.requires_grad and torch.equal(inputs.mask, batch.response_mask)
        assert torch.equal(inputs.advantages, batch.advantages)


def test_the_loss_function_not_the_engine_config_decides_the_loss():
    """Engines built with and without algorithm.use_kl_loss take the same step with the same loss function."""
    no_kl = ActorLoss.from_config(_cfg("algorithm.use_kl_loss=false"))
    batches = _micro_batches(_sequences(), 2)
    steps = [_step_capturing_grads(_engine(_cfg(kl), rank=0, world_size=1, device="cpu"), batches, loss_fn=no_kl)
             for kl in ("algorithm.use_kl_loss=true", "algorithm.use_kl_loss=false")]
    (m_a, g_a, _), (m_b, g_b, _) = steps
    assert m_a == m_b and m_a["actor/kl_loss"] == 0
    assert all(torch.equal(g_a[n], g_b[n]) for n in g_a)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batch_1_equals_4(mode):
    cfg = _cfg(f"algorithm.loss_agg_mode={mode}")
    seqs = _sequences()
    m4, g4, w4 = _run(cfg, seqs, micro=4)
    m1, g1, w1 = _run(cfg, seqs, micro=1)
    for name in g4:
        torch.testing.assert_close(g1[name], g4[name], rtol=1e-4, atol=1e-6, msg=name)
        _assert_same_update(w1[name], w4[name], g4[name], name)
    for k in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl"):
        assert m1[k] == pytest.approx(m4[k], rel=1e-4, abs=1e-7), k


def test_explicit_global_counts_equal_computed_ones():
    cfg = _cfg()
    seqs = _sequences()
    batches = _micro_batches(seqs, 2)
    tokens = float(sum(len(r) for r in seqs.response_ids))
    a = _step_capturing_grads(_engine(cfg, rank=0, world_size=1, device="cpu"), batches,
                              {GLOBAL_TOKENS: tokens, GLOBAL_SEQS: float(len(seqs))})
    b = _step_capturing_grads(_engine(cfg, rank=0, world_size=1, device="cpu"), batches, {})
    assert all(torch.equal(a[1][n], b[1][n]) for n in a[1])
    # a doubled token count halves the token-mean gradient
    c = _step_capturing_grads(_engine(cfg, rank=0, world_size=1, device="cpu"), batches,
                              {GLOBAL_TOKENS: 2 * tokens, GLOBAL_SEQS: float(len(seqs))})
    assert c[0]["actor/grad_norm"] == pytest.approx(b[0]["actor/grad_norm"] / 2, rel=1e-4)


def test_lr_schedule():
    warm_const = lr_lambda(3, "constant", None, 0.0)
    assert [warm_const(s) for s in range(5)] == pytest.approx([1 / 3, 2 / 3, 1, 1, 1])
    cos = lr_lambda(2, "cosine", 12, 0.1)
    assert cos(2) == pytest.approx(1.0) and cos(7) == pytest.approx(0.55) and cos(12) == pytest.approx(0.1)
    assert cos(50) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="total"):
        lr_lambda(0, "cosine", None, 0.0)


def test_engine_lr_follows_schedule():
    engine = _engine(_cfg("backend.lr=1e-3", "backend.lr_warmup_steps=2", "backend.lr_scheduler=cosine",
                                  "backend.min_lr_ratio=0.5"), rank=0, world_size=1, device="cpu", total_steps=4)
    batch = build_batch(_sequences(), PAD)
    lrs = [engine.train_mini_batch([batch], _loss(engine))["actor/lr"] for _ in range(5)]
    # warmup 1/2, 2/2; cosine over steps 2..4 from 1 down to min_lr_ratio; then flat
    assert lrs == pytest.approx([5e-4, 1e-3, 1e-3, 1e-3 * (0.5 + 0.25 * (1 + math.cos(math.pi / 2))), 5e-4])


def test_export_round_trip_and_reference_mode():
    cfg = _cfg()
    engine = _engine(cfg, rank=0, world_size=1, device="cpu")
    engine.train_mini_batch(_micro_batches(_sequences(), 4), _loss(engine))
    buckets = list(engine.export_weights(bucket_mb=0))  # tiny buckets: one tensor each
    assert len(buckets) == len(list(engine.lm.named_parameters())) and all(len(b) == 1 for b in buckets)
    assert len(list(engine.export_weights(bucket_mb=1024))) == 1
    sizes = [sum(t.numel() * t.element_size() for _, t in b) for b in engine.export_weights(bucket_mb=0.1)]
    assert len(sizes) > 2 and all(s >= 0.1 * 2 ** 20 for s in sizes[:-1])
    assert all(t.device.type == "cpu" for b in buckets for _, t in b)
    on_meta = [t for b in engine.export_weights(bucket_mb=1024, device="meta") for _, t in b]  # a chosen device
    assert len(on_meta) == len(buckets) and all(t.is_meta and t.dtype == torch.float32 for t in on_meta)
    ref = _engine(cfg, rank=0, world_size=1, device="cpu", reference=True)
    assert ref.optimizer is None and not any(p.requires_grad for p in ref.module.parameters())
    batch = build_batch(_sequences(seed=5), PAD)
    assert not torch.allclose(ref.compute_log_probs(batch)[0], engine.compute_log_probs(batch)[0])
    with torch.no_grad():
        params = dict(ref.lm.named_parameters())
        for bucket in buckets:
            for name, t in bucket:
                params[name].copy_(t)
    torch.testing.assert_close(ref.compute_log_probs(batch)[0], engine.compute_log_probs(batch)[0])
    with pytest.raises(RuntimeError, match="frozen"):
        ref.train_mini_batch([batch], _loss(ref))


def test_checkpoint_state_round_trip(tmp_path):
    import torch.distributed.checkpoint as dcp

    cfg = _cfg("backend.lr_scheduler=cosine")
    a = _engine(cfg, rank=0, world_size=1, device="cpu", total_steps=10)
    seqs = _sequences()
    a.train_mini_batch(_micro_batches(seqs, 4), _loss(a))
    dcp.save({"engine": a.state_dict_for_checkpoint()}, checkpoint_id=str(tmp_path))
    b = _engine(cfg, rank=0, world_size=1, device="cpu", total_steps=10)
    state = {"engine": b.state_dict_for_checkpoint()}
    dcp.load(state, checkpoint_id=str(tmp_path))
    b.load_checkpoint_state(state["engine"])
    # the next step is identical: weights, Adam moments and the schedule position all came back
    ma, _, wa = _step_capturing_grads(a, _micro_batches(seqs, 4))
    mb, _, wb = _step_capturing_grads(b, _micro_batches(seqs, 4))
    assert ma == mb
    assert all(torch.equal(wa[n], wb[n]) for n in wa)


# ----------------------------------------------------------------------------------------- two processes
def _dp2_worker(rank, init_file, out_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        results = {}
        seqs = _sequences()
        for mode in AGG_MODES:
            # FSDP composed with activation checkpointing on one of them (dp=1 runs without)
            ckpt_on = f"backend.gradient_checkpointing={mode == 'seq-mean-token-mean'}"
            results[mode] = _run(_cfg(f"algorithm.loss_agg_mode={mode}", ckpt_on, world=2), seqs, micro=1, world=2, rank=rank)
        # checkpoint state of a sharded engine: save with DCP, load into a fresh one, take identical steps
        cfg = _cfg(world=2)
        ckpt = os.path.join(os.path.dirname(out_file), "ckpt")
        import torch.distributed.checkpoint as dcp
        a = _engine(cfg, rank=rank, world_size=2, device="cpu")
        share = seqs.select(2 * rank, 2 * rank + 2)
        a.train_mini_batch(_micro_batches(share, 2), _loss(a))
        dcp.save({"engine": a.state_dict_for_checkpoint()}, checkpoint_id=ckpt)
        b = _engine(cfg, rank=rank, world_size=2, device="cpu")
        state = {"engine": b.state_dict_for_checkpoint()}
        dcp.load(state, checkpoint_id=ckpt)
        b.load_checkpoint_state(state["engine"])
        results["ckpt"] = (_step_capturing_grads(a, _micro_batches(share, 2)), _step_capturing_grads(b, _micro_batches(share, 2)))
        if rank == 0:
            torch.save(results, out_file)
        dist.barrier()  # a rank that leaves the group while its peer still talks to it aborts at exit (gloo)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_dp2_fsdp_equals_dp1():
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "dp2.pt")
        mp.spawn(_dp2_worker, args=(os.path.join(d, "init"), out), nprocs=2, join=True)
        dp2 = torch.load(out, weights_only=False)
    seqs = _sequences()
    for mode in AGG_MODES:
        m1, g1, w1 = _run(_cfg(f"algorithm.loss_agg_mode={mode}"), seqs, micro=4)
        m2, g2, w2 = dp2[mode]
        assert g1.keys() == g2.keys()
        for name in g1:
            torch.testing.assert_close(g2[name], g1[name], rtol=1e-4, atol=1e-6, msg=f"{mode} grad {name}")
            _assert_same_update(w2[name], w1[name], g1[name], f"{mode} weight {name}")
        for k in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl", "actor/pg_clipfrac"):
            assert m2[k] == pytest.approx(m1[k], rel=1e-4, abs=1e-7), (mode, k)
    (ma, _, wa), (mb, _, wb) = dp2["ckpt"]
    assert ma == mb and all(torch.equal(wa[n], wb[n]) for n in wa)


def test_gradient_checkpointing_gives_the_same_gradients():
    seqs = _sequences()
    _, g_plain, _ = _run(_cfg(), seqs, micro=2)
    engine = _engine(_cfg("backend.gradient_checkpointing=true"), rank=0, world_size=1, device="cpu")
    assert any(type(m).__name__ == "CheckpointWrapper" or getattr(m, "gradient_checkpointing", False)
               for m in engine.lm.modules())
    _, g_ckpt, _ = _step_capturing_grads(engine, _micro_batches(seqs, 2))
    for name in g_plain:
        torch.testing.assert_close(g_ckpt[name], g_plain[name], rtol=1e-5, atol=1e-7, msg=name)


def test_moe_model_trains():
    engine = _engine(_cfg("model=qwen3_5_tiny_moe"), rank=0, world_size=1, device="cpu")
    assert type(engine.lm).__name__ == "Qwen3_5MoeForCausalLM"
    m, grads, _ = _step_capturing_grads(engine, _micro_batches(_sequences(), 2))
    assert math.isfinite(m["actor/grad_norm"]) and m["actor/grad_norm"] > 0
    assert grads["model.layers.0.mlp.experts.gate_up_proj"].abs().sum() > 0


def test_vision_language_batch():
    import numpy as np
    from PIL import Image

    from qwen35rl.models.processor import build_processor
    from qwen35rl.models.tokenizer import build_tokenizer

    cfg = _cfg("model=qwen3_5_tiny_vl", "data.has_images=true")
    engine = _engine(cfg, rank=0, world_size=1, device="cpu")
    assert type(engine.lm).__name__ == "Qwen3_5ForConditionalGeneration"
    proc = build_processor(cfg.model, build_tokenizer(cfg.model))
    img = Image.fromarray((np.random.default_rng(0).random((50, 70, 3)) * 255).astype("uint8"))
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) + "a cat<|im_end|>"
    enc = proc(text=[text, "<|im_start|>user\nno image<|im_end|>\n<|im_start|>assistant\na dog<|im_end|>"],
               images=[img], return_tensors="pt", padding=True)
    resp = torch.zeros_like(enc["input_ids"])
    resp[:, -6:] = 1
    mm = {"pixel_values": enc["pixel_values"], "image_grid_thw": enc["image_grid_thw"]}
    batch = Batch(enc["input_ids"], enc["attention_mask"], resp, advantages=resp.float(),
                  ref_log_probs=torch.full(resp.shape, -5.0), multimodal=mm)
    logp, _ = engine.compute_log_probs(batch)
    with torch.no_grad():
        logits = engine.lm(**enc).logits.float()
    ref = torch.log_softmax(logits[:, :-1], -1).gather(-1, enc["input_ids"][:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(logp[:, -6:], ref[:, -6:], rtol=1e-4, atol=1e-4)
    blank = Batch(enc["input_ids"], enc["attention_mask"], resp, multimodal={**mm, "pixel_values": mm["pixel_values"] * 0})
    assert not torch.allclose(engine.compute_log_probs(blank)[0][0], logp[0])  # the image reaches the log-probs
    m = engine.train_mini_batch([batch], _loss(engine))
    assert math.isfinite(m["actor/grad_norm"]) and m["actor/skipped_steps"] == 0
    assert any(n.startswith("model.visual.") for bucket in engine.export_weights(64) for n, _ in bucket)


def test_frozen_vision_tower_keeps_its_weights():
    """model.freeze_vision_tower: the update changes the language model only, and the optimizer holds no state for
    the tower; a generated image-token id in a response is text (no image slot), as in the rollout."""
    import numpy as np
    from PIL import Image

    from qwen35rl.models.processor import build_processor, prompt_ids, vision_inputs
    from qwen35rl.models.tokenizer import build_tokenizer

    cfg = _cfg("model=qwen3_5_tiny_vl", "data.has_images=true", "model.freeze_vision_tower=true")
    engine = _engine(cfg, rank=0, world_size=1, device="cpu")
    proc = build_processor(cfg.model, build_tokenizer(cfg.model))
    img = Image.fromarray((np.random.default_rng(0).random((32, 64, 3)) * 255).astype("uint8"))
    prompt = prompt_ids(proc, [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x?"}]}], [img])
    response = [ord("a"), engine.lm.config.image_token_id, ord("b")]  # a sampled image-token id
    ids = torch.tensor([prompt + response])
    resp = torch.zeros_like(ids)
    resp[:, -3:] = 1
    batch = Batch(ids, torch.ones_like(ids), resp, advantages=resp.float(), ref_log_probs=torch.full(resp.shape, -5.0),
                  multimodal=vision_inputs(proc.image_processor, [img]))
    before = {n: p.detach().clone() for n, p in engine.lm.named_parameters()}
    m = engine.train_mini_batch([batch], _loss(engine))
    assert math.isfinite(m["actor/grad_norm"]) and m["actor/grad_norm"] > 0
    after = dict(engine.lm.named_parameters())
    assert all(torch.equal(after[n], before[n]) for n in before if n.startswith("model.visual."))
    assert not all(torch.equal(after[n], before[n]) for n in before if n.startswith("model.language_model."))
    visual = {id(p) for p in engine.lm.model.visual.parameters()}
    assert not any(id(p) in visual for group in engine.optimizer.param_groups for p in group["params"])


def test_grad_clip_scales_gradients_to_the_limit():
    seqs = _sequences()
    m_raw, g_raw, _ = _run(_cfg(), seqs, micro=4)
    raw_norm = math.sqrt(sum(g.double().pow(2).sum().item() for g in g_raw.values()))
    assert m_raw["actor/grad_norm"] == pytest.approx(raw_norm, rel=1e-5)
    clip = raw_norm / 4
    m, g, _ = _run(_cfg(f"backend.grad_clip={clip}"), seqs, micro=4)
    assert m["actor/grad_norm"] == pytest.approx(raw_norm, rel=1e-5)  # the metric is the norm before clipping
    assert math.sqrt(sum(t.double().pow(2).sum().item() for t in g.values())) == pytest.approx(clip, rel=1e-4)


def test_the_engine_refuses_what_the_plan_refuses_with_the_plans_problem():
    from qwen35rl.config import capabilities, rules

    cfg = compose(["model=qwen3_5_tiny", "hw=cpu", "hw.devices_per_node=2", "parallelism.sp=2",
                   "backend.remove_padding=false"])
    layout = derive_layout(cfg)
    planned = [p for p in rules.check_all(cfg, layout) if p.code == "sp_requires_remove_padding"]
    with pytest.raises(capabilities.Unsupported) as e:
        FsdpTrainEngine(cfg, layout=layout, rank=0, world_size=2, device="cpu")
    assert planned and [p.to_dict() for p in e.value.problems] == [p.to_dict() for p in planned]


def test_single_rank_without_fsdp_computes_what_the_unsharded_engine_does(monkeypatch):
    """FsdpTrainEngine.shard_single_rank=False: in an initialised world of one rank the model stays a plain module
    (no DTensor parameters) and gives the log-probs and update of the engine built without a process group; with
    the default the same world shards it."""
    from torch.distributed.tensor import DTensor

    cfg = _cfg()
    seqs = _sequences()
    batch = build_batch(seqs, PAD)
    plain = FsdpTrainEngine(cfg, layout=derive_layout(cfg), rank=0, world_size=1, device="cpu")
    want = (plain.compute_log_probs(batch)[0], plain.train_mini_batch([batch], _loss(plain))["actor/grad_norm"])
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/init", rank=0, world_size=1)
        try:
            sharded = FsdpTrainEngine(cfg, layout=derive_layout(cfg), rank=0, world_size=1, device="cpu")
            assert sharded.distributed and any(isinstance(p, DTensor) for p in sharded.module.parameters())
            monkeypatch.setattr(FsdpTrainEngine, "shard_single_rank", False)
            single = FsdpTrainEngine(cfg, layout=derive_layout(cfg), rank=0, world_size=1, device="cpu")
            assert not single.distributed
            assert not any(isinstance(p, DTensor) for p in single.module.parameters())
            got = (single.compute_log_probs(batch)[0],
                   single.train_mini_batch([batch], _loss(single))["actor/grad_norm"])
        finally:
            dist.destroy_process_group()
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    assert got[1] == pytest.approx(want[1], rel=1e-6)


def test_compiled_layer_parts_compute_what_eager_ones_do():
    """compile_regions: the norms and dense MLPs of every layer compiled in place (each layer's four or five parts)
    give the eager forward and gradients."""
    import copy

    from qwen35rl.engines.compile_regions import compile_layer_parts, layer_parts
    from qwen35rl.engines.fsdp_engine import decoder_layers
    from qwen35rl.models.build import build_model

    cfg = _cfg()
    eager = build_model(cfg.model, dtype=torch.float32, seed=0, text_only=True)
    compiled = copy.deepcopy(eager)
    layers = decoder_layers(compiled)
    assert compile_layer_parts(layers) == sum(len(layer_parts(layer)) for layer in layers) >= 4 * len(layers)
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(0))
    outs = []
    for model in (eager, compiled):
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
        outs.append((hidden, torch.autograd.grad(hidden.square().mean(), list(model.parameters()), allow_unused=True)))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-5)
    for a, b in zip(outs[1][1], outs[0][1]):
        if b is None:
            assert a is None
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("ckpt", [False, True], ids=["no-ckpt", "ckpt"])
def test_compile_layers_reaches_every_decoder_layer_and_trains_as_eager(ckpt):
    """backend.compile_layers (default false): the engine compiles each decoder layer's norms and MLP in place (the
    policy's and the reference's), and in an initialised world of one rank (FSDP2-sharded, as on a GPU) gives the
    eager engine's log-probs and gradient norm, with and without gradient checkpointing (the compiled parts re-run
    in the recompute); off, every part runs eagerly."""
    from torch.distributed.tensor import DTensor

    from qwen35rl.engines.compile_regions import layer_parts
    from qwen35rl.engines.fsdp_engine import decoder_layers

    def compiled_parts(engine):
        parts = [p for layer in decoder_layers(engine.lm) for p in layer_parts(layer)]
        return sum(p._compiled_call_impl is not None for p in parts), len(parts)

    assert _cfg().backend.compile_layers is False
    batch = build_batch(_sequences(), PAD)
    results = []
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/init", rank=0, world_size=1)
        try:
            for extra in ([], ["backend.compile_layers=true"]):
                cfg = _cfg(f"backend.gradient_checkpointing={str(ckpt).lower()}", *extra)
                engine = FsdpTrainEngine(cfg, layout=derive_layout(cfg), rank=0, world_size=1, device="cpu")
                ref = FsdpTrainEngine(cfg, layout=derive_layout(cfg), rank=0, world_size=1, device="cpu",
                                      reference=True)
                assert any(isinstance(p, DTensor) for p in engine.module.parameters())
                for e in (engine, ref):
                    n, total = compiled_parts(e)
                    assert n == (total if extra else 0) and total >= 4 * len(decoder_layers(e.lm))
                results.append((engine.compute_log_probs(batch)[0], ref.compute_log_probs(batch)[0],
                                engine.train_mini_batch([batch], _loss(engine))["actor/grad_norm"]))
        finally:
            dist.destroy_process_group()
    (eager_lp, eager_ref, eager_norm), (lp, ref_lp, norm) = results
    torch.testing.assert_close(lp, eager_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ref_lp, eager_ref, rtol=1e-5, atol=1e-5)
    assert norm == pytest.approx(eager_norm, rel=1e-4)
