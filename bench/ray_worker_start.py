"""How long Ray takes to give the driver two ready CPU workers that have imported torch and transformers, three ways
(each in a fresh local cluster, as `qwen35rl-train` starts one):

  per-actor-env   each actor gets runtime_env={"env_vars": ...} (what runtime/cluster.py does), so its runtime env
                  differs from that of the workers Ray prestarts for the job
  job-env         the same variables set once for the job (ray.init(runtime_env=...)), so that actors could take the
                  prestarted workers (whether they are faster for it is what this measures)
  job-env+hook    as job-env, plus a worker_process_setup_hook that imports torch + transformers in every worker as it
                  starts, while the driver does other work for `--driver-work` seconds (the plan, the data, the preflight)

    PYTHONPATH=. OMP_NUM_THREADS=1 RAY_AUTH_MODE=disabled .venv/bin/python bench/ray_worker_start.py [--repeat 3] [--driver-work 3]

Prints, per way, seconds from ray.init to both actors answering (ray.init's own time apart)."""
from __future__ import annotations

import argparse
import os
import statistics
import time

ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def preload() -> None:
    import torch  # noqa: F401
    import transformers  # noqa: F401


class Worker:
    def __init__(self) -> None:
        preload()

    def ready(self) -> int:
        return os.getpid()


def one(way: str, driver_work: float) -> dict:
    import ray

    runtime_env = {} if way == "per-actor-env" else {"env_vars": ENV}
    if way == "job-env+hook":
        # by name: a function of __main__ does not unpickle in the worker
        runtime_env["worker_process_setup_hook"] = "bench.ray_worker_start.preload"
    t0 = time.perf_counter()
    ray.init(num_cpus=3, include_dashboard=False, logging_level="ERROR", runtime_env=runtime_env or None)
    t_init = time.perf_counter() - t0
    time.sleep(driver_work)  # the driver's own work meanwhile (identical for every way)
    t1 = time.perf_counter()
    remote = ray.remote(num_cpus=1)(Worker)
    opts = {"runtime_env": {"env_vars": ENV}} if way == "per-actor-env" else {}
    actors = [remote.options(**opts).remote() for _ in range(2)]
    ray.get([a.ready.remote() for a in actors])
    t_workers = time.perf_counter() - t1
    ray.shutdown()
    return {"init_s": t_init, "workers_s": t_workers}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--driver-work", type=float, default=3.0)
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ways = ("per-actor-env", "job-env", "job-env+hook")
    results = {w: [] for w in ways}
    for _ in range(args.repeat):
        for w in ways:  # interleaved, so that the box's load falls on every way alike
            results[w].append(one(w, args.driver_work))
    print(f"| way | ray.init (median) | workers ready after the driver's {args.driver_work:g} s of work (median, min-max) |")
    print("|---|---|---|")
    for w in ways:
        ws = [r["workers_s"] for r in results[w]]
        print(f"| {w} | {statistics.median(r['init_s'] for r in results[w]):.2f} s | {statistics.median(ws):.2f} s "
              f"({min(ws):.2f}-{max(ws):.2f}) |")
    print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
