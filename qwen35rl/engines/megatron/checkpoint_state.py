"""The engine's checkpoint state and the layout it was saved with.

Every tensor is this rank's own shard under a key of its coordinates: model parameters under
`pp{p}_tp{t}_ep{e}_etp{x}/{chunk}/{local name}` (local layer and expert numbers), optimizer shards under
`rank{global rank}/...`. DCP therefore cannot reshard them: another TP / PP / EP / ETP / VPP, pipeline layout,
world size (distributed optimizer shards, per-rank keys) or optimizer placement names other keys or other shapes,
and a layout whose keys and shapes happen to coincide (a moved pipeline boundary) would load the wrong layers.

So the state carries `layout`, a JSON string of what decides the keys and shapes (`shard_layout`). DCP stores it
as one object every rank agrees on, readable without a process group (`saved_layout`): a driver compares it with
the run's before launch (`layout_change` says what differs), and the engine refuses a mismatch after loading.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional

from qwen35rl.config import capabilities
from qwen35rl.config.layout import Layout

LAYOUT_KEY = "layout"
"""The entry of the engine state (DCP key `engine.layout` as runtime.checkpoint saves it)."""


def shard_layout(cfg: Any, layout: Layout) -> Dict[str, Any]:
    """What decides which tensors each rank saves, under which keys and shapes (the config layer states it once)."""
    return capabilities.checkpoint_layout(cfg, layout)


def layout_change(saved: Dict[str, Any], current: Dict[str, Any]) -> Optional[str]:
    """Why a checkpoint saved with `saved` cannot resume under `current` (None when they agree)."""
    problem = capabilities.resume_problem(saved, current)
    return None if problem is None else f"{problem.message}; {problem.hint}"


def encode(record: Dict[str, Any]) -> str:
    return json.dumps(record, sort_keys=True)


def saved_layout(model_dir: Path) -> Optional[Dict[str, Any]]:
    """The shard layout recorded in a DCP checkpoint directory (runtime.checkpoint's model dir), read in this
    process without a process group; None for a checkpoint from before the record existed."""
    import torch.distributed.checkpoint as dcp

    state = {"engine": {LAYOUT_KEY: ""}}
    try:
        dcp.load(state, checkpoint_id=str(model_dir), no_dist=True)
    except Exception as e:  # DCP reports a missing key as a CheckpointException naming it
        if LAYOUT_KEY in str(e):
            return None
        raise
    return json.loads(state["engine"][LAYOUT_KEY])


def check_loaded(state: Dict[str, Any], current: Dict[str, Any]) -> None:
    """After DCP loaded into the engine's state: refuse a checkpoint of another layout (its tensors went into the
    wrong places, or only happened to fit)."""
    saved = state.get(LAYOUT_KEY)
    if not saved:
        return
    why = layout_change(json.loads(saved), current)
    if why:
        raise RuntimeError(why)
