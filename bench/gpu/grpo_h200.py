"""The GRPO workload on an H200, measured: qwen35rl through its real CLI / driver, TRL's GRPOTrainer on the same
workload, and the memory estimate against measured peaks.

The workload (both sides): a random-init Qwen3.5-0.8B architecture (vocab 248,320, byte-level tokenizer), 16 prompts
of exactly 256 tokens (the synthetic copy-digit task behind a fixed system prompt) x n=8 samples of up to 512 tokens,
temperature 1, KL to a reference (k3, coefficient 0.001), AdamW lr 1e-6 / weight decay 0.01 / clip 1.0, constant LR,
one optimizer step per batch (micro batches of --micro), bf16 compute on fp32 master weights, no vLLM.

Subcommands (each writes JSON; `report` turns them into markdown and runs anywhere):
  peak      bf16 matmul TFLOP/s of the visible GPU
  qwen35rl  `python -m qwen35rl.cli.train <overrides>` in a subprocess; its metrics.jsonl is the result
  trl       trl.GRPOTrainer with per-phase timers (generate / old / ref log-probs, update) per optimizer step
  memory    estimated vs measured peaks (training, rollout) of the colocated worker for several configs, a decode
            micro-benchmark (eager / CUDA graph / transformers generate) and a kernel profile of one update
  report    bench/results tables from those files
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.gpu.workload import N, PROMPT_LEN, PROMPTS, RESPONSE_LEN, card_memory_gb, system_prompt, workload  # noqa: E402,F401


def write_json(path: str, data: Any) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)


# ================================================================================================ peak
def cmd_peak(args) -> None:
    import torch

    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    for _ in range(5):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    iters = 50
    start.record()
    for _ in range(iters):
        a @ b
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / iters
    tflops = 2 * 8192 ** 3 / seconds / 1e12
    out = {"device": torch.cuda.get_device_name(), "bf16_matmul_tflops": tflops, "shape": [8192, 8192, 8192],
           "torch": torch.__version__, "cuda": torch.version.cuda}
    print(json.dumps(out))
    write_json(args.out, out)


# ============================================================================================ qwen35rl
def cmd_qwen35rl(args) -> None:
    overrides = workload(model=args.model, hw=args.hw, devices=args.devices, micro=args.micro, ckpt=args.ckpt,
                         kl=not args.no_kl, backend=args.backend, prompts=args.prompts, steps=args.steps, peak_tflops=args.peak_tflops,
                         prompt_len=args.prompt_len, response_len=args.response_len,
                         memory_gb=card_memory_gb(args.hw), data=args.data)
    entry = args.entry
    if args.lengths == "realistic":  # the CLI with the hf rollout's responses cut to the drawn lengths
        if "trainer.launcher=local" not in args.extra or entry != "qwen35rl.cli.train":
            sys.exit("--lengths realistic runs bench.gpu.shaped_train: needs trainer.launcher=local and the CLI entry")
        entry = "bench.gpu.shaped_train"
    cmd = [sys.executable, "-m", entry, f"hydra.run.dir={args.run_dir}", *overrides, *args.extra]
    print("command:", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=str(ROOT))
    try:
        code: Any = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        proc.wait()
        code = "timeout"
    info = {"command": cmd, "exit_code": code, "wall_s": time.perf_counter() - t0, "overrides": overrides + args.extra}
    metrics = Path(args.run_dir) / "metrics.jsonl"
    info["steps"] = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    timeline = Path(args.run_dir) / "timeline.jsonl"  # placement=split: when each pool was busy
    if timeline.exists():
        info["timeline"] = [json.loads(line) for line in timeline.read_text().splitlines()]
    write_json(args.out, info)
    print(f"qwen35rl exit {code} after {info['wall_s']:.0f} s, {len(info['steps'])} steps", flush=True)


def descendants(pid: int) -> List[int]:
    """Every process below `pid` (from /proc: parent ids), children first found first."""
    children: Dict[int, List[int]] = defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children[int(stat.rsplit(")", 1)[1].split()[1])].append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(pid: int, grace_s: float = 10.0) -> None:
    """End a process and everything it started (Ray's local cluster: GCS, raylet, workers holding the GPU), by pid:
    SIGTERM, then SIGKILL for what is left after `grace_s`."""
    import signal

    procs = descendants(pid) + [pid]
    for p in procs:
        try:
            os.kill(p, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.time() + grace_s
    while time.time() < deadline and any(Path(f"/proc/{p}").exists() for p in procs):
        time.sleep(0.5)
    for p in procs:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ================================================================================================= trl
class PhaseTimer:
    """Wall time per phase name, synchronising the device at both ends (phases nest: callers subtract)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.seconds: Dict[str, float] = defaultdict(float)

    def wrap(self, name, fn, pick_name=None):
        import torch

        def timed(*a, **k):
            key = pick_name(*a, **k) if pick_name else name
            if self.cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                if self.cuda:
                    torch.cuda.synchronize()
                self.seconds[key] += time.perf_counter() - t0

        return timed


def cmd_trl(args) -> None:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from qwen35rl.config.compose import compose
    from qwen35rl.data import build_dataset
    from qwen35rl.data.synthetic import digit_reward
    from qwen35rl.models.build import build_model, save_hf
    from qwen35rl.models.tokenizer import build_tokenizer

    cuda = torch.cuda.is_available()
    cfg = compose(workload(model=args.model, hw=args.hw, micro=args.micro, ckpt=args.ckpt, kl=not args.no_kl,
                           prompts=args.prompts, steps=args.steps, prompt_len=args.prompt_len,
                           response_len=args.response_len, memory_gb=card_memory_gb(args.hw)))
    tok = build_tokenizer(cfg.model)
    model_dir = Path(args.work_dir) / "init_hf"
    t0 = time.perf_counter()
    # the same initial weights as qwen35rl's policy (same builder, seed and fp32 master dtype)
    save_hf(build_model(cfg.model, dtype=torch.float32, seed=int(cfg.trainer.seed)), tok, str(model_dir))
    save_s = time.perf_counter() - t0

    examples = build_dataset(cfg.data, tok, "train")
    texts = [tok.decode(ex.prompt_ids) for ex in examples]  # exactly the prompt token ids qwen35rl feeds
    data = Dataset.from_dict({"prompt": texts, "answer": [ex.answer for ex in examples]})

    def reward(prompts, completions, answer, **_):
        return [digit_reward(c, a) for c, a in zip(completions, answer)]

    rows = args.prompts * N
    conf = GRPOConfig(
        output_dir=str(Path(args.work_dir) / "out"), per_device_train_batch_size=args.micro,
        gradient_accumulation_steps=rows // args.micro, num_generations=N, max_completion_length=args.response_len,
        temperature=1.0, top_p=1.0, beta=0.0 if args.no_kl else 0.001, epsilon=0.2, loss_type="dapo",
        learning_rate=1e-6, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0,
        lr_scheduler_type="constant", warmup_steps=0, max_steps=args.steps, logging_steps=1, report_to="none",
        save_strategy="no", bf16=cuda, use_cpu=not cuda, gradient_checkpointing=args.ckpt,
        model_init_kwargs={"dtype": torch.float32}, seed=1, shuffle_dataset=False, use_vllm=False,
        dataloader_num_workers=0)
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=reward, args=conf, train_dataset=data,
                          processing_class=tok)
    timer = PhaseTimer(cuda)

    def logp_phase(model, *a, **k):
        if model is trainer.ref_model:
            return "ref"
        return "old_log_prob" if not torch.is_grad_enabled() else "update_forward"

    generate = trainer._generate_single_turn
    if args.lengths == "realistic":  # the same drawn lengths by row as qwen35rl's (prompt-major rows there too)
        from bench.gpu.lengths import response_lengths, shape

        plain_generate, calls = generate, [0]

        def generate(*a, **k):
            completion_ids, logprobs = plain_generate(*a, **k)
            lengths = response_lengths(len(completion_ids), args.response_len, calls[0])
            calls[0] += 1
            return shape(completion_ids, lengths, trainer.eos_token_ids[0]), logprobs
    trainer._generate_single_turn = timer.wrap("gen", generate)
    trainer._get_per_token_logps_and_entropies = timer.wrap("", trainer._get_per_token_logps_and_entropies, logp_phase)
    trainer._generate_and_score_completions = timer.wrap("gen_score_logps", trainer._generate_and_score_completions)
    steps: List[Dict[str, Any]] = []
    out = {"config": conf.to_dict(), "save_init_s": save_s, "steps": steps, "model_dtype": str(trainer.model.dtype)}

    class StepTimes(TrainerCallback):
        def on_step_begin(self, *_a, **_k):
            if cuda:
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()
            timer.seconds.clear()

        def on_step_end(self, _args, state, *_a, **_k):
            if cuda:
                torch.cuda.synchronize()
            total = time.perf_counter() - self.t0
            s = dict(timer.seconds)
            row = {"step": state.global_step, "step_s": total, "gen_s": s.get("gen", 0.0),
                   "old_log_prob_s": s.get("old_log_prob", 0.0), "ref_s": s.get("ref", 0.0),
                   "update_s": total - s.get("gen_score_logps", 0.0),
                   "score_other_s": s.get("gen_score_logps", 0.0) - s.get("gen", 0.0) - s.get("ref", 0.0)
                   - s.get("old_log_prob", 0.0),
                   "max_memory_allocated_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None,
                   "max_memory_reserved_gib": torch.cuda.max_memory_reserved() / 2 ** 30 if cuda else None}
            steps.append(row)
            print("trl step", json.dumps(row), flush=True)
            write_json(args.out, out)

        def on_log(self, _args, state, control, logs=None, **_k):
            if logs and steps:
                steps[-1].setdefault("logs", {}).update({k: v for k, v in logs.items() if isinstance(v, (int, float))})
                write_json(args.out, out)

    trainer.add_callback(StepTimes())
    t0 = time.perf_counter()
    trainer.train()
    out["train_wall_s"] = time.perf_counter() - t0
    write_json(args.out, out)


