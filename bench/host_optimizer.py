"""The host side of an offloaded trainer's optimizer step (FSDP2 CPUOffloadPolicy), per variant, on this machine:
AdamW with torch's default for host tensors (a per-tensor loop of elementwise ops) against the fused kernel, and the
gradient norm through a float64 copy of each gradient against float32 norms of 4096-element rows.

    OMP_NUM_THREADS=1 .venv/bin/python bench/host_optimizer.py [--params-m 200] [--threads 1,2]

Prints seconds per call (median of 3) for `--params-m` million fp32 parameters in 2048-wide matrices; a 4B policy
is 20x the default size."""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from qwen35rl.engines import host_optimizer


class Backend:
    lr, betas, weight_decay = 1e-5, (0.9, 0.999), 0.01


def median_s(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params-m", type=int, default=200)
    ap.add_argument("--threads", default="1")
    args = ap.parse_args()
    rows = max(1, args.params_m * 1_000_000 // (2048 * 2048))
    params = [torch.nn.Parameter(torch.randn(2048, 2048) * 0.02) for _ in range(rows)]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    n = sum(p.numel() for p in params)
    print(f"{n / 1e6:.0f}M fp32 parameters, torch {torch.__version__}")
    for threads in (int(t) for t in args.threads.split(",")):
        with host_optimizer.torch_threads(threads):
            out = {}
            for name, on_host in (("default", False), ("fused", True)):
                opt = host_optimizer.adamw(params, Backend, on_host=on_host)
                opt.step()  # states allocated outside the timing
                out[f"adamw {name}"] = median_s(opt.step)
                del opt
            grads = [p.grad for p in params]
            out["norm float64 copy"] = median_s(lambda: host_optimizer.squared_norm(grads, False, torch.device("cpu")))
            out["norm rows"] = median_s(lambda: host_optimizer.squared_norm(grads, True, torch.device("cpu")))
        print(f"threads {threads}: " + ", ".join(f"{k} {v:.3f} s" for k, v in out.items()))


if __name__ == "__main__":
    main()
