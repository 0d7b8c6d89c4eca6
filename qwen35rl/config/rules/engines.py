"""What the training engine builds with this layout: the capabilities declaration (settings an engine
refuses or does not apply) and megatron-core's version facts about expert gradients."""
from __future__ import annotations

from typing import Any, List

from qwen35rl.config import capabilities, quirks
from qwen35rl.config.layout import Layout
from qwen35rl.config.megatron_versions import EXPERT_GROUPS_WITHOUT_EP  # the version facts, stated once
from qwen35rl.config.problems import Problem
from qwen35rl.config.rules.registry import _err, _megatron_core, _moe, _try, rule, val


# ===================================================================================== what the engines build
@rule("train")
def engine_builds_setting(cfg: Any, layout: Layout) -> List[Problem]:
    """The declaration of what each engine builds (`config.capabilities`): settings it refuses are errors, settings
    it accepts without applying them warnings that say what runs instead. The engines check the same entries."""
    return capabilities.problems(cfg, layout)


# ============================================================================================ megatron-core
@rule("train")
def expert_grads_need_ep_or_etp_equal_tp(cfg: Any, layout: Layout) -> List[Problem]:
    """megatron-core < 0.19 reduces expert gradients like dense ones when EP = 1 and ETP != TP: wrong gradients."""
    if not (_megatron_core(layout) and _moe(cfg) and layout.ep == 1 and layout.etp != layout.tp):
        return []
    first = ".".join(map(str, EXPERT_GROUPS_WITHOUT_EP))
    if not quirks.version_below(val(cfg, "backend.megatron_core_version"), first):
        return []
    return _err("expert_grads_need_ep_or_etp_equal_tp", "parallelism.etp", f"EP1 with ETP{layout.etp} != TP{layout.tp}:"
                f" megatron-core {val(cfg, 'backend.megatron_core_version')} reduces such expert gradients like dense "
                f"ones and misses the sum over the TP ranks (fixed in {first})", _try("parallelism.etp", layout.tp))