# ============================================================================================== memory
MEMORY_GROUPS = [
    # one colocated worker per (gradient checkpointing, KL) pair; shapes measured on it in turn:
    # (name, micro batch, prompts, prompt_len, response_len). Long sequences come from long prompts, so that no
    # shape decodes more than 512 steps (an eager decode step costs about as much at 8 rows as at 128).
    (False, True, [("m16_s768_nockpt_kl", 16, 2, 256, 512), ("m4_s1280_nockpt_kl", 4, 1, 768, 512)]),
    (True, False, [("m8_s768_ckpt_nokl", 8, 2, 256, 512), ("m2_s2304_ckpt_nokl", 2, 1, 1792, 512)]),
    (True, True, [("m16_s768_ckpt_kl", 16, 2, 256, 512)]),
]
SMOKE_GROUP = (False, True, [("smoke_m8_s320_kl", 8, 2, 256, 64)])
"""A short check of the whole worker path (decode graph, log-probs, updates) before the long runs."""


def _gib(n: float) -> float:
    return n / 2 ** 30


class DeviceMemory:
    """torch.cuda's allocator counters in GiB; zeros without CUDA (so the flow can be checked on a CPU)."""

    def __init__(self):
        import torch

        self.torch, self.cuda = torch, torch.cuda.is_available()

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def reset_peak(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()
            self.torch.cuda.reset_peak_memory_stats()

    def allocated(self) -> float:
        return _gib(self.torch.cuda.memory_allocated()) if self.cuda else 0.0

    def peak(self) -> float:
        return _gib(self.torch.cuda.max_memory_allocated()) if self.cuda else 0.0

    def alloc_retries(self) -> int:
        """How often the caching allocator had to free its cache and retry a cudaMalloc (memory pressure)."""
        return int(self.torch.cuda.memory_stats().get("num_alloc_retries", 0)) if self.cuda else 0

    def reserved_peak(self) -> float:
        return _gib(self.torch.cuda.max_memory_reserved()) if self.cuda else 0.0

    def empty_cache(self) -> None:
        if self.cuda:
            self.torch.cuda.empty_cache()


def measure_group(ckpt: bool, kl: bool, shapes, args, port: int, results: List[Dict[str, Any]]) -> None:
    """One colocated worker (FSDP over a world-1 process group, hf rollout, reference when KL is on), driven like
    the GRPO loop for each shape in turn: generate, log-probs, updates (two on the first shape, so that the Adam
    states exist); peak allocator memory per phase, against the estimate of that shape's config."""
    from omegaconf import OmegaConf

    from bench.gpu.report import rollout_measurement
    from qwen35rl.config.compose import compose
    from qwen35rl.config.layout import derive_layout
    from qwen35rl.config.memory import estimate
    from qwen35rl.data import build_dataset
    from qwen35rl.engines import gdn_kernels
    from qwen35rl.runtime.batching import Sequences
    from qwen35rl.runtime.worker import PolicyWorker

    def overrides(micro, prompts, p_len, r_len):
        return workload(model=args.model, hw=args.hw, micro=micro, ckpt=ckpt, kl=kl, prompts=prompts,
                        prompt_len=p_len, response_len=r_len, steps=2, memory_gb=card_memory_gb(args.hw))

    mem = DeviceMemory()
    # the GDN kernels this process runs (transformers picks fla when it can import it)
    gdn = "fla" if mem.cuda and gdn_kernels.fla_version() is not None else "torch"
    _, micro0, prompts0, p0, r0 = shapes[0]
    cfg = compose(overrides(micro0, prompts0, p0, r0))
    worker = PolicyWorker(OmegaConf.to_container(cfg, resolve=True), layout=derive_layout(cfg), rank=0,
                          world_size=1, local_rank=0, run_dir="/tmp/qwen35rl-memory", optimizer_steps=10)
    mem.reset_peak()
    t0 = time.perf_counter()
    worker.init_distributed("127.0.0.1", port)
    worker.sync_weights()
    mem.sync()
    built = {"after_build_gib": mem.allocated(), "build_peak_gib": mem.peak(), "build_s": time.perf_counter() - t0}
    for i, (name, micro, prompts, p_len, r_len) in enumerate(shapes):
        if args.tiny:  # the flow on a CPU: short sequences
            prompts, p_len, r_len = 1, 32, 8
        ov = overrides(micro, prompts, p_len, r_len)
        cfg = compose(ov)
        est = estimate(cfg, derive_layout(cfg), gdn=gdn)
        worker.cfg.backend.micro_batch_size_per_device = micro
        worker.cfg.data.max_response_length = r_len
        res: Dict[str, Any] = {"name": name, "overrides": ov, "gdn": gdn, "estimate": est.to_dict(), **built}
        results.append(res)
        prompt_ids = [ex.prompt_ids for ex in build_dataset(cfg.data, worker.tokenizer, "train")[:prompts]]
        params = dict(n=N, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=r_len, seed=3)

        def peak(fn, key):
            gc.collect()
            mem.reset_peak()
            base = mem.allocated()
            t = time.perf_counter()
            out = fn()
            mem.sync()
            res[key] = {"peak_gib": mem.peak(), "reserved_gib": mem.reserved_peak(), "before_gib": base,
                        "after_gib": mem.allocated(), "s": time.perf_counter() - t}
            return out

        result = peak(lambda: worker.generate(prompt_ids, params), "generate")
        res["decode"] = vars(worker.rollout.stats)
        seqs = Sequences([p for p in prompt_ids for _ in range(N)], result.response_ids)
        res["response_tokens"] = seqs.token_count()
        old = peak(lambda: worker.compute_log_probs(seqs), "log_probs")
        if worker.ref is not None:
            seqs.ref_log_probs = peak(lambda: worker.compute_log_probs(seqs, reference=True), "ref_log_probs")
        seqs.old_log_probs = old
        seqs.advantages = [(-1.0) ** k for k in range(len(seqs))]
        scale = {"global_tokens": float(seqs.token_count()), "global_seqs": float(len(seqs))}
        if i == 0:
            res["update_first_metrics"] = peak(lambda: worker.update_actor(seqs, scale), "update_first")
        res["update_metrics"] = peak(lambda: worker.update_actor(seqs, scale), "update")
        if i == 0:  # a generation in the steady state: AdamW's states exist, the reference's root is gathered
            worker.sync_weights()
            peak(lambda: worker.generate(prompt_ids, params), "generate_after_update")
        res["measured_train_peak_gib"] = max(res[k]["peak_gib"] for k in ("log_probs", "ref_log_probs", "update")
                                             if k in res)
        res["measured_rollout_peak_gib"] = rollout_measurement(res)["peak_gib"]
        if mem.cuda:
            res["train_error"] = est.train_peak_gib / res["measured_train_peak_gib"] - 1
            res["rollout_error"] = est.rollout_peak_gib / res["measured_rollout_peak_gib"] - 1
        print(f"memory {name}: train est {est.train_peak_gib:.2f} vs {res['measured_train_peak_gib']:.2f} GiB, "
              f"rollout est {est.rollout_peak_gib:.2f} vs {res['measured_rollout_peak_gib']:.2f} GiB", flush=True)
        if args.profile and i == 0:  # one update, one reference pass, one generation of 64 tokens (graph replays)
            res["profile"] = profile_call(lambda: worker.update_actor(seqs, scale))
            if worker.ref is not None:
                res["profile_ref"] = profile_call(lambda: worker.compute_log_probs(seqs, reference=True))
            short = dict(params, max_new_tokens=min(64, r_len))
            res["profile_generate"] = profile_call(lambda: worker.generate(prompt_ids, short))
        if args.decode_bench and i == 0:
            write_json(args.out, results)  # the profiles stay if the benchmark's compilation outlasts the time limit
            res["decode_bench"] = bench_decode(worker, prompt_ids, N, args.decode_tokens)
        write_json(args.out, results)
    worker.actor = worker.ref = worker.rollout = None  # free the device for the next worker
    gc.collect()
    mem.empty_cache()


def profile_call(fn) -> str:
    """Top kernels of one call (time share), as text: CUDA kernels and the host ops that launched them; on CUDA then
    the host ops by their own CPU time (where a host-bound call spends it)."""
    from torch.profiler import ProfilerActivity, profile

    mem = DeviceMemory()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if mem.cuda else [])
    with profile(activities=activities) as prof:
        fn()
        mem.sync()
    table = lambda key, rows: prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=70)
    if not mem.cuda:
        return table("cpu_time_total", 30)
    return table("cuda_time_total", 30) + "\n\nby self CPU time:\n" + table("self_cpu_time_total", 25)


