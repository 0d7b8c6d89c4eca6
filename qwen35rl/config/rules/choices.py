"""Enum-like fields take one of their values (`CHOICES`, a built-in or `pkg.module:function`
reward), and every ranged key other than the parallel degrees lies within the range its schema field declares."""
from __future__ import annotations

from typing import Any, Dict, List, Sequence

from qwen35rl.config import capabilities, engine_specs
from qwen35rl.config.launcher import LAUNCHERS
from qwen35rl.config.layout import Layout
from qwen35rl.config.problems import Problem
from qwen35rl.config.rules.declared import DEGREES, _choice_problems, _range_problems, declared_ranges
from qwen35rl.config.rules.registry import _err, _get, _try, rule, val
from qwen35rl.names import REWARDS, did_you_mean


# ================================================================================================ enums, ranges
CHOICES: Dict[str, Sequence[Any]] = {
    "placement.mode": tuple(capabilities.PLACEMENT),
    "algorithm.rollout_is": ("auto", "token", "sequence", "off"),
    "rollout.engine": tuple(engine_specs.ROLLOUT_ENGINES),
    "algorithm.adv_estimator": ("grpo",),
    "algorithm.loss_agg_mode": ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
    "algorithm.kl_loss_type": ("kl", "mse", "low_var_kl", "abs"),
    "data.truncation": ("error", "left", "right"),
    "data.kind": ("synthetic", "text", "multimodal"),
    "model.init": ("pretrained", "random"),
    "model.dtype": ("bfloat16", "float16", "float32"),
    "backend.name": tuple(engine_specs.TRAIN_ENGINES),
    "backend.lr_scheduler": ("constant", "cosine"),
    "backend.mixed_precision": ("auto", "bf16", "fp32"),
    "backend.recompute_granularity": ("full", "selective", None),
    "backend.recompute_method": ("uniform", "block", None),
    "backend.moe_token_dispatcher_type": ("allgather", "alltoall", "flex"),
    "hw.device": ("cpu", "cuda", "npu"),
    "hw.collective_backend": ("gloo", "nccl", "hccl"),
    "rollout.sleep_level": (1, 2),
    "rollout.load_format": ("dummy", "auto", None),
    "rollout.cudagraph_mode": ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE", None),
    "format": ("text", "json", "verl"),
    "trainer.launcher": LAUNCHERS,
}


@rule("config")
def known_choice(cfg: Any, layout: Layout) -> List[Problem]:
    """Enum-like fields take one of their documented values."""
    out = []
    for key, allowed in CHOICES.items():
        v = _get(cfg, key)
        if v is KeyError or v in allowed:
            continue
        names = [str(a) for a in allowed if a is not None]
        out += _err("known_choice", key, f"{key}={v!r} is not one of {', '.join(names)}" +
                    (" (or null)" if None in allowed else ""), did_you_mean(str(v), names) or _try(key, names[0]))
    reward = str(val(cfg, "data.reward"))
    if reward not in REWARDS and ":" not in reward:
        out += _err("known_choice", "data.reward", f"data.reward={reward!r} is neither a built-in reward "
                    f"({', '.join(REWARDS)}) nor a `pkg.module:function` path",
                    did_you_mean(reward, REWARDS) or "e.g. data.reward=mypkg.rewards:score")
    return out


@rule("config")
def value_in_range(cfg: Any, layout: Layout) -> List[Problem]:
    """Counts, sizes, rates and coefficients within the range their field declares in qwen35rl/config/schema.py
    (e.g. 0 < rollout.gpu_memory_utilization <= 1, algorithm.clip_ratio_c > 1); the `Any` fields that also take
    `auto` of their type (an integer, or true / false)."""
    return (_range_problems(cfg, "value_in_range", [k for k in declared_ranges() if k not in DEGREES])
            + _choice_problems(cfg, "value_in_range"))
