"""Token plumbing of the Megatron engine (qwen35rl.engines.megatron.tokens): left alignment of the runtime's
left-padded batches. (Its vocab-parallel log-probs are tests/engines/test_logprob.py's split-vocabulary test.)"""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")


import pytest
import torch

from qwen35rl.engines.megatron import tokens


def test_left_align_and_restore_round_trip():
    # prompt left-padded, response right-padded (runtime.batching layout)
    ids = torch.tensor([[0, 0, 5, 6, 7, 0], [1, 2, 3, 4, 5, 6], [0, 9, 8, 0, 0, 0]])
    mask = (ids != 0).long()
    mask[1, 0] = 1
    a = tokens.left_align(ids, mask, pad_token_id=0)
    assert a.input_ids.tolist() == [[5, 6, 7, 0, 0, 0], [1, 2, 3, 4, 5, 6], [9, 8, 0, 0, 0, 0]]
    assert a.valid.sum(1).tolist() == [3, 6, 2] and a.shift.tolist() == [2, 0, 1]
    values = torch.randn(3, 6, 2)
    assert torch.equal(a.restore(a.take(values)), values)
    assert torch.equal(a.take(ids)[a.valid], ids[mask.bool()])  # same tokens, same order


def test_left_align_refuses_holes():
    ids = torch.tensor([[1, 0, 2]])
    with pytest.raises(ValueError, match="contiguous"):
        tokens.left_align(ids, torch.tensor([[1, 0, 1]]))


def test_pad_columns():
    x = torch.ones(2, 5, dtype=torch.long)
    assert tokens.pad_columns(x, 4).shape == (2, 8) and tokens.pad_columns(x, 4)[:, 5:].sum() == 0
    assert tokens.pad_columns(x, 5) is x