def bench_decode(worker, prompts, n, new_tokens: int) -> Dict[str, Any]:
    """Decode of all prompts x n rows: ms per decode step of our loop with a CUDA graph, run eagerly, with its decode
    step compiled (`rollout.compile_decode`) and captured, and of transformers `generate` (dynamic cache, as TRL
    generates). Per step = (T(2k) - T(k)) / k over two generations of k and 2k new tokens after a warm-up at k
    (which compiles and autotunes): both timed generations pay one prefill, one graph capture and the eager steps
    before it, so the difference is k replayed steps. Next to them the floor of reading the weights once per step
    (bf16 bytes / 4.8 TB/s, the H200's HBM bandwidth)."""
    import torch
    from transformers import GenerationConfig

    from qwen35rl.engines.base import RolloutRequest

    eng, mem = worker.rollout, DeviceMemory()
    rows = [p for p in prompts for _ in range(n)]
    ids = torch.tensor(rows, device=eng.device)
    k = max(32, new_tokens)

    def timed(fn) -> float:
        mem.sync()
        t0 = time.perf_counter()
        fn()
        mem.sync()
        return time.perf_counter() - t0

    def ours(tokens):
        return lambda: eng.generate(RolloutRequest(prompt_ids=prompts, n=n, temperature=1.0, max_new_tokens=tokens, seed=1))

    def hf(tokens):
        gen = GenerationConfig(do_sample=True, temperature=1.0, top_p=1.0, top_k=None, max_new_tokens=tokens,
                               min_new_tokens=tokens, pad_token_id=eng.pad_token_id, eos_token_id=eng.eos_token_ids)

        def run():
            with torch.no_grad():
                eng.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen)
        return run

    weight_bytes = sum(p.numel() * p.element_size() for p in eng.model.parameters())
    out: Dict[str, Any] = {"rows": len(rows), "prompt_len": len(rows[0]), "k": k, "method": "(T(2k) - T(k)) / k",
                           "weight_gib": weight_bytes / 2 ** 30, "floor_ms": weight_bytes / 4.8e12 * 1e3}
    # compiled last: its compilation is the longest warm-up
    for label, graphs, compiled in (("graph", True, False), ("eager", False, False), ("hf_generate", None, False),
                                    ("compiled_graph", True, True)):
        if graphs is not None:
            eng.cuda_graphs, eng.compile_decode = graphs, compiled
        make = hf if graphs is None else ours
        try:
            out[label] = {"warmup_s": timed(make(k))}
            short, long = timed(make(k)), timed(make(2 * k))
        except Exception as e:  # noqa: BLE001 - record it and measure the other ways
            out[label] = {"error": f"{type(e).__name__}: {e}"[:1000]}
            continue
        out[label].update(k_s=short, two_k_s=long, ms_per_step=(long - short) / k * 1e3)
        if graphs is not None:
            out[label].update(captured=eng.stats.cuda_graph, graph_error=eng.stats.graph_error, steps=eng.stats.steps)
        print(f"decode bench {label}", json.dumps(out[label]), flush=True)
    eng.cuda_graphs, eng.compile_decode = True, False
    print("decode bench", json.dumps(out), flush=True)
    return out


