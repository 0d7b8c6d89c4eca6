"""One run of bench/gpu/vllm_runs.sh in numbers: steps, reward (first and last five steps), log-prob gap between
vLLM and the trainer (mean and max per step), weight sync and generation time, step time, and each phase's
measured device memory against the plan's estimate (plan.json beside metrics.jsonl).

    python3 bench/gpu/vllm_summary.py RUN_DIR [--json]"""
import json
import statistics
import sys
from pathlib import Path


def summary(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] \
        if (run / "metrics.jsonl").exists() else []
    plan = json.loads((run / "plan.json").read_text()) if (run / "plan.json").exists() else {}
    out: dict = {"run": run.name, "steps": len(rows)}
    if not rows:
        return out

    def col(key):
        return [r[key] for r in rows if isinstance(r.get(key), (int, float))]

    def mean(xs):
        return round(statistics.fmean(xs), 4) if xs else None

    score = col("critic/score/mean")
    out["reward_first5"], out["reward_last5"] = mean(score[:5]), mean(score[-5:])
    gap_mean, gap_max = col("rollout/logprob_diff_mean"), col("rollout/logprob_diff_max")
    out["logprob_gap_mean"] = {"median": round(statistics.median(gap_mean), 5), "max": round(max(gap_mean), 5)} \
        if gap_mean else None
    out["logprob_gap_max"] = {"median": round(statistics.median(gap_max), 4), "max": round(max(gap_max), 4)} \
        if gap_max else None
    for key in ("timing_s/step", "timing_s/gen", "timing_s/gen_wake", "timing_s/gen_generate", "timing_s/gen_sleep",
                "timing_s/sync_weights", "timing_s/update_actor"):
        xs = col(key)
        if xs:
            steady = xs[1:] or xs
            out[key] = {"first": round(xs[0], 2), "median_after_first": round(statistics.median(steady), 3)}
    mem = {}
    for key in rows[-1]:
        if key.startswith(("perf/device_memory_used_gb/", "perf/max_memory_allocated_gb/", "perf/memory_allocated_gb/",
                               "perf/memory_reserved_gb/", "perf/memory_default_pool")):
            xs = col(key)
            mem[key] = round(max(xs), 2)
    out["memory_gib_peak"] = mem
    est = plan.get("memory_gib") or {}
    if est:
        out["plan_gib"] = {"train_peak": round(est.get("train_peak", 0), 2),
                           "rollout_peak": round(est.get("rollout_peak", 0), 2),
                           "capacity": round(est.get("capacity", 0), 2),
                           "kept_by_trainer": round((est.get("terms") or {}).get("rollout/kept_by_trainer", 0), 2)}
        # the device's used memory holds the runtime's reserve (CUDA context, loaded kernels) beside the peak
        out["plan_gib"]["reserve"] = est.get("reserve")
        used_gen = mem.get("perf/device_memory_used_gb/gen")
        if used_gen:
            out["rollout_used_vs_plan"] = round(used_gen / (est["rollout_peak"] + (est.get("reserve") or 0)) - 1, 3)
    out["vllm"] = plan.get("vllm")
    return out


if __name__ == "__main__":
    s = summary(Path(sys.argv[1]))
    print(json.dumps(s) if "--json" in sys.argv else "SUMMARY " + json.dumps(s))
