"""Rows of jsonl / parquet files as dicts."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Iterator, List


def read_rows(path: str) -> List[Dict[str, Any]]:
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"data file {path} does not exist")
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(p).to_pylist()
    if p.suffix in (".jsonl", ".json"):
        return list(_json_lines(p))
    raise ValueError(f"data file {path}: expected .jsonl, .json (one object per line) or .parquet")


def _json_lines(p: Path) -> Iterator[Dict[str, Any]]:
    with p.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{p}:{n}: not a JSON object per line ({e.msg})") from None


def lookup(row: Dict[str, Any], key: str) -> Any:
    """`row[key]`, or a nested field named with dots (`reward_model.ground_truth`)."""
    if key in row:
        return row[key]
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(f"data key {key!r} not in row (fields: {', '.join(map(str, row))})")
        value = value[part]
    return value
