"""Split placement on the 2-core machine: one rollout worker and one training worker (one torch thread each), the
embedded default task, `algorithm.max_staleness` 0 (generate, train, sync in turn) against 1 (one-step-off: the next
batch generates while this one trains).

    .venv/bin/python bench/split_cpu.py [--steps 40] [--markdown] [-- extra overrides...]

Per run: median step time and tokens/s after step 1, `timing_s/sync_weights`, the reward (`critic/score/mean`) at
the start and the end, and from the run's timeline.jsonl the busy time of each pool and the share of the wall time
both were busy at once (overlap), over the steps after the first.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Tuple

os.environ.setdefault("OMP_NUM_THREADS", "1")
TRAIN = Path(sys.executable).parent / "qwen35rl-train"
SPLIT = ["placement=split", "placement.rollout_devices=1", "hw.devices_per_node=2", "trainer.test_freq=-1",
         "trainer.export_hf=false", "trainer.save_freq=-1"]


def union(intervals: List[Tuple[float, float]]) -> List[Tuple[float, float]]:
    out: List[Tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def length(intervals: List[Tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def intersect(x: List[Tuple[float, float]], y: List[Tuple[float, float]]) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        total += max(0.0, hi - lo)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def timeline_stats(rows: List[Dict], first_step: int) -> Dict[str, float]:
    """Busy seconds per pool and both at once, over the timeline from the start of `first_step` on."""
    rows = [r for r in rows if r["step"] >= first_step]
    start, end = min(r["start"] for r in rows), max(r["end"] for r in rows)
    rollout = union([(r["start"], r["end"]) for r in rows if r["pool"] in ("rollout", "both")])
    train = union([(r["start"], r["end"]) for r in rows if r["pool"] in ("train", "both")])
    both = intersect(rollout, train) - length(union([(r["start"], r["end"]) for r in rows if r["pool"] == "both"]))
    wall = end - start
    return {"wall_s": wall, "rollout_busy": length(rollout) / wall, "train_busy": length(train) / wall,
            "overlap": both / wall}


def run(staleness: int, steps: int, extra: List[str]) -> Dict:
    run_dir = Path(tempfile.mkdtemp(prefix=f"bench_split_{staleness}_"))
    cmd = [str(TRAIN), f"hydra.run.dir={run_dir}", "trainer.resume=never", *SPLIT, f"trainer.total_steps={steps}",
           f"algorithm.max_staleness={staleness}", *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timeline = [json.loads(line) for line in (run_dir / "timeline.jsonl").read_text().splitlines()]
    later = rows[1:]
    step_s = statistics.median(r["timing_s/step"] for r in later)
    score = [r["critic/score/mean"] for r in rows]
    k = min(5, len(score))
    return {"staleness": staleness, "steps": steps, "wall_s": time.perf_counter() - t0, "step_s": step_s,
            "tokens_per_s": statistics.median(r["perf/total_num_tokens"] / r["timing_s/step"] for r in later),
            "sync_s": statistics.median(r["timing_s/sync_weights"] for r in later),
            "gen_s": statistics.median(r["timing_s/gen"] for r in later),
            "update_s": statistics.median(r["timing_s/update_actor"] for r in later),
            # sync: the whole collection (timing_s/rollout); one-step-off: what is left of it after the update
            "wait_rollout_s": statistics.median(r.get("timing_s/rollout", 0.0) + r.get("timing_s/wait_rollout", 0.0)
                                                for r in later),
            "score_first5": sum(score[:k]) / k, "score_last5": sum(score[-k:]) / k,
            "staleness_max": max(r.get("staleness/max", 0.0) for r in rows),
            "is_mean": statistics.mean(r["rollout_corr/rollout_is_mean"] for r in rows
                                       if "rollout_corr/rollout_is_mean" in r) if staleness else None,
            **timeline_stats(timeline, 2), "run_dir": str(run_dir)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--markdown", action="store_true")
    p.add_argument("extra", nargs="*")
    args = p.parse_args()
    results = [run(k, args.steps, args.extra) for k in (0, 1)]
    print(json.dumps(results, indent=1))
    if args.markdown:
        a, b = results
        print(f"\n- date: {time.strftime('%Y-%m-%d', time.gmtime())} (UTC)\n- machine: {platform.machine()}, "
              f"{os.cpu_count()} CPUs, Python {platform.python_version()}, load average after {os.getloadavg()}\n"
              f"- command: `.venv/bin/python bench/split_cpu.py --steps {args.steps} --markdown`\n")
        print("| | staleness 0 (sync) | staleness 1 (one-step-off) |\n|---|---:|---:|")
        rows = [("median step time (after step 1)", "step_s", "{:.2f} s"), ("tokens/s", "tokens_per_s", "{:.0f}"),
                ("generation (`timing_s/gen`)", "gen_s", "{:.2f} s"), ("update (`timing_s/update_actor`)",
                                                                       "update_s", "{:.2f} s"),
                ("training pool waiting for rollouts", "wait_rollout_s", "{:.2f} s"),
                ("`timing_s/sync_weights`", "sync_s", "{:.3f} s"), ("rollout pool busy", "rollout_busy", "{:.0%}"),
                ("training pool busy", "train_busy", "{:.0%}"), ("both busy at once (overlap)", "overlap", "{:.0%}"),
                ("reward, mean of first 5 steps", "score_first5", "{:.3f}"),
                ("reward, mean of last 5 steps", "score_last5", "{:.3f}"), ("staleness/max", "staleness_max", "{:.0f}")]
        for label, key, fmt in rows:
            print(f"| {label} | {fmt.format(a[key])} | {fmt.format(b[key])} |")
        print(f"\nspeed-up of the step: {a['step_s'] / b['step_s']:.2f}x")


if __name__ == "__main__":
    main()
