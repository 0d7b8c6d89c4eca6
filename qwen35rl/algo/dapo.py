"""DAPO's additions to GRPO: dynamic sampling's group filter and overlong reward shaping."""
from __future__ import annotations

import torch
from torch import Tensor


def group_filter_mask(scores: Tensor, group_index: Tensor) -> Tensor:
    """Bool [num_groups]: True for groups whose scores are not all equal (only those carry a learning signal).

    Groups are ordered by sorted group id (as `torch.unique`); with ids 0..G-1 entry g is group g. A group of a
    single response has no spread and is dropped.
    """
    ids, inverse = torch.unique(group_index, return_inverse=True)
    scores = scores.float()
    high = torch.full((len(ids),), -torch.inf, device=scores.device).scatter_reduce(0, inverse, scores, "amax")
    low = torch.full((len(ids),), torch.inf, device=scores.device).scatter_reduce(0, inverse, scores, "amin")
    return high > low


def keep_responses(group_mask: Tensor, group_index: Tensor) -> Tensor:
    """Bool [N]: the responses of the groups `group_filter_mask` kept."""
    _, inverse = torch.unique(group_index, return_inverse=True)
    return group_mask[inverse]


def overlong_penalty(response_lengths: Tensor, max_response_length: int, buffer_len: int,
                     penalty_factor: float = 1.0) -> Tensor:
    """Reward added per response: 0 up to max_response_length - buffer_len tokens, then falling linearly to
    -penalty_factor at max_response_length."""
    if not 0 < buffer_len <= max_response_length:
        raise ValueError(f"algorithm.overlong_shaping.buffer_len={buffer_len} must be in (0, max_response_length="
                         f"{max_response_length}]")
    start = max_response_length - buffer_len
    over = (response_lengths.float().clamp(max=max_response_length) - start).clamp(min=0)
    return -penalty_factor * over / buffer_len
