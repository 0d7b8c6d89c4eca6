"""Soak on CPU: the embedded default run (`qwen35rl-train` with no model arguments) for a few hundred steps, once
straight through and once SIGKILLed at random moments and resumed each time; then

  - the final weights of both runs are compared bitwise (the run is deterministic on CPU),
  - driver and worker RSS early vs late in the straight run (growth),
  - after every kill: how long the killed run's processes (its session: driver, local Ray, workers) take to go
    away, and whether any is left after 15 s (then it is killed and counted).

    OMP_NUM_THREADS=1 RAY_AUTH_MODE=disabled .venv/bin/python bench/soak_cpu.py --steps 120 --kills 10 \
        --out /tmp/soak --report bench/results/soak_cpu.md

Only the driver is SIGKILLed (a crash, an OOM kill of the driver): cleaning up after it is the run's job.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from tests.processes import cmdline, session_pids  # noqa: E402

_SCRIPT = Path(sys.executable).parent / "qwen35rl-train"
TRAIN = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "qwen35rl.cli.train"]
GRACE_S = 15.0


def rss_mb(pid):
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def steps_logged(run):
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line)["step"])
        except (ValueError, KeyError):
            pass          # a line cut by the kill
    return out


def start(run, args, err):
    return subprocess.Popen([*TRAIN, f"hydra.run.dir={run}", *args], stdout=subprocess.DEVNULL,
                            stderr=open(err, "a"), start_new_session=True, env=dict(os.environ))


def wait_gone(sid, grace_s=GRACE_S):
    """Seconds until no process of session `sid` is left, and what was left after `grace_s` (then killed)."""
    t0 = time.monotonic()
    while session_pids(sid) and time.monotonic() - t0 < grace_s:
        time.sleep(0.1)
    elapsed = time.monotonic() - t0
    left = {pid: cmdline(pid) for pid in session_pids(sid)}
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return elapsed, left


def straight(run, args, sample_every_s=5.0):
    """The uninterrupted run, sampling driver and worker RSS; returns [(step, driver_mb, [worker_mb...])]."""
    proc = start(run, args, run.parent / "straight.err")
    samples = []
    while proc.poll() is None:
        time.sleep(sample_every_s)
        logged = steps_logged(run)
        workers = [p for p in session_pids(proc.pid) if "PolicyWorker" in cmdline(p)]
        d = rss_mb(proc.pid)
        if logged and d is not None:
            samples.append((logged[-1], d, [w for w in map(rss_mb, workers) if w is not None]))
    if proc.returncode != 0:
        raise SystemExit(f"straight run failed ({proc.returncode}): see {run.parent / 'straight.err'}")
    _, left = wait_gone(proc.pid)
    return samples, left


def interrupted(run, args, kills, rng, save_freq):
    """Kill the driver `kills` times at random moments (a random 0-3 checkpoint intervals after the attempt's first
    step), resume with the same command each time, then let the last attempt finish."""
    err = run.parent / "interrupted.err"
    events = []
    for i in range(kills + 1):
        proc = start(run, args, err)
        before = steps_logged(run)
        first = before[-1] if before else 0
        if i == kills:
            proc.wait()
            if proc.returncode != 0:
                raise SystemExit(f"final attempt failed ({proc.returncode}): see {err}")
            _, left = wait_gone(proc.pid)
            events.append({"attempt": i + 1, "resumed_at": first, "finished": True, "left": left})
            break
        while proc.poll() is None and not (len(steps_logged(run)) > len(before)):
            time.sleep(0.05)
        delay = rng.uniform(0, 3 * save_freq * 2.7)
        time.sleep(delay)
        if proc.poll() is not None:
            raise SystemExit(f"attempt {i + 1} ended before its kill ({proc.returncode}): see {err}")
        at = steps_logged(run)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        gone_s, left = wait_gone(proc.pid)
        events.append({"attempt": i + 1, "resumed_at": first, "killed_at_step": at[-1] if at else None,
                       "delay_s": round(delay, 1), "gone_s": round(gone_s, 1), "left": left})
        print(f"attempt {i + 1}: killed at step {events[-1]['killed_at_step']} after {delay:.1f} s; session gone "
              f"in {gone_s:.1f} s, left {len(left)}", flush=True)
    return events


def compare(a_dir, b_dir):
    import torch
    from safetensors.torch import load_file

    a, b = load_file(a_dir / "final" / "model.safetensors"), load_file(b_dir / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])], len(a)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--save-freq", type=int, default=5)
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("/tmp/qwen35rl-soak"))
    ap.add_argument("--report", type=Path, default=None)
    opts = ap.parse_args()
    args = [f"trainer.total_steps={opts.steps}", f"trainer.save_freq={opts.save_freq}", "trainer.test_freq=-1",
            "trainer.max_keep_checkpoints=2"]
    opts.out.mkdir(parents=True, exist_ok=True)
    a_dir, b_dir = opts.out / "straight", opts.out / "interrupted"
    if a_dir.exists() or b_dir.exists():
        raise SystemExit(f"{opts.out} holds an earlier soak: pick another --out")
    t0 = time.monotonic()
    samples, left_a = straight(a_dir, args)
    t_straight = time.monotonic() - t0
    print(f"straight: {opts.steps} steps in {t_straight:.0f} s", flush=True)
    t1 = time.monotonic()
    events = interrupted(b_dir, args, opts.kills, random.Random(opts.seed), opts.save_freq)
    t_interrupted = time.monotonic() - t1
    differing, n = compare(a_dir, b_dir)
    steps_b = steps_logged(b_dir)

    k = max(1, len(samples) // 10)
    early, late = samples[:k], samples[-k:]
    avg = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    d_early, d_late = avg([s[1] for s in early]), avg([s[1] for s in late])
    w_early, w_late = avg([sum(s[2]) / max(1, len(s[2])) for s in early]), avg([sum(s[2]) / max(1, len(s[2]))
                                                                              for s in late])
    killed = [e for e in events if not e.get("finished")]
    leftovers = sum(len(e["left"]) for e in events) + len(left_a)
    result = {
        "steps": opts.steps, "save_freq": opts.save_freq, "kills": opts.kills,
        "straight_s": round(t_straight), "interrupted_s": round(t_interrupted),
        "bitwise_identical": not differing, "differing_tensors": differing[:10], "tensors": n,
        "interrupted_steps_logged_once": steps_b == list(range(1, opts.steps + 1)),
        "driver_rss_mb": [round(d_early), round(d_late)], "worker_rss_mb": [round(w_early), round(w_late)],
        "rss_window_steps": [[early[0][0], early[-1][0]], [late[0][0], late[-1][0]]] if samples else None,
        "session_gone_s": [e["gone_s"] for e in killed], "killed_at_steps": [e["killed_at_step"] for e in killed],
        "leftover_processes": leftovers,
        "leftover_detail": [e["left"] for e in events if e["left"]] + ([left_a] if left_a else []),
    }
    print(json.dumps(result, indent=2), flush=True)
    if opts.report:
        cmd = " ".join(["OMP_NUM_THREADS=1 RAY_AUTH_MODE=disabled .venv/bin/python bench/soak_cpu.py", *sys.argv[1:]])
        opts.report.write_text(
            f"# CPU soak: kill -9 and resume, bitwise against an uninterrupted run\n\n"
            f"Date: {time.strftime('%Y-%m-%d %H:%M')}. Machine: {platform.node()}, {os.cpu_count()} CPU cores "
            f"(shared with other work), Python {platform.python_version()}.\n\nCommand:\n\n    {cmd}\n\n"
            f"Run: the embedded default (tiny model, CPU, 2 Ray workers) with `{' '.join(args)}`; the interrupted "
            f"run's driver is SIGKILLed {opts.kills} times at random moments (a random 0-3 checkpoint intervals "
            f"after the attempt's first step) and restarted with the same command (resume=auto).\n\n"
            f"| measure | value |\n|---|---|\n"
            f"| final weights, interrupted vs straight | "
            f"{'bitwise identical' if not differing else f'{len(differing)} of {n} tensors differ'} ({n} tensors) |\n"
            f"| steps logged once each (interrupted run) | {result['interrupted_steps_logged_once']} |\n"
            f"| wall time straight / interrupted | {t_straight:.0f} s / {t_interrupted:.0f} s |\n"
            f"| killed at steps | {result['killed_at_steps']} |\n"
            f"| driver RSS early -> late (straight) | {d_early:.0f} -> {d_late:.0f} MB "
            f"({d_late - d_early:+.0f} MB) |\n"
            f"| worker RSS early -> late (mean of workers) | {w_early:.0f} -> {w_late:.0f} MB "
            f"({w_late - w_early:+.0f} MB) |\n"
            f"| RSS windows (steps) | {result['rss_window_steps']} |\n"
            f"| seconds until the killed run's processes were gone | {result['session_gone_s']} |\n"
            f"| processes left after {GRACE_S:g} s (all attempts) | {leftovers} |\n\n"
            f"Raw:\n\n```json\n{json.dumps(result, indent=2)}\n```\n")
    return 0 if not differing and leftovers == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
