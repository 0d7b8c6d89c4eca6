"""Ulysses SP against SP1 on the same batch, through the FSDP engine: log-probs, the time of a log-prob pass and of
an update, and peak memory per rank. One run per layout (torchrun for SP > 1), then `compare` of two runs.

    torchrun --nproc_per_node=2 bench/gpu/sp_gap.py run --sp 2 --out sp2.pt [--seq-len 4096]
    python bench/gpu/sp_gap.py run --sp 1 --out sp1.pt
    python bench/gpu/sp_gap.py compare sp1.pt sp2.pt --out gap.json

Rows are random byte tokens, half prompt and half response, the same for every layout (seeded); with SP every rank
holds the full log-probs, rank 0 writes them (with DP > 1, those of its share of the rows). `--hw cpu` checks the flow on a CPU (tiny model, gloo).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.gpu.grpo_h200 import DeviceMemory, card_memory_gb, workload, write_json  # noqa: E402


def sequences(rows: int, seq_len: int, seed: int = 0):
    import random

    from qwen35rl.runtime.batching import Sequences

    rng = random.Random(seed)
    half = seq_len // 2
    seqs = Sequences([[rng.randrange(3, 250) for _ in range(half)] for _ in range(rows)],
                     [[rng.randrange(3, 250) for _ in range(seq_len - half)] for _ in range(rows)])
    seqs.advantages = [(-1.0) ** k for k in range(rows)]
    seqs.old_log_probs = [[-5.5] * len(r) for r in seqs.response_ids]
    return seqs


def cmd_run(args) -> None:
    import torch
    import torch.distributed as dist

    from qwen35rl.algo.loss import ActorLoss
    from qwen35rl.config.compose import compose
    from qwen35rl.config.layout import derive_layout
    from qwen35rl.engines.fsdp_engine import FsdpTrainEngine
    from qwen35rl.runtime.batching import build_batch

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    cuda = args.hw != "cpu"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo")
    model = args.model if cuda else "qwen3_5_tiny"
    ov = workload(model=model, hw=args.hw, devices=world, micro=args.rows, kl=False, prompts=1,
                  prompt_len=args.seq_len // 2, response_len=args.seq_len - args.seq_len // 2, steps=2,
                  memory_gb=card_memory_gb(args.hw))
    layout_ov = [f"parallelism.sp={args.sp}", f"parallelism.fsdp_size={args.fsdp_size or world}"]
    cfg = compose(ov + layout_ov + args.extra)
    engine = FsdpTrainEngine(cfg, layout=derive_layout(cfg), rank=rank, world_size=world, device=device)
    seqs = sequences(args.rows, args.seq_len)
    n, dp, k = len(seqs), engine.dp_size, engine.dp_rank     # each SP group trains its share of the rows
    batch = build_batch(seqs.select(k * n // dp, (k + 1) * n // dp), 0)
    scale = {"global_tokens": float(seqs.token_count()), "global_seqs": float(len(seqs))}
    mem = DeviceMemory()
    out = {"sp": args.sp, "world": world, "rows": args.rows, "seq_len": args.seq_len, "overrides": ov + layout_ov + args.extra,
           "dp": engine.dp_size,
           "logprob_s": [], "update_s": []}
    first = None  # the log-probs of the initial weights: what the layouts are compared on
    for _ in range(args.reps):
        mem.reset_peak()
        t0 = time.perf_counter()
        logp, _ = engine.compute_log_probs(batch)
        mem.sync()
        out["logprob_s"].append(time.perf_counter() - t0)
        out["logprob_peak_gib"] = mem.peak()
        first = logp.detach().float().cpu() if first is None else first
        mem.reset_peak()
        t0 = time.perf_counter()
        engine.train_mini_batch([batch], ActorLoss.from_config(engine.cfg), scale)
        mem.sync()
        out["update_s"].append(time.perf_counter() - t0)
        out["update_peak_gib"] = mem.peak()
    if rank == 0:
        print(f"sp {args.sp} world {world} {args.rows} x {args.seq_len}: log-probs {min(out['logprob_s']):.3f} s, "
              f"update {min(out['update_s'][1:] or out['update_s']):.3f} s, peak {out['update_peak_gib']:.1f} GiB",
              flush=True)
    if rank == 0:
        torch.save({**out, "logp": first, "response_mask": batch.response_mask.bool()}, args.out)
    if world > 1:
        dist.destroy_process_group()


def cmd_compare(args) -> None:
    import torch

    a, b = torch.load(args.a), torch.load(args.b)
    if a["logp"].shape != b["logp"].shape:
        sys.exit(f"different batches: {tuple(a['logp'].shape)} against {tuple(b['logp'].shape)} (same --rows, --seq-len)")
    mask = a["response_mask"]
    gap = (a["logp"].float() - b["logp"].float()).abs()[mask]
    res = {"a": {k: v for k, v in a.items() if k != "logp"}, "b": {k: v for k, v in b.items() if k != "logp"},
           "logprob_gap_max": gap.max().item(), "logprob_gap_mean": gap.mean().item(), "tokens": int(mask.sum())}
    write_json(args.out, res)
    print(f"log-prob gap sp {a['sp']} vs sp {b['sp']}: max {res['logprob_gap_max']:.4f}, mean "
          f"{res['logprob_gap_mean']:.5f} over {res['tokens']} tokens", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--sp", type=int, required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--model", default="qwen3_5_0_8b")
    r.add_argument("--hw", default="gpu_1x")
    r.add_argument("--fsdp-size", type=int, default=0, help="parallelism.fsdp_size (default: the world; less is HSDP)")
    r.add_argument("--rows", type=int, default=4)
    r.add_argument("--seq-len", type=int, default=4096)
    r.add_argument("--reps", type=int, default=2)
    r.add_argument("extra", nargs="*", help="more Hydra overrides")
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--out", required=True)
    args = p.parse_args()
    cmd_run(args) if args.cmd == "run" else cmd_compare(args)


if __name__ == "__main__":
    main()
