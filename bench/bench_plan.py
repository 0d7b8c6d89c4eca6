"""How long planning takes: compose, the plan (rules + parameter count + memory estimate), the `parallelism=auto`
search, and the `qwen35rl-plan` command end to end.

    .venv/bin/python bench/bench_plan.py [--repeat 5] [--markdown]

Prints one line per measurement (min and median over the repeats, seconds); --markdown prints the table for
bench/results/plan.md. The load average is printed too: on a shared machine it explains slow numbers.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qwen35rl.config import layout_search, memory, params, rules  # noqa: E402
from qwen35rl.config.compose import compose  # noqa: E402
from qwen35rl.config.layout import derive_layout  # noqa: E402
from qwen35rl.config.plan import build_plan  # noqa: E402

CASES = {
    "397b a3_16node": ["model=qwen3_5_397b_a17b", "hw=a3_16node", "backend=megatron"],
    "397b gpu_16node": ["model=qwen3_5_397b_a17b", "hw=gpu_16node", "backend=megatron"],
    "35b gpu_1node": ["model=qwen3_5_35b_a3b", "hw=gpu_1node", "backend=megatron"],
    "27b fsdp gpu_1node": ["model=qwen3_5_27b", "hw=gpu_1node", "backend=fsdp"],
}


def timed(fn, repeat):
    times, result = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times), result


def measure(repeat: int):
    rows = []
    for name, overrides in CASES.items():
        cfg = compose(overrides)
        layout = derive_layout(cfg)
        rows.append((f"{name}: compose", *timed(lambda: compose(overrides), repeat)[:2], ""))
        rows.append((f"{name}: rules + params + memory",
                     *timed(lambda: (rules.check_all(cfg, layout), params.count_params(cfg.model),
                                     memory.estimate(cfg, layout)), repeat)[:2], ""))
        auto = compose(overrides + ["parallelism=auto"])
        lo, med, cands = timed(lambda: layout_search.search(auto), repeat)
        rows.append((f"{name}: parallelism=auto search", lo, med, f"{len(cands)} valid layouts"))
        lo, med, _ = timed(lambda: build_plan(auto), repeat)
        rows.append((f"{name}: plan with parallelism=auto", lo, med, ""))
    cli = [sys.executable, "-m", "qwen35rl.cli.plan", *CASES["397b a3_16node"], "parallelism=auto", "format=json"]
    lo, med, _ = timed(lambda: subprocess.run(cli, capture_output=True, cwd=ROOT, check=False), max(1, repeat // 2))
    rows.append(("`qwen35rl-plan` 397b a3_16node parallelism=auto (new process)", lo, med, "interpreter start included"))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    load = os.getloadavg()
    rows = measure(args.repeat)
    header = (f"machine: {platform.node()} {platform.machine()} {os.cpu_count()} CPUs, Python "
              f"{platform.python_version()}, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    if args.markdown:
        print(header + "\n\n| measurement | min (s) | median (s) | note |\n|---|---|---|---|")
        for name, lo, med, note in rows:
            print(f"| {name} | {lo:.3f} | {med:.3f} | {note} |")
    else:
        print(header)
        for name, lo, med, note in rows:
            print(f"{name:70s} min {lo:7.3f}s  median {med:7.3f}s  {note}")


if __name__ == "__main__":
    main()
