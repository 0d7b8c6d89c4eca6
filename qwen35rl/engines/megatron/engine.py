"""TrainEngine over megatron-core: the Qwen3.5 model (GDN hybrid, dense or MoE; with the vision tower on image
data) with TP / PP (virtual and uneven stages) / EP / ETP / DP, the distributed optimizer, recompute and bf16.

One instance per rank. The driver must hand the same micro batches to every rank of a model-parallel group and
different ones across data-parallel ranks (`dp_rank` / `dp_size`). Batches are left-aligned before the forward
(megatron's GDN ignores the attention mask) and per-token results are put back in the batch's layout.

Between phases the engine can move its parameters, gradients and optimizer states to the host
(`backend.param_offload` / `grad_offload` / `optimizer_offload`, `host_offload`), as the colocated reference runs
need while vLLM generates.

On image data (`models.build.trains_vision`) the model is Qwen3.5-VL: transformers' vision tower on the first
pipeline stage, its features in place of the image tokens' embeddings, and transformers' 3-D M-RoPE positions on
every stage (`model.Qwen35VLModel`); exports carry the `Qwen3_5[Moe]ForConditionalGeneration` names.

What is not here: packed (THD) sequences and context parallelism (they need TE attention in the specs).
"""
from __future__ import annotations

import importlib.util
import logging
from functools import partial
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from qwen35rl.algo.core import ACTOR_SUMS, actor_loss, actor_metrics
from qwen35rl.config.ignored_keys import ignored_settings
from qwen35rl.config.layout import Layout, derive_layout
from qwen35rl.engines.base import Batch, TrainEngine, mini_batch_agg
from qwen35rl.engines.host_offload import HostOffload
from qwen35rl.config import megatron_versions as version
from qwen35rl.engines.megatron import ascend
from qwen35rl.engines.megatron import mapping as mp
from qwen35rl.engines.megatron.tokens import Aligned, left_align, pad_columns, vocab_parallel_logprobs
from qwen35rl.engines.megatron.vision import RowImages, build_vision_tower
from qwen35rl.models.build import build_model, enable_activation_checkpointing, torch_dtype, trains_vision
from qwen35rl.models.image_tokens import mrope_positions, prompt_image_mask
from qwen35rl.engines.gdn_kernels import fla_gdn_backward_refused
from qwen35rl.engines.gdn_kernels import fla_tilelang_usable as _fla_tilelang_usable
from qwen35rl.engines.gdn_kernels import triton_version as _triton_version

log = logging.getLogger(__name__)

TE_ONLY = ("moe_grouped_gemm", "moe_permute_fusion", "use_precision_aware_optimizer")
"""backend.* options that need Transformer Engine; without it they are turned off (with a warning)."""


# ------------------------------------------------------------------------------------------------ the layout
def megatron_layout(cfg: Any, world: int) -> Layout:
    """The config layer's layout of `cfg`, checked against the process group the engine runs in."""
    layout = derive_layout(cfg)
    if layout.world != world:
        raise ValueError(f"the process group has {world} ranks but hw.nodes x hw.devices_per_node = {layout.world}")
    if world % (layout.tp * layout.pp * layout.cp):
        raise ValueError(f"world size {world} is not divisible by tp*pp*cp = {layout.tp * layout.pp * layout.cp}")
    return layout


def transformer_parallel(layout: Layout) -> Dict[str, Any]:
    """The parallel sizes under TransformerConfig / MindSpeed names."""
    return {"tensor_model_parallel_size": layout.tp, "pipeline_model_parallel_size": layout.pp,
            "context_parallel_size": layout.cp, "expert_model_parallel_size": layout.ep,
            "expert_tensor_parallel_size": layout.etp, "sequence_parallel": layout.tp > 1}


def te_gated_options(backend: Any, has_te: bool) -> Tuple[Dict[str, bool], List[str]]:
    """backend.* TE-only options as they apply here, and the names switched off for lack of TE."""
    wanted = {name: bool(backend.get(name, False)) for name in TE_ONLY}
    if has_te:
        return wanted, []
    off = [name for name, on in wanted.items() if on]
    return {name: False for name in wanted}, off


def _dtype(backend: Any) -> torch.dtype:
    return torch.bfloat16 if backend.bf16 else torch.float32


def _import_megatron():
    try:
        import megatron.core  # noqa: F401
    except ImportError as e:
        raise ImportError(f"backend=megatron needs megatron-core: {version.INSTALL_HINT} ({e})") from e


