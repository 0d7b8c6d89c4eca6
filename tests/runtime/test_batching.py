"""Padding responses into the engine's Batch and splitting work over ranks."""
import pytest
import torch

from qwen35rl.runtime.batching import Sequences, build_batch, chunk, response_values, split_even, split_sequences
from qwen35rl.runtime.rollouts import RolloutBatch, data_metrics


def test_build_batch_layout():
    seqs = Sequences(prompt_ids=[[1, 2, 3], [4]], response_ids=[[5], [6, 7, 8]],
                     old_log_probs=[[-0.1], [-0.2, -0.3, -0.4]], advantages=[1.5, -2.0])
    b = build_batch(seqs, pad_token_id=0)
    # prompts left-padded to 3, responses right-padded to 3: every response starts at column 3
    assert b.input_ids.tolist() == [[1, 2, 3, 5, 0, 0], [0, 0, 4, 6, 7, 8]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]]
    assert b.response_mask.tolist() == [[0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 1]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 3, 3], [0, 0, 0, 1, 2, 3]]
    assert b.advantages.tolist() == [[0, 0, 0, 1.5, 0, 0], [0, 0, 0, -2.0, -2.0, -2.0]]
    assert torch.allclose(b.old_log_probs[1, 3:], torch.tensor([-0.2, -0.3, -0.4]))
    assert b.ref_log_probs is None
    assert response_values(b.old_log_probs, b) == [pytest.approx([-0.1]), pytest.approx([-0.2, -0.3, -0.4])]


def test_build_batch_rejects_misaligned_log_probs():
    with pytest.raises(ValueError, match="old_log_probs"):
        build_batch(Sequences([[1]], [[2, 3]], old_log_probs=[[-1.0]]), pad_token_id=0)


def test_splits():
    assert split_even(list(range(5)), 2) == [[0, 1, 2], [3, 4]]
    seqs = Sequences([[i] for i in range(6)], [[10 + i] for i in range(6)], advantages=[float(i) for i in range(6)])
    shares = split_sequences(seqs, 3)
    assert [s.advantages for s in shares] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    assert [len(c) for c in chunk(seqs, 4)] == [4, 2]
    assert seqs.take([5, 0]).prompt_ids == [[5], [0]]


def test_rollout_groups_and_metrics():
    batch = RolloutBatch(n=2, examples=["a", "b"], prompt_ids=[[1], [1], [2, 2], [2, 2]],
                         response_ids=[[1, 2, 3, 4], [5], [6, 7], [8, 9, 10, 11]], rollout_log_probs=[[]] * 4,
                         finish_reasons=["length", "stop", "stop", "length"], scores=[1.0, 0.0, 0.5, 0.5],
                         rewards=[1.0, 0.0, 0.5, 0.5])
    assert batch.group_index.tolist() == [0, 0, 1, 1]
    sub = batch.select_groups([1])
    assert sub.examples == ["b"] and sub.response_ids == [[6, 7], [8, 9, 10, 11]]
    both = RolloutBatch.concat([sub, batch.select_groups([0])])
    assert both.examples == ["b", "a"] and both.scores == [0.5, 0.5, 1.0, 0.0]
    adv = torch.tensor([1.0, -1.0, 0.0, 0.0])
    m = data_metrics(batch, torch.tensor(batch.rewards), adv, max_response_length=4)
    assert m["critic/score/mean"] == pytest.approx(0.5)
    assert m["response_length/mean"] == pytest.approx(11 / 4)
    assert m["response_length/clip_ratio"] == pytest.approx(0.5)
    assert m["critic/advantages/mean"] == pytest.approx((4 * 1.0 - 1 * 1.0) / 11)   # token-weighted


def test_build_batch_per_token_advantages():
    prompts, responses = [[1, 2, 3], [4]], [[5], [6, 7, 8]]
    per_response = build_batch(Sequences(prompts, responses, advantages=[1.5, -2.0]), pad_token_id=0)
    constant = build_batch(Sequences(prompts, responses, advantages=[[1.5], [-2.0, -2.0, -2.0]]), pad_token_id=0)
    assert torch.equal(constant.advantages, per_response.advantages)
    varying = build_batch(Sequences(prompts, responses, advantages=[[0.5], [1.0, -2.0, 3.0]]), pad_token_id=0)
    assert varying.advantages.tolist() == [[0, 0, 0, 0.5, 0, 0], [0, 0, 0, 1.0, -2.0, 3.0]]
    mixed = build_batch(Sequences(prompts, responses, advantages=[0.5, [1.0, -2.0, 3.0]]), pad_token_id=0)
    assert torch.equal(mixed.advantages, varying.advantages)
    with pytest.raises(ValueError, match=r"advantages\[1\] has 2 values for 3 response tokens"):
        build_batch(Sequences(prompts, responses, advantages=[[0.5], [1.0, 2.0]]), pad_token_id=0)


def test_per_token_advantages_survive_splitting():
    seqs = Sequences([[i] for i in range(4)], [[10 + i] * (i + 1) for i in range(4)],
                     advantages=[[float(i)] * (i + 1) for i in range(4)])
    assert seqs.take([3, 0]).advantages == [[3.0] * 4, [0.0]]
    assert seqs.select(1, 3).advantages == [[1.0] * 2, [2.0] * 3]
    assert [s.advantages for s in split_sequences(seqs, 2)] == [[[0.0], [1.0] * 2], [[2.0] * 3, [3.0] * 4]]
    assert [c.advantages for c in chunk(seqs, 3)][1] == [[3.0] * 4]
    b = build_batch(seqs.take([2]), pad_token_id=0)
    assert response_values(b.advantages, b) == [[2.0] * 3]
