"""The colocated worker in one process (world 1, no Ray, no process group) with the real engines: a non-finite
loss skips the update and is counted, checkpoints restore the policy and RNG exactly, weight sync reaches the
rollout engine, and the HF export loads with transformers."""
import os
from functools import partial

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
from omegaconf import OmegaConf

from qwen35rl.config.layout import derive_layout
from qwen35rl.config.compose import compose
from qwen35rl.config.special_tokens import BYTE_SPECIAL_IDS
from qwen35rl.runtime.batching import Sequences
from qwen35rl.runtime.worker import PolicyWorker

PROMPTS = [[ord(c) for c in "7 3 9 ="], [ord(c) for c in "1 2 ="]]
IM_END, EOS = BYTE_SPECIAL_IDS["im_end"], BYTE_SPECIAL_IDS["eos"]


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    cfg = compose(["hw.devices_per_node=1", "rollout.n=2", "data.max_response_length=4"])
    w = PolicyWorker(OmegaConf.to_container(cfg, resolve=True), layout=derive_layout(cfg), rank=0, world_size=1,
                     local_rank=0, run_dir=str(tmp_path_factory.mktemp("run")), optimizer_steps=10)
    w._build_engines()
    w.sync_weights()
    return w


def _policy(worker):
    return {n: t.clone() for bucket in worker.actor.export_weights(64) for n, t in bucket}


def _rollout_seqs(worker, advantage):
    result = worker.generate(PROMPTS, dict(n=2, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=4, seed=5))
    prompts = [p for p in PROMPTS for _ in range(2)]
    seqs = Sequences(prompts, result.response_ids)
    seqs.old_log_probs = worker.compute_log_probs(seqs)
    seqs.advantages = [advantage, -advantage] * 2
    return seqs


def _scale(seqs):
    return {"global_tokens": float(seqs.token_count()), "global_seqs": float(len(seqs))}


def test_nonfinite_loss_skips_the_update_and_counts_it(worker):
    before = _policy(worker)
    seqs = _rollout_seqs(worker, float("nan"))
    metrics = worker.update_actor(seqs, _scale(seqs))
    assert metrics["actor/skipped_steps"] == 1
    after = _policy(worker)
    assert all(torch.equal(before[k], after[k]) for k in before), "a non-finite loss must not touch the weights"
    seqs = _rollout_seqs(worker, 1.0)
    metrics = worker.update_actor(seqs, _scale(seqs))
    assert metrics["actor/skipped_steps"] == 1 and metrics["actor/grad_norm"] > 0
    assert any(not torch.equal(after[k], v) for k, v in _policy(worker).items())


def test_rollout_log_probs_follow_weight_sync(worker):
    """After a sync the rollout engine samples from the policy: its log-probs match the train engine's."""
    seqs = _rollout_seqs(worker, 1.0)
    worker.update_actor(seqs, _scale(seqs))
    worker.sync_weights()
    result = worker.generate(PROMPTS, dict(n=2, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=4, seed=9))
    recomputed = worker.compute_log_probs(Sequences([p for p in PROMPTS for _ in range(2)], result.response_ids))
    for a, b in zip(result.log_probs, recomputed):
        assert a == pytest.approx(b, abs=1e-4)


def test_sync_fills_every_rollout_weight_from_the_policy(worker):
    """With a random init the rollout model is only allocated; after a sync each of its tensors (the tied
    lm_head too) equals the policy's, and the stop tokens are the model's."""
    worker.sync_weights()
    policy = _policy(worker)
    model = worker.rollout.model
    for name, p in model.named_parameters():
        assert torch.equal(p, policy[name].to(p.dtype)), name
    assert model.lm_head.weight is model.model.embed_tokens.weight or not worker.cfg.model.tie_word_embeddings
    assert worker.rollout.eos_token_ids == [IM_END, EOS]


def test_rollout_keys_reach_the_hf_engine_and_cpu_decodes_eagerly(worker):
    """rollout.cuda_graph (default true) and rollout.compile_decode (default null: on CUDA only) reach the hf engine;
    on CPU no graph is captured and the decode step stays eager, and the decode stats the driver reads say so (a
    rank without prompts reports none)."""
    assert worker.cfg.rollout.cuda_graph is True and worker.rollout.cuda_graphs is True
    params = dict(n=2, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=4, seed=5)
    stats = worker.generate(PROMPTS, params).decode
    assert (stats["rows"], stats["steps"], stats["cuda_graph"], stats["graph_error"]) == (4, 4, False, "")
    assert worker.generate([], params).decode == {}
    assert worker.cfg.rollout.compile_decode is None and worker.rollout.compile_decode is False
    worker.cfg.rollout.cuda_graph, worker.cfg.rollout.compile_decode = False, True
    try:
        engine = worker._rollout_engine()
        assert engine.cuda_graphs is False and engine.compile_decode is True
    finally:
        worker.cfg.rollout.cuda_graph, worker.cfg.rollout.compile_decode = True, None