# ------------------------------------------------------------------------------------------------ the engine
class MegatronTrainEngine(TrainEngine):
    """The policy (or, with `reference=True`, a frozen reference copy without optimizer) on one rank.

    cfg: the resolved run config; the process group must be initialised (every rank constructs together).
    `hf_state`: HF tensors to start from instead of `model.init` (tests, weight hand-over).
    """

    # the pipeline schedule runs every micro batch of a step at the largest one's rows and columns
    micro_batch_layout = "uniform"

    def __init__(self, cfg: Any, *, rank: int, world_size: int, device: Any, reference: bool = False,
                 total_steps: Optional[int] = None, hf_state: Optional[Dict[str, torch.Tensor]] = None):
        self.cfg, self.reference, self.total_steps = cfg, reference, total_steps
        self._host = HostOffload()  # what offload_states moved to the host
        self.backend, self.algo = cfg.backend, cfg.algorithm
        self.device = torch.device(device)
        if self.device.type == "cpu":
            from qwen35rl.engines.megatron import cpu

            cpu.install()  # megatron-core assumes CUDA: its stand-ins, before megatron is imported
        self.layout = megatron_layout(cfg, world_size)
        # MindSpeed must patch megatron before anything imports it
        self.platform = ascend.prepare_platform(cfg.hw, transformer_parallel(self.layout))
        self._check_stack()

        from megatron.core import parallel_state as mpu

        self.mpu = mpu
        if not mpu.model_parallel_is_initialized():
            l = self.layout
            mpu.initialize_model_parallel(
                tensor_model_parallel_size=l.tp, pipeline_model_parallel_size=l.pp,
                virtual_pipeline_model_parallel_size=l.vpp or None, context_parallel_size=l.cp,
                expert_model_parallel_size=l.ep, expert_tensor_parallel_size=l.etp,
                distributed_timeout_minutes=max(1, int(self.backend.dist_timeout_s) // 60))
            if self.device.type != "cpu":
                from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

                model_parallel_cuda_manual_seed(int(cfg.trainer.seed))
        self.temperature = float(cfg.rollout.temperature) if cfg.rollout.temperature > 0 else 1.0
        self.shape = mp.Qwen35Shape.from_model_config(cfg.model)
        self.vision = trains_vision(cfg.model, cfg.data)
        # the HF names exports carry: those of the model class the run loads and exports (VL on image data)
        self.hf_prefix = mp.VL_PREFIX if self.vision else mp.CAUSAL_LM_PREFIX
        self.skipped_steps = 0
        self.steps = 0

        self._build()
        self._load_hf(hf_state)
        if reference:
            for c in self.chunks:
                c.requires_grad_(False)
                c.eval()
            self.model, self.optimizer = list(self.chunks), None
        else:
            self._wrap_and_optimize()
        self._export_plan()

    def _check_stack(self) -> None:
        """Refuse what this run cannot do here, each with its reason; switch off TE-only options without TE."""
        cfg, l, b = self.cfg, self.layout, self.backend
        if l.cp > 1:
            raise NotImplementedError("parallelism.cp > 1: context parallelism needs Transformer Engine attention, "
                                      "which these specs do not build")
        self.caps = version.capabilities()
        self.caps.check_layout(cp=l.cp, packed=False, tp=l.tp, ep=l.ep, etp=l.etp, moe=bool(cfg.model.moe))
        _import_megatron()
        if b.remove_padding:
            log.info("backend=megatron: padded (right-aligned) batches; packed sequences are not implemented here")
        for key, why in ignored_settings(b):
            log.warning("%s is not applied by the megatron engine: %s", key, why)
        self.te_options, disabled = te_gated_options(b, self.caps.has_te)
        if disabled:
            log.warning("Transformer Engine is not installed: %s turned off", ", ".join(disabled))
        if self.device.type == "cuda" and importlib.util.find_spec("fla") is None:
            raise ImportError("megatron-core's GatedDeltaNet needs flash-linear-attention: pip install "
                              "flash-linear-attention (see ../shared/gpu/README.md for the Hopper stack)")

    # ------------------------------------------------------------------------------------------ build
    def _transformer_config(self):
        from qwen35rl.engines.megatron import model as mm

        b, l = self.backend, self.layout
        recompute: Dict[str, Any] = {}
        if b.gradient_checkpointing and not self.reference and b.recompute_granularity:
            recompute = {"recompute_granularity": b.recompute_granularity}
            if b.recompute_granularity == "full":
                recompute.update(recompute_method=b.recompute_method, recompute_num_layers=int(b.recompute_num_layers))
        aux, z = float(b.moe_aux_loss_coeff), float(b.moe_z_loss_coeff)
        moe = {"moe_token_dispatcher_type": b.moe_token_dispatcher_type,
               "moe_router_load_balancing_type": "aux_loss" if aux > 0 else "none", "moe_aux_loss_coeff": aux,
               "moe_z_loss_coeff": z if z > 0 else None,
               "moe_grouped_gemm": self.te_options["moe_grouped_gemm"],
               "moe_permute_fusion": self.te_options["moe_permute_fusion"]}
        overrides = {**self.platform.transformer, **dict(b.transformer_overrides or {})}
        self._gdn_fallback(overrides)
        if self.device.type == "cpu":
            overrides.setdefault("use_cpu_initialization", True)
            overrides.setdefault("deterministic_mode", True)  # megatron-core's torch GDN recurrence: no fla on CPU
        return mm.transformer_config(self.cfg.model, self.shape, tp=l.tp, pp=l.pp, ep=l.ep, etp=l.etp, cp=l.cp,
                                     vpp=l.vpp or None, pipeline_layout=self.cfg.parallelism.pipeline_layout or None,
                                     dtype=_dtype(b), recompute=recompute, moe=moe, overrides=overrides,
                                     vision=self.vision)

    def _gdn_fallback(self, overrides: Dict[str, Any]) -> None:
        """Where fla would refuse the GDN backward, the policy trains with megatron-core's torch GDN recurrence
        (`deterministic_mode`), unless backend.transformer_overrides (or the platform) chose. The frozen reference
        only runs forwards and keeps fla's kernels."""
        if self.reference or self.device.type != "cuda" or "deterministic_mode" in overrides:
            return
        capability = tuple(torch.cuda.get_device_capability(self.device))
        triton_version = _triton_version()
        if fla_gdn_backward_refused(capability, triton_version, _fla_tilelang_usable()):
            overrides["deterministic_mode"] = True
            log.warning("flash-linear-attention's chunked GDN backward refuses compute capability %d.%d with Triton "
                        "%s and no usable TileLang (fla issue #640): training with megatron-core's torch GDN "
                        "recurrence (deterministic_mode=True; slower, more activation memory). Install tilelang (and "
                        "nvcc) or Triton >= 3.7.1 for fla's kernels, or set backend.transformer_overrides."
                        "deterministic_mode to choose.", capability[0], capability[1], triton_version)

    def _build(self) -> None:
        from qwen35rl.engines.megatron import model as mm

        self.tconfig = self._transformer_config()
        if self.te_options["moe_grouped_gemm"]:
            raise NotImplementedError("backend.moe_grouped_gemm with Transformer Engine: the TEGroupedMLP spec is "
                                      "not wired in yet; set backend.moe_grouped_gemm=false")
        self.names = mp.MegatronNames()
        # the HF model's structure without memory: its config (token ids, vision config), names and full shapes
        self.meta = build_model(self.cfg.model, dtype=_dtype(self.backend), device="meta", text_only=not self.vision)
        vision = [n for n, _ in self.meta.named_parameters() if n.startswith(mp.VISION_PREFIX)]
        self.vision_names = [n[len(mp.VISION_PREFIX):] for n in vision]
        tower = (lambda: build_vision_tower(self.meta.config, _dtype(self.backend))) if self.vision else None
        self.chunks = mm.build_chunks(self.tconfig, self.cfg.model, self.shape,
                                      megatron_attention=self.platform.megatron_core_attention, vision_tower=tower)
        for c in self.chunks:
            c.to(self.device)
            if hasattr(c, "visual"):
                self._setup_tower(c.visual)
        self.chunk_layers = mm.chunk_layer_ids(self.tconfig, self.chunks)

    def _setup_tower(self, tower: torch.nn.Module) -> None:
        """The vision tower trains like the decoder: frozen with model.freeze_vision_tower (before DDP wraps it: no
        gradient buffer, no optimizer state), its blocks recomputed when the decoder's layers are (megatron's
        recompute does not reach transformers' modules; the plan's memory estimate counts it so)."""
        if self.cfg.model.freeze_vision_tower:
            tower.requires_grad_(False)
        elif self.tconfig.recompute_granularity == "full":
            enable_activation_checkpointing(tower)

    # ------------------------------------------------------------------------------------------ ranks
    @property
    def dp_rank(self) -> int:
        return self.mpu.get_data_parallel_rank()

    @property
    def dp_size(self) -> int:
        return self.mpu.get_data_parallel_world_size()

    def _rank_layout(self) -> mp.RankLayout:
        m = self.mpu
        return mp.RankLayout(tp_rank=m.get_tensor_model_parallel_rank(), tp_size=m.get_tensor_model_parallel_world_size(),
                             ep_rank=m.get_expert_model_parallel_rank(), ep_size=m.get_expert_model_parallel_world_size(),
                             etp_rank=m.get_expert_tensor_parallel_rank(),
                             etp_size=m.get_expert_tensor_parallel_world_size())

    def _chunk_maps(self, ci: int) -> List[mp.ParamMap]:
        chunk = self.chunks[ci]
        maps = mp.param_maps(self.shape, self.names, layers=self.chunk_layers[ci], pre_process=chunk.pre_process,
                             post_process=chunk.post_process, vision_names=self.vision_names)
        if self.shape.tie_word_embeddings and chunk.post_process and not chunk.pre_process:
            maps.append(mp.tied_output_layer_map())
        return maps

    def _local_name(self, ci: int, p: mp.MegatronParam, local_experts: range) -> str:
        name = p.name
        layer = mp.layer_index(name)
        if layer is not None:
            name = mp.with_layer_index(name, self.chunk_layers[ci].index(layer))
        if p.expert is not None:
            name = mp.with_expert_index(name, p.expert - local_experts.start)
        return name

    # ------------------------------------------------------------------------------------------ weights in
    def _hf_source(self, hf_state):
        from qwen35rl.engines.megatron.hf_source import CheckpointSource, DictSource

        if hf_state is not None:
            return DictSource(hf_state)
        m = self.cfg.model
        if m.init == "pretrained":
            return CheckpointSource(str(m.path))
        # the same seeded init as the rollout engine's and the FSDP engine's: every rank builds it identically
        return DictSource(build_model(m, dtype=_dtype(self.backend), device="cpu", seed=int(self.cfg.trainer.seed),
                                      text_only=not self.vision).state_dict())

    @torch.no_grad()
    def _load_hf(self, hf_state) -> None:
        """Fill this rank's shards from HF tensors; every parameter of every chunk must be set (strict unless the
        platform says otherwise)."""
        source = self._hf_source(hf_state)
        rank = self._rank_layout()
        local_experts = rank.local_experts(self.shape.num_experts) if self.shape.moe else range(0)
        for ci, chunk in enumerate(self.chunks):
            params = dict(chunk.named_parameters())
            loaded = set()
            for m in self._chunk_maps(ci):
                missing = [n for n in m.hf if n not in source]
                if missing:
                    if self.platform.strict_load:
                        raise KeyError(f"HF weights lack {missing}")
                    log.warning("HF weights lack %s: those parameters keep megatron's random init", missing)
                    continue
                for p, t in zip(m.megatron, m.to_megatron([source.get(n) for n in m.hf])):
                    if p.expert is not None and p.expert not in local_experts:
                        continue
                    name = self._local_name(ci, p, local_experts)
                    tp_rank, tp_size = (rank.etp_rank, rank.etp_size) if p.expert is not None else (rank.tp_rank, rank.tp_size)
                    shard = mp.split_for_rank(t, p.split, tp_rank, tp_size)
                    if name not in params:
                        raise KeyError(f"megatron model has no parameter {name!r} (chunk {ci}); the specs and the "
                                       f"mapping disagree")
                    if params[name].shape != shard.shape:
                        raise ValueError(f"{name}: model shape {tuple(params[name].shape)} vs mapped {tuple(shard.shape)}")
                    params[name].copy_(shard)
                    loaded.add(name)
            unset = sorted(set(params) - loaded)
            if unset and self.platform.strict_load:
                raise RuntimeError(f"chunk {ci}: parameters not set from the HF weights: {unset[:8]}")

    # ------------------------------------------------------------------------------------------ optimizer
    def _wrap_and_optimize(self) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        b = self.backend
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=bool(b.use_distributed_optimizer))
        self.model = [DistributedDataParallel(config=self.tconfig, ddp_config=ddp_config, module=c,
                                              disable_bucketing=i > 0) for i, c in enumerate(self.chunks)]
        opt = OptimizerConfig(
            optimizer="adam", lr=float(b.lr), min_lr=float(b.lr) * float(b.min_lr_ratio),
            weight_decay=float(b.weight_decay), adam_beta1=float(b.betas[0]), adam_beta2=float(b.betas[1]),
            clip_grad=float(b.grad_clip) if b.grad_clip and b.grad_clip > 0 else 0.0,
            bf16=_dtype(b) == torch.bfloat16, params_dtype=_dtype(b),
            use_distributed_optimizer=bool(b.use_distributed_optimizer),
            # on a CPU device the optimizer already runs on the host (megatron's hybrid optimizer expects a GPU)
            optimizer_cpu_offload=bool(b.optimizer_cpu_offload) and self.device.type != "cpu",
            optimizer_offload_fraction=float(b.optimizer_offload_fraction),
            overlap_cpu_optimizer_d2h_h2d=bool(b.overlap_cpu_optimizer_d2h_h2d),
            use_precision_aware_optimizer=self.te_options["use_precision_aware_optimizer"])
        self.optimizer = get_megatron_optimizer(opt, self.model)
        self.tconfig.grad_scale_func = self.optimizer.scale_loss
        self.tconfig.finalize_model_grads_func = finalize_model_grads
        from qwen35rl.engines.fsdp_engine import lr_lambda

        self.lr_at = lr_lambda(int(b.lr_warmup_steps), b.lr_scheduler, self.total_steps, float(b.min_lr_ratio))

    # ------------------------------------------------------------------------------------------ batches
    def _prepare(self, batch: Batch, train: bool) -> Dict[str, Any]:
        """A micro batch in the model's layout: rows left-aligned, padded to a multiple of TP (sequence
        parallelism), per-token inputs moved to the logit positions (logits at t predict token t+1)."""
        pad = 0  # any valid id: padded positions are masked out of every loss and result
        aligned = left_align(batch.input_ids, batch.attention_mask, pad)
        tp = self.layout.tp

        def at_logits(x: Optional[torch.Tensor], fill=0) -> Optional[torch.Tensor]:
            if x is None:
                return None
            y = aligned.take(x)
            y = torch.cat([y[:, 1:], torch.full_like(y[:, :1], fill)], dim=1)
            return pad_columns(y, tp, fill).to(self.device)

        ids = pad_columns(aligned.input_ids, tp, pad).to(self.device)
        out = {
            "aligned": aligned,
            "width": batch.input_ids.shape[1],
            "input_ids": ids,
            "position_ids": torch.arange(ids.shape[1], device=self.device)[None].expand(ids.shape[0], -1),
            "labels": torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], pad)], dim=1),
            "loss_mask": at_logits(batch.response_mask.bool(), False),
            "images": None,
        }
        if self.vision:
            self._add_images(out, batch, aligned)
        elif batch.multimodal:
            raise ValueError("a multimodal batch needs a vision model and data.has_images=true")
        if train:
            out.update(advantages=at_logits(batch.advantages.float()), old=at_logits(batch.old_log_probs),
                       ref=at_logits(batch.ref_log_probs))
        return out

    def _add_images(self, out: Dict[str, Any], batch: Batch, aligned: Aligned) -> None:
        """The VL model's inputs: which tokens are the prompts' image tokens, the images of each row, and
        transformers' 3-D M-RoPE positions (kept row-major as [B, 3, T], so they split and pad with the rows).
        Worked out on the host (the batch's tokens may already be on the device, its vision inputs not; the
        positions are a loop over rows and images), then moved to the device."""
        cols = out["input_ids"].shape[1]
        config = self.meta.config
        mask = aligned.take(prompt_image_mask(batch.input_ids, batch.attention_mask, batch.response_mask,
                                              config.image_token_id)).cpu()
        multimodal = {k: v.cpu() for k, v in (batch.multimodal or {}).items()}
        images = RowImages.of(multimodal, mask, int(config.vision_config.spatial_merge_size))
        pos = mrope_positions(aligned.input_ids.cpu(), aligned.valid.cpu(), mask,
                              None if images is None else images.grid_thw, config)  # [3, B, T]
        out["image_mask"] = pad_columns(mask, self.layout.tp, False).to(self.device)
        out["position_ids"] = F.pad(pos.permute(1, 0, 2), (0, cols - pos.shape[-1])).contiguous().to(self.device)
        out["images"] = None if images is None else images.to(self.device)

    def _to_batch_layout(self, prepared: Dict[str, Any], values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
        """Per-logit values [B, T'] -> per-token values [B, T] of the original layout, 0 outside the response."""
        aligned: Aligned = prepared["aligned"]
        width = prepared["width"]
        device = response_mask.device
        tok = F.pad(values[:, :-1], (1, 0))[:, :width].float().to(device)
        out = aligned.restore(tok)
        return torch.where(response_mask.bool(), out, torch.zeros((), dtype=out.dtype, device=device))

    _ROW_KEYS = ("input_ids", "position_ids", "labels", "loss_mask", "advantages", "old", "ref", "image_mask")

    def _rows(self, p: Dict[str, Any], parts: int) -> List[Dict[str, Any]]:
        """`p` split into up to `parts` micro batches of consecutive rows."""
        rows = p["input_ids"].shape[0]
        bounds = [round(i * rows / parts) for i in range(parts + 1)]
        images = p.get("images")
        return [{**{k: (v[a:b] if k in self._ROW_KEYS and v is not None else v) for k, v in p.items()},
                 "images": None if images is None else images.take_rows(a, b)}
                for a, b in zip(bounds, bounds[1:]) if b > a]

    def _schedule_ready(self, prepared: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        """Micro batches of one shape (rows and columns padded with entries that count nowhere), so pipeline
        stages can exchange fixed-shape activations; with virtual pipeline stages, a multiple of PP of them
        (megatron's interleaved schedule needs it), padded with empty micro batches."""
        rows = max(p["input_ids"].shape[0] for p in prepared)
        cols = max(p["input_ids"].shape[1] for p in prepared)
        count = len(prepared)
        if self.layout.vpp:
            count += (-count) % self.layout.pp
        out = []
        for i in range(count):
            p = prepared[min(i, len(prepared) - 1)]
            q = dict(p)
            for k in self._ROW_KEYS:
                v = p.get(k)
                if v is None:
                    continue
                if i >= len(prepared):  # an empty micro batch
                    v = torch.zeros_like(v)
                grown = v.new_zeros((rows, *v.shape[1:-1], cols))  # [rows, cols] ([rows, 3, cols]: M-RoPE)
                grown[:v.shape[0], ..., :v.shape[-1]] = v
                q[k] = grown
            if not self.vision:
                q["position_ids"] = torch.arange(cols, device=self.device)[None].expand(rows, -1)
            if i >= len(prepared):
                q["images"] = None
            out.append(q)
        return out

    # ------------------------------------------------------------------------------------------ forward
    def _iterators(self, prepared: Sequence[Dict[str, Any]]):
        its = [iter(list(prepared)) for _ in self.model]
        return its if len(its) > 1 else its[0]

    def _forward_step(self, loss_fn, data_iterator, model):
        b = next(data_iterator)
        positions, images = b["position_ids"], {}
        if self.vision:
            positions = positions.permute(1, 0, 2)  # [3, rows, cols], as M-RoPE takes them
            if b["images"] is not None:
                images = dict(pixel_values=b["images"].pixel_values, image_grid_thw=b["images"].grid_thw,
                              image_mask=b["image_mask"])
        output = model(input_ids=b["input_ids"], position_ids=positions, attention_mask=None, **images)
        return output, partial(loss_fn, b)

    def _run(self, prepared: List[Dict[str, Any]], loss_fn, forward_only: bool) -> List[Dict[str, torch.Tensor]]:
        """megatron's pipeline schedule over `prepared`; `loss_fn(num_micro, batch, logits)` on the last stage.
        Returns the last stage's per-micro-batch results (padding micro batches last)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        ready = self._schedule_ready(prepared)
        rows, cols = ready[0]["input_ids"].shape
        return get_forward_backward_func()(
            forward_step_func=partial(self._forward_step, partial(loss_fn, len(ready))),
            data_iterator=self._iterators(ready), model=self.model, num_microbatches=len(ready),
            seq_length=cols, micro_batch_size=rows, forward_only=forward_only)

    def _tp_group(self):
        return self.mpu.get_tensor_model_parallel_group() if self.layout.tp > 1 else None

    def _logprobs(self, b, logits, with_entropy: bool):
        return vocab_parallel_logprobs(logits, b["labels"], self._tp_group(), self.temperature, with_entropy,
                                       int(self.backend.logprob_chunk_size))

    def _logprob_loss(self, with_entropy: bool, num_micro: int, b, logits):
        logp, ent = self._logprobs(b, logits, with_entropy)
        out = {"logp": logp.detach()}
        if ent is not None:
            out["ent"] = ent.detach()
        return logits.new_zeros(()), out

    def _is_last_stage(self) -> bool:
        return self.mpu.is_pipeline_last_stage(ignore_virtual=True)

    def _pp_broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """`t` from the last pipeline stage to every stage (same shape everywhere)."""
        if self.layout.pp == 1:
            return t
        group = self.mpu.get_pipeline_model_parallel_group()
        dist.broadcast(t, src=dist.get_global_rank(group, self.layout.pp - 1), group=group)
        return t

    @torch.no_grad()
    def compute_log_probs(self, batch: Batch, with_entropy: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        for c in self.model:
            c.eval()
        prepared = self._prepare(batch, train=False)
        # the interleaved schedule wants a multiple of PP micro batches: split the rows
        parts = self._rows(prepared, self.layout.pp if self.layout.vpp else 1)
        out = self._run(parts, partial(self._logprob_loss, with_entropy), forward_only=True)
        shape = prepared["input_ids"].shape
        n = 2 if with_entropy else 1
        stacked = torch.zeros((n, *shape), dtype=torch.float32, device=self.device)
        if self._is_last_stage():
            sizes = [p["input_ids"].shape[0] for p in parts]
            stacked[0] = torch.cat([o["logp"][:r, :shape[1]] for o, r in zip(out, sizes)])
            if with_entropy:
                stacked[1] = torch.cat([o["ent"][:r, :shape[1]] for o, r in zip(out, sizes)])
        stacked = self._pp_broadcast(stacked)
        logp = self._to_batch_layout(prepared, stacked[0], batch.response_mask)
        ent = self._to_batch_layout(prepared, stacked[1], batch.response_mask) if with_entropy else None
        return logp, ent

    # ------------------------------------------------------------------------------------------ update
    def _sum_over_dp(self, t: torch.Tensor) -> torch.Tensor:
        t = t.to(self.device)
        dist.all_reduce(t, group=self.mpu.get_data_parallel_group())
        return t

    def _train_loss(self, agg: Dict[str, Any], num_micro: int, b, logits):
        logp, ent = self._logprobs(b, logits, with_entropy=True)
        loss, sums = actor_loss(logp, ent, b["old"], b["ref"], b["advantages"], b["loss_mask"], self.algo, agg)
        # megatron's schedule divides the loss by the number of micro batches; agg_loss already normalises over
        # the global mini batch, so undo it
        return loss * num_micro, {"sums": sums}

    def _grads_finite(self) -> bool:
        """Whether every rank's reduced gradients are finite (checked before the step: megatron's bf16 optimizer
        would apply a NaN update)."""
        local = [p.main_grad.isfinite().all() for c in self.model for p in c.parameters()
                 if getattr(p, "main_grad", None) is not None]
        bad = torch.tensor(0.0 if not local or torch.stack(local).all() else 1.0, device=self.device)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return bad.item() == 0.0

    def train_mini_batch(self, micro_batches: List[Batch], global_scale: Dict[str, float]) -> Dict[str, float]:
        if self.reference:
            raise RuntimeError("the reference engine is frozen: it has no optimizer")
        algo = self.algo
        agg = mini_batch_agg(micro_batches, global_scale, algo, int(self.cfg.data.max_response_length), self.dp_size,
                             self._sum_over_dp)
        prepared = [self._prepare(mb, train=True) for mb in micro_batches]
        for c in self.model:
            c.train()
            c.zero_grad_buffer()
        self.optimizer.zero_grad()
        out = self._run(prepared, partial(self._train_loss, agg), forward_only=False)

        sums = torch.zeros(len(ACTOR_SUMS), dtype=torch.float64, device=self.device)
        if self._is_last_stage():
            for o in out:
                sums += o["sums"].to(self.device)
        dist.all_reduce(sums, group=self.mpu.get_data_parallel_group())
        sums = self._pp_broadcast(sums).cpu()

        lr = float(self.backend.lr) * self.lr_at(self.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        grad_norm = float("nan")
        nonfinite_loss = sums[ACTOR_SUMS.index("nonfinite")] > 0
        if nonfinite_loss or not self._grads_finite():
            self.skipped_steps += 1
            log.warning("skipping optimizer step: non-finite %s", "loss" if nonfinite_loss else "gradients")
        else:
            ok, norm, _ = self.optimizer.step()
            grad_norm = float(norm) if norm is not None else float("nan")
            if not ok:
                self.skipped_steps += 1
                log.warning("the optimizer skipped the step")
        self.optimizer.zero_grad()
        self.steps += 1
        for c in self.model:
            c.eval()
        return {
            **actor_metrics(sums, self.dp_size),
            "actor/grad_norm": grad_norm,
            "actor/lr": lr,
            "actor/skipped_steps": float(self.skipped_steps),
        }

    # ------------------------------------------------------------------------------------------ weights out
    def _export_plan(self) -> None:
        """Which pipeline rank and chunk own each map, and the whole-model shapes (for broadcasts), agreed by all
        ranks: the full shapes come from running the mapping on meta tensors."""
        self.export_maps = mp.param_maps(self.shape, self.names, hf_prefix=self.hf_prefix,
                                         vision_names=self.vision_names)
        meta = dict(self.meta.state_dict())
        self.full_shapes = {p.name: tuple(t.shape) for m in self.export_maps
                            for p, t in zip(m.megatron, m.to_megatron([meta[n] for n in m.hf]))}
        mine = {}
        pp_rank = self.mpu.get_pipeline_model_parallel_rank()
        for ci, chunk in enumerate(self.chunks):
            for m in mp.param_maps(self.shape, self.names, hf_prefix=self.hf_prefix, layers=self.chunk_layers[ci],
                                   pre_process=chunk.pre_process, post_process=chunk.post_process,
                                   vision_names=self.vision_names):
                mine[m.hf] = (pp_rank, ci)
        owners = [mine]
        if self.layout.pp > 1:
            owners = [None] * self.layout.pp
            dist.all_gather_object(owners, mine, group=self.mpu.get_pipeline_model_parallel_group())
        self.owner = {k: v for o in owners for k, v in o.items()}

    def _gather_local(self, ci: int, m: mp.ParamMap) -> List[torch.Tensor]:
        """Whole-model tensors of `m` from this pipeline stage's shards (collective over TP / EP / ETP)."""
        rank = self._rank_layout()
        params = dict(self.chunks[ci].named_parameters())
        local_experts = rank.local_experts(self.shape.num_experts) if self.shape.moe else range(0)
        out: List[torch.Tensor] = []
        if any(p.expert is not None for p in m.megatron):
            mine = [params[self._local_name(ci, p, local_experts)].detach() for p in m.megatron if p.expert in local_experts]
            split = m.megatron[0].split
            mine = [self._gather(t, split, self.mpu.get_expert_tensor_parallel_group(), rank.etp_size) for t in mine]
            stacked = torch.stack(mine)
            if rank.ep_size > 1:
                parts = [torch.empty_like(stacked) for _ in range(rank.ep_size)]
                dist.all_gather(parts, stacked.contiguous(), group=self.mpu.get_expert_model_parallel_group())
                stacked = torch.cat(parts)
            return list(stacked.unbind(0))
        for p in m.megatron:
            t = params[self._local_name(ci, p, local_experts)].detach()
            out.append(self._gather(t, p.split, self._tp_group(), rank.tp_size))
        return out

    @staticmethod
    def _gather(t: torch.Tensor, split: Optional[mp.Split], group, size: int) -> torch.Tensor:
        if split is None or size == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(parts, t.contiguous(), group=group)
        return mp.merge_ranks(parts, split)

    def _fetch(self, out_dtype: torch.dtype, out_device: torch.device, m: mp.ParamMap) -> List[torch.Tensor]:
        owner_pp, ci = self.owner[m.hf]
        pp_rank = self.mpu.get_pipeline_model_parallel_rank()
        if pp_rank == owner_pp:
            full = [t.to(out_dtype) for t in self._gather_local(ci, m)]
        else:
            full = [torch.empty(self.full_shapes[p.name], dtype=out_dtype, device=self.device) for p in m.megatron]
        if self.layout.pp > 1:
            group = self.mpu.get_pipeline_model_parallel_group()
            src = dist.get_global_rank(group, owner_pp)
            for t in full:
                dist.broadcast(t, src=src, group=group)
        return [t.to(out_device, copy=True) for t in full]

    def export_weights(self, bucket_mb: int, device: Optional[Any] = None) -> Iterator[List[Tuple[str, torch.Tensor]]]:
        """HF-named full tensors (tied embedding once) in model.dtype, on CPU or on `device` (a rollout engine on
        the trainer's device skips the host). Collective over every rank, one map at a time."""
        out = torch.device("cpu") if device is None else torch.device(device)
        return mp.export_hf(self.export_maps, partial(self._fetch, torch_dtype(self.cfg.model.dtype), out), float(bucket_mb))

    # ------------------------------------------------------------------------------------------ checkpoints
    def _rank_key(self) -> str:
        r = self._rank_layout()
        return f"pp{self.mpu.get_pipeline_model_parallel_rank()}_tp{r.tp_rank}_ep{r.ep_rank}_etp{r.etp_rank}"

    def _torch_optimizers(self) -> List[Any]:
        """The torch optimizers over this rank's fp32 main-parameter shards (one per megatron optimizer: dense and
        expert parameters are chained)."""
        return [opt.optimizer for opt in getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer]]

    def _optimizer_tensors(self) -> Dict[str, torch.Tensor]:
        """Main (fp32) params and Adam moments of this rank's optimizer shards, as plain tensors under keys unique
        to this rank (DCP stores each once). Resuming needs the same parallel layout and world size."""
        out: Dict[str, torch.Tensor] = {}
        prefix = f"rank{dist.get_rank()}"
        for i, torch_opt in enumerate(self._torch_optimizers()):
            for g, group in enumerate(torch_opt.param_groups):
                for j, p in enumerate(group["params"]):
                    state = torch_opt.state[p]
                    if not state:  # before the first step: placeholders DCP can load into
                        state.update(step=torch.zeros((), dtype=torch.float32), exp_avg=torch.zeros_like(p),
                                     exp_avg_sq=torch.zeros_like(p))
                    out[f"{prefix}/{i}/{g}/{j}/param"] = p.data
                    for k, v in state.items():
                        if torch.is_tensor(v):
                            out[f"{prefix}/{i}/{g}/{j}/{k}"] = v
        return out

    # ------------------------------------------------------------------------------------------ offload
    def _offloadable(self) -> Iterator[torch.Tensor]:
        """The tensors the offload settings name that live on the engine's device: parameters (views into DDP's
        buffers), gradients (`main_grad`, views into DDP's gradient buffers) and the optimizer's fp32 main
        parameters and moments (with backend.optimizer_cpu_offload, megatron's hybrid optimizer keeps those on the
        host already, some of them in pinned storages that cannot be resized)."""
        return (t for t in self._offload_candidates() if t.device.type == self.device.type)

    def _offload_candidates(self) -> Iterator[torch.Tensor]:
        b = self.backend
        params = [p for c in self.chunks for p in c.parameters()]
        if b.param_offload:
            yield from params
        if b.grad_offload and not self.reference:
            yield from (p.main_grad for p in params if getattr(p, "main_grad", None) is not None)
        if b.optimizer_offload and self.optimizer is not None:
            for torch_opt in self._torch_optimizers():
                for group in torch_opt.param_groups:
                    for p in group["params"]:
                        yield p
                        yield from (v for v in torch_opt.state.get(p, {}).values() if torch.is_tensor(v) and v.dim())

    def offload_states(self) -> int:
        return self._host.offload(self._offloadable())

    def reload_states(self) -> int:
        return self._host.reload()

    def state_dict_for_checkpoint(self) -> Dict[str, Any]:
        key = self._rank_key()
        model = {f"{key}/{ci}/{name}": p.data for ci, c in enumerate(self.chunks) for name, p in c.named_parameters()}
        if self.reference:
            return {"model": model}
        counters = torch.tensor([self.steps, self.skipped_steps], dtype=torch.int64)
        return {"model": model, "optimizer": self._optimizer_tensors(), f"counters_rank{dist.get_rank()}": counters}

    def load_checkpoint_state(self, state: Dict[str, Any]) -> None:
        # DCP loaded into the tensors handed out by state_dict_for_checkpoint, which are the live ones
        if self.reference:
            return
        counters = state[f"counters_rank{dist.get_rank()}"]
        self.steps, self.skipped_steps = int(counters[0]), int(counters[1])
