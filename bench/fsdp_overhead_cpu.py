"""Host-side cost of FSDP2 at data-parallel size 1: the FSDP engine's log-prob passes and one update over the same
micro batches, as a plain module (no process group) and as FSDP2 in a gloo group of one. The model is the tiny
Qwen3.5 with the 0.8B architecture's 24 layers, so compute is small and the per-layer hook work shows.

  OMP_NUM_THREADS=1 python bench/fsdp_overhead_cpu.py
"""
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from qwen35rl.algo.loss import ActorLoss  # noqa: E402
from qwen35rl.config.layout import derive_layout
from qwen35rl.config.compose import compose  # noqa: E402
from qwen35rl.engines.fsdp_engine import FsdpTrainEngine  # noqa: E402
from qwen35rl.runtime.batching import Sequences, build_batch, chunk  # noqa: E402

LAYERS, ROWS, MICRO = 24, 16, 2


def engine():
    cfg = config()
    return FsdpTrainEngine(cfg, layout=derive_layout(cfg), rank=0, world_size=1, device="cpu")


def config():
    return compose(["model=qwen3_5_tiny", "hw=cpu", "hw.devices_per_node=1", f"model.num_hidden_layers={LAYERS}", "backend.mixed_precision=fp32",
                    "algorithm.use_kl_loss=false", "backend.gradient_checkpointing=false",
                    f"backend.micro_batch_size_per_device={MICRO}"])


def measure(engine, batches, repeats=3):
    """Best of `repeats`: seconds of the log-prob passes and of the update."""
    fwd, upd = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        for b in batches:
            engine.compute_log_probs(b)
        fwd.append(time.perf_counter() - t)
        t = time.perf_counter()
        engine.train_mini_batch(batches, ActorLoss.from_config(engine.cfg), {})
        upd.append(time.perf_counter() - t)
    return min(fwd), min(upd)


def main():
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    seqs = Sequences([torch.randint(0, 200, (8,), generator=g).tolist() for _ in range(ROWS)],
                     [torch.randint(0, 200, (8,), generator=g).tolist() for _ in range(ROWS)], advantages=[1.0] * ROWS)
    batches = [build_batch(m, 0) for m in chunk(seqs, MICRO)]
    calls = len(batches) * LAYERS
    results = {"plain module": measure(engine(), batches)}
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/init", rank=0, world_size=1)
        results["FSDP2, world 1"] = measure(engine(), batches)
        dist.destroy_process_group()
    print(f"| engine | log-prob passes ({len(batches)} micro batches) | per layer call | update | per layer call |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, (fwd, upd) in results.items():
        print(f"| {name} | {fwd * 1e3:.0f} ms | {fwd / calls * 1e6:.0f} us | {upd * 1e3:.0f} ms | {upd / calls * 1e6:.0f} us |")


if __name__ == "__main__":
    main()