def test_dynamic_batch_size_cuts_by_tokens_and_keeps_row_order(worker, monkeypatch):
    """backend.dynamic_batch_size: micro batches hold as many rows as backend.max_tokens_per_device allows at the
    engine's layout (padded on CPU); log-probs come back in the share's row order, equal to fixed micro batches'."""
    lengths = [1, 9, 2, 8, 1, 7]
    seqs = Sequences([[104, 105]] * len(lengths), [[40 + k for k in range(n)] for n in lengths])
    setting = partial(monkeypatch.setitem, worker.cfg.backend)  # the module-scoped worker's, restored after the test
    setting("micro_batch_size_per_device", 1)
    assert worker.micro_batch_groups(seqs, worker.actor) == [[0], [1], [2], [3], [4], [5]]
    fixed = worker.compute_log_probs(seqs)
    setting("dynamic_batch_size", True)
    setting("max_tokens_per_device", 24)
    assert worker.actor.micro_batch_layout == "padded"
    groups = worker.micro_batch_groups(seqs, worker.actor)
    assert sorted(i for g in groups for i in g) == list(range(6)) and len(groups) < len(lengths)
    assert all(len(g) * max(2 + lengths[i] for i in g) <= 24 for g in groups)
    dynamic = worker.compute_log_probs(seqs)
    assert [len(r) for r in dynamic] == lengths
    for a, b in zip(dynamic, fixed):
        assert a == pytest.approx(b, abs=1e-5)
    seen = _update_micro_batches(worker, seqs, dynamic, monkeypatch)
    assert [int(b.response_mask.sum()) for b in seen] == [sum(lengths[i] for i in g) for g in groups]


def _update_micro_batches(worker, seqs, old_log_probs, monkeypatch):
    """The micro batches one update of `seqs` trains on (the engine's step recorded instead of taken)."""
    seen = []
    monkeypatch.setattr(worker.actor, "train_mini_batch", lambda micro, loss, scale: seen.extend(micro) or {})
    seqs.advantages, seqs.old_log_probs = [1.0] * len(seqs), old_log_probs
    worker.update_actor(seqs, _scale(seqs))
    return seen


def test_checkpoint_round_trip_restores_policy_optimizer_and_rng(worker, tmp_path):
    worker.save_checkpoint(str(tmp_path))
    saved, draw = _policy(worker), torch.rand(3)
    seqs = _rollout_seqs(worker, 1.0)
    worker.update_actor(seqs, _scale(seqs))
    assert worker.load_checkpoint(str(tmp_path))
    assert all(torch.equal(saved[k], v) for k, v in _policy(worker).items())
    assert torch.equal(torch.rand(3), draw)      # RNG state as at the save
    # the optimizer state came back too: the same update from the restored state gives the same weights
    seqs = _rollout_seqs(worker, 1.0)
    worker.update_actor(seqs, _scale(seqs))
    first = _policy(worker)
    worker.load_checkpoint(str(tmp_path))
    worker.update_actor(seqs, _scale(seqs))
    assert all(torch.equal(first[k], v) for k, v in _policy(worker).items())


def test_hf_export_loads_with_transformers(worker, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    worker.export_hf(str(tmp_path / "final"))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"))
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "final"))
    policy = _policy(worker)
    exported = dict(model.named_parameters())
    assert set(policy) <= set(exported)
    assert all(torch.equal(policy[k], exported[k].detach()) for k in policy)
    assert tok.decode(tok.encode("7 3 9 =")) == "7 3 9 ="
    # for an engine on placeholders the same directory is written again without weights, the earlier ones removed
    config = (tmp_path / "final" / "config.json").read_text()
    worker.export_hf(str(tmp_path / "final"), weights=False)
    assert not list((tmp_path / "final").glob("*.safetensors*"))
    assert (tmp_path / "final" / "config.json").read_text() == config


def test_log_prob_passes_cut_their_own_micro_batches(worker, monkeypatch):
    """backend.log_prob_micro_batch_size_per_device / log_prob_max_tokens_per_device size the forward-only passes
    (old and reference log-probs) alone: the update keeps the training micro batch, and the log-probs are the same."""
    lengths = [1, 9, 2, 8, 1, 7]
    seqs = Sequences([[104, 105]] * len(lengths), [[40 + k for k in range(n)] for n in lengths])
    setting = partial(monkeypatch.setitem, worker.cfg.backend)
    setting("micro_batch_size_per_device", 1)
    setting("log_prob_micro_batch_size_per_device", None)
    one_by_one = worker.compute_log_probs(seqs)
    setting("log_prob_micro_batch_size_per_device", 3)
    assert worker.micro_batch_groups(seqs, worker.actor, forward_only=True) == [[0, 1, 2], [3, 4, 5]]
    assert worker.micro_batch_groups(seqs, worker.actor) == [[i] for i in range(6)]
    rows = []
    real = worker.actor.compute_log_probs
    monkeypatch.setattr(worker.actor, "compute_log_probs", lambda b: rows.append(len(b.input_ids)) or real(b))
    together = worker.compute_log_probs(seqs)
    assert rows == [3, 3]
    for a, b in zip(together, one_by_one):
        assert a == pytest.approx(b, abs=1e-5)
    seen = _update_micro_batches(worker, seqs, together, monkeypatch)
    assert len(seen) == 6  # the training micro batch of 1
    setting("dynamic_batch_size", True)
    setting("max_tokens_per_device", 11)
    setting("log_prob_max_tokens_per_device", 33)
    train = worker.micro_batch_groups(seqs, worker.actor)
    forward = worker.micro_batch_groups(seqs, worker.actor, forward_only=True)
    assert len(forward) < len(train) and all(len(g) * max(2 + lengths[i] for i in g) <= 33 for g in forward)
