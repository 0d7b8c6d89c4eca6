import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from qwen35rl.algo.dapo import group_filter_mask, keep_responses, overlong_penalty


def test_group_filter_mask_keeps_groups_with_spread():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5, 0.5001, 3.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 3, 4])
    mask = group_filter_mask(scores, groups)
    assert mask.tolist() == [False, True, False, True, False]  # singleton group 4 has no spread
    assert keep_responses(mask, groups).tolist() == [False, False, True, True, False, False, True, True, True, False]


def test_group_filter_mask_orders_by_sorted_id():
    scores = torch.tensor([0.0, 1.0, 2.0, 2.0])
    groups = torch.tensor([9, 9, 4, 4])  # id 4 comes first
    assert group_filter_mask(scores, groups).tolist() == [False, True]


def test_overlong_penalty_linear_ramp():
    lengths = torch.tensor([0, 100, 768, 896, 1000, 1024])
    got = overlong_penalty(lengths, max_response_length=1024, buffer_len=256, penalty_factor=2.0)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, 0.0, -1.0, -2.0 * 232 / 256, -2.0]))
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(lengths, 1024, 2048)
