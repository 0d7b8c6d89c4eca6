"""Markdown tables from the JSON files `grpo_h200.py` writes (peak.json, q1.json, trl.json, q2.json, memory.json).

Per phase: seconds, tokens/s and, for the training phases, MFU by the FLOP count of `qwen35rl.runtime.flops`
(forward 2x, training 6x the matmul parameters per token, recomputation not counted) over the bf16 matmul rate
measured in the same call. Steady-state numbers average the steps after the first (which pays warm-ups).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional

PHASES = ("gen", "old_log_prob", "ref", "update", "sync")
QWEN_KEYS = {"gen": "timing_s/gen", "old_log_prob": "timing_s/old_log_prob", "ref": "timing_s/ref",
             "update": "timing_s/update_actor", "sync": "timing_s/sync_weights", "step": "timing_s/step"}
SKIPPED_S = 1e-3
TRL_KEYS = {"gen": "gen_s", "old_log_prob": "old_log_prob_s", "ref": "ref_s", "update": "update_s", "step": "step_s"}


def _load(path: Path) -> Optional[Any]:
    return json.loads(path.read_text()) if path.exists() else None


def _mean(values: List[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def steady(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    return rows[1:] if len(rows) > 1 else rows


def model_cfg(overrides: Optional[List[str]] = None):
    from bench.gpu.workload import workload
    from qwen35rl.config.compose import compose

    return compose(overrides or workload()).model


def phase_table(seconds: Dict[str, float], tokens: float, response_tokens: float, seq_len: float, rows: int,
                peak_tflops: float, devices: int, m) -> Dict[str, Dict[str, float]]:
    """{phase: {s, tok_s, mfu}} for one (mean) step; tokens = prompt + response tokens of the step."""
    from qwen35rl.runtime.flops import forward_flops, train_flops

    fwd = forward_flops(m, [seq_len] * rows)
    train = train_flops(m, [seq_len] * rows)
    peak = peak_tflops * 1e12 * devices
    out: Dict[str, Dict[str, float]] = {}
    for phase, s in seconds.items():
        if s < SKIPPED_S:  # a phase that did not run (old log-probs of a single on-policy update, no KL)
            out[phase] = {"s": 0.0, "tok_s": float("nan"), "mfu": float("nan")}
            continue
        row = {"s": s, "tok_s": (response_tokens if phase == "gen" else tokens) / s}
        if phase in ("old_log_prob", "ref"):
            row["mfu"] = fwd / s / peak
        elif phase == "update":
            row["mfu"] = train / s / peak
        out[phase] = row
    fwd_phases = [p for p in ("old_log_prob", "ref") if seconds.get(p, 0) >= SKIPPED_S]
    train_s = sum(seconds.get(p, 0) for p in ("old_log_prob", "ref", "update"))
    out["training"] = {"s": train_s, "tok_s": tokens / train_s if train_s else 0.0,
                       "mfu": (fwd * len(fwd_phases) + train) / train_s / peak if train_s else 0.0}
    return out


def qwen35rl_summary(run: Dict[str, Any], peak: float) -> Optional[Dict[str, Any]]:
    rows = [r for r in run.get("steps", []) if "timing_s/step" in r]
    if not rows:
        return None
    ov = run["overrides"]
    value = lambda key: next(o.split("=", 1)[1] for o in ov if o.startswith(key + "="))  # noqa: E731
    n_rows = int(value("data.train_batch_size")) * int(value("rollout.n"))
    devices = int(value("hw.devices_per_node"))
    sel = steady(rows)
    sec = {p: _mean([r.get(QWEN_KEYS[p], 0.0) for r in sel]) for p in QWEN_KEYS}
    tokens = _mean([r["perf/total_num_tokens"] for r in sel])
    resp = _mean([r["response_length/mean"] for r in sel]) * n_rows
    step_s = sec.pop("step")
    table = phase_table(sec, tokens, resp, tokens / n_rows, n_rows, peak, devices, model_cfg(ov))
    return {"steps": len(rows), "devices": devices, "rows": n_rows, "tokens": tokens, "step_s": step_s,
            "tok_s": tokens / step_s, "phases": table,
            "loss": [r.get("actor/pg_loss") for r in rows], "grad_norm": [r.get("actor/grad_norm") for r in rows],
            "max_memory_allocated_gb": max(r.get("perf/max_memory_allocated_gb", 0) for r in rows)}


def trl_summary(run: Dict[str, Any], peak: float, prompt_len: int = 256) -> Optional[Dict[str, Any]]:
    rows = run.get("steps", [])
    if not rows:
        return None
    n_rows = int(run["config"]["per_device_train_batch_size"]) * int(run["config"]["gradient_accumulation_steps"])
    sel = steady(rows)
    sec = {p: _mean([r.get(TRL_KEYS[p], 0.0) for r in sel]) for p in TRL_KEYS}
    resp = _mean([r["logs"]["completions/mean_length"] * n_rows for r in sel])
    tokens = resp + prompt_len * n_rows
    step_s = sec.pop("step")
    table = phase_table(sec, tokens, resp, tokens / n_rows, n_rows, peak, 1, model_cfg())
    return {"steps": len(rows), "rows": n_rows, "tokens": tokens, "step_s": step_s, "tok_s": tokens / step_s,
            "phases": table, "loss": [r.get("logs", {}).get("loss") for r in rows],
            "grad_norm": [r.get("logs", {}).get("grad_norm") for r in rows],
            "max_memory_allocated_gib": max(r["max_memory_allocated_gib"] or 0 for r in rows)}


def _fmt(x: Optional[float], spec: str = ".2f") -> str:
    return "-" if x is None or x != x else format(x, spec)


def phase_rows(name: str, s: Dict[str, Any]) -> List[str]:
    out = []
    for phase in (*PHASES, "training"):
        p = s["phases"].get(phase)
        if p is None:
            continue
        out.append(f"| {name} | {phase} | {_fmt(p['s'])} | {_fmt(p['tok_s'], ',.0f')} | "
                   f"{_fmt(p.get('mfu', float('nan')) * 100, '.1f')} |")
    out.append(f"| {name} | **step** | {_fmt(s['step_s'])} | {_fmt(s['tok_s'], ',.0f')} | |")
    return out


def rollout_measurement(r: Dict[str, Any]) -> Dict[str, Any]:
    """The generation the rollout estimate describes: the steady state, with the trainer's optimizer states and
    gathered reference root in memory (`generate_after_update`, recorded for the first shape). The first `generate`
    of a memory job runs before any update, so it lacks `rollout/kept_by_trainer`."""
    return r.get("generate_after_update") or r["generate"]


def render(results: Path) -> str:
    peak_rows = _load(results / "peak.json") or []
    peak = peak_rows[0]["bf16_matmul_tflops"] if peak_rows else float("nan")
    lines = [f"bf16 matmul peak (8192^3, same call): {', '.join(_fmt(p['bf16_matmul_tflops'], '.1f') for p in peak_rows)} "
             "TFLOP/s", ""]
    summaries = {}
    for label, file, fn in (("qwen35rl 1 GPU", "q1.json", qwen35rl_summary), ("TRL GRPOTrainer", "trl.json", trl_summary),
                            ("qwen35rl 2 GPUs", "q2.json", qwen35rl_summary)):
        run = _load(results / file)
        s = fn(run, peak) if run else None
        summaries[label] = s
        if s is None:
            lines.append(f"{label}: no finished step in {file}" + ("" if run else " (file missing)"))
    lines += ["", "| run | phase | s / step | tokens/s | MFU % |", "| --- | --- | ---: | ---: | ---: |"]
    for label, s in summaries.items():
        if s:
            lines += phase_rows(label, s)
    ours, trl = summaries.get("qwen35rl 1 GPU"), summaries.get("TRL GRPOTrainer")
    if ours and trl:
        lines += ["", "| phase | qwen35rl / TRL speed |", "| --- | ---: |"]
        for phase in (*PHASES, "training"):
            a, b = ours["phases"].get(phase), trl["phases"].get(phase)
            if a and b and a["s"] >= SKIPPED_S and b["s"] >= SKIPPED_S:
                lines.append(f"| {phase} | {b['s'] / a['s']:.2f}x |")
        lines.append(f"| end to end (tokens/s) | {ours['tok_s'] / trl['tok_s']:.2f}x |")
    memory = _load(results / "memory.json") or []
    if memory:
        lines += ["", "| config | train est GiB | train allocated | reserved | error | rollout est | rollout "
                  "allocated | reserved | error |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in memory:
            if "error" in r:
                lines.append(f"| {r.get('name', r.get('group'))} | failed: {r['error'][:80]} |")
                continue
            train_key = max(("log_probs", "ref_log_probs", "update"), key=lambda k: r.get(k, {}).get("peak_gib", -1))
            gen = rollout_measurement(r)
            lines.append(
                f"| {r['name']} | {_fmt(r['estimate']['train_peak'])} | {_fmt(r['measured_train_peak_gib'])} | "
                f"{_fmt(r[train_key]['reserved_gib'])} | {_fmt(r.get('train_error', float('nan')) * 100, '+.0f')}% | "
                f"{_fmt(r['estimate']['rollout_peak'])} | {_fmt(gen['peak_gib'])} | {_fmt(gen['reserved_gib'])} | "
                f"{_fmt((r['estimate']['rollout_peak'] / gen['peak_gib'] - 1) * 100, '+.0f')}% |")
    return "\n".join(lines)
