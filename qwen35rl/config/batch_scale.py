"""Batch sizes that scale with the data-parallel size: the defaults of `data.train_batch_size` and
`algorithm.mini_batch_size` (and the recipes' values) are written `${qwen35rl_batch:<which>,<train>,<mini>}`, which
resolves when the config is composed to the smallest batch that splits over the composed layout's DP ranks:

- unit   = the prompts whose responses (x rollout.n) split evenly over DP x micro batch (micro 1 when `auto` or with
           dynamic batch size, whose micro batches hold tokens, not responses);
- mini   = the smallest multiple of the unit that is at least <mini>;
- train  = mini x (<train> / <mini>) (the base's optimizer steps per rollout batch), made a multiple of the mini
           batch the config ends up with (a mini batch the user set).

Where <mini> already splits (every reference run on its own hardware: e.g. 64 / 16 at DP 8, n=5) the values are the
base's exactly; on more devices they grow with DP (256 / 64 at DP 64), so the step's responses per device stay about
the same. A value the user sets replaces the interpolation: the batch rules then check it as given. The DP is the
composed layout's (the tested layout's with `parallelism=auto`, whose search keeps only layouts it splits over);
with `placement=split` and the pool size left to the search, every device counts. Standard library and omegaconf
only."""
from __future__ import annotations

import math
from typing import Any

RESOLVER = "qwen35rl_batch"


def _int(v: Any, default: int) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else default


def dp_micro(root: Any) -> int:
    """DP ranks x micro batch of the composed config (1 where something is not a usable number yet)."""
    from qwen35rl.config.layout import derive_layout

    try:
        layout = derive_layout(root)
        dp = layout.dp if layout.dp >= 1 else 1
    except Exception:  # a half-formed config (a refused value): the rules report it; the batch needs a number
        dp = 1
    b = root["backend"]
    micro = 1 if b["dynamic_batch_size"] else _int(b["micro_batch_size_per_device"], 1)
    return dp * micro


def scaled(which: str, base_train: int, base_mini: int, root: Any) -> int:
    """The resolved `data.train_batch_size` (`which`="train") or `algorithm.mini_batch_size` ("mini")."""
    per = dp_micro(root)
    n = _int(root["rollout"]["n"], 1)
    unit = per // math.gcd(per, n)
    mini = unit * max(1, math.ceil(int(base_mini) / unit))
    if which == "mini":
        return mini
    train = mini * max(1, int(base_train) // max(int(base_mini), 1))
    own = _int(root["algorithm"]["mini_batch_size"], mini)
    return own * max(1, math.ceil(train / own))


def register() -> None:
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(
            RESOLVER, lambda which, train, mini, *, _root_: scaled(str(which), int(train), int(mini), _root_))
