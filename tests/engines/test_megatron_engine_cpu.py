"""The Megatron engine end to end on CPU with real megatron-core: log-probs, gradients and grad norm against
transformers, bitwise weight export, and a few GRPO steps, at TP2 / PP2 / EP2 over 2 gloo processes.

megatron-core comes with the `[test]` extra (python < 3.12); without it this module skips. The CPU stand-ins of
`tests/megatron_cpu.py` are installed in the workers after the transformers reference ran (so the reference keeps
transformers' GDN recurrence)."""
from tests.megatron_cpu import CPU_TRANSFORMER_OVERRIDES, megatron_on_cpu  # first: the prelude (skips without megatron)

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import OmegaConf

from qwen35rl.algo.core import agg_loss, kl_penalty, local_batch_counts, logprobs_from_logits, policy_loss
from qwen35rl.algo.loss import ActorLoss, LossScale
from qwen35rl.config.compose import compose
from qwen35rl.config.layout import derive_layout
from qwen35rl.engines.base import Batch
from qwen35rl.engines.megatron import checkpoint_state
from qwen35rl.models.build import build_model
from qwen35rl.runtime.cluster import free_port
from tests.shared_results import result_dict

pytestmark = pytest.mark.slow


# ----------------------------------------------------------------------------------------------- the problem
def _config(model: str, parallel):
    cfg = compose([f"model={model}", "backend=megatron", "hw=cpu", "backend.bf16=false",
                   "backend.optimizer_cpu_offload=false", "backend.use_distributed_optimizer=false",
                   "backend.gradient_checkpointing=false", "backend.grad_clip=0", "backend.lr=1e-3",
                   "backend.moe_z_loss_coeff=0", "backend.moe_aux_loss_coeff=0",
                   # what the reference loss assumes, whatever the tiny recipe trains with
                   "algorithm.use_kl_loss=true", "algorithm.entropy_coef=0", "backend.micro_batch_size_per_device=1",
                   "backend.lr_warmup_steps=0", "backend.weight_decay=0.01"] + list(parallel))
    OmegaConf.set_readonly(cfg, False)
    OmegaConf.set_struct(cfg, False)
    cfg.backend.transformer_overrides = dict(CPU_TRANSFORMER_OVERRIDES)
    return cfg


def _loss(engine):
    """The run's GRPO loss, as the worker hands it to the engine."""
    return ActorLoss.from_config(engine.cfg)


def _batch(cfg):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, cfg.model.vocab_size, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding (prompt side) and right padding (response side), as runtime.batching builds
    mask[1, -2:] = 0
    mask[2, :1] = 0
    mask[2, -4:] = 0
    ids = ids * mask
    resp = mask.clone()
    resp[:, :6] = 0
    adv = (torch.tensor([[-1.0], [0.5], [1.0]]).expand(3, 12) * resp).contiguous()
    old = -torch.rand(3, 12, generator=g) * 5 * resp
    return Batch(input_ids=ids, attention_mask=mask, response_mask=resp, advantages=adv, old_log_probs=old,
                 ref_log_probs=old.clone())


def _reference(cfg, batch):
    """transformers' log-probs, and the gradient of the GRPO loss of one rank holding the whole batch."""
    hf = build_model(cfg.model, dtype=torch.float32, seed=int(cfg.trainer.seed))
    init = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    pos = (batch.attention_mask.cumsum(1) - 1).clamp(min=0)
    logits = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=pos).logits.float()
    return (init, *reference_loss(cfg, hf, batch, logits))


def reference_loss(cfg, hf, batch, logits):
    """Masked per-token log-probs from `logits`, the gradients of the GRPO loss (backward through `hf`) and the
    loss aggregation settings."""
    logp = torch.zeros(batch.input_ids.shape)
    logp[:, 1:] = logprobs_from_logits(logits[:, :-1], batch.input_ids[:, 1:])
    mask, algo = batch.response_mask, cfg.algorithm
    tokens, seqs = local_batch_counts(mask)
    agg = dict(mode=algo.loss_agg_mode, global_tokens=tokens, global_seqs=seqs, dp_size=1,
               norm_const=float(cfg.data.max_response_length))
    pg, _ = policy_loss(logp, batch.old_log_probs, batch.advantages, mask)
    loss = agg_loss(pg, mask, **agg) + algo.kl_loss_coef * agg_loss(
        kl_penalty(logp, batch.ref_log_probs, algo.kl_loss_type), mask, **agg)
    loss.backward()
    grads = {k: p.grad.detach().clone() for k, p in hf.named_parameters()}
    return (logp.detach() * mask), grads, agg


def _worker(rank, world, port, cfg, batch, agg, out):
    megatron_on_cpu()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from qwen35rl.engines.megatron.engine import MegatronTrainEngine

        eng = MegatronTrainEngine(cfg, layout=derive_layout(cfg), rank=rank, world_size=world, device="cpu",
                                  total_steps=10)
        res = {"dp": (eng.dp_rank, eng.dp_size),
               "tower_checkpointed": [bool(c.visual.gradient_checkpointing) for c in eng.chunks if hasattr(c, "visual")]}
        res["export"] = {k: v for b in eng.export_weights(1) for k, v in b}
        res["logp"], _ = eng.compute_log_probs(batch)
        # gradients of one mini batch (every DP rank holds the same batch: the global counts double)
        scaled = LossScale(dp_size=eng.dp_size, global_tokens=agg["global_tokens"] * eng.dp_size,
                           global_seqs=agg["global_seqs"] * eng.dp_size, norm_const=agg["norm_const"])
        eng.step.backward([batch], _loss(eng), scaled)
        eng.optimizer.prepare_grads()
        res["grad_norm"] = float(eng.optimizer.get_grad_norm())
        params = {p: p.data for c in eng.chunks for p in c.parameters()}
        for p in params:  # a frozen parameter has no gradient buffer: zeros
            p.data = p.main_grad if getattr(p, "main_grad", None) is not None else torch.zeros_like(p.data)
        res["grads"] = {k: v for b in eng.export_weights(1) for k, v in b}
        for p, data in params.items():
            p.data = data
        res["steps"] = [eng.train_mini_batch([batch], _loss(eng)) for _ in range(3)]
        res["trained"] = {k: v for b in eng.export_weights(1) for k, v in b}
        out[rank] = res
        dist.barrier()  # a rank that leaves the group while its peer still talks to it aborts at exit (gloo)
    finally:
        dist.destroy_process_group()


