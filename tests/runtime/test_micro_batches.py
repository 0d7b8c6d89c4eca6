"""Micro batches under a token budget (`backend.dynamic_batch_size`): every row once, every group within the
budget for the engine's layout, the same count on ranks whose shares need different counts."""
import random

import pytest

from qwen35rl.runtime.micro_batches import (balanced_parts, fewest_groups, fixed_groups, group_cost, split_even,
                                            split_to_count, token_budget_groups)


def _rows(groups):
    return sorted(i for g in groups for i in g)


def _within(groups, lengths, budget, layout):
    if layout == "uniform":  # the engine grows every group to the largest rows and the share's longest sequence
        return max(len(g) for g in groups) * max(lengths) <= budget
    return all(group_cost([lengths[i] for i in g], layout) <= budget for g in groups)


def test_fixed_groups_are_consecutive():
    assert fixed_groups(5, 2) == [[0, 1], [2, 3], [4]]
    assert fixed_groups(0, 4) == []


def test_group_cost_by_layout():
    assert group_cost([3, 10, 5], "packed") == 18
    assert group_cost([3, 10, 5], "padded") == 30
    assert group_cost([], "padded") == 0


@pytest.mark.parametrize("layout", ["packed", "padded", "uniform"])
@pytest.mark.parametrize("seed", range(20))
def test_every_row_once_and_every_group_within_budget(layout, seed):
    rng = random.Random(seed)
    lengths = [rng.randint(5, 100) for _ in range(rng.randint(1, 40))]
    budget = rng.randint(100, 600)
    groups = fewest_groups(lengths, budget, layout)
    assert _rows(groups) == list(range(len(lengths)))
    assert _within(groups, lengths, budget, layout)
    for count in range(len(groups), len(lengths) + 1, 3):
        split = split_to_count(groups, lengths, count, layout)
        assert len(split) == count and all(split)
        assert _rows(split) == list(range(len(lengths)))
        assert _within(split, lengths, budget, layout)


def test_packing_puts_short_rows_together():
    # one long row fills a micro batch on its own; the eight short ones share one
    lengths = [90, 10, 10, 10, 10, 10, 10, 10, 10]
    groups = fewest_groups(lengths, 100, "packed")
    assert sorted(map(sorted, groups)) == [[0, 1], [2, 3, 4, 5, 6, 7, 8]]
    # padded, the long row's width makes the short rows expensive next to it
    padded = fewest_groups(lengths, 100, "padded")
    assert [0] in padded and len(padded) == 2


def test_uniform_rows_follow_the_longest_sequence():
    assert fewest_groups([10, 50, 20, 30, 10], 100, "uniform") == [[0, 1], [2, 3], [4]]
    assert split_to_count([[0, 1], [2, 3], [4]], [10, 50, 20, 30, 10], 4, "uniform") == [[0, 1], [2], [3], [4]]


def test_ranks_agree_on_the_largest_count():
    short, long_ = [10] * 8, [60] * 8
    counts = [len(fewest_groups(x, 120, "packed")) for x in (short, long_)]
    assert counts == [1, 4]
    agreed = max(counts)
    for lengths in (short, long_):
        groups = token_budget_groups(lengths, 120, "packed", agree=lambda c: agreed)
        assert len(groups) == agreed and _rows(groups) == list(range(8))


def test_a_sequence_longer_than_the_budget_names_the_key():
    with pytest.raises(ValueError, match=r"backend.max_tokens_per_device=50 cannot hold .* 80 tokens.*=80"):
        fewest_groups([10, 80], 50, "packed")


def test_more_micro_batches_than_rows_is_refused():
    with pytest.raises(ValueError, match="holds 2 rows but the ranks agreed on 3"):
        split_to_count([[0, 1]], [5, 5], 3, "packed")
    with pytest.raises(ValueError, match="cannot hold rows that need 2"):
        split_to_count([[0], [1]], [5, 5], 1, "packed")


def test_unknown_layout():
    with pytest.raises(ValueError, match="expected one of packed, padded, uniform"):
        fewest_groups([1], 10, "ragged")


def test_empty_share():
    assert token_budget_groups([], 100, "packed") == []


def _two_ranks(rank, init, out):
    import os
    import types

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from qwen35rl.runtime.batching import Sequences
    from qwen35rl.runtime.worker import PolicyWorker

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    try:
        lengths = [10] * 8 if rank == 0 else [60] * 8  # rank 0 alone would need 1 micro batch, rank 1 four
        seqs = Sequences([[1] * 5] * 8, [[2] * (n - 5) for n in lengths])
        fake = types.SimpleNamespace(device=torch.device("cpu"), cfg=OmegaConf.create(
            {"backend": {"dynamic_batch_size": True, "max_tokens_per_device": 120, "micro_batch_size_per_device": 2}}))
        fake._largest_over_ranks = lambda count: PolicyWorker._largest_over_ranks(fake, count)
        groups = PolicyWorker.micro_batch_groups(fake, seqs, types.SimpleNamespace(micro_batch_layout="packed"))
        torch.save(groups, f"{out}.{rank}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_worker_ranks_agree_on_the_count_over_the_process_group(tmp_path):
    import torch
    import torch.multiprocessing as mp

    mp.spawn(_two_ranks, args=(str(tmp_path / "init"), str(tmp_path / "groups")), nprocs=2, join=True)
    short, long_ = (torch.load(tmp_path / f"groups.{r}") for r in (0, 1))
    assert len(short) == len(long_) == 4
    assert sorted(i for g in short for i in g) == list(range(8))
    assert [len(g) for g in long_] == [2, 2, 2, 2]  # 2 x 60 tokens fill the budget of 120


def test_balanced_parts_keep_counts_equal_and_sums_close():
    lengths = [100, 90, 10, 10, 80, 5, 70, 15]
    in_order = [sum(lengths[:4]), sum(lengths[4:])]  # what a split in order gives: 210 / 170
    parts = balanced_parts(lengths, 2)
    assert [len(p) for p in parts] == [4, 4] and sorted(i for p in parts for i in p) == list(range(8))
    assert all(p == sorted(p) for p in parts)  # each rank keeps the rows in batch order
    sums = [sum(lengths[i] for i in p) for p in parts]
    assert max(sums) - min(sums) < in_order[0] - in_order[1] and sums == [190, 190]
    rng = random.Random(3)
    for _ in range(50):
        lengths = [rng.randint(1, 4000) for _ in range(rng.choice([6, 12, 13, 24]))]
        parts = balanced_parts(lengths, 3)
        assert [len(p) for p in parts] == [len(g) for g in split_even(range(len(lengths)), 3)]
        sums = [sum(lengths[i] for i in p) for p in parts]
        assert max(sums) - min(sums) <= max(lengths)  # greedy largest-first: within one row of each other
