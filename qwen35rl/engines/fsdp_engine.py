"""TrainEngine over a transformers Qwen3.5 model with FSDP2 (`fully_shard` per decoder layer, then the root).

Without an initialised process group (one CPU process, unit tests) the same code runs on a plain module.
Parameters are kept in fp32 (the optimizer's master copy); `backend.mixed_precision` picks bf16 compute on
accelerators. Log-probs come from the chunked vocab projection of `engines.logprob`, inside the FSDP root's
forward so that FSDP gathers lm_head for it and reduce-scatters its gradient.
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import warnings
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from qwen35rl.algo.core import ACTOR_SUMS, actor_loss, actor_metrics
from qwen35rl.config.ignored_keys import ignored_settings
from qwen35rl.engines.base import Batch, TrainEngine, mini_batch_agg
from qwen35rl.engines.logprob import chunked_logprobs_entropy
from qwen35rl.engines.packed_attention import use_packed_attention
from qwen35rl.engines.packed_gdn import enable_packing
from qwen35rl.models.build import (build_model, enable_activation_checkpointing, init_rotary_buffers, torch_dtype,
                                   trains_vision)
from qwen35rl.models.image_tokens import mrope_positions, prompt_image_mask

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------- helpers
def packing_supported(device: torch.device) -> bool:
    """Packed sequences (no padding) pay off where flash-linear-attention's GDN kernel takes the sequence boundaries
    (CUDA). The short convolution keeps documents apart through `packed_gdn.enable_packing`, full attention through
    `packed_attention` (per-document kernels instead of sdpa over an [N, N] mask); without fla the recurrence would
    run once per document, slower than a padded batch."""
    return device.type == "cuda" and importlib.util.find_spec("fla") is not None


def packed_call_kwargs(lengths: torch.Tensor) -> Dict[str, Any]:
    """The document boundaries a transformers model takes with one packed row of documents of these lengths:
    cumulative lengths (int32, as flash-attention kernels want them), the longest document and per-token ids."""
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    max_len = int(lengths.max())
    seq_idx = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device, dtype=torch.int32), lengths)
    return dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_len, max_length_k=max_len, seq_idx=seq_idx[None])


def _on(t: Optional[torch.Tensor], device: torch.device) -> Optional[torch.Tensor]:
    return None if t is None else t.to(device)


def mixed_precision_dtype(setting: str, device: torch.device) -> torch.dtype:
    if setting == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return torch_dtype(setting)


def decoder_layers(lm: nn.Module) -> List[nn.Module]:
    """The FSDP units: text decoder layers (and vision blocks of a VL model)."""
    inner = lm.model
    text = inner.language_model if hasattr(inner, "language_model") else inner
    units = list(text.layers)
    if hasattr(inner, "visual"):
        units += list(inner.visual.blocks)
    return units


def lr_lambda(warmup: int, scheduler: str, total_steps: Optional[int], min_lr_ratio: float):
    """Linear warmup over `warmup` optimizer steps (step k uses (k+1)/warmup), then constant or cosine down to
    min_lr_ratio at `total_steps`."""
    if scheduler not in ("constant", "cosine"):
        raise ValueError(f"backend.lr_scheduler={scheduler!r}: expected constant or cosine")
    if scheduler == "cosine" and not total_steps:
        raise ValueError("backend.lr_scheduler=cosine needs the total number of optimizer steps")

    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if scheduler == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return fn


class PolicyWithLogProbs(nn.Module):
    """The FSDP root: decoder forward plus the chunked log-prob head, so lm_head is gathered for it."""

    def __init__(self, lm: nn.Module, chunk_size: int, compiled: bool = False):
        super().__init__()
        self.lm = lm
        self.chunk_size, self.compiled = chunk_size, compiled

    def forward(self, input_ids, attention_mask, position_ids, response_mask, temperature: float, with_entropy: bool,
                pack: bool = False, multimodal: Optional[Dict[str, torch.Tensor]] = None):
        hidden = self._hidden(input_ids, attention_mask, position_ids, pack, multimodal or {})
        # the token at t is predicted from position t-1
        sel = response_mask[:, 1:].bool()
        h = hidden[:, :-1][sel]
        labels = input_ids[:, 1:][sel]
        logp, ent = chunked_logprobs_entropy(h, self.lm.lm_head.weight, labels, self.chunk_size, temperature, with_entropy,
                                             self.compiled)
        out_logp = hidden.new_zeros(input_ids.shape, dtype=torch.float32)
        out_logp[:, 1:][sel] = logp
        out_ent = None
        if ent is not None:
            out_ent = hidden.new_zeros(input_ids.shape, dtype=torch.float32)
            out_ent[:, 1:][sel] = ent
        return out_logp, out_ent

    def _hidden(self, input_ids, attention_mask, position_ids, pack, multimodal):
        base = self.lm.model
        if multimodal:
            return self._hidden_with_images(input_ids, attention_mask, multimodal)
        if not pack:
            return base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        use_cache=False, **multimodal).last_hidden_state
        valid = attention_mask.bool()
        packed = base(input_ids=input_ids[valid][None], position_ids=position_ids[valid][None], attention_mask=None,
                      use_cache=False, **packed_call_kwargs(valid.sum(1))).last_hidden_state
        hidden = packed.new_zeros(*input_ids.shape, packed.shape[-1])
        hidden[valid] = packed[0]
        return hidden

    def _hidden_with_images(self, input_ids, attention_mask, multimodal):
        """The VL model's forward with the image features at `image_mask` (the prompts' image tokens) and the 3-D
        positions of those tokens. transformers would take every token with the image id as an image slot, also
        one a response sampled; so the embeddings and positions are built here and passed in."""
        base, image_mask = self.lm.model, multimodal["image_mask"]
        grid = multimodal.get("image_grid_thw")
        embeds = base.get_input_embeddings()(input_ids)
        if multimodal.get("pixel_values") is not None:
            feats = torch.cat(base.get_image_features(multimodal["pixel_values"], grid, return_dict=True).pooler_output)
            if feats.shape[0] != int(image_mask.sum()):
                raise ValueError(f"{int(image_mask.sum())} image tokens in the prompts for {feats.shape[0]} image "
                                 "features: prompt ids and images do not belong together")
            embeds = embeds.masked_scatter(image_mask[..., None], feats.to(embeds.dtype))
        positions = mrope_positions(input_ids, attention_mask, image_mask, grid, self.lm.config)
        return base(inputs_embeds=embeds, attention_mask=attention_mask, position_ids=positions,
                    use_cache=False).last_hidden_state


# ---------------------------------------------------------------------------------------------- the engine
class FsdpTrainEngine(TrainEngine):
    """The policy (or, with `reference=True`, a frozen reference copy without optimizer) on one DP rank.

    cfg: the resolved run config. `total_steps`: optimizer steps of the whole run (needed by the cosine schedule).
    """

    def __init__(self, cfg: Any, *, rank: int, world_size: int, device: Any, dp_group: Optional[Any] = None,
                 reference: bool = False, total_steps: Optional[int] = None):
        self.cfg, self.rank, self.world_size, self.reference = cfg, rank, world_size, reference
        self.device = torch.device(device)
        self.backend, self.algo = cfg.backend, cfg.algorithm
        self.distributed = dist.is_available() and dist.is_initialized()
        if world_size > 1 and not self.distributed:
            raise RuntimeError(f"world_size={world_size} needs an initialised torch.distributed process group")
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group) if self.distributed else 1
        self.compute_dtype = mixed_precision_dtype(self.backend.mixed_precision, self.device)
        self.temperature = float(cfg.rollout.temperature) if cfg.rollout.temperature > 0 else 1.0
        self.text_only = not trains_vision(cfg.model, cfg.data)
        for key, why in ([] if reference else ignored_settings(self.backend)):
            log.warning("%s is not applied by the FSDP engine: %s", key, why)
        self.pack = bool(self.backend.remove_padding) and packing_supported(self.device)
        if self.pack:
            enable_packing()
        elif self.backend.remove_padding:
            log.info("backend.remove_padding: padded batches (packing needs flash-linear-attention on CUDA)")
        self.skipped_steps = 0
        # FSDP2's CPU offload keeps parameter shards, gradients and optimizer states on the host (one policy)
        b = self.backend
        self.offloaded = self.distributed and self.device.type != "cpu" and bool(
            b.offload_policy or b.param_offload or b.optimizer_offload or b.grad_offload)

        # A frozen reference never updates: keep it in the compute dtype. The policy keeps fp32 master weights.
        param_dtype = self.compute_dtype if reference else torch.float32
        seed = int(cfg.trainer.seed)
        if self.distributed:
            lm = build_model(cfg.model, dtype=param_dtype, device="meta", text_only=self.text_only)
        else:
            lm = build_model(cfg.model, dtype=param_dtype, device=self.device, seed=seed, text_only=self.text_only)
        lm.config.use_cache = False
        if self.pack:
            use_packed_attention(lm)
        if self.backend.gradient_checkpointing and not reference:
            enable_activation_checkpointing(lm)
        self.lm = lm
        self.module: nn.Module = PolicyWithLogProbs(lm, int(self.backend.logprob_chunk_size),
                                                    bool(self.backend.use_torch_compile))
        if self.distributed:
            self._shard()
            self._materialise(param_dtype, seed)
        if reference:
            self.module.requires_grad_(False)
        elif cfg.model.freeze_vision_tower and not self.text_only:
            self.lm.model.visual.requires_grad_(False)  # no gradients, no optimizer state; still exported
        self.module.eval()

        self.optimizer = self.scheduler = None
        if not reference:
            trainable = [p for p in self.module.parameters() if p.requires_grad]
            self.optimizer = torch.optim.AdamW(trainable, lr=float(self.backend.lr),
                                               betas=tuple(float(b) for b in self.backend.betas),
                                               weight_decay=float(self.backend.weight_decay))
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(
                int(self.backend.lr_warmup_steps), self.backend.lr_scheduler, total_steps, float(self.backend.min_lr_ratio)))

    # ------------------------------------------------------------------------------------------ setup
    def _shard(self) -> None:
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        if self.dp_group is not None:
            mesh = DeviceMesh.from_group(self.dp_group, self.device.type)
        else:
            mesh = init_device_mesh(self.device.type, (dist.get_world_size(),))
        mp = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
        offload = CPUOffloadPolicy() if self.offloaded else OffloadPolicy()
        kw = dict(mesh=mesh, mp_policy=mp, offload_policy=offload)
        for unit in decoder_layers(self.lm):
            fully_shard(unit, reshard_after_forward=bool(self.backend.reshard_after_forward), **kw)
        fully_shard(self.module, **kw)

    def _materialise(self, param_dtype: torch.dtype, seed: int) -> None:
        """Allocate this rank's shards and fill them from rank 0's full weights (random init or the checkpoint):
        only rank 0 ever holds the whole model, and only on CPU."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        self.module.to_empty(device="cpu" if self.offloaded else self.device)
        for module in self.module.modules():  # buffers (rotary inv_freq) are not offloaded: compute needs them on device
            for name, buf in module.named_buffers(recurse=False):
                module._buffers[name] = buf.to(self.device)
        init_rotary_buffers(self.lm)
        full: Dict[str, torch.Tensor] = {}
        if dist.get_rank() == 0:
            src = build_model(self.cfg.model, dtype=param_dtype, device="cpu", seed=seed, text_only=self.text_only)
            full = {f"lm.{k}": v for k, v in src.state_dict().items()}
        set_model_state_dict(self.module, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))

    # ------------------------------------------------------------------------------------------ forward
    def _autocast(self):
        if self.distributed or self.compute_dtype == torch.float32 or self.reference:
            return contextlib.nullcontext()  # FSDP's mixed-precision policy (or plain fp32) already decides
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    @property
    def micro_batch_layout(self) -> str:
        return "packed" if self.pack else "padded"

    def _forward(self, batch: Batch, with_entropy: bool):
        pack = self.pack and not batch.multimodal
        mm = {k: v.to(self.device) for k, v in batch.multimodal.items()}
        position_ids = batch.position_ids
        if position_ids is None:
            position_ids = (batch.attention_mask.long().cumsum(1) - 1).clamp(min=0)
        if mm:
            if self.text_only:
                raise ValueError("a multimodal batch needs a vision model and data.has_images=true")
            position_ids = None  # 3-D M-RoPE positions, from the image grids and image tokens
            mm["image_mask"] = prompt_image_mask(batch.input_ids, batch.attention_mask, batch.response_mask,
                                                 self.lm.config.image_token_id).to(self.device)
        with self._autocast():
            return self.module(batch.input_ids.to(self.device), batch.attention_mask.to(self.device),
                               None if position_ids is None else position_ids.to(self.device),
                               batch.response_mask.to(self.device), self.temperature, with_entropy, pack, mm)

    @torch.no_grad()
    def compute_log_probs(self, batch: Batch, with_entropy: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        self.module.eval()
        logp, ent = self._forward(batch, with_entropy)
        return logp, ent

    # ------------------------------------------------------------------------------------------ update
    def _all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the DP group (on the device: NCCL/HCCL reduce device tensors only); returned on the CPU."""
        if self.distributed:
            t = t.to(self.device)
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.dp_group)
        return t.cpu()

    def train_mini_batch(self, micro_batches: List[Batch], global_scale: Dict[str, float]) -> Dict[str, float]:
        if self.reference:
            raise RuntimeError("the reference engine is frozen: it has no optimizer")
        algo = self.algo
        agg = mini_batch_agg(micro_batches, global_scale, algo, int(self.cfg.data.max_response_length), self.dp_size,
                             self._all_reduce)

        self.module.train()
        self.optimizer.zero_grad(set_to_none=True)
        # sums over this rank: aggregated losses, then masked token sums and counts for the token-mean metrics
        # (kept on the device: reading them per micro batch would stall the launch queue)
        sums = torch.zeros(len(ACTOR_SUMS), dtype=torch.float64, device=self.device)
        for mb in micro_batches:
            logp, ent = self._forward(mb, with_entropy=True)
            loss, mb_sums = actor_loss(logp, ent, _on(mb.old_log_probs, self.device), _on(mb.ref_log_probs, self.device),
                                       mb.advantages.to(self.device), mb.response_mask.to(self.device), algo, agg)
            loss.backward()
            sums += mb_sums
        sums = self._all_reduce(sums)
        grad_norm = self._clip_grad_norm()
        lr = self.optimizer.param_groups[0]["lr"]
        nonfinite_loss = sums[ACTOR_SUMS.index("nonfinite")] > 0
        if nonfinite_loss or not math.isfinite(grad_norm):
            self.skipped_steps += 1
            log.warning("skipping optimizer step: non-finite %s", "loss" if nonfinite_loss else f"grad norm {grad_norm}")
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        with warnings.catch_warnings():  # the schedule follows steps taken or skipped; torch warns on a skipped first
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            self.scheduler.step()
        self.module.eval()
        return {
            **actor_metrics(sums, self.dp_size),
            "actor/grad_norm": grad_norm,
            "actor/lr": lr,
            "actor/skipped_steps": float(self.skipped_steps),
        }

    def _clip_grad_norm(self) -> float:
        """Global L2 norm of the gradients, then clipping to backend.grad_clip. FSDP shards every parameter over
        the DP group (each element on one rank), so the squared norm is the all-reduced sum of local shards'.
        Computed on local shards so it also works when they live on the host (CPU offload)."""
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for g in local:
            sq += g.detach().double().pow(2).sum().to(self.device)
        norm = math.sqrt(float(self._all_reduce(sq)))
        clip = float(self.backend.grad_clip or 0)
        if clip > 0 and math.isfinite(norm) and norm > clip:
            coef = clip / (norm + 1e-6)
            for g in local:
                g.mul_(coef)
        return norm

    # ------------------------------------------------------------------------------------------ weights
    def export_weights(self, bucket_mb: int, device: Optional[Any] = None) -> Iterator[List[Tuple[str, torch.Tensor]]]:
        """Collective on every rank (each gathers one parameter at a time); tensors in `model.dtype` on CPU, or on
        `device` (a rollout engine on the trainer's own device takes them without a round trip through the host)."""
        out_dtype = torch_dtype(self.cfg.model.dtype)
        out_device = torch.device("cpu") if device is None else torch.device(device)
        limit = float(bucket_mb) * 2 ** 20  # <= 0: one tensor per bucket
        bucket: List[Tuple[str, torch.Tensor]] = []
        size = 0
        for name, p in self.lm.named_parameters():
            t = p.detach()
            if hasattr(t, "full_tensor"):
                if t.device.type != self.device.type:  # host-offloaded shard: gather on the device's backend
                    t = t.to(self.device)
                t = t.full_tensor()
            t = t.to(device=out_device, dtype=out_dtype)
            bucket.append((name, t))
            size += t.numel() * t.element_size()
            if size >= limit:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket

    def state_dict_for_checkpoint(self) -> Dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if self.reference:
            return {"model": get_model_state_dict(self.module)}
        model_sd, optim_sd = get_state_dict(self.module, self.optimizer)
        return {"model": model_sd, "optimizer": optim_sd, "scheduler": self.scheduler.state_dict(),
                "skipped_steps": self.skipped_steps}

    def load_checkpoint_state(self, state: Dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        if self.reference:
            set_model_state_dict(self.module, state["model"])
            return
        set_state_dict(self.module, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
