"""Batch arithmetic and what one sequence needs: GRPO groups, the overlong buffer, train / mini /
micro batches over the DP ranks, prompt + response within the model's positions and the rollout's max_model_len,
a dynamic micro batch holding a sequence, image data on a vision model, and a MoE dispatcher that takes micro
batches of different lengths."""
from __future__ import annotations

import math
from typing import Any, List, Optional, Tuple

from qwen35rl.config import schema
from qwen35rl.config.layout import Layout
from qwen35rl.config.problems import Problem
from qwen35rl.config.rules.registry import _divisors, _err, _megatron_core, _nearest, _try, rule, val


# ====================================================================================================== batches
@rule("config")
def rollout_n_at_least_2(cfg: Any, layout: Layout) -> List[Problem]:
    """GRPO compares the responses of one prompt: groups of at least two."""
    n = int(val(cfg, "rollout.n"))
    if n >= 2:
        return []
    return _err("rollout_n_at_least_2", "rollout.n", f"rollout.n={n}: GRPO normalises rewards within each prompt's "
                "group of responses, which needs at least 2", _try("rollout.n", 2))


@rule("config")
def overlong_buffer_within_response(cfg: Any, layout: Layout) -> List[Problem]:
    """DAPO's overlong penalty ramps over the last `buffer_len` tokens of the response budget: it must fit in it."""
    shaping = val(cfg, "algorithm.overlong_shaping")
    budget = int(val(cfg, "data.max_response_length"))
    if not shaping["enable"] or 0 < int(shaping["buffer_len"]) <= budget:
        return []
    return _err("overlong_buffer_within_response", "algorithm.overlong_shaping.buffer_len",
                f"buffer_len={shaping['buffer_len']} must be between 1 and data.max_response_length={budget}",
                _try("algorithm.overlong_shaping.buffer_len", max(1, budget // 4)))


def _batch(cfg: Any) -> Tuple[int, int, int, int, bool]:
    return (int(val(cfg, "data.train_batch_size")), int(val(cfg, "algorithm.mini_batch_size")),
            int(val(cfg, "rollout.n")), int(val(cfg, "backend.micro_batch_size_per_device")),
            bool(val(cfg, "backend.dynamic_batch_size")))


def _multiple_at_least(x: int, unit: int) -> int:
    return max(unit, (x + unit - 1) // unit * unit)


def _valid_multiple(x: int, unit: int, high: int = schema.INT_MAX) -> Optional[int]:
    """The multiple of `unit` nearest above x that is still <= high (the field's range), else the largest one
    below; None when no multiple fits."""
    up = _multiple_at_least(x, unit)
    if up <= high:
        return up
    down = high // unit * unit
    return down if down >= 1 else None


@rule("config")
def mini_batch_within_batch(cfg: Any, layout: Layout) -> List[Problem]:
    """mini_batch_size <= train_batch_size (prompts)."""
    batch, mini, *_ = _batch(cfg)
    if mini <= batch:
        return []
    return _err("mini_batch_within_batch", "algorithm.mini_batch_size", f"mini batch of {mini} prompts exceeds the "
                f"train batch of {batch} prompts", _try("algorithm.mini_batch_size", batch))


@rule("config")
def batch_divisible_by_mini_batch(cfg: Any, layout: Layout) -> List[Problem]:
    """A rollout batch splits into whole mini batches (train_batch_size % mini_batch_size == 0)."""
    batch, mini, *_ = _batch(cfg)
    if mini < 1 or mini > batch or batch % mini == 0:
        return []
    best = _nearest(mini, _divisors(batch))
    return _err("batch_divisible_by_mini_batch", "algorithm.mini_batch_size", f"train batch of {batch} prompts does "
                f"not split into mini batches of {mini}", _try("algorithm.mini_batch_size", best))


@rule("train")
def batch_divisible_by_dp_micro(cfg: Any, layout: Layout) -> List[Problem]:
    """The step's responses (train_batch_size * n) split evenly over DP ranks and micro batches."""
    batch, _, n, micro, dynamic = _batch(cfg)
    unit = layout.dp * (1 if dynamic else micro)
    if unit < 1 or (batch * n) % unit == 0:
        return []
    per = unit // math.gcd(unit, n)
    fix = _valid_multiple(batch, per)
    hint = (_try("data.train_batch_size", fix) if fix is not None else
            _try("backend.micro_batch_size_per_device", 1) if not dynamic and micro > 1 else
            f"fewer DP ranks: no data.train_batch_size up to {schema.INT_MAX} splits over DP{layout.dp}")
    return _err("batch_divisible_by_dp_micro", "data.train_batch_size", f"{batch} prompts x n={n} = {batch * n} "
                f"responses do not split over DP{layout.dp}" + ("" if dynamic else f" x micro batch {micro}"), hint)


@rule("train")
def mini_batch_divisible_by_dp(cfg: Any, layout: Layout) -> List[Problem]:
    """Each mini batch's responses (mini_batch_size * n) split evenly over the DP ranks."""
    _, mini, n, *_ = _batch(cfg)
    if layout.dp < 1 or (mini * n) % layout.dp == 0:
        return []
    per = layout.dp // math.gcd(layout.dp, n)
    fix = _valid_multiple(mini, per)
    return _err("mini_batch_divisible_by_dp", "algorithm.mini_batch_size", f"{mini} prompts x n={n} = {mini * n} "
                f"responses per mini batch do not split over DP{layout.dp}",
                _try("algorithm.mini_batch_size", fix) if fix is not None else "use fewer DP ranks")


@rule("train")
def mini_batch_divisible_by_micro(cfg: Any, layout: Layout) -> List[Problem]:
    """Without dynamic batch size, a DP rank's share of a mini batch is whole micro batches."""
    _, mini, n, micro, dynamic = _batch(cfg)
    if dynamic or layout.dp < 1 or (mini * n) % layout.dp:
        return []
    per_rank = mini * n // layout.dp
    if per_rank % micro == 0:
        return []
    return _err("mini_batch_divisible_by_micro", "backend.micro_batch_size_per_device", f"{per_rank} responses per "
                f"DP rank per mini batch are not whole micro batches of {micro}",
                _try("backend.micro_batch_size_per_device", _nearest(micro, _divisors(per_rank))))


def _seq_len(cfg: Any) -> int:
    return int(val(cfg, "data.max_prompt_length")) + int(val(cfg, "data.max_response_length"))


@rule("config")
def sequence_within_max_position(cfg: Any, layout: Layout) -> List[Problem]:
    """Prompt + response fit the model's position embeddings."""
    seq, limit = _seq_len(cfg), int(val(cfg, "model.max_position_embeddings"))
    if seq <= limit:
        return []
    prompt, response = int(val(cfg, "data.max_prompt_length")), int(val(cfg, "data.max_response_length"))
    message = f"prompt {prompt} + response {response} = {seq} tokens exceed the model's {limit} positions"
    if limit - prompt >= 1:
        return _err("sequence_within_max_position", "data.max_response_length", message,
                    _try("data.max_response_length", limit - prompt))
    if limit - response >= 1:  # the prompt alone is too long: shortening the response cannot help
        return _err("sequence_within_max_position", "data.max_prompt_length", message,
                    _try("data.max_prompt_length", limit - response))
    return _err("sequence_within_max_position", "data.max_prompt_length", message,
                f"try data.max_prompt_length={max(limit // 2, 1)} data.max_response_length={max(limit - limit // 2, 1)}")


@rule("config")
def sequence_within_max_model_len(cfg: Any, layout: Layout) -> List[Problem]:
    """Prompt + response fit the rollout engine's max_model_len when it is set."""
    limit = val(cfg, "rollout.max_model_len")
    seq = _seq_len(cfg)
    if limit is None or seq <= int(limit):
        return []
    return _err("sequence_within_max_model_len", "rollout.max_model_len", f"prompt + response = {seq} tokens exceed "
                f"rollout.max_model_len={limit}", _try("rollout.max_model_len", seq))


@rule("config")
def dynamic_batch_holds_a_sequence(cfg: Any, layout: Layout) -> List[Problem]:
    """With dynamic batch size a micro batch of max_tokens_per_device (and of the log-prob passes' budget) must hold
    the longest sequence."""
    if not val(cfg, "backend.dynamic_batch_size"):
        return []
    out, seq = [], _seq_len(cfg)
    for key in ("backend.max_tokens_per_device", "backend.log_prob_max_tokens_per_device"):
        budget = val(cfg, key)
        if budget is not None and int(budget) < seq:
            out += _err("dynamic_batch_holds_a_sequence", key, f"a micro batch of {budget} tokens cannot hold one "
                        f"prompt + response of {seq} tokens", _try(key, seq))
    return out


@rule("config")
def images_need_vision_model(cfg: Any, layout: Layout) -> List[Problem]:
    """Image data needs a model with a vision tower."""
    if not val(cfg, "data.has_images") or val(cfg, "model.vision") is not None:
        return []
    return _err("images_need_vision_model", "model", f"data={val(cfg, 'data.name')} has images but model="
                f"{val(cfg, 'model.name')} has no vision tower (model.vision is null)",
                "choose a VL checkpoint (every official Qwen3.5 size, or qwen3_5_tiny_vl) or text data")


@rule("config")
def megatron_dispatcher_takes_variable_lengths(cfg: Any, layout: Layout) -> List[Problem]:
    """The Megatron engine feeds micro batches of different lengths (variable_seq_lengths); megatron-core's
    allgather MoE dispatcher refuses that at start-up."""
    if (not _megatron_core(layout) or not val(cfg, "model.moe")
            or val(cfg, "backend.moe_token_dispatcher_type") != "allgather"):
        return []
    return _err("megatron_dispatcher_takes_variable_lengths", "backend.moe_token_dispatcher_type",
                "backend.moe_token_dispatcher_type=allgather cannot take micro batches of different lengths, which "
                "the Megatron engine feeds (megatron-core refuses it when the model is built)",
                "try backend.moe_token_dispatcher_type=alltoall (or flex with DeepEP)")
