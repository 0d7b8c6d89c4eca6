"""Packed against padded micro batches in the FSDP engine on one device (`backend.remove_padding`): a log-prob pass
and an update over the same rows, whose response lengths are spread uniformly between --min-response and
--max-response as a GRPO batch's are (rows end at different lengths). Three modes: padded and packed micro batches
of --micro rows, and packed micro batches filled up to the tokens of --micro padded rows
(`backend.dynamic_batch_size`: fewer, fuller forward calls). Reports seconds per phase, peak memory and how far each
mode's log-probs are from the padded ones. Results: bench/results/h200.md.

  python bench/gpu/packing.py --out packing.json            (CUDA with flash-linear-attention: the 0.8B architecture)
  python bench/gpu/packing.py --out packing.json --tiny     (the flow on a CPU: tiny model, packing forced on)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def workload(args) -> List[str]:
    return [f"model={args.model}", "model.init=random", "model.tokenizer=byte", f"hw={args.hw}",
            "hw.devices_per_node=1", "backend=fsdp", "rollout=hf", "algorithm.use_kl_loss=false",
            "backend.gradient_checkpointing=false", f"backend.micro_batch_size_per_device={args.micro}",
            f"data.max_prompt_length={args.prompt_len}", f"data.max_response_length={args.max_response}",
            "backend.lr=1e-6"]


def rows(args, vocab: int):
    import torch

    from qwen35rl.runtime.batching import Sequences

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.min_response, args.max_response + 1, (args.rows,), generator=g).tolist()
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.rows)]
    responses = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    return Sequences(prompts, responses, advantages=[(-1.0) ** k for k in range(args.rows)])


MODES = ("padded", "packed", "packed_by_tokens")


def micro_groups(seqs, args, mode: str) -> List[List[int]]:
    from qwen35rl.runtime.micro_batches import fixed_groups, token_budget_groups

    if mode != "packed_by_tokens":
        return fixed_groups(len(seqs), args.micro)
    return token_budget_groups(seqs.lengths(), args.micro * (args.prompt_len + args.max_response), "packed")


def measure(cfg, seqs, args, mode: str) -> Dict[str, Any]:
    import torch

    from qwen35rl.algo.loss import ActorLoss
    from qwen35rl.engines import fsdp_engine
    from qwen35rl.engines.packed_attention import use_packed_attention
    from qwen35rl.config.layout import derive_layout
    from qwen35rl.engines.packed_gdn import enable_packing
    from qwen35rl.runtime.batching import build_batch, response_values

    device = "cuda" if torch.cuda.is_available() else "cpu"
    packed = mode != "padded"
    cfg.backend.remove_padding = packed
    engine = fsdp_engine.FsdpTrainEngine(cfg, layout=derive_layout(cfg), rank=0, world_size=1, device=device)
    if packed and not engine.pack:
        if not args.tiny:
            return {"mode": mode, "error": "packing is not supported here (CUDA with flash-linear-attention)"}
        engine.pack = True  # the CPU flow check: the torch paths of packed_gdn and packed_attention
        enable_packing()
        use_packed_attention(engine.lm)
    groups = micro_groups(seqs, args, mode)
    batches = [build_batch(seqs.take(g), 0, device) for g in groups]
    real = sum(int(b.attention_mask.sum()) for b in batches)
    padded = sum(b.attention_mask.numel() for b in batches)

    def timed(fn):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return out, time.perf_counter() - t

    res: Dict[str, Any] = {"mode": mode, "engine_packs": engine.pack, "micro_batches": len(batches), "tokens": real,
                           "padded_tokens": padded, "log_probs_s": [], "update_s": []}
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.repeats):  # the first repeat compiles and autotunes kernels
        logp, s = timed(lambda: [engine.compute_log_probs(b)[0] for b in batches])
        res["log_probs_s"].append(s)
        _, s = timed(lambda: engine.train_mini_batch(batches, ActorLoss.from_config(engine.cfg), {}))
        res["update_s"].append(s)
        print(f"[{time.strftime('%H:%M:%S')}] {mode}: log-probs {res['log_probs_s'][-1]:.2f} s, "
              f"update {s:.2f} s", flush=True)
    by_row: List[List[float]] = [[] for _ in range(len(seqs))]
    for g, lp, b in zip(groups, logp, batches):
        for i, row in zip(g, response_values(lp, b)):
            by_row[i] = row
    res["response_log_probs"] = [v for row in by_row for v in row]
    if device == "cuda":
        res["max_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return res


def write(path: str, results: Dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(results, indent=1, default=str))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--model", default=None)
    ap.add_argument("--rows", type=int, default=None)
    ap.add_argument("--micro", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--min-response", type=int, default=None)
    ap.add_argument("--max-response", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    big = dict(model="qwen3_5_0_8b", rows=128, micro=16, prompt_len=256, min_response=32, max_response=512)
    small = dict(model="qwen3_5_tiny", rows=8, micro=3, prompt_len=8, min_response=2, max_response=24)
    for k, v in (small if args.tiny else big).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.hw = "cpu" if args.tiny else "gpu_1x"

    import gc

    import torch
    import torch.distributed as dist

    from qwen35rl.config.compose import compose

    with tempfile.TemporaryDirectory() as d:
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(0)
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{d}/init", rank=0, world_size=1)
        cfg = compose(workload(args))
        seqs = rows(args, min(int(cfg.model.vocab_size), 256))
        results: Dict[str, Any] = {"args": vars(args), "overrides": workload(args), "modes": []}
        for mode in MODES:
            results["modes"].append(measure(compose(workload(args)), seqs, args, mode))
            write(args.out, results)  # a run cut short by its time limit keeps the finished mode
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        dist.destroy_process_group()
    padded, *others = results["modes"]
    a = torch.tensor(padded.pop("response_log_probs"))
    steady = lambda r, k: min(r[k][1:] or r[k])  # noqa: E731 - best steady repeat
    for other in others:
        if "error" in other:
            continue
        b = torch.tensor(other.pop("response_log_probs"))
        other["log_prob_diff_vs_padded"] = {"max": float((a - b).abs().max()), "mean": float((a - b).abs().mean())}
        other["speedup_vs_padded"] = {k: steady(padded, k) / steady(other, k) for k in ("log_probs_s", "update_s")}
    write(args.out, results)
    print(json.dumps({k: v for k, v in results.items() if k != "overrides"}, default=str)[:2000], flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
