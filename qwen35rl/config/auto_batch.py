"""`backend.micro_batch_size_per_device=auto`, `backend.max_tokens_per_device=auto` and
`backend.gradient_checkpointing=auto`: the plan picks them from
the memory estimate, once, before anything downstream (rules, estimate, engines, run identity, the verl export,
the runtime) reads them; those only ever see an int and a bool.

Policy: the fastest setting whose training peak fits (the test of `rules.train_memory_problems`: `memory.estimate`'s
training peak against the usable memory, the device less `hw.reserve_gib` and the allocator slack). Recomputing every layer costs about a
third more compute, more than a smaller micro batch costs a device that a micro batch of full sequences already
fills, so:
1. without checkpointing, the largest micro batch that divides a DP rank's share of a mini batch and fits;
2. else with checkpointing, the largest that fits;
3. else the smallest (micro 1, checkpointing on): the memory rule then reports the overflow with its hint.
Only the fields set to `auto` are searched: a fixed micro batch with `gradient_checkpointing=auto` tries off, then
on; a fixed checkpointing setting with `micro_batch_size_per_device=auto` searches the micro batch alone.
- `backend.dynamic_batch_size=true`: micro batches hold `backend.max_tokens_per_device` tokens whatever the count
  of responses (the engine ignores the count, the estimate counts the budget): the count's `auto` resolves to 1 and
  checkpointing `auto` is chosen for the token budget. A budget of `auto` is searched as the micro batch is: the
  largest that fits, from one whole sequence (prompt + response) up to a DP rank's share of a mini batch of whole
  sequences, in steps of TOKEN_STEP. Fuller micro batches keep the GPU busier: the FSDP engine's host time per micro
  batch is about fixed (bench/results/h200.md, 2026-12-04). Without dynamic batch size the budget is unused and
  `auto` resolves to one sequence.
- Megatron with a pipeline (PP > 1): at least PP micro batches per mini batch when the share allows it (fewer
  leave pipeline stages idle for most of the step), so the largest micro batch of at most share / PP. Megatron
  recomputes only with `backend.recompute_granularity=full` (`memory.recompute_groups`, the engine's rule): with
  another granularity both settings estimate alike and off is chosen.
The training peak grows with the micro batch (activations are per token), so the largest that fits is found by
bisection over the divisors."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from omegaconf import DictConfig, OmegaConf

from qwen35rl.config import memory as M
from qwen35rl.config.layout import Layout, derive_layout
from qwen35rl.config.rules import _divisors as divisors
from qwen35rl.config.schema import AUTO
from qwen35rl.config.tree import at

MICRO, CHECKPOINTING = "backend.micro_batch_size_per_device", "backend.gradient_checkpointing"
TOKENS = "backend.max_tokens_per_device"
TOKEN_STEP = 1024
"""Granularity of an `auto` token budget."""


@dataclass(frozen=True)
class Choice:
    """What `auto` resolved to, and why."""

    micro: int
    checkpointing: bool
    keys: Tuple[str, ...]
    """The keys that were `auto`."""
    why: str
    """One line: e.g. "largest that fits without checkpointing"."""
    train_peak_gib: float
    capacity_gib: float
    larger: Optional[Dict[str, Any]] = None
    """The next larger micro batch allowed, {micro, train_peak_gib} with the chosen checkpointing setting: it does
    not fit (None: the chosen one is the largest allowed). With a searched token budget: {tokens, train_peak_gib}."""
    tokens: Optional[int] = None
    """The token budget (max_tokens_per_device) when it was auto."""

    def settings(self) -> Dict[str, Any]:
        """The resolved keys (only those that were auto) -> value."""
        return {k: v for k, v in ((MICRO, self.micro), (CHECKPOINTING, self.checkpointing), (TOKENS, self.tokens))
                if k in self.keys}

    def to_dict(self) -> Dict[str, Any]:
        r = lambda x: round(float(x), 3)  # noqa: E731
        larger = None
        if self.larger is not None:
            key = "max_tokens_per_device" if "tokens" in self.larger else "micro_batch_size_per_device"
            larger = {key: self.larger.get("tokens", self.larger.get("micro")),
                      "train_peak_gib": r(self.larger["train_peak_gib"])}
        return {"keys": list(self.keys), "micro_batch_size_per_device": self.micro,
                "gradient_checkpointing": self.checkpointing, "max_tokens_per_device": self.tokens, "why": self.why,
                "train_peak_gib": r(self.train_peak_gib), "capacity_gib": r(self.capacity_gib), "next_larger": larger}

    def describe(self) -> str:
        """The plan's text, e.g. "micro batch 8, checkpointing off (auto: largest that fits without checkpointing,
        52.1 of 110.6 GiB)"."""
        what = []
        if MICRO in self.keys:
            what.append(f"micro batch {self.micro}")
        if TOKENS in self.keys:
            what.append(f"token budget {self.tokens}")
        if CHECKPOINTING in self.keys:
            what.append(f"checkpointing {'on' if self.checkpointing else 'off'}")
        gib = lambda x: f"{x:.1f}" if x >= 1 else f"{x:.2g}"  # noqa: E731
        return (f"{', '.join(what)} (auto: {self.why}, train peak {gib(self.train_peak_gib)} of "
                f"{gib(self.capacity_gib)} GiB usable)")


