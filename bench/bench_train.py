"""Time to first step and steps/s of the embedded default (`qwen35rl-train` with no overrides: qwen3_5_tiny on
hw=cpu, 2 worker processes, data=synthetic), plus the reward it reaches.

    .venv/bin/python bench/bench_train.py [--markdown] [-- extra overrides...]

Runs the real command in a fresh run directory (resume=never) and watches its metrics.jsonl: time to first step
is from process start to the first step's row (interpreter, Ray and worker start-up, model build, first rollout
and update); steps/s is over the remaining steps. --markdown prints the rows for bench/results/train_cpu.md.
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

os.environ.setdefault("OMP_NUM_THREADS", "1")
TRAIN = Path(sys.executable).parent / "qwen35rl-train"


def run(extra: list) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="bench_train_"))
    cmd = [str(TRAIN), f"hydra.run.dir={run_dir}", "trainer.resume=never", *extra]
    metrics = run_dir / "metrics.jsonl"
    seen: list = []  # (wall time, step) when each row appeared
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while proc.poll() is None:
        if metrics.exists():
            rows = metrics.read_text().splitlines()
            while len(seen) < len(rows):
                seen.append((time.perf_counter() - start, json.loads(rows[len(seen)])["step"]))
        time.sleep(0.05)
    total = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr.read()[-3000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    seen += [(total, r["step"]) for r in rows[len(seen):]]
    first_t, first_step = seen[0]
    last_t, last_step = seen[-1]
    score = [r["critic/score/mean"] for r in rows]
    val = [(r["step"], r["val/score/mean"]) for r in rows if r.get("val/score/mean") is not None]
    k = min(5, len(score))
    return {
        "command": " ".join(["qwen35rl-train", *extra]) or "qwen35rl-train",
        "steps": len(rows),
        "time_to_first_step_s": first_t,
        "steps_per_s": (last_step - first_step) / (last_t - first_t) if last_t > first_t else float("nan"),
        "median_step_s": statistics.median(r["timing_s/step"] for r in rows),
        "total_s": total,
        "reward_first": score[0], "reward_first5": sum(score[:k]) / k,
        "reward_last": score[-1], "reward_last5": sum(score[-k:]) / k,
        "val": val,
        "throughput_tokens_s_device": statistics.median(r["perf/throughput"] for r in rows),
        "run_dir": str(run_dir),
    }


def markdown(r: dict) -> str:
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    val = ", ".join(f"{v:.3f} (step {s})" for s, v in r["val"])
    return "\n".join([
        f"- date: {time.strftime('%Y-%m-%d', time.gmtime())} (UTC)",
        f"- machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"load average after the run {load}",
        f"- command: `{r['command']}` (through `bench/bench_train.py`)",
        "",
        "| measurement | value |",
        "|---|---|",
        f"| time to first step (process start -> step 1 logged) | {r['time_to_first_step_s']:.1f} s |",
        f"| steps/s after the first step | {r['steps_per_s']:.3f} ({1 / r['steps_per_s']:.2f} s/step) |",
        f"| median `timing_s/step` | {r['median_step_s']:.2f} s |",
        f"| whole run ({r['steps']} steps, checkpoints and HF export included) | {r['total_s']:.1f} s |",
        f"| `perf/throughput` (median) | {r['throughput_tokens_s_device']:.0f} tokens/s/device |",
        f"| reward (`critic/score/mean`) step 1 / mean of first 5 | {r['reward_first']:.3f} / {r['reward_first5']:.3f} |",
        f"| reward last step / mean of last 5 | {r['reward_last']:.3f} / {r['reward_last5']:.3f} |",
        f"| validation (greedy, `val/score/mean`) | {val} |",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("overrides", nargs="*", help="extra qwen35rl-train overrides (default: none)")
    args = parser.parse_args()
    result = run(args.overrides)
    print(markdown(result) if args.markdown else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
