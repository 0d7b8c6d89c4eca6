"""The FSDP engine's training phases on one GPU, measured directly: a reference log-prob pass and an update (every
micro batch + AdamW) over one GRPO batch, through the worker the CLI runs (`PolicyWorker`), kernel change by
kernel change, on the all-at-cap and the realistic response lengths (`bench.gpu.lengths`). `--backend megatron
--variants built` measures the Megatron engine the same way; `--snapshot` says what holds the memory at the
update's peak.

    python bench/gpu/train_phases.py --out phases.json [--model qwen3_5_0_8b] [--micro 16] [--profile]

Variants are applied in turn to one worker (each keeps the ones before it): `torch` (the GDN convolution and the
log-prob head's chunk math eager), `conv` (the convolution, `short_conv`, through torch.compile), `head` (the head's
chunk math through torch.compile), `regions` (norms and MLPs compiled, as backend.compile_layers=true builds
them), `flanorm` (the GDN recurrence's own q/k norm instead of the convolution's, `gdn_layer.QK_NORM_IN_CONV`),
`fused` (the convolution's norm and fla's fused gates, `gdn_layer.FLA_FUSED_GATES`), `qknorm` (back to the
default: the convolution's norm, gates computed apart); the worker starts as the engine builds it (convolution and head compiled on CUDA); then a second worker
without FSDP at world size 1 (`plain`), and, with --padded, the same without packing. Each phase runs --reps times
per workload; the first run of a shape compiles and autotunes (reported apart), the rest are the steady state. Peak allocator memory per phase
next to the plan's estimate. MFU: FLOPs of `qwen35rl.runtime.flops` (6N per token plus attention and the GDN
recurrence; recompute not counted) over the bf16 matmul peak given with --peak-tflops.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.gpu.grpo_h200 import N, DeviceMemory, card_memory_gb, profile_call, workload, write_json  # noqa: E402
from bench.gpu.lengths import response_lengths  # noqa: E402

VARIANTS = ("torch", "conv", "head", "regions", "flanorm", "fused", "qknorm")
"""`built` (not among the defaults) measures the worker as the engine built it, changing nothing: the Megatron engine
(`--set backend=megatron`), whose kernels the other variants do not reach."""


def batch(workload_name: str, prompts: int, prompt_len: int, cap: int, seed: int = 0):
    """One GRPO batch of prompts x N rows: random prompt and response tokens (byte ids), response lengths all at the
    cap or drawn (`lengths`); old log-probs and alternating advantages so the update has a gradient."""
    import random

    from qwen35rl.runtime.batching import Sequences

    rows = prompts * N
    lengths = [cap] * rows if workload_name == "cap" else response_lengths(rows, cap, seed)
    rng = random.Random(seed)
    prompt_ids = [[rng.randrange(3, 250) for _ in range(prompt_len)] for _ in range(prompts)]
    seqs = Sequences([p for p in prompt_ids for _ in range(N)],
                     [[rng.randrange(3, 250) for _ in range(n)] for n in lengths])
    seqs.advantages = [(-1.0) ** k for k in range(rows)]
    return seqs, lengths


def timed(fn: Callable[[], Any], mem: DeviceMemory) -> Dict[str, float]:
    gc.collect()
    mem.reset_peak()
    retries = mem.alloc_retries()
    t0 = time.perf_counter()
    fn()
    mem.sync()
    return {"s": time.perf_counter() - t0, "peak_gib": mem.peak(), "reserved_peak_gib": mem.reserved_peak(),
            "alloc_retries": mem.alloc_retries() - retries}


def build(args, overrides_extra: List[str], port: int):
    from omegaconf import OmegaConf

    from qwen35rl.config.compose import compose
    from qwen35rl.config.layout import derive_layout
    from qwen35rl.runtime.worker import PolicyWorker

    ov = workload(model=args.model, hw=args.hw, micro=args.micro, ckpt=args.ckpt, kl=True, backend=args.backend,
                  prompts=args.prompts,
                  prompt_len=args.prompt_len, response_len=args.response_len, steps=2,
                  memory_gb=card_memory_gb(args.hw)) + args.set + overrides_extra
    cfg = compose(ov)
    worker = PolicyWorker(OmegaConf.to_container(cfg, resolve=True), layout=derive_layout(cfg), rank=0,
                          world_size=1, local_rank=0, run_dir="/tmp/qwen35rl-phases", optimizer_steps=100)
    worker.init_distributed("127.0.0.1", port)
    return worker, cfg, ov


def measure(worker, cfg, variant: str, args, results: List[Dict[str, Any]], out: str, profile: bool,
            layers_compiled: bool = False) -> None:
    from qwen35rl.config.layout import derive_layout
    from qwen35rl.config.memory import estimate
    from qwen35rl.engines import gdn_kernels
    from qwen35rl.runtime import flops

    mem = DeviceMemory()
    m = cfg.model
    if layers_compiled:  # compiled in place by `regions` (kept by the variants after it): estimated as built so
        from omegaconf import OmegaConf

        cfg = OmegaConf.merge(cfg, {"backend": {"compile_layers": True}})
    est = estimate(cfg, derive_layout(cfg), gdn="fla" if gdn_kernels.fla_version() else "torch")
    for wl in args.workloads:
        seqs, lengths = batch(wl, args.prompts, args.prompt_len, args.response_len)
        seq_lens = [args.prompt_len + n for n in lengths]
        fwd = flops.forward_flops(m, seq_lens)
        tokens = sum(seq_lens)
        res: Dict[str, Any] = {"variant": variant, "workload": wl, "tokens": tokens,
                               "response_tokens": sum(lengths), "slots_padded": len(seq_lens) * max(seq_lens),
                               "estimate_train_gib": est.train_peak_gib, "ref": [], "update": []}
        results.append(res)
        seqs.old_log_probs = worker.compute_log_probs(seqs)
        seqs.ref_log_probs = worker.compute_log_probs(seqs, reference=True)
        scale = {"global_tokens": float(seqs.token_count()), "global_seqs": float(len(seqs))}
        for _ in range(args.reps):
            res["ref"].append(timed(lambda: worker.compute_log_probs(seqs, reference=True), mem))
            res["update"].append(timed(lambda: worker.update_actor(seqs, scale), mem))
            write_json(out, results)
        steady = lambda key: min(r["s"] for r in res[key][1:]) if len(res[key]) > 1 else res[key][0]["s"]
        ref_s, upd_s = steady("ref"), steady("update")
        peak = args.peak_tflops * 1e12
        res.update(ref_s=ref_s, update_s=upd_s, first_ref_s=res["ref"][0]["s"], first_update_s=res["update"][0]["s"],
                   ref_mfu=fwd / ref_s / peak, update_mfu=3 * fwd / upd_s / peak,
                   train_mfu=4 * fwd / (ref_s + upd_s) / peak,
                   train_peak_gib=max(r["peak_gib"] for r in res["ref"] + res["update"]))
        res["estimate_error"] = est.train_peak_gib / res["train_peak_gib"] - 1 if res["train_peak_gib"] else None
        print(f"phases {variant:9s} {wl:9s} ref {ref_s:.3f} s ({res['ref_mfu']:.1%}) update {upd_s:.3f} s "
              f"({res['update_mfu']:.1%}) together {res['train_mfu']:.1%}  first {res['first_ref_s']:.1f}"
              f"+{res['first_update_s']:.1f} s  peak {res['train_peak_gib']:.1f} GiB (est {est.train_peak_gib:.1f})",
              flush=True)
        if args.snapshot:  # one more update under the allocator's history (slower: each allocation's stack)
            from bench.gpu.memory_snapshot import recording

            with recording() as rec:
                worker.update_actor(seqs, scale)
            res["snapshot_update"] = rec.summary()
            print(f"snapshot {variant} {wl}: " + rec.text(), flush=True)
        if profile:  # on the first --profile-rows rows: the same micro batches, fewer of them (torch's profiler
            # builds its event tree in Python, minutes for a 4B update of all rows)
            part = seqs.select(0, min(args.profile_rows or len(seqs), len(seqs)))
            part_scale = {"global_tokens": float(part.token_count()), "global_seqs": float(len(part))}
            res["profile_rows"] = len(part)
            res["profile_ref"] = profile_call(lambda: worker.compute_log_probs(part, reference=True))
            write_json(out, results)
            res["profile_update"] = profile_call(lambda: worker.update_actor(part, part_scale))
        write_json(out, results)


def apply_variant(worker, variant: str) -> None:
    from qwen35rl.engines import gdn_layer, packed_gdn
    from qwen35rl.engines.compile_regions import compile_layer_parts
    from qwen35rl.engines.fsdp_engine import decoder_layers

    if variant == "torch":
        packed_gdn.COMPILE = False
        for e in (worker.actor, worker.ref):
            e.module.compiled = False
    elif variant == "conv":
        packed_gdn.COMPILE = True
    elif variant == "head":
        for e in (worker.actor, worker.ref):
            e.module.compiled = True
    elif variant == "regions":
        for e in (worker.actor, worker.ref):
            compile_layer_parts(decoder_layers(e.lm))
    elif variant in ("flanorm", "fused", "qknorm"):  # the GDN forward's q/k norm and gates, on what ran before
        gdn_layer.QK_NORM_IN_CONV, gdn_layer.FLA_FUSED_GATES = variant != "flanorm", variant == "fused"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="qwen3_5_0_8b")
    p.add_argument("--backend", default="fsdp", help="megatron: with --variants built")
    p.add_argument("--hw", default="gpu_1x", help="cpu: check the flow on a CPU (tiny model, short rows)")
    p.add_argument("--micro", type=int, default=16)
    p.add_argument("--ckpt", action="store_true")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--response-len", type=int, default=512)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--workloads", default="cap,realistic")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--plain", action="store_true", help="then a worker without FSDP at world size 1")
    p.add_argument("--padded", action="store_true", help="then that worker without packing")
    p.add_argument("--profile", default="", help="variants to profile (comma-separated)")
    p.add_argument("--profile-rows", type=int, default=0, help="profile on this many of the rows (default: all)")
    p.add_argument("--peak-tflops", type=float, default=790.0)
    p.add_argument("--decode-tokens", type=int, default=0, help="last, the decode benchmark (k new tokens)")
    p.add_argument("--snapshot", action="store_true",
                   help="after the timed reps, one update under torch.cuda's allocation history: what is live at its "
                        "peak, by allocating frame (bench/gpu/memory_snapshot.py)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="one more override of the worker's config (repeatable), e.g. backend.dynamic_batch_size=true")
    args = p.parse_args()
    args.workloads = args.workloads.split(",")
    profiled = set(filter(None, args.profile.split(",")))
    results: List[Dict[str, Any]] = []
    port = 29700 + os.getpid() % 500
    worker, cfg, _ = build(args, [], port)
    layers_compiled = False
    for variant in filter(None, args.variants.split(",")):  # none: only the decode benchmark
        apply_variant(worker, variant)
        layers_compiled = layers_compiled or variant == "regions"
        measure(worker, cfg, variant, args, results, args.out, variant in profiled, layers_compiled)
    if args.plain or args.padded:
        from qwen35rl.engines.fsdp_engine import FsdpTrainEngine

        worker.actor = worker.ref = worker.rollout = None
        gc.collect()
        DeviceMemory().empty_cache()
        FsdpTrainEngine.shard_single_rank = False
        head = (["backend.use_torch_compile=true"] if "head" in args.variants else []) + (
            ["backend.compile_layers=true"] if "regions" in args.variants else [])
        if args.plain:
            worker, cfg, _ = build(args, head, port)
            measure(worker, cfg, "plain", args, results, args.out, "plain" in profiled)
        if args.padded:
            worker.actor = worker.ref = worker.rollout = None
            gc.collect()
            worker, cfg, _ = build(args, head + ["backend.remove_padding=false"], port)
            measure(worker, cfg, "padded", args, results, args.out, "padded" in profiled)
    if args.decode_tokens:  # on the last worker's rollout engine (the same hf engine whatever trains)
        from bench.gpu.grpo_h200 import bench_decode
        from qwen35rl.data import build_dataset

        prompt_ids = [ex.prompt_ids for ex in build_dataset(cfg.data, worker.tokenizer, "train")[:args.prompts]]
        results.append({"decode_bench": bench_decode(worker, prompt_ids, N, args.decode_tokens)})
        write_json(args.out, results)
    write_json(args.out, results)


if __name__ == "__main__":
    main()
