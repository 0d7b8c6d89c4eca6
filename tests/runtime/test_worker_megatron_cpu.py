"""The colocated worker with backend=megatron and rollout=hf, driven as the GRPO driver drives it, on 2 gloo
processes with real megatron-core (the CPU stand-ins of tests/megatron_cpu.py): the reference policy built after
the actor in the same process, weight sync into the hf rollout engine, generation per rollout group, policy and
reference log-probs per data-parallel rank, an update with the driver's global normalisers, sync and generation
again, a checkpoint round trip (in the same workers, and for the first layout also in fresh ones, as a restarted
run) and the HF export.

Every layout of a model runs the same steps from the same init and seeds, so the first step must also agree across
layouts (responses, log-probs, update metrics, updated weights). fp32 (backend.bf16=false) keeps the comparisons
tight; one bf16 case (the GPU default) holds the exact parts (sync, checkpoint, resume, export) and looser
log-prob tolerances. The MoE router's auxiliary losses are off because they are computed per rank (layouts would
differ)."""
from tests.megatron_cpu import CPU_TRANSFORMER_OVERRIDES, megatron_on_cpu  # first: the prelude (skips without megatron)

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import OmegaConf

from qwen35rl.algo.core import grpo_advantages
from qwen35rl.config.compose import compose
from qwen35rl.config.layout import derive_layout
from qwen35rl.engines.base import GLOBAL_SEQS, GLOBAL_TOKENS, NORM_CONST
from qwen35rl.runtime.batching import Sequences, split_even, split_sequences
from qwen35rl.runtime.grpo import step_seed
from qwen35rl.runtime.cluster import free_port
from tests.shared_results import result_dict

pytestmark = pytest.mark.slow

PROMPTS = [[ord(c) for c in p] for p in ("7 3 9 =", "1 2 =", "4 =", "5 6 8 1 =")]
N, MAX_NEW, SEED, LR = 2, 4, 3, 1e-2
"""Responses per prompt, response budget, sampling seed, and a learning rate large enough that one update moves
the log-probs well beyond the tolerances below."""
WORLD = 2
TOLERANCE = {False: {"logp": 1e-4, "kl": 1e-5}, True: {"logp": 0.1, "kl": 1e-2}}
"""By backend.bf16: the largest |difference| between the hf engine's fp32 log-probs and the megatron engine's, and
of the update's KL terms (its forward against the sampling and reference log-probs)."""


def _config(model: str, parallel):
    cfg = compose([f"model={model}", "backend=megatron", "rollout=hf", "hw=cpu", f"hw.devices_per_node={WORLD}",
                   "algorithm.use_kl_loss=true", f"rollout.n={N}", f"data.max_response_length={MAX_NEW}",
                   f"data.train_batch_size={len(PROMPTS)}", f"algorithm.mini_batch_size={len(PROMPTS)}",
                   "backend.bf16=false", "backend.optimizer_cpu_offload=false", f"backend.lr={LR}",
                   "backend.moe_aux_loss_coeff=0", "backend.moe_z_loss_coeff=0", *parallel])
    OmegaConf.set_readonly(cfg, False)
    OmegaConf.set_struct(cfg, False)
    # everything else as configured: alltoall dispatcher, distributed optimizer, full recompute
    cfg.backend.transformer_overrides = dict(CPU_TRANSFORMER_OVERRIDES)
    return cfg


# ------------------------------------------------------------------------------- the driver's side, per rank
def _gather(obj):
    objs = [None] * dist.get_world_size()
    dist.all_gather_object(objs, obj)
    return objs


def _first_of_groups(pairs):
    """The worker handles' per-group calls (worker_groups): one result per group, from the first rank of the group,
    in group order."""
    first = {}
    for group, result in pairs:
        first.setdefault(group, result)
    return [first[g] for g in sorted(first)]


