"""Seed spread of the embedded default (`qwen35rl-train` with no model arguments: qwen3_5_tiny on CPU, synthetic
task): runs it once per seed, one after the other, and prints a table of what each seed reached.

    OMP_NUM_THREADS=1 .venv/bin/python bench/seeds_cpu.py --seeds 1-5 --out /tmp/seeds \
        [--repeat 1] [--report bench/results/seeds_cpu.md --title "..."] [-- extra overrides...]

Each run is `qwen35rl-train trainer.output_root=<out> trainer.run_name=seed<N> trainer.seed=<N> [overrides]`; a run
directory that already holds a finished run (80 of 80 steps) is read, not run again (`--fresh` starts over).
`--repeat 1` runs the first seed a second time in `<out>/seed<N>_again` and compares the two: every logged reward
and validation score, and the final weights (sha256 of the exported model files).

Per seed: mean training reward (`critic/score/mean`) of the last 5 steps, greedy validation (`val/score/mean`) at
the last step and its best, the first step whose validation reached `--val-target` (0.95), and wall time.
Pass/fail is against `--reward-target` (0.85) and `--val-target` (0.95).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
_SCRIPT = Path(sys.executable).parent / "qwen35rl-train"
TRAIN = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "qwen35rl.cli.train"]


def parse_seeds(text: str) -> list:
    seeds = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        seeds += list(range(int(lo), int(hi or lo) + 1))
    return seeds


def read_rows(run_dir: Path) -> list:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def weights_digest(run_dir: Path) -> str:
    files = sorted(p for p in (run_dir / "final").rglob("*") if p.is_file() and p.suffix in (".safetensors", ".bin"))
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16] if files else "-"


STOPPED = (143, 130, -15, -2, -9, 137)
"""Exit codes of a run stopped from outside (SIGTERM / SIGINT / SIGKILL): it is resumed from its checkpoint."""


def train(out: Path, name: str, seed: int, overrides: list, fresh: bool, attempts: int = 5) -> dict:
    """One finished run of `seed`: read from `out/name` if it finished there, else run (a run stopped from outside
    is resumed from its newest checkpoint, which continues it exactly; the table marks its wall time as resumed)."""
    run_dir = out / name
    rows = read_rows(run_dir)
    wall, resumed = None, 0
    if fresh or not rows or not (run_dir / "final").exists():
        base = [*TRAIN, f"trainer.output_root={out}", f"trainer.run_name={name}", f"trainer.seed={seed}", *overrides]
        wall, restart = 0.0, fresh or not rows
        for attempt in range(attempts):
            cmd = [*base, "trainer.resume=never" if attempt == 0 and restart else "trainer.resume=auto"]
            start = time.perf_counter()
            proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            wall += time.perf_counter() - start
            if proc.returncode == 0:
                break
            if proc.returncode not in STOPPED or attempt == attempts - 1:
                sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
            resumed += 1
            print(f"{name}: stopped from outside (exit {proc.returncode}), resuming", file=sys.stderr, flush=True)
        (run_dir / "wall_s.txt").write_text(f"{wall:.1f} {resumed}\n")
        rows = read_rows(run_dir)
    elif (run_dir / "wall_s.txt").exists():
        parts = (run_dir / "wall_s.txt").read_text().split()
        wall, resumed = float(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    return {**summarise(run_dir, seed, rows, wall), "resumed": resumed}


def summarise(run_dir: Path, seed: int, rows: list, wall) -> dict:
    score = [r["critic/score/mean"] for r in rows]
    val = [(r["step"], r["val/score/mean"]) for r in rows if r.get("val/score/mean") is not None]
    return {
        "seed": seed, "run_dir": str(run_dir), "steps": len(rows),
        "reward_first5": sum(score[:5]) / len(score[:5]),
        "reward_last5": sum(score[-5:]) / len(score[-5:]),
        "val": val, "val_last": val[-1][1], "val_best": max(v for _, v in val),
        "wall_s": wall, "weights": weights_digest(run_dir),
        "scores": score,
    }


def first_reaching(val: list, target: float):
    return next((s for s, v in val if v >= target), None)


def table(results: list, reward_target: float, val_target: float) -> str:
    lines = [
        f"| seed | reward first 5 | reward last 5 | val at last step | best val | first step val >= {val_target} "
        "| wall time | pass |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ok = r["reward_last5"] >= reward_target and r["val_last"] >= val_target
        wall = f"{r['wall_s']:.0f} s" if r["wall_s"] else "-"
        wall += f" (resumed {r['resumed']}x)" if r.get("resumed") else ""
        lines.append(f"| {r['seed']} | {r['reward_first5']:.3f} | {r['reward_last5']:.3f} | {r['val_last']:.3f} "
                     f"| {r['val_best']:.3f} | {first_reaching(r['val'], val_target) or '-'} | {wall} "
                     f"| {'yes' if ok else 'no'} |")
    last5 = [r["reward_last5"] for r in results]
    vals = [r["val_last"] for r in results]
    passed = sum(r["reward_last5"] >= reward_target and r["val_last"] >= val_target for r in results)
    lines.append(f"| range | | {min(last5):.3f}-{max(last5):.3f} | {min(vals):.3f}-{max(vals):.3f} | | | "
                 f"| {passed} of {len(results)} |")
    return "\n".join(lines)


def curves(results: list) -> str:
    """Validation per seed at every test step, one row per seed."""
    steps = [s for s, _ in results[0]["val"]]
    head = "| seed | " + " | ".join(str(s) for s in steps) + " |"
    lines = [head, "|---" * (len(steps) + 1) + "|"]
    for r in results:
        lines.append(f"| {r['seed']} | " + " | ".join(f"{v:.2f}" for _, v in r["val"]) + " |")
    return "\n".join(lines)


def compare(a: dict, b: dict) -> str:
    same_scores = a["scores"] == b["scores"]
    same_val = a["val"] == b["val"]
    diff = [i + 1 for i, (x, y) in enumerate(zip(a["scores"], b["scores"])) if x != y]
    return (f"seed {a['seed']} twice: training rewards {'identical at every step' if same_scores else 'differ from step %d' % diff[0] if diff else 'differ'}, "
            f"validation {'identical' if same_val else 'different'}, final weights "
            f"{'identical' if a['weights'] == b['weights'] and a['weights'] != '-' else 'different'} "
            f"(sha256 {a['weights']} / {b['weights']})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="1-5")
    parser.add_argument("--out", type=Path, default=Path("/tmp/seeds"))
    parser.add_argument("--repeat", type=int, default=0, help="run the first seed this many more times and compare")
    parser.add_argument("--fresh", action="store_true", help="run again even where a finished run is found")
    parser.add_argument("--reward-target", type=float, default=0.85)
    parser.add_argument("--val-target", type=float, default=0.95)
    parser.add_argument("--report", type=Path, help="append the table to this markdown file")
    parser.add_argument("--title", default="")
    parser.add_argument("overrides", nargs="*", help="extra qwen35rl-train overrides")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in parse_seeds(args.seeds):
        results.append(train(args.out, f"seed{seed}", seed, args.overrides, args.fresh))
        r = results[-1]
        print(f"seed {seed}: reward last 5 {r['reward_last5']:.3f}, val {r['val_last']:.3f} "
              f"(best {r['val_best']:.3f}), {r['wall_s'] or 0:.0f} s", file=sys.stderr, flush=True)
    repeats = []
    for k in range(args.repeat):
        again = train(args.out, f"seed{results[0]['seed']}_again{k + 1}", results[0]["seed"], args.overrides,
                      args.fresh)
        repeats.append(compare(results[0], again))
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    command = " ".join(["qwen35rl-train", "trainer.seed=N", *args.overrides])
    text = "\n".join([
        f"- date: {time.strftime('%Y-%m-%d', time.gmtime())} (UTC)",
        f"- machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"load average after the runs {load}",
        f"- command: `{command}` (through `bench/seeds_cpu.py --seeds {args.seeds}`)",
        "",
        table(results, args.reward_target, args.val_target),
        "",
        "Greedy validation by step:",
        "",
        curves(results),
        *([""] + [f"- {line}" for line in repeats] if repeats else []),
    ])
    print(text)
    (args.out / "seeds.json").write_text(json.dumps(results, indent=1))
    if args.report:
        with args.report.open("a") as f:
            f.write(f"\n## {args.title}\n\n{text}\n" if args.title else f"\n{text}\n")


if __name__ == "__main__":
    main()
