"""How one rank cuts its share of a batch into micro batches (row indices per micro batch).

Without `backend.dynamic_batch_size`: consecutive groups of `backend.micro_batch_size_per_device` rows. With it:
groups whose cost fits `backend.max_tokens_per_device`, so that a micro batch of short responses holds more rows
than one of long responses. A group's cost is what the engine lays out for it:

  packed   the sum of its sequences' lengths (one row without padding: the FSDP engine where it packs)
  padded   rows x its longest sequence (the FSDP engine's padded batches)
  uniform  rows x the longest sequence of the whole share (the Megatron engine grows every micro batch of a step to
           the largest rows and columns among them: its pipeline schedule sends one shape)

Ranks run collectives in every micro batch (FSDP's gathers, MoE all-to-all, pipeline sends), so they must run the
same number: every rank computes the fewest groups its share needs, they agree on the largest of those counts, and
each rank splits its groups until it has that many (splitting never raises a group's cost).
"""
from __future__ import annotations

from typing import Callable, List, Sequence, TypeVar

T = TypeVar("T")
LAYOUTS = ("packed", "padded", "uniform")


def split_even(items: Sequence[T], parts: int) -> List[List[T]]:
    """Contiguous, as even as possible (sizes differ by at most one, larger first)."""
    base, extra = divmod(len(items), parts)
    out, start = [], 0
    for p in range(parts):
        size = base + (1 if p < extra else 0)
        out.append(list(items[start:start + size]))
        start += size
    return out


def balanced_parts(lengths: Sequence[int], parts: int) -> List[List[int]]:
    """Row indices in `parts` groups of `split_even`'s sizes whose length sums are close: the longest row first, each
    to the open group with the smallest sum so far (ties: the lower group). Each group keeps its rows in order."""
    sizes = [len(g) for g in split_even(range(len(lengths)), parts)]
    groups: List[List[int]] = [[] for _ in range(parts)]
    sums = [0] * parts
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        p = min((g for g in range(parts) if len(groups[g]) < sizes[g]), key=lambda g: (sums[g], g))
        groups[p].append(i)
        sums[p] += lengths[i]
    return [sorted(g) for g in groups]


def fixed_groups(rows: int, size: int) -> List[List[int]]:
    """Consecutive groups of `size` rows (the last may be shorter)."""
    size = max(int(size), 1)
    return [list(range(i, min(i + size, rows))) for i in range(0, rows, size)]


def group_cost(lengths: Sequence[int], layout: str) -> int:
    """Tokens the engine lays out for one micro batch of sequences of these lengths ("uniform" as "padded": its
    share-wide width is handled by `fewest_groups`)."""
    if not lengths:
        return 0
    return sum(lengths) if layout == "packed" else len(lengths) * max(lengths)


def _check(lengths: Sequence[int], budget: int, layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"micro batch layout {layout!r}: expected one of {', '.join(LAYOUTS)}")
    longest = max(lengths, default=0)
    if longest > budget:
        raise ValueError(f"backend.max_tokens_per_device={budget} cannot hold a prompt + response of {longest} tokens: "
                         f"try backend.max_tokens_per_device={longest} or more")


def fewest_groups(lengths: Sequence[int], budget: int, layout: str) -> List[List[int]]:
    """Few groups of row indices, each within `budget` tokens: first-fit over the rows longest first ("packed",
    "padded"), or consecutive rows, as many as `budget` holds at the share's longest sequence ("uniform")."""
    _check(lengths, budget, layout)
    n = len(lengths)
    if n == 0:
        return []
    if layout == "uniform":
        return fixed_groups(n, budget // max(lengths))
    groups: List[List[int]] = []
    for i in sorted(range(n), key=lambda k: -lengths[k]):
        for g in groups:
            if group_cost([lengths[k] for k in g + [i]], layout) <= budget:
                g.append(i)
                break
        else:
            groups.append([i])
    return groups


def split_to_count(groups: List[List[int]], lengths: Sequence[int], count: int, layout: str) -> List[List[int]]:
    """`count` groups from `groups` (each within the budget): "uniform" re-cuts the rows into `count` consecutive
    groups as even as possible; otherwise the costliest group of two or more rows is halved until there are `count`.
    Each group's indices come back in ascending order, groups ordered by their first row."""
    rows = sum(len(g) for g in groups)
    if count == rows == 0:
        return []
    if count < len(groups):
        raise ValueError(f"{count} micro batches cannot hold rows that need {len(groups)}")
    if count > rows:
        raise ValueError(f"this rank holds {rows} rows but the ranks agreed on {count} micro batches: every rank must "
                         f"hold as many rows (data.train_batch_size * rollout.n divisible by the data-parallel size)")
    if layout == "uniform":
        return split_even(range(rows), count)
    out = [list(g) for g in groups]
    cost = lambda g: group_cost([lengths[k] for k in g], layout)  # noqa: E731
    while len(out) < count:
        heavy = max((g for g in out if len(g) > 1), key=cost)
        halves: List[List[int]] = [[], []]
        for k in sorted(heavy, key=lambda k: -lengths[k]):  # longest first, each to the cheaper half
            min(halves, key=cost).append(k)
        out.remove(heavy)
        out.extend(halves)
    return sorted((sorted(g) for g in out), key=lambda g: g[0])


def token_budget_groups(lengths: Sequence[int], budget: int, layout: str,
                        agree: Callable[[int], int] = lambda count: count) -> List[List[int]]:
    """The micro batches of `backend.dynamic_batch_size`: the fewest groups within `budget` this share needs, then
    as many as `agree` (the largest count over the ranks) returns."""
    groups = fewest_groups(lengths, budget, layout)
    count = agree(len(groups))
    return split_to_count(groups, lengths, count, layout)