def _generate(w, shards, seed):
    """GRPOTrainer.generate: the prompts split over the rollout groups, each generating its share."""
    group = shards["rollout_group"]
    share = split_even(PROMPTS, shards["rollout_groups"])[group]
    result = w.generate(share, dict(n=N, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=MAX_NEW,
                                    seed=step_seed(seed, group)))
    shares = _first_of_groups(_gather((group, (share, result))))
    seqs = Sequences([p for share, _ in shares for p in share for _ in range(N)],
                     [r for _, res in shares for r in res.response_ids])
    return seqs, [lp for _, res in shares for lp in res.log_probs]


def _my_share(seqs, shards):
    return split_sequences(seqs, shards["train_dp_size"])[shards["train_dp_rank"]]


def _log_probs(w, shards, seqs, reference=False):
    """GRPOTrainer.log_probs, and whether the ranks of each data-parallel group returned the same rows."""
    gathered = _gather((shards["train_dp_rank"], w.compute_log_probs(_my_share(seqs, shards), reference=reference)))
    per_group = _first_of_groups(gathered)
    return [row for share in per_group for row in share], all(rows == per_group[g] for g, rows in gathered)


def _update(w, shards, seqs):
    """GRPOTrainer.update_actor with one mini batch: the global normalisers of the whole mini batch."""
    scale = {GLOBAL_TOKENS: float(seqs.token_count()), GLOBAL_SEQS: float(sum(1 for r in seqs.response_ids if r)),
             NORM_CONST: float(MAX_NEW)}
    return w.update_actor(_my_share(seqs, shards), scale)


def _export(w):
    return {k: v.clone() for bucket in w.actor.export_weights(1) for k, v in bucket}


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _rollout_holds(w, weights) -> bool:
    return _equal({k: p.detach() for k, p in w.rollout.model.named_parameters()}, weights)


