"""The public datasets `qwen35rl-data prepare` writes: their names, splits and the columns of the written files,
and the command a plan offers for a missing file. Facts only (the conversion is `qwen35rl.data.prepare`)."""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import Dict, Optional, Tuple

DEFAULT_SPLITS = ("train", "test")
"""The splits `qwen35rl-data prepare` writes unless --splits says otherwise."""

SPLITS: Dict[str, Tuple[str, ...]] = {"gsm8k": ("train", "test"), "geo3k": ("train", "validation", "test")}
COLUMNS: Dict[str, Tuple[str, ...]] = {"gsm8k": ("question", "answer", "solution"),
                                       "geo3k": ("problem", "answer", "images")}
"""Columns of `OUT/<name>/<split>.parquet`, in order."""


def prepare_command(path: str, data_name: Optional[str] = None) -> Optional[str]:
    """How to make the missing data file `path`: the exact `qwen35rl-data prepare ...` command when `path` is named
    as the command names its files (`OUT/<dataset>/<split>.parquet`); when only `data_name` is a dataset the command
    knows, the command with DIR and where it writes. None otherwise."""
    p = Path(str(path))
    name = p.parent.name
    if name in SPLITS and p.suffix == ".parquet" and p.stem in SPLITS[name]:
        out = str(p.parent.parent)
        extra = "" if p.stem in DEFAULT_SPLITS else f" --splits {p.stem}"
        return f"make it with `qwen35rl-data prepare {name} --out {shlex.quote(out)}{extra}`"
    if data_name in SPLITS:
        return (f"`qwen35rl-data prepare {data_name} --out DIR` writes DIR/{data_name}/train.parquet and "
                f"test.parquet: point the data files there")
    return None
