"""The FSDP engine on 4 gloo ranks with HSDP (fsdp_size 2, and 1: replicas only), Ulysses SP 2 and 4 (packed on CPU), and both at once
trains like one rank on the same batch: log-probs (full on every SP rank), the reference engine's log-probs,
first-step gradients, the weights after the step and the metrics. Then kill + resume on SP2 x HSDP: fresh
processes that load the checkpoint take the same next step bit for bit."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qwen35rl.config.compose import compose
from qwen35rl.config.layout import derive_layout
from qwen35rl.engines.base import Batch
from qwen35rl.engines.fsdp_engine import FsdpTrainEngine
from qwen35rl.runtime.batching import build_batch
from tests.engines.test_fsdp_engine import PAD, _loss, _sequences, _step_capturing_grads
from tests.shared_results import result_dict

WORLD = 4
TWO_LAYERS = ("model.num_hidden_layers=2", "model.full_attention_interval=2")  # one GDN, one attention layer
# (model, fsdp_size, sp, loss_agg_mode)
CASES = [
    ("qwen3_5_tiny", 2, 1, "token-mean"),
    ("qwen3_5_tiny", 4, 2, "seq-mean-token-mean"),
    ("qwen3_5_tiny", 2, 2, "token-mean"),
    ("qwen3_5_tiny", 1, 4, "seq-mean-token-sum-norm"),  # fsdp_size 1: replicas only
    ("qwen3_5_tiny_moe", 2, 2, "token-mean"),
]
VL = ("qwen3_5_tiny_vl", 2, 4, "token-mean")  # dp 1: the whole two-row batch on one SP group


def _cfg(model, world, fsdp=-1, sp=1, mode="token-mean", *extra):
    return compose([f"model={model}", *TWO_LAYERS, "hw=cpu", f"hw.devices_per_node={world}", "backend.lr=1e-3",
                    "backend.gradient_checkpointing=false", "backend.grad_clip=0", "algorithm.use_kl_loss=true",
                    "algorithm.entropy_coef=0.01", "backend.lr_warmup_steps=0", "backend.remove_padding=null",
                    f"algorithm.loss_agg_mode={mode}", f"parallelism.fsdp_size={fsdp}", f"parallelism.sp={sp}",
                    f"data.has_images={model.endswith('_vl')}", *extra])


def _vl_batch(cfg):
    import numpy as np
    from PIL import Image

    from qwen35rl.models.processor import build_processor
    from qwen35rl.models.tokenizer import build_tokenizer

    proc = build_processor(cfg.model, build_tokenizer(cfg.model))
    img = Image.fromarray((np.random.default_rng(0).random((40, 56, 3)) * 255).astype("uint8"))
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) + "a cat<|im_end|>"
    enc = proc(text=[text, "<|im_start|>user\nno image<|im_end|>\n<|im_start|>assistant\na dog<|im_end|>"],
               images=[img], return_tensors="pt", padding=True)
    resp = torch.zeros_like(enc["input_ids"])
    resp[:, -6:] = 1
    mm = {"pixel_values": enc["pixel_values"], "image_grid_thw": enc["image_grid_thw"]}
    g = torch.Generator().manual_seed(3)
    return Batch(enc["input_ids"], enc["attention_mask"], resp, advantages=torch.randn(resp.shape, generator=g),
                 ref_log_probs=torch.full(resp.shape, -5.0), multimodal=mm)


def _batch(case, cfg, dp_rank, dp):
    if case[0].endswith("_vl"):
        return _vl_batch(cfg)
    seqs = _sequences()
    return build_batch(seqs.select(dp_rank * len(seqs) // dp, (dp_rank + 1) * len(seqs) // dp), PAD)


def _train_once(case, cfg, rank, world):
    """Sharded (world > 1), the reference copies the policy's initial shards; on one rank it draws them itself."""
    def reference(init_from=None):
        return FsdpTrainEngine(cfg, layout=derive_layout(cfg), rank=rank, world_size=world, device="cpu",
                               reference=True, init_from=init_from)

    engine = FsdpTrainEngine(cfg, layout=derive_layout(cfg), rank=rank, world_size=world, device="cpu")
    ref = reference(engine if world > 1 else None)
    batch = _batch(case, cfg, engine.dp_rank, engine.dp_size)
    logp, ent = engine.compute_log_probs(batch, with_entropy=True)
    ref_logp, _ = ref.compute_log_probs(batch)
    metrics, grads, weights = _step_capturing_grads(engine, [batch])
    copied = None
    if world > 1:  # a copy of the weights as they are now (a second draw would give the initial ones)
        def same(a, b):
            a, b = (t.to_local() if hasattr(t, "to_local") else t for t in (a, b))
            return torch.equal(a.to(b.dtype), b)

        trained, again, initial = (e.module.state_dict() for e in (engine, reference(engine), ref))
        copied = (all(same(t, again[k]) for k, t in trained.items())
                  and not all(same(t, initial[k]) for k, t in trained.items()))
    return dict(dp=(engine.dp_rank, engine.dp_size), layout=engine.micro_batch_layout, logp=logp, ent=ent,
                ref_logp=ref_logp, metrics=metrics, grads=grads if rank == 0 else None,
                weights=weights if rank == 0 else None, copied=copied)


