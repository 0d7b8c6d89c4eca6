"""What a run will do, for the plan's first screen: checkpoint, data (files with their row counts), reward,
algorithm settings, the number of steps and the run's name and directory. Torch-free; reading a parquet file's row
count touches only its footer, a jsonl file is counted when it is small."""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

JSONL_COUNT_LIMIT = 64 * 2 ** 20
"""jsonl files up to this size are counted line by line (bigger ones would slow the plan down)."""


def file_rows(path: str) -> Optional[int]:
    """Rows of a local data file; None when it cannot be counted here (remote, missing, unknown format, big jsonl)."""
    if "://" in path or not os.path.isfile(path):
        return None
    try:
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq

            return int(pq.ParquetFile(path).metadata.num_rows)
        if path.endswith((".jsonl", ".json")) and os.path.getsize(path) <= JSONL_COUNT_LIMIT:
            with open(path, "rb") as f:
                return sum(1 for line in f if line.strip())
    except Exception:  # a damaged file: the data rules say what is wrong with it
        return None
    return None


def _files(paths: Any) -> List[Dict[str, Any]]:
    return [{"path": str(p), "rows": file_rows(str(p))} for p in (paths or [])]


def run_summary(cfg: Any, steps_per_epoch: Optional[int] = None) -> Dict[str, Any]:
    m, d, a, b, t = cfg["model"], cfg["data"], cfg["algorithm"], cfg["backend"], cfg["trainer"]
    if m["init"] == "random":
        checkpoint = "random init"
    elif m["path"]:
        checkpoint = f"pretrained from {m['path']}"
    else:
        checkpoint = "pretrained from model.path (not set" + (f"; the hub's {m['hf_id']})" if m.get("hf_id") else ")")
    kl = (f"{a['kl_loss_type']} x {a['kl_loss_coef']:g} in the loss" if a["use_kl_loss"] else
          f"{a['kl_loss_type']} x {a['kl_loss_coef']:g} in the reward" if a["use_kl_in_reward"] else "off")
    train_files = [] if d["kind"] == "synthetic" else _files(d["train_files"])
    rows = [f["rows"] for f in train_files]
    total_rows = sum(rows) if rows and None not in rows else None
    total_steps = t["total_steps"]
    if total_steps is None and d["kind"] != "synthetic" and total_rows is not None:
        total_steps = int(t["total_epochs"]) * (total_rows // int(d["train_batch_size"]))
    return {
        "name": str(t["run_name"]), "output_dir": f"{t['output_root']}/{t['run_name']}",
        "checkpoint": checkpoint, "tokenizer": str(m["tokenizer"]),
        "data": {"name": str(d["name"]), "kind": str(d["kind"]),
                 "task": str(d["synthetic_task"]) if d["kind"] == "synthetic" else None,
                 "train_files": train_files, "val_files": [] if d["kind"] == "synthetic" else _files(d["val_files"]),
                 "train_rows": total_rows, "reward": str(d["reward"]),
                 "max_prompt_length": int(d["max_prompt_length"]), "max_response_length": int(d["max_response_length"])},
        "algorithm": {"name": str(a["name"]), "adv_estimator": str(a["adv_estimator"]), "lr": float(b["lr"]),
                      "lr_scheduler": str(b["lr_scheduler"]), "kl": kl,
                      "clip": [float(a["clip_ratio_low"]), float(a["clip_ratio_high"])],
                      "group_size": int(cfg["rollout"]["n"]), "ppo_epochs": int(a["ppo_epochs"])},
        "total_steps": None if total_steps is None else int(total_steps),
        "total_epochs": int(t["total_epochs"]),
    }


def render_lines(run: Dict[str, Any]) -> List[str]:
    d, a = run["data"], run["algorithm"]
    if d["kind"] == "synthetic":
        data = f"{d['name']} ({d['task']}, generated in code)"
    else:
        def shown(files):
            return ", ".join(f"{f['path']} ({f['rows']:,} rows)" if f["rows"] is not None else f["path"]
                             for f in files) or "none"
        data = f"{d['name']}: train {shown(d['train_files'])}; validation {shown(d['val_files'])}"
    steps = (f"{run['total_steps']:,} steps" if run["total_steps"] is not None
             else f"{run['total_epochs']} epoch(s) over the train files")
    return [
        f"  run        {run['name']} -> {run['output_dir']}; {steps}",
        f"  checkpoint {run['checkpoint']}, tokenizer {run['tokenizer']}",
        f"  data       {data}; reward {d['reward']}; prompts <= {d['max_prompt_length']}, responses <= "
        f"{d['max_response_length']} tokens",
        f"  algorithm  {a['name']} ({a['adv_estimator']} advantages, group of {a['group_size']}): lr {a['lr']:g} "
        f"{a['lr_scheduler']}, KL {a['kl']}, clip {a['clip'][0]:g}/{a['clip'][1]:g}, {a['ppo_epochs']} pass(es) "
        f"over each batch",
    ]