def _drive(rank, world, port, cfg, run_dir, out):
    megatron_on_cpu()
    from qwen35rl.runtime.worker import PolicyWorker

    w = PolicyWorker(cfg, layout=derive_layout(cfg), rank=rank, world_size=world, local_rank=rank, run_dir=run_dir,
                     optimizer_steps=10)
    try:
        w.init_distributed("127.0.0.1", port)
        shards = w.data_shards()
        res = {"shards": shards, "agree": []}
        w.sync_weights()
        init = _export(w)
        res["synced"] = [_rollout_holds(w, init)]

        seqs, res["rollout_lp"] = _generate(w, shards, SEED)
        res["seqs"] = (seqs.prompt_ids, seqs.response_ids)
        res["policy_lp"], agree = _log_probs(w, shards, seqs)
        res["agree"].append(agree)
        res["ref_lp"], agree = _log_probs(w, shards, seqs, reference=True)
        res["agree"].append(agree)
        seqs.old_log_probs = res["rollout_lp"]  # backend.use_rollout_log_probs, the megatron recipe's default
        seqs.ref_log_probs = res["ref_lp"]
        seqs.advantages = grpo_advantages(torch.tensor([float(i % 2) for i in range(len(seqs))]),
                                          torch.arange(len(seqs)) // N).tolist()
        res["update_inputs"] = seqs
        res["metrics"] = _update(w, shards, seqs)
        w.sync_weights()
        trained = _export(w)
        res["synced"].append(_rollout_holds(w, trained))
        res["unchanged"] = [k for k in init if torch.equal(init[k], trained[k])]
        res["ref_after_update"], _ = _log_probs(w, shards, seqs, reference=True)

        seqs2, res["rollout_lp2"] = _generate(w, shards, SEED + 1)
        # backend.param/grad/optimizer_offload (on in the megatron recipe): the trainers' states waited on the host
        # during generation (storages of zero bytes on the device) and come back for the next log-probs
        res["offloaded"] = (w.actor._host.offloaded_bytes, w.ref._host.offloaded_bytes,
                            min(p.untyped_storage().nbytes() for c in w.actor.chunks for p in c.parameters()))
        res["policy_lp2"], _ = _log_probs(w, shards, seqs2)
        res["offloaded"] += (w.actor._host.offloaded_bytes,)
        res["ref_lp2"], _ = _log_probs(w, shards, seqs2, reference=True)

        ckpt_dir = os.path.join(run_dir, "ckpt")
        w.save_checkpoint(ckpt_dir)
        draw = torch.rand(3)
        _update(w, shards, seqs)
        stepped = _export(w)
        res["rng_restored"] = w.load_checkpoint(ckpt_dir) and torch.equal(torch.rand(3), draw)
        res["weights_restored"] = _equal(_export(w), trained)
        _update(w, shards, seqs)  # from the restored model, Adam moments and step count: the same step again
        res["step_replayed"] = _equal(_export(w), stepped) and not _equal(stepped, trained)

        final = _export(w)
        w.export_hf(os.path.join(run_dir, "hf"))
        if rank == 0:
            res["trained"], res["final"] = trained, final
        out[rank] = res
    finally:
        w.shutdown()


def _resume(rank, world, port, cfg, run_dir, seqs, out):
    """A restarted run: fresh workers load the checkpoint, sync and repeat the update the first run repeated."""
    megatron_on_cpu()
    from qwen35rl.config.layout import derive_layout
    from qwen35rl.runtime.worker import PolicyWorker

    w = PolicyWorker(cfg, layout=derive_layout(cfg), rank=rank, world_size=world, local_rank=rank, run_dir=run_dir,
                     optimizer_steps=10)
    try:
        w.init_distributed("127.0.0.1", port)
        shards = w.data_shards()
        restored = w.load_checkpoint(os.path.join(run_dir, "ckpt"))
        w.sync_weights()
        saved = _export(w)
        synced = _rollout_holds(w, saved)
        _update(w, shards, seqs)
        out[rank] = {"restored": restored, "synced": synced, "saved": saved, "stepped": _export(w)}
    finally:
        w.shutdown()


# ------------------------------------------------------------------------------------------------ checks
def _max_diff(a, b):
    assert [len(r) for r in a] == [len(r) for r in b]
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def _run_layout(model, parallel, tmp_path, resume: bool):
    cfg = _config(model, parallel)
    plain = OmegaConf.to_container(cfg, resolve=True)
    run_dir = tmp_path / "_".join(p.replace("parallelism.", "").replace("=", "") for p in parallel)
    (run_dir / "ckpt").mkdir(parents=True)  # the driver's CheckpointManager.begin makes the directory
    out = result_dict()
    mp.start_processes(_drive, args=(WORLD, free_port(), plain, str(run_dir), out), nprocs=WORLD, join=True,
                       start_method="spawn")
    out = dict(out)
    _check_layout(cfg, out, run_dir / "hf")
    if resume:
        resumed = result_dict()
        mp.start_processes(_resume, args=(WORLD, free_port(), plain, str(run_dir), out[0]["update_inputs"], resumed),
                           nprocs=WORLD, join=True, start_method="spawn")
        for rank, res in dict(resumed).items():
            assert res["restored"] and res["synced"], rank
            assert _equal(res["saved"], out[0]["trained"]), rank
            assert _equal(res["stepped"], out[0]["final"]), rank  # the first run's update after its own load
    return out


def _check_layout(cfg, out, hf_dir):
    layout, tol = derive_layout(cfg), TOLERANCE[bool(cfg.backend.bf16)]
    first = out[0]
    for rank, res in out.items():
        # megatron numbers ranks tp fastest, then dp: the ranks of one model-parallel group share a data shard
        assert res["shards"] == {"train_dp_rank": (rank // layout.tp) % layout.dp, "train_dp_size": layout.dp,
                                 "rollout_group": rank, "rollout_groups": WORLD}
        assert all(res["agree"]), "ranks of one data-parallel group returned different log-probs"
        assert res["synced"] == [True, True], "the rollout engine does not hold the policy's exported weights"
        for key in ("seqs", "rollout_lp", "policy_lp", "ref_lp", "metrics"):
            assert res[key] == first[key], (rank, key)
        assert res["rng_restored"] and res["weights_restored"] and res["step_replayed"], rank
        actor_away, ref_away, smallest_param_storage, after_reload = res["offloaded"]
        if cfg.backend.param_offload and cfg.backend.optimizer_offload:
            assert actor_away > ref_away > 0 and smallest_param_storage == 0 and after_reload == 0, res["offloaded"]

    # the hf engine sampled from the policy: its log-probs are the megatron engine's for the same tokens
    assert _max_diff(first["rollout_lp"], first["policy_lp"]) < tol["logp"]
    assert _max_diff(first["ref_lp"], first["policy_lp"]) < 1e-5  # the reference starts as the policy
    metrics = first["metrics"]
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert metrics["actor/grad_norm"] > 0 and metrics["actor/skipped_steps"] == 0
    # the update's own forward reproduces the log-probs the tokens were sampled with, and the reference's
    assert abs(metrics["actor/ppo_kl"]) < tol["kl"] and metrics["actor/pg_clipfrac"] == 0
    assert abs(metrics["actor/kl_loss"]) < tol["kl"]

    assert first["unchanged"] == [], "the update left these tensors as they were"
    assert first["ref_after_update"] == first["ref_lp"], "the update moved the reference policy"
    # after the second sync the rollout follows the updated policy, which is far from the initial one
    assert _max_diff(first["rollout_lp2"], first["policy_lp2"]) < tol["logp"]
    assert _max_diff(first["rollout_lp2"], first["ref_lp2"]) > 3 * tol["logp"]

    from transformers import AutoModelForCausalLM, AutoTokenizer

    exported = dict(AutoModelForCausalLM.from_pretrained(str(hf_dir)).named_parameters())
    assert first["final"].keys() <= exported.keys()
    assert all(torch.equal(exported[k].detach(), t) for k, t in first["final"].items())
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    assert tok.decode(tok.encode("7 3 9 =")) == "7 3 9 ="


def _check_layouts_agree(runs):
    (base_name, base), *others = runs.items()
    for name, run in others:
        a, b = base[0], run[0]
        assert a["seqs"] == b["seqs"] and a["rollout_lp"] == b["rollout_lp"], name  # same init, same samples
        assert _max_diff(a["policy_lp"], b["policy_lp"]) < 1e-5, name
        for key, value in a["metrics"].items():
            assert b["metrics"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), (name, key)
        # Adam moves a weight by about lr * g / (|g| + eps): where |g| is near eps (e.g. embedding rows of tokens
        # seen once) the step depends on the gradient's last digits, so compare each tensor's mean difference; a
        # wrong gradient moves most weights of a tensor by about lr
        for k, t in a["trained"].items():
            assert (b["trained"][k] - t).abs().mean().item() < 1e-3 * LR, (name, k)


@pytest.mark.parametrize("model,layouts", [
    # the last: micro batches by tokens (3 rows of at most 13 tokens within 40: 3 + 3 + 2 rows, and one empty micro
    # batch for the interleaved schedule), which must train as the fixed micro batches do
    ("qwen3_5_tiny", [["parallelism.tp=2"], ["parallelism.pp=2"], ["parallelism.pp=2", "parallelism.vpp=2"],
                      ["parallelism.pp=2", "parallelism.vpp=2", "backend.dynamic_batch_size=true",
                       "backend.max_tokens_per_device=40"]]),
    ("qwen3_5_tiny_moe", [["parallelism.ep=2"], ["parallelism.pp=2"]]),
    ("qwen3_5_tiny_moe", [["parallelism.ep=2", "backend.bf16=true"]]),
], ids=["dense-tp2-pp2-vpp2", "moe-ep2-pp2", "moe-ep2-bf16"])
def test_worker_drives_megatron_like_the_grpo_driver(model, layouts, tmp_path):
    # the first layout also resumes in fresh processes, as a restarted run does
    runs = {" ".join(parallel): _run_layout(model, parallel, tmp_path, resume=i == 0)
            for i, parallel in enumerate(layouts)}
    _check_layouts_agree(runs)