def _resume_cfg(world):
    return _cfg("qwen3_5_tiny", world, 2, 2, "token-mean")


def _resume_batches(engine):
    seqs = _sequences(n=8, seed=4)
    share = seqs.select(engine.dp_rank * 4, engine.dp_rank * 4 + 4)
    return [build_batch(share.select(0, 2), PAD), build_batch(share.select(2, 4), PAD)]


def _worker(rank, init_file, ckpt, resume, results):
    from qwen35rl.runtime.checkpoint import load_engine_state, save_engine_state

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        cfg = _resume_cfg(WORLD)
        engine = FsdpTrainEngine(cfg, layout=derive_layout(cfg), rank=rank, world_size=WORLD, device="cpu")
        first, second = _resume_batches(engine)
        if resume:  # a fresh set of processes: the checkpoint's step, then the second one
            load_engine_state(ckpt, engine)
        else:
            engine.train_mini_batch([first], _loss(engine))
            save_engine_state(ckpt, engine)
        metrics, _, weights = _step_capturing_grads(engine, [second])
        results[("resume" if resume else "straight", rank)] = (metrics, weights if rank == 0 else None)
        if not resume:
            for case in CASES + [VL]:
                results[(case, rank)] = _train_once(case, _cfg(*case[:1], WORLD, *case[1:]), rank, WORLD)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _close(a, b, msg):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=msg)


@pytest.mark.slow
def test_hsdp_and_sp_train_like_one_rank_and_resume_bitwise():
    results = result_dict()
    with tempfile.TemporaryDirectory() as d:
        ckpt = os.path.join(d, "ckpt")
        os.makedirs(ckpt)
        mp.spawn(_worker, args=(os.path.join(d, "init"), ckpt, False, results), nprocs=WORLD, join=True)
        mp.spawn(_worker, args=(os.path.join(d, "init2"), ckpt, True, results), nprocs=WORLD, join=True)
        results = dict(results)
    for rank in range(WORLD):  # every rank's step metrics; rank 0 holds the full weights
        (ma, wa), (mb, wb) = results[("straight", rank)], results[("resume", rank)]
        assert ma == mb
    assert all(torch.equal(wa, wb) for wa, wb in zip(results[("straight", 0)][1].values(),
                                                     results[("resume", 0)][1].values()))
    for case in CASES + [VL]:
        one = _train_once(case, _cfg(case[0], 1, -1, 1, case[3]), 0, 1)
        assert one["layout"] == "padded"  # CPU without SP: the world-1 run pads
        mask = _batch(case, _cfg(case[0], 1), 0, 1).response_mask.bool()
        _, sp, _ = case[1:]
        for rank in range(WORLD):
            got = results[(case, rank)]
            dp_rank, dp = got["dp"]
            assert (dp_rank, dp) == (rank // sp, WORLD // sp)
            assert got["layout"] == ("packed" if sp > 1 else "padded")
            assert got["copied"], f"{case} rank {rank}: the reference did not copy the policy's shards"
            rows = slice(dp_rank * mask.shape[0] // dp, (dp_rank + 1) * mask.shape[0] // dp)
            share = _batch(case, _cfg(case[0], 1), dp_rank, dp).response_mask.bool()  # this share's padding
            for key in ("logp", "ent", "ref_logp"):
                assert (got[key][~share] == 0).all()
                ref = one["logp" if key == "ref_logp" else key][rows][mask[rows]]
                _close(got[key][share], ref, f"{case} {key} rank {rank}")
        got = results[(case, 0)]
        for name in one["grads"]:
            _close(got["grads"][name], one["grads"][name], f"{case} grad {name}")
            sure = one["grads"][name].abs() > 1e-5  # Adam's first step: lr * sign(grad) where the sign is sure
            _close(got["weights"][name][sure], one["weights"][name][sure], f"{case} weight {name}")
        for k in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl"):
            assert got["metrics"][k] == pytest.approx(one["metrics"][k], rel=1e-5, abs=1e-7), (case, k)