def auto_keys(cfg: Any) -> Tuple[str, ...]:
    """The keys of `cfg` set to `auto` (micro batch, checkpointing, token budget)."""
    return tuple(k for k in (MICRO, CHECKPOINTING, TOKENS) if at(cfg, k) == AUTO)


def micro_sizes(cfg: Any, layout: Layout) -> List[int]:
    """The micro batches to choose from, increasing: the divisors of a DP rank's share of a mini batch (a divisor
    of it divides the rank's share of the step too), at most share / PP with a pipeline when that leaves any."""
    responses = int(cfg["algorithm"]["mini_batch_size"]) * int(cfg["rollout"]["n"])
    dp = max(layout.dp, 1)
    if responses % dp:  # the layout rules refuse this split; the smallest keeps the rest of the plan computable
        return [1]
    share = responses // dp
    if share < 1:
        return [1]
    sizes = divisors(share)
    if layout.pp > 1:  # a pipeline fills its stages with at least PP micro batches
        sizes = [d for d in sizes if share // d >= layout.pp] or [1]
    return sizes


def token_budgets(tree: Dict[str, Any], layout: Layout) -> List[int]:
    """The token budgets to choose from, increasing: one sequence, then multiples of TOKEN_STEP up to a DP rank's
    share of a mini batch of whole sequences (a larger budget holds nothing more)."""
    seq = M.sequence_length(tree)
    responses = int(tree["algorithm"]["mini_batch_size"]) * int(tree["rollout"]["n"])
    most = max(seq, responses // max(layout.dp, 1) * seq)
    step = TOKEN_STEP
    return [seq] + list(range((seq // step + 1) * step, most + 1, step))


def with_settings(tree: Dict[str, Any], micro: int, checkpointing: bool, tokens: Optional[int] = None
                  ) -> Dict[str, Any]:
    """A copy of the plain config tree with the settings concrete (the backend dict copied, the rest shared);
    `tokens` None keeps the tree's budget."""
    backend = {**tree["backend"], "micro_batch_size_per_device": micro, "gradient_checkpointing": checkpointing}
    if tokens is not None:
        backend["max_tokens_per_device"] = tokens
    return {**tree, "backend": backend}


def smallest(tree: Dict[str, Any]) -> Dict[str, Any]:
    """The tree with its `auto` keys at the setting that needs the least memory (micro 1, checkpointing on): what
    the layout rules see while the setting is not chosen yet (every micro batch a choice may take divides as 1
    does, and no rule but the memory ones reads checkpointing)."""
    keys = auto_keys(tree)
    if not keys:
        return tree
    b = tree["backend"]
    return with_settings(tree, 1 if MICRO in keys else b["micro_batch_size_per_device"],
                         True if CHECKPOINTING in keys else b["gradient_checkpointing"],
                         M.sequence_length(tree) if TOKENS in keys else None)


def chosen(tree: Dict[str, Any], choice: Optional[Choice]) -> Dict[str, Any]:
    """The plain tree with the choice's settings (unchanged without one)."""
    return tree if choice is None else with_settings(tree, choice.micro, choice.checkpointing, choice.tokens)


def _peak(tree: Dict[str, Any], layout: Layout, rterms: Dict[str, float], micro: int, ckpt: bool,
          tokens: Optional[int] = None) -> float:
    t = with_settings(tree, micro, ckpt, tokens)
    return M.assemble(t, M.train_terms(t, layout), rterms).train_peak_gib


def choose(cfg: Any, layout: Layout, rollout_terms: Optional[Dict[str, float]] = None) -> Optional[Choice]:
    """What the `auto` keys of `cfg` resolve to under `layout` (None when neither is auto). `rollout_terms`: the
    rollout engine's terms to fit beside the trainer (they hold the sleeping engine's share of the training
    peak; default: this config's rollout layout)."""
    tree = M.as_tree(cfg)
    keys = auto_keys(tree)
    if not keys:
        return None
    b = tree["backend"]
    rterms = M.rollout_terms(tree, layout) if rollout_terms is None else rollout_terms
    cap = M.capacity_gib(tree)
    dynamic = bool(b["dynamic_batch_size"])
    # the budget is searched with dynamic batch size, else unused (one sequence); the count is unused with it
    searched_tokens = TOKENS in keys and dynamic
    tokens = M.sequence_length(tree) if TOKENS in keys and not dynamic else None
    if searched_tokens:
        sizes = token_budgets(tree, layout)
    elif MICRO in keys:
        sizes = [1] if dynamic else micro_sizes(tree, layout)
    else:
        sizes = [int(b["micro_batch_size_per_device"])]
    fixed_micro = None if MICRO in keys else int(b["micro_batch_size_per_device"])

    def micro_at(i: int) -> int:  # a searched budget leaves the count unused: 1
        return fixed_micro if fixed_micro is not None else 1 if searched_tokens else sizes[i]

    tokens_of = lambda i: sizes[i] if searched_tokens else tokens  # noqa: E731
    ckpts = [False, True] if CHECKPOINTING in keys else [bool(b["gradient_checkpointing"])]
    for ckpt in ckpts:
        peaks: Dict[int, float] = {}

        def peak(i: int) -> float:
            if i not in peaks:
                peaks[i] = _peak(tree, layout, rterms, micro_at(i), ckpt, tokens_of(i))
            return peaks[i]

        if peak(0) > cap:
            continue
        lo, hi = 0, len(sizes) - 1  # sizes[lo] fits, every size above hi does not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if peak(mid) <= cap else (lo, mid - 1)
        larger = None
        if lo + 1 < len(sizes):
            larger = {"tokens" if searched_tokens else "micro": sizes[lo + 1], "train_peak_gib": peak(lo + 1)}
        fit = peak(lo)
        how = "with checkpointing" if ckpt else "without checkpointing"
        if searched_tokens:
            why = f"largest token budget that fits {how}" + (
                " (none fits without)" if ckpt and CHECKPOINTING in keys else "")
        elif MICRO in keys and dynamic:
            why = (f"micro batches of {b['max_tokens_per_device']} tokens (dynamic_batch_size: the count is unused)"
                   + (f", fits {how}" if CHECKPOINTING in keys else ""))
        elif MICRO in keys:
            why = f"largest that fits {how}"
            if ckpt and CHECKPOINTING in keys:
                why += " (none fits without)"
        else:
            why = f"fits {how}" + (" (not without)" if ckpt else "")
        if TOKENS in keys and not dynamic:
            why += "; token budget unused without dynamic_batch_size"
        return Choice(micro_at(lo), ckpt, keys, why, fit, cap, larger, tokens_of(lo))
    ckpt = ckpts[-1]
    return Choice(micro_at(0), ckpt, keys, "nothing fits: the smallest setting",
                  _peak(tree, layout, rterms, micro_at(0), ckpt, tokens_of(0)), cap, None, tokens_of(0))


def apply(cfg: Any, choice: Optional[Choice]) -> DictConfig:
    """A copy of `cfg` with the choice's keys set (unchanged without a choice)."""
    out = cfg.copy() if isinstance(cfg, DictConfig) else OmegaConf.create(copy.deepcopy(cfg))
    for key, value in (choice.settings() if choice else {}).items():
        OmegaConf.update(out, key, value, merge=False)
    return out


def resolve(cfg: DictConfig, layout: Optional[Layout] = None) -> Tuple[DictConfig, Optional[Choice]]:
    """`cfg` with its `auto` keys resolved under `layout` (default: the config's own layout), and the choice."""
    if not auto_keys(cfg):
        return cfg, None
    tree = M.as_tree(cfg)
    choice = choose(tree, derive_layout(tree) if layout is None else layout)
    return apply(cfg, choice), choice
