"""The training worker: one process per device holding this rank's shard of the policy (train engine) and, when KL
is on, the reference policy. Colocated (`placement=colocated`, the hybrid engine) it also holds a rollout engine with
the full policy for generation; with `placement=split` generation lives on its own pool (`rollout_worker`), and
training rank 0 sends the weights there over a communicator of their own (`weight_sync`).

The driver calls every worker at once (through the typed handles of `worker_groups`); collective methods
(log-probs, updates, weight sync, checkpoints, export) must be called on all ranks together. Arguments and results
are plain python (`batching.Sequences`, lists, dicts), so nothing here depends on how the driver transports them.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from qwen35rl.algo.loss import ActorLoss
from qwen35rl.config import engine_specs, vllm_facts
from qwen35rl.config.layout import Layout
from qwen35rl.config.schema import typed
from qwen35rl.engines.base import RolloutEngine, RolloutRequest, RolloutResult, TrainEngine
from qwen35rl.config.memory import log_prob_tree, trains_vision  # config rules: the modeling loads with the engines
from qwen35rl.runtime import checkpoint as ckpt
from qwen35rl.engines import kernel_cache
from qwen35rl.engines.host_optimizer import node_thread_share
from qwen35rl.runtime.batching import Sequences, build_batch, response_values
from qwen35rl.runtime.cluster import connected_ray, free_port, node_ip
from qwen35rl.runtime.micro_batches import fixed_groups, token_budget_groups
from qwen35rl.runtime.memory_peaks import MemoryPeaks
from qwen35rl.runtime.platform import require_stack, resolve_platform
from qwen35rl.runtime.quiet import quiet_known_warnings
from qwen35rl.runtime.timer import Timer

log = logging.getLogger(__name__)


def needs_reference(cfg: Any) -> bool:
    """A reference policy exists only when some KL term uses it."""
    return bool(cfg.algorithm.use_kl_loss or cfg.algorithm.use_kl_in_reward)


def accelerator_ids(platform: Any) -> List[str]:
    """The devices Ray gave this worker; outside Ray (trainer.launcher=local, tests, benchmarks) none: device 0."""
    ray = connected_ray()
    if ray is None:
        return []
    return list(ray.get_runtime_context().get_accelerator_ids().get(platform.ray_resource, []))


class PolicyWorker:
    def __init__(self, cfg: Union[DictConfig, Dict[str, Any]], *, layout: Layout, rank: int, world_size: int,
                 local_rank: int, run_dir: str, optimizer_steps: Optional[int] = None):
        """`cfg`, `layout`: the run's (`ResolvedRun`: the typed config and the layout every engine uses as is; a
        plain-python config, as scripts pass it, is typed here); `optimizer_steps`: of the whole run (the cosine LR
        schedule needs it); `run_dir`: shared by all nodes."""
        self.cfg = cfg if OmegaConf.is_config(cfg) else typed(cfg)
        if layout.world != world_size:
            raise ValueError(f"the layout has {layout.world} ranks, the worker group {world_size}")
        self.layout = layout
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.run_dir, self.optimizer_steps = Path(run_dir), optimizer_steps
        self.platform = resolve_platform(self.cfg)
        quiet_known_warnings(self.platform.device_type)  # e.g. the GPU-kernel fallback warnings of a CPU run
        require_stack(self.platform, self.cfg.rollout.engine)
        self.device = self.platform.torch_device(self.platform.local_device_index(accelerator_ids(self.platform)))
        self.memory = MemoryPeaks(self.platform.device_module())
        if self.platform.is_accelerator:  # before anything compiles: kernels cached for the next run
            kernel_cache.apply(self.cfg)
        self.actor: Optional[TrainEngine] = None
        self.ref: Optional[TrainEngine] = None
        self.rollout: Optional[RolloutEngine] = None
        self.tokenizer = None
        self.text_only = not trains_vision({"model": self.cfg.model, "data": self.cfg.data})
        self.processor = None
        """The model's processor when the policy sees images (its image processor builds the vision inputs)."""
        self.build_s: Dict[str, float] = {}

    # ---------------------------------------------------------------------------------------------- bring-up
    def rendezvous_address(self) -> Tuple[str, int]:
        """Address and a free port on this worker's node for torch.distributed (asked of rank 0)."""
        return node_ip(), free_port()

    def init_distributed(self, master_addr: str, master_port: int) -> None:
        """Join the process group with the platform's collective backend, then build the engines."""
        os.environ.update(MASTER_ADDR=str(master_addr), MASTER_PORT=str(master_port), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(self.local_rank))
        if not dist.is_initialized():
            dist.init_process_group(
                backend=self.platform.collective_backend, init_method=f"tcp://{master_addr}:{master_port}",
                rank=self.rank, world_size=self.world_size,
                timeout=timedelta(seconds=self.cfg.backend.dist_timeout_s))
        self._build_engines()

    def _build_engines(self) -> None:
        from qwen35rl.models.tokenizer import build_tokenizer

        cfg = self.cfg
        # Same seed on every rank: a random init must be the same model everywhere (and again on resume, for the
        # reference policy); per-step randomness comes from explicit seeds and the restored RNG state.
        torch.manual_seed(cfg.trainer.seed)
        self.tokenizer = build_tokenizer(cfg.model)
        if not self.text_only:
            from qwen35rl.models.processor import build_processor

            self.processor = build_processor(cfg.model, self.tokenizer)
        threads = torch.get_num_threads()
        if self.platform.is_accelerator:
            # Ray gives each worker one CPU (one torch thread); the CPU-side model init may use the node's share
            torch.set_num_threads(node_thread_share(cfg.hw.devices_per_node))
        timer = Timer()
        try:
            with timer(f"{cfg.backend.name} train engine"):
                self.actor = self._train_engine(reference=False)
            self.actor_loss = ActorLoss.from_config(cfg)
            if needs_reference(cfg):
                with timer("reference policy"):
                    self.ref = self._train_engine(reference=True)
            if not self.layout.split:  # split: the rollout pool generates (rollout_worker.RolloutWorker)
                self.rollout = self._rollout_engine(timer)
        finally:
            torch.set_num_threads(threads)
        self.build_s = dict(timer.seconds)

    def engine_build_s(self) -> Dict[str, float]:
        """Seconds each engine of this worker took to build (where a start-up's minutes go)."""
        return dict(self.build_s)

    def _train_engine(self, reference: bool) -> TrainEngine:
        engine_cls = engine_specs.load(engine_specs.train_engine(self.cfg).builder)
        # the reference starts from the policy's initial weights: copied where the engine can, else drawn or read again
        copy = {"init_from": self.actor} if reference and getattr(engine_cls, "copies_initial_weights", False) else {}
        return engine_cls(self.cfg, layout=self.layout, rank=self.rank, world_size=self.world_size, device=self.device,
                          reference=reference, total_steps=self.optimizer_steps, **copy)

    def data_shards(self) -> Dict[str, int]:
        """Which share of the data this worker takes. Training: its data-parallel rank (the ranks of one
        tensor/pipeline-parallel group take the same micro batches). Rollout: its rollout TP group (the ranks of
        one TP group generate the same prompts)."""
        rollout_tp = self.layout.rollout_tp if engine_specs.rollout_engine(self.cfg).tensor_parallel else 1
        return {"train_dp_rank": int(getattr(self.actor, "dp_rank", self.rank)),
                "train_dp_size": int(getattr(self.actor, "dp_size", self.world_size)),
                "rollout_group": self.rank // rollout_tp, "rollout_groups": self.world_size // rollout_tp}

    def _rollout_engine(self, timer: Optional[Timer] = None) -> RolloutEngine:
        """The driver syncs the policy's weights into the rollout engine before every generation (fresh or
        resumed), so with a random init the hf engine's model is only allocated, not initialised. `timer` gets the
        seconds of each part."""
        timer = timer or Timer()
        spec = engine_specs.rollout_engine(self.cfg)
        name = f"{self.cfg.rollout.engine} rollout engine"
        if not spec.own_weights:  # generates with a model the weight sync fills in place
            with timer(name):
                return hf_rollout_engine(self.cfg, self.device, self.tokenizer, self.processor, self.text_only)
        if self.cfg.model.init == "pretrained":
            model_dir = self.cfg.model.path
        else:  # an engine with its own weights starts from a checkpoint directory: the random init, written once
            model_dir = str(self.run_dir / ".rollout_init_hf")
            weights = not vllm_facts.starts_on_placeholders(self.cfg)
            with timer("rollout checkpoint written"):
                self.export_hf(model_dir, vision_form=self.text_only and self.cfg.model.vision is not None
                               and not installed_vllm_loads_text_checkpoint(), weights=weights)
                if not weights:
                    model_dir = shared_config_dir(model_dir, kernel_cache.cache_root(self.cfg) / "rollout_configs")
        with timer(name):
            return engine_specs.load(spec.builder)(self.cfg, model_dir, self.layout)

    @property
    def pad_token_id(self) -> int:
        return int(self.tokenizer.pad_token_id)

    # ------------------------------------------------------------------------------- weight sync (split)
    def join_weight_sync(self, host: str, port: int, world_size: int) -> None:
        """Split placement: training rank 0 joins the sync communicator as its rank 0 (the sender, the TCP store's
        host); the other training ranks take part in the export only."""
        from qwen35rl.runtime.weight_sync import WeightSyncGroup, collective_backend

        self.sync_group = None
        if self.rank == 0:
            self.sync_group = WeightSyncGroup(host, port, 0, world_size, collective_backend(self.platform.device_type),
                                              self.device, self.cfg.backend.dist_timeout_s)

    def send_weights(self) -> Dict[str, float]:
        """Collective on the training pool, with `RolloutWorker.receive_weights` on the rollout pool at the same time:
        the export gathers each bucket of full tensors on every rank (FSDP all-gathers, Megatron gathers TP/PP/EP
        shards into the Hugging Face layout), and rank 0 broadcasts it to the rollout workers."""
        self._trainers_on_device()
        buckets = self.actor.export_weights(self.cfg.rollout.weight_sync_bucket_mb, device=self.device)
        if self.rank != 0:
            for _ in buckets:  # the gather needs every rank; only rank 0 sends
                pass
            return {}
        return self.sync_group.send(buckets).as_dict()

    # ----------------------------------------------------------------------------------------------- rollout
    def generate(self, prompt_ids: List[List[int]], params: Dict[str, Any]) -> RolloutResult:
        """This rank's share of prompts, `params` = RolloutRequest fields (n, temperature, seed, ...)."""
        if not prompt_ids:
            return RolloutResult(response_ids=[], log_probs=[], finish_reasons=[])
        self._move_trainer_states("to the host", lambda e: e.offload_states())  # backend.*_offload
        timer = Timer()
        with timer("wake_s"):  # with the trainer's cached blocks returned to the device first
            self._wake_rollout()
        with self.memory.phase("gen"), timer("generate_s"):
            result = self.rollout.generate(RolloutRequest(prompt_ids=prompt_ids, **params))
        stats = getattr(self.rollout, "stats", None)  # the hf engine's DecodeStats; the vLLM engine has none
        if stats is not None:
            result.decode = dataclasses.asdict(stats)
        if self.cfg.rollout.free_cache_engine:  # give the memory back to the trainer until the next generation
            with timer("sleep_s"):
                self.rollout.sleep(self.cfg.rollout.sleep_level)
        result.decode.update(timer.seconds)
        return result

    def _wake_rollout(self) -> None:
        """Wake the rollout engine. Its pools (vLLM's KV cache) come back outside torch's caching allocator: the
        blocks the trainer's last phase left cached there are returned to the device first, else a wake after a
        few steps finds the device full of the allocator's cached free blocks (cuMem 'out of memory')."""
        device = self.platform.device_module() if self.platform.is_accelerator else None
        if device is not None and getattr(self.rollout, "asleep", False):
            import gc

            gc.collect()
            device.empty_cache()
            # the trainer's side, held against rollout/kept_by_trainer, plus the engine's weights when the weight
            # sync woke them (vLLM wakes its weights to load the policy's, its KV cache only now)
            self.memory.moment("before_wake")
        try:
            self.rollout.wake_up()
        except (RuntimeError, MemoryError) as e:
            if device is None or "out of memory" not in str(e).lower():
                raise
            free, total = device.mem_get_info()
            raise RuntimeError(
                f"waking the rollout engine ran out of device memory: {free / 2 ** 30:.1f} of {total / 2 ** 30:.1f} "
                f"GiB were free before it, {device.memory_reserved() / 2 ** 30:.1f} GiB held by this process's "
                f"allocator; the engine wants rollout.gpu_memory_utilization="
                f"{self.cfg.rollout.gpu_memory_utilization} of the device. Lower rollout.gpu_memory_utilization, "
                f"or offload the trainer's state during generation (backend.param_offload / optimizer_offload)") from e

    def sync_weights(self) -> None:
        """Collective: stream the policy's full weights into the rollout engine bucket by bucket (an engine that
        sleeps takes them asleep and wakes for the next generation)."""
        self._trainers_on_device()
        # Colocated engines share the trainer's device: the gathered tensors are handed over there (cast to the
        # engine's dtype on the device), without a round trip through the host. Through the host, the 0.8B's sync
        # into vLLM 0.26 took 2.1 s per step on an H100 (bench/results/vllm_gpu.md).
        buckets = self.actor.export_weights(self.cfg.rollout.weight_sync_bucket_mb, device=self.device)
        self.rollout.load_weights(buckets)

    # -------------------------------------------------------------------------------------------- training
    def compute_log_probs(self, seqs: Sequences, reference: bool = False) -> List[List[float]]:
        """Collective: per-response log-probs of the response tokens under the policy (or the reference)."""
        engine = self.ref if reference else self.actor
        self._trainers_on_device()
        groups = self.micro_batch_groups(seqs, engine, forward_only=True)
        computed = []
        with torch.no_grad(), self.memory.phase("ref" if reference else "old_log_prob"):
            for rows in groups:
                batch = build_batch(seqs.take(rows), self.pad_token_id, self.device, self._image_processor)
                computed.append((engine.compute_log_probs(batch)[0], batch))
        # read back once at the end: a read per micro batch would idle the device while the next one is launched
        out: List[List[float]] = [[] for _ in range(len(seqs))]
        for rows, (log_probs, batch) in zip(groups, computed):
            for i, values in zip(rows, response_values(log_probs, batch)):
                out[i] = values
        return out

    def update_actor(self, seqs: Sequences, global_scale: Dict[str, float]) -> Dict[str, float]:
        """Collective: one optimizer step over this rank's share of a mini batch, in micro batches."""
        self._trainers_on_device()
        with self.memory.phase("update_actor"):
            micro_batches = [build_batch(seqs.take(rows), self.pad_token_id, self.device, self._image_processor)
                             for rows in self.micro_batch_groups(seqs, self.actor)]
            return self.actor.train_mini_batch(micro_batches, self.actor_loss, dict(global_scale))

    def _move_trainer_states(self, where: str, move) -> None:
        """`move` (offload or reload) on the policy and the reference engine; logs what moved and how long it took."""
        t0 = time.perf_counter()
        moved = sum(move(engine) for engine in (self.actor, self.ref) if engine is not None)
        if moved:
            log.info("moved %.2f GiB of trainer state %s in %.2f s", moved / 2 ** 30, where, time.perf_counter() - t0)

    def _trainers_on_device(self) -> None:
        """Before any use of the train engines: what `generate` moved to the host comes back (no-op otherwise)."""
        self._move_trainer_states("back to the device", lambda e: e.reload_states())

    @property
    def _image_processor(self) -> Any:
        return None if self.processor is None else self.processor.image_processor

    def micro_batch_groups(self, seqs: Sequences, engine: Any, forward_only: bool = False) -> List[List[int]]:
        """Collective with `backend.dynamic_batch_size`: the row indices of each micro batch of this share
        (`runtime.micro_batches`). `forward_only` (the log-prob passes) cuts by `backend.log_prob_*` where set."""
        b = log_prob_tree({"backend": self.cfg.backend})["backend"] if forward_only else self.cfg.backend
        if not b["dynamic_batch_size"]:
            return fixed_groups(len(seqs), b["micro_batch_size_per_device"])
        return token_budget_groups(seqs.lengths(), b["max_tokens_per_device"], engine.micro_batch_layout,
                                   self._largest_over_ranks)

    def _largest_over_ranks(self, count: int) -> int:
        if not dist.is_initialized():
            return count
        t = torch.tensor([count], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    # ------------------------------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str) -> None:
        """Collective: model + optimizer shards (DCP) and this rank's RNG into the (temporary) checkpoint dir."""
        self._trainers_on_device()
        ckpt.save_engine_state(Path(path), self.actor)
        ckpt.save_rng(Path(path), self.rank, self.platform.device_module())
        self._barrier()

    def load_checkpoint(self, path: str) -> bool:
        """Collective. Returns whether this rank's RNG state was restored (False: saved with another world)."""
        self._trainers_on_device()
        ckpt.load_engine_state(Path(path), self.actor)
        restored = ckpt.load_rng(Path(path), self.rank, self.platform.device_module())
        self._barrier()
        return restored

    @staticmethod
    def _barrier() -> None:
        if dist.is_initialized():  # a single process without a group (tests) has nobody to wait for
            dist.barrier()

    def export_hf(self, path: str, vision_form: bool = False, weights: bool = True) -> None:
        """Collective: gather the full policy; rank 0 writes it in Hugging Face format. From a pretrained checkpoint
        the policy is written over a copy of it (`models.export`), so it loads as that checkpoint's type with what
        training did not hold (a VL vision tower, `mtp.*`, tokenizer, processor, chat template); from a random init,
        the policy's own model with the tokenizer (and processor). `vision_form`: a text-only policy written as the
        vision-language checkpoint (`Qwen3_5*ForConditionalGeneration`, the text model under
        `model.language_model.`, a zero vision tower that text prompts never run, and the processor), for vLLM
        releases that load no text-only Qwen3.5 checkpoint. `weights=False`: the checkpoint without its weight
        files, for an engine that starts on placeholders (nothing gathered)."""
        from qwen35rl.models.build import build_model, generation_config, save_hf, save_hf_config
        from qwen35rl.models.export import export_over_source, source_weight_files

        if not weights:
            if self.rank == 0:
                from qwen35rl.models.processor import build_processor

                as_vision = vision_form and self.text_only
                for stale in Path(path).glob("*.safetensors*"):  # an earlier launch's weights: none belong here
                    stale.unlink()
                save_hf_config(self.cfg.model, self.tokenizer, path, text_only=self.text_only and not as_vision,
                               processor=build_processor(self.cfg.model, self.tokenizer) if as_vision
                               else self.processor)
            self._barrier()
            return
        self._trainers_on_device()
        state: Dict[str, torch.Tensor] = {}
        for bucket in self.actor.export_weights(self.cfg.rollout.weight_sync_bucket_mb):
            if self.rank == 0:
                state.update({name: t.detach().to("cpu", copy=True) for name, t in bucket})
        if self.rank == 0:
            model = build_model(self.cfg.model, dtype=self.cfg.model.dtype, device="meta", text_only=self.text_only)
            source = self.cfg.model.path if self.cfg.model.init == "pretrained" else None
            if source and source_weight_files(source):
                export_over_source(state, model, source, path)
                if self.cfg.model.tokenizer != "checkpoint":  # the ids the policy learned are this tokenizer's
                    (self.processor or self.tokenizer).save_pretrained(path)
            elif vision_form and self.text_only:
                write_vision_form(self.cfg.model, state, self.tokenizer, path)
            else:
                missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
                model.tie_weights()
                still_meta = [n for n, p in model.named_parameters() if p.is_meta]
                if still_meta or unexpected:
                    raise RuntimeError(f"HF export: no weights for {still_meta[:5]}, unknown {unexpected[:5]}")
                model.generation_config = generation_config(self.cfg.model)
                save_hf(model, self.tokenizer, path, self.processor)
        self._barrier()

    # ------------------------------------------------------------------------------------------------ stats
    def max_memory_allocated_gb(self) -> float:
        return self.memory.overall_gb()

    def phase_memory_gb(self) -> Dict[str, float]:
        """The device's peak per phase since the last call (empty on CPU)."""
        return self.memory.take_phases_gb()

    def shutdown(self) -> None:
        if getattr(self, "sync_group", None) is not None:
            self.sync_group.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def shared_config_dir(written: str, root: Path) -> str:
    """The weightless checkpoint `written` (config, tokenizer, processor), kept under `root` by its content: the next
    run of the same model starts vLLM from the same path, and vLLM's compile cache, which the model path keys, is
    reused (on an H100 a new path cost the 0.8B's warm start 12-20 s of torch.compile). Each rank copies it (the
    cache may be node-local); a copy that another rank or run finished first is kept. Where the cache cannot be
    written, `written` itself (the run starts as it would without the cache)."""
    import hashlib
    import shutil

    files = sorted(p for p in Path(written).iterdir() if p.is_file())
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    target = root / digest.hexdigest()[:16]
    if not target.is_dir():
        tmp = root / f".{target.name}.{os.getpid()}"
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(written, tmp)
            os.rename(tmp, target)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if not target.is_dir():  # not another rank's or run's copy: the cache cannot be written
                log.warning("the rollout's weightless checkpoint is not kept under %s (%s): vLLM starts from the "
                            "run's copy and compiles again in the next run; trainer.kernel_cache_dir=<a writable "
                            "path> keeps it", root, e)
                return written
    return str(target)


def installed_vllm_loads_text_checkpoint() -> bool:
    """Whether the vLLM of this process loads a text-only `Qwen3_5ForCausalLM` checkpoint (0.26 does not)."""
    install = vllm_facts.installed_vllm()
    return install is None or vllm_facts.loads_text_checkpoint(install.version, install)


def write_vision_form(model_cfg: Any, text_state: Dict[str, torch.Tensor], tokenizer: Any, path: str) -> None:
    """Write a text policy's weights (`text_state`, HF names of the text model) as the vision-language checkpoint
    of `model_cfg`: the text model under `model.language_model.`, a zero vision tower (text prompts never run it)
    and the processor. vLLM 0.26 loads a Qwen3.5 checkpoint only in this form."""
    from qwen35rl.engines.vllm_rollout import vllm_weight_name
    from qwen35rl.models.build import build_model, generation_config, save_hf
    from qwen35rl.models.processor import build_processor

    if model_cfg.vision is None:
        raise ValueError(f"model {model_cfg.name} has no vision tower: no vision-language form to write")
    model = build_model(model_cfg, dtype=model_cfg.dtype, device="meta", text_only=False)
    state = {vllm_weight_name(n, multimodal=True): t for n, t in text_state.items()}
    _, unexpected = model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    _zero_meta_vision_tower(model)
    still_meta = [n for n, p in model.named_parameters() if p.is_meta]
    if still_meta or unexpected:
        raise RuntimeError(f"HF export: no weights for {still_meta[:5]}, unknown {unexpected[:5]}")
    model.generation_config = generation_config(model_cfg)
    save_hf(model, tokenizer, path, build_processor(model_cfg, tokenizer))


def _zero_meta_vision_tower(model: Any) -> None:
    """Zeros for the vision tower's parameters and buffers still on `meta` (a text policy has none to give)."""
    with torch.no_grad():
        for module_name, module in model.named_modules():
            for kind in ("_parameters", "_buffers"):
                for name, t in list(getattr(module, kind).items()):
                    if t is None or not t.is_meta:
                        continue
                    if "visual" not in module_name:  # a text parameter left out is an error below; buffers
                        continue                     # (rotary frequencies) are not saved

                    zero = torch.zeros(t.shape, dtype=t.dtype)
                    getattr(module, kind)[name] = torch.nn.Parameter(zero, requires_grad=False) \
                        if kind == "_parameters" else zero


def hf_rollout_engine(cfg: Any, device: Any, tokenizer: Any, processor: Any, text_only: bool) -> RolloutEngine:
    """The transformers rollout engine. The driver syncs the policy's weights into it before every generation, so with
    a random init its model is only allocated, not initialised (a second random init would be overwritten)."""
    from qwen35rl.config.capabilities import compiles_decode
    from qwen35rl.engines.hf_rollout import HfRolloutEngine
    from qwen35rl.models.build import build_model, generation_config, init_rotary_buffers

    if cfg.model.init == "random":
        model = build_model(cfg.model, dtype=cfg.model.dtype, device="meta", text_only=text_only)
        model.to_empty(device=device)
        model.tie_weights()
        init_rotary_buffers(model)
        eos = generation_config(cfg.model).eos_token_id
    else:
        model = build_model(cfg.model, dtype=cfg.model.dtype, device=device, seed=cfg.trainer.seed, text_only=text_only)
        eos = model.generation_config.eos_token_id
    return HfRolloutEngine(model, tokenizer, device=device, pad_token_id=int(tokenizer.pad_token_id), eos_token_id=eos,
                           processor=processor, cuda_graphs=cfg.rollout.cuda_graph,
                           compile_decode=compiles_decode(cfg.rollout.compile_decode, device.type))
