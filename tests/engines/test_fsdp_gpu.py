"""The FSDP engine and the rollout engine on a CUDA device: bf16 mixed precision under FSDP2 (one NCCL rank),
and packed sequences when flash-linear-attention is installed."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import importlib.util
import math
import tempfile

import pytest
import torch
import torch.distributed as dist

from qwen35rl.algo.loss import ActorLoss
from qwen35rl.config.compose import compose
from qwen35rl.config.layout import derive_layout
from qwen35rl.engines.base import RolloutRequest
from qwen35rl.engines.fsdp_engine import FsdpTrainEngine, packing_supported
from qwen35rl.engines.hf_rollout import HfRolloutEngine
from qwen35rl.models.build import build_model
from qwen35rl.config.special_tokens import BYTE_SPECIAL_IDS
from qwen35rl.runtime.batching import Sequences, build_batch, response_values

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
PAD = BYTE_SPECIAL_IDS["pad"]


def _loss(engine):
    """The run's GRPO loss, as the worker hands it to the engine."""
    return ActorLoss.from_config(engine.cfg)


def _cfg(*overrides):
    return compose(["model=qwen3_5_tiny", "hw=gpu_1x", "backend.lr=1e-3", "backend.lr_warmup_steps=0", *overrides])


def _engine(cfg, **kw):
    return FsdpTrainEngine(cfg, layout=derive_layout(cfg), **kw)


def _sequences(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 256, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]
    resps = [torch.randint(0, 256, (int(torch.randint(2, 20, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]
    return Sequences(prompts, resps, advantages=torch.randn(n, generator=g).tolist(),
                     ref_log_probs=[[-5.5] * len(r) for r in resps])


@pytest.fixture(scope="module")
def nccl_world_1():
    with tempfile.TemporaryDirectory() as d:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=f"file://{d}/init", rank=0, world_size=1)
        yield
        dist.destroy_process_group()


def test_fsdp_bf16_matches_fp32_and_trains(nccl_world_1):
    batch = build_batch(_sequences(), PAD)
    mask = batch.response_mask.bool()
    fsdp = _engine(_cfg("backend.mixed_precision=auto"), rank=0, world_size=1, device="cuda")
    assert fsdp.distributed and fsdp.compute_dtype == torch.bfloat16
    lp_bf16 = fsdp.compute_log_probs(batch)[0].cpu()
    dist.barrier()
    fp32 = _engine(_cfg("backend.mixed_precision=fp32"), rank=0, world_size=1, device="cuda")
    lp_fp32 = fp32.compute_log_probs(batch)[0].cpu()
    assert (lp_bf16[mask] - lp_fp32[mask]).abs().max() < 0.05
    metrics = [fsdp.train_mini_batch([batch], _loss(fsdp)) for _ in range(3)]
    assert all(math.isfinite(m["actor/grad_norm"]) and m["actor/skipped_steps"] == 0 for m in metrics)
    names = {n for bucket in fsdp.export_weights(1) for n, t in bucket if t.device.type == "cpu"}
    assert names == {n for n, _ in fsdp.lm.named_parameters()}


def test_rollout_on_cuda_agrees_with_fp32_recompute(nccl_world_1):
    cfg = _cfg("backend.mixed_precision=fp32", "rollout.temperature=0.8")
    train = _engine(cfg, rank=0, world_size=1, device="cuda")
    model = build_model(cfg.model, dtype=torch.float32, seed=99)
    rollout = HfRolloutEngine(model, None, device="cuda", pad_token_id=PAD,
                              eos_token_id=[BYTE_SPECIAL_IDS["im_end"], BYTE_SPECIAL_IDS["eos"]])
    rollout.load_weights(train.export_weights(1))
    prompts = [[104, 105, 32], [50, 43, 50, 61], [113]]
    out = rollout.generate(RolloutRequest(prompt_ids=prompts, n=2, temperature=0.8, max_new_tokens=16, seed=3))
    batch = build_batch(Sequences([p for p in prompts for _ in range(2)], out.response_ids), PAD)
    recomputed = response_values(train.compute_log_probs(batch)[0], batch)
    for a, b in zip(out.log_probs, recomputed):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=2e-3, atol=2e-3)


@pytest.mark.skipif(not importlib.util.find_spec("fla"), reason="packing needs flash-linear-attention")
@pytest.mark.parametrize("precision, tol", [("fp32", 1e-3), ("bf16", 5e-2)])
def test_packed_equals_padded(nccl_world_1, precision, tol):
    """fla's varlen GDN kernel, packed_gdn's convolution and packed_attention on the GPU (in bf16 its varlen flash
    kernel, in fp32 one sdpa per document): log-probs and the first update agree with padded batches."""
    assert packing_supported(torch.device("cuda"))
    seqs = _sequences()
    seqs.advantages = [(-1.0) ** k for k in range(len(seqs))]
    seqs.old_log_probs = seqs.ref_log_probs = None
    batch = build_batch(seqs, PAD)
    mask = batch.response_mask.bool()
    common = (f"backend.mixed_precision={precision}", "algorithm.use_kl_loss=false")
    packed = _engine(_cfg("backend.remove_padding=true", *common), rank=0, world_size=1, device="cuda")
    padded = _engine(_cfg("backend.remove_padding=false", *common), rank=0, world_size=1, device="cuda")
    assert packed.pack and not padded.pack
    a, b = packed.compute_log_probs(batch)[0], padded.compute_log_probs(batch)[0]
    torch.testing.assert_close(a[mask], b[mask], rtol=tol, atol=tol)
    ga = packed.train_mini_batch([batch], _loss(packed))["actor/grad_norm"]
    gb = padded.train_mini_batch([batch], _loss(padded))["actor/grad_norm"]
    assert ga == pytest.approx(gb, rel=tol)


def test_cpu_offload_matches_on_device(nccl_world_1):
    batch = build_batch(_sequences(), PAD)
    common = ("backend.mixed_precision=fp32", "algorithm.use_kl_loss=true")
    on_device = _engine(_cfg(*common), rank=0, world_size=1, device="cuda")
    offloaded = _engine(_cfg(*common, "backend.offload_policy=true"), rank=0, world_size=1, device="cuda")
    assert offloaded.offloaded and not on_device.offloaded
    assert next(iter(offloaded.module.parameters())).to_local().device.type == "cpu"
    a, b = on_device.train_mini_batch([batch], _loss(on_device)), offloaded.train_mini_batch([batch], _loss(offloaded))
    assert b["actor/grad_norm"] == pytest.approx(a["actor/grad_norm"], rel=1e-4)
    wa = {n: t for bucket in on_device.export_weights(1) for n, t in bucket}
    wb = {n: t for bucket in offloaded.export_weights(1) for n, t in bucket}
    assert wa.keys() == wb.keys()
    assert max((wa[n] - wb[n]).abs().max().item() for n in wa) < 1e-4