def cmd_memory(args) -> None:
    import torch.distributed as dist

    results: List[Dict[str, Any]] = []
    groups = [SMOKE_GROUP] if args.smoke else MEMORY_GROUPS
    port = 29600 + os.getpid() % 1000
    for g, (ckpt, kl, shapes) in enumerate(groups):
        if g:  # the profile and the decode benchmark once
            args.profile = args.decode_bench = False
        try:
            measure_group(ckpt, kl, shapes, args, port, results)
        except Exception as e:  # noqa: BLE001 - record and go on with the next worker
            import traceback

            traceback.print_exc()
            results.append({"group": [ckpt, kl], "error": f"{type(e).__name__}: {e}"[:2000]})
            gc.collect()
            DeviceMemory().empty_cache()
        write_json(args.out, results)
    if dist.is_initialized():
        dist.destroy_process_group()


# ============================================================================================== report
def cmd_report(args) -> None:
    from bench.gpu.report import render

    print(render(Path(args.results)))


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("peak")
    s.add_argument("--out", required=True)
    for name in ("qwen35rl", "trl", "memory"):
        s = sub.add_parser(name)
        s.add_argument("--out", required=True)
        s.add_argument("--model", default="qwen3_5_0_8b")
        s.add_argument("--hw", default="gpu_1x")
        s.add_argument("--micro", type=int, default=16)
        s.add_argument("--ckpt", action="store_true", help="gradient checkpointing")
        s.add_argument("--no-kl", action="store_true")
        s.add_argument("--prompts", type=int, default=PROMPTS)
        s.add_argument("--prompt-len", type=int, default=PROMPT_LEN)
        s.add_argument("--response-len", type=int, default=RESPONSE_LEN)
        s.add_argument("--steps", type=int, default=4)
    for name in ("qwen35rl", "trl"):
        sub.choices[name].add_argument("--lengths", default="cap", choices=("cap", "realistic"),
                                       help="responses as sampled (all at the cap from a random init) or cut to "
                                            "the drawn lengths of bench/gpu/lengths.py")
    sub.choices["qwen35rl"].add_argument("--devices", type=int, default=1)
    sub.choices["qwen35rl"].add_argument("--backend", default="fsdp", choices=("fsdp", "megatron"))
    sub.choices["qwen35rl"].add_argument("--data", default="synthetic", help="data config (geo3k: images)")
    sub.choices["qwen35rl"].add_argument("--entry", default="qwen35rl.cli.train",
                                         help="module run with the overrides (bench.gpu.vl_device_shim: the CLI with "
                                              "the Megatron VL engine's device stop-gap)")
    sub.choices["qwen35rl"].add_argument("--run-dir", required=True)
    sub.choices["qwen35rl"].add_argument("--peak-tflops", type=float, default=None)
    sub.choices["qwen35rl"].add_argument("--timeout", type=float, default=None, help="seconds; then the run's "
                                         "process tree is ended and the steps logged so far are kept")
    sub.choices["qwen35rl"].add_argument("extra", nargs="*", help="more Hydra overrides")
    sub.choices["trl"].add_argument("--work-dir", required=True)
    sub.choices["memory"].add_argument("--profile", action="store_true")
    sub.choices["memory"].add_argument("--decode-bench", action="store_true")
    sub.choices["memory"].add_argument("--tiny", action="store_true", help="short sequences (checking the flow on a CPU)")
    sub.choices["memory"].add_argument("--smoke", action="store_true", help="only the short smoke case")
    sub.choices["memory"].add_argument("--decode-tokens", type=int, default=32)
    s = sub.add_parser("report")
    s.add_argument("results")
    args = p.parse_args(argv)
    {"peak": cmd_peak, "qwen35rl": cmd_qwen35rl, "trl": cmd_trl, "memory": cmd_memory, "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    main()