def _run_parallel(model, parallel, world=2):
    cfg = _config(model, parallel)
    batch = _batch(cfg)
    init, logp, grads, agg = _reference(cfg, batch)
    out = result_dict()
    mp.start_processes(_worker, args=(world, free_port(), cfg, batch, agg, out), nprocs=world, join=True,
                       start_method="spawn")
    if cfg.model.tie_word_embeddings:  # exported once, as the embedding
        init.pop("lm_head.weight")
    return init, logp, grads, dict(out)


def _check(init, logp, grads, out):
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())).item()
    for rank, res in out.items():
        assert res["export"].keys() == init.keys()
        assert all(torch.equal(res["export"][k], init[k]) for k in res["export"]), rank
        torch.testing.assert_close(res["logp"], logp, atol=2e-5, rtol=0)
        for k, g in res["grads"].items():
            # relative to the tensor's largest gradient, with a floor at fp32 noise for tensors whose gradients are
            # all tiny (GDN's dt_bias / A_log behind images: ~1e-6, differences ~2e-10)
            torch.testing.assert_close(g, grads[k], atol=1e-4 * grads[k].abs().max().item() + 1e-9, rtol=0, msg=k)
        assert res["grad_norm"] == pytest.approx(norm, rel=1e-4)
        losses = [s["actor/pg_loss"] for s in res["steps"]]
        assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
        assert res["steps"] == out[0]["steps"]  # every rank reports the same metrics


@pytest.mark.parametrize("model,parallel", [
    ("qwen3_5_tiny", ["parallelism.tp=2"]),
    ("qwen3_5_tiny", ["parallelism.tp=2", "model.tie_word_embeddings=false"]),  # the output layer's own weight
    ("qwen3_5_tiny", ["parallelism.pp=2"]),
    ("qwen3_5_tiny_moe", ["parallelism.ep=2"]),
    ("qwen3_5_tiny_moe", ["parallelism.tp=2", "parallelism.etp=2"]),
    ("qwen3_5_tiny", ["parallelism.pp=2", "parallelism.vpp=2"]),
    ("qwen3_5_tiny_moe", ["parallelism.pp=2", "parallelism.pipeline_layout=Et|tttL"]),
], ids=["dense-tp2", "dense-tp2-untied", "dense-pp2", "moe-ep2", "moe-tp2-etp2", "dense-pp2-vpp2", "moe-pp2-uneven"])
def test_engine_matches_transformers(model, parallel):
    _check(*_run_parallel(model, parallel))


def _checkpoint_worker(rank, world, port, cfg, batch, path, out):
    megatron_on_cpu()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        import torch.distributed.checkpoint as dcp

        from qwen35rl.engines.megatron.engine import MegatronTrainEngine

        batch.ref_log_probs = batch.old_log_probs
        first = MegatronTrainEngine(cfg, layout=derive_layout(cfg), rank=rank, world_size=world, device="cpu",
                                    total_steps=10)
        first.train_mini_batch([batch], _loss(first))
        dcp.save({"engine": first.state_dict_for_checkpoint()}, checkpoint_id=path)
        expected = first.train_mini_batch([batch], _loss(first))  # the step a resumed run must reproduce
        expected_weights = {k: v for b in first.export_weights(1) for k, v in b}  # after Adam's update
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        second = MegatronTrainEngine(cfg, layout=derive_layout(cfg), rank=rank, world_size=world, device="cpu",
                                     total_steps=10)
        state = {"engine": second.state_dict_for_checkpoint()}
        dcp.load(state, checkpoint_id=path)
        second.load_checkpoint_state(state["engine"])
        resumed = second.train_mini_batch([batch], _loss(second))
        weights = {k: v for b in second.export_weights(1) for k, v in b}
        out[rank] = (expected, resumed, second.steps,
                     max((weights[k] - expected_weights[k]).abs().max().item() for k in weights))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_checkpoint_resumes_model_optimizer_and_schedule(tmp_path):
    cfg = _config("qwen3_5_tiny", ["parallelism.tp=2", "backend.lr_warmup_steps=3"])
    out = result_dict()
    mp.start_processes(_checkpoint_worker, args=(2, free_port(), cfg, _batch(cfg), str(tmp_path / "ckpt"), out), nprocs=2,
                       join=True, start_method="spawn")
    # the layout it was saved with, readable before launch (no process group)
    assert checkpoint_state.saved_layout(tmp_path / "ckpt") == checkpoint_state.shard_layout(cfg, derive_layout(cfg))
    for rank, (expected, resumed, steps, weight_diff) in out.items():
        assert steps == 2  # one step before the checkpoint, one after
        assert resumed == pytest.approx(expected, rel=1e-6), rank
        assert weight_diff < 1e-7  # the update used the restored Adam moments
