"""TrainEngine over a transformers Qwen3.5 model with FSDP2 (`fully_shard` per decoder layer, then the root).

Without an initialised process group (one CPU process, unit tests) the same code runs on a plain module.
Parameters are kept in fp32 (the optimizer's master copy); `backend.mixed_precision` picks bf16 compute on
accelerators. Log-probs come from the chunked vocab projection of `engines.logprob`, inside the FSDP root's
forward so that FSDP gathers lm_head for it and reduce-scatters its gradient.

Ranks (the driver's `Layout`): FSDP shard groups are `fsdp_size` consecutive ranks, replicated world / fsdp_size
times (HSDP when fsdp_size < world); Ulysses SP groups are `sp` consecutive ranks that take the same micro batches
and split each packed row between them (`engines.ulysses`). FSDP averages gradients over every rank of the world,
SP ranks included, whatever the two sizes; the loss scale (`agg_loss`'s dp_size = world) accounts for it.
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

from qwen35rl.algo import lr_schedule
from qwen35rl.algo.loss import LossInputs, TrainLoss
from qwen35rl.config import capabilities
from qwen35rl.config.layout import Layout
from qwen35rl.engines.base import Batch, TrainEngine, mini_batch_scale
from qwen35rl.engines.logprob import chunked_logprobs_entropy
from qwen35rl.engines.packed_attention import use_packed_attention
from qwen35rl.engines import host_optimizer, packed_gdn
from qwen35rl.engines.gdn_layer import use_training_forward
from qwen35rl.engines.packed_gdn import enable_packing
from qwen35rl.engines.ulysses import SpGroup, gather_tokens, sequence_parallel, use_ulysses
from qwen35rl.models.build import (build_model, enable_activation_checkpointing, init_rotary_buffers, torch_dtype,
                                   trains_vision)
from qwen35rl.models.image_tokens import mrope_positions, prompt_image_mask

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------- helpers
def packing_supported(device: torch.device, sp: int = 1) -> bool:
    """Whether packing pays (what backend.remove_padding=null decides): where flash-linear-attention's GDN kernel
    takes the sequence boundaries (CUDA); elsewhere the recurrence runs once per document (`packed_gdn`), slower
    than a padded batch, so there only Ulysses SP (which splits one packed row) packs. The short convolution keeps
    documents apart through `packed_gdn.enable_packing`, full attention through `packed_attention`."""
    return sp > 1 or (device.type == "cuda" and importlib.util.find_spec("fla") is not None)


def packs(remove_padding: Optional[bool], device: torch.device, sp: int = 1) -> bool:
    """backend.remove_padding: true packs, false pads, null packs where it pays."""
    return remove_padding if remove_padding is not None else packing_supported(device, sp)


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


class PolicyWithLogProbs(nn.Module):
    """The FSDP root: decoder forward plus the chunked log-prob head, so lm_head is gathered for it."""

    def __init__(self, lm: nn.Module, chunk_size: int, compiled: bool = False):
        super().__init__()
        self.lm = lm
        self.chunk_size, self.compiled = chunk_size, compiled

    def forward(self, input_ids, attention_mask, position_ids, response_mask, temperature: float, with_entropy: bool,
                pack: bool = False, multimodal: Optional[Dict[str, torch.Tensor]] = None, sp: Optional[SpGroup] = None):
        if pack:
            return self._packed(input_ids, attention_mask, position_ids, response_mask, temperature, with_entropy,
                                multimodal or {}, sp)
        if multimodal:
            hidden = self._hidden_with_images(input_ids, attention_mask, multimodal)
        else:
            hidden = self.lm.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   use_cache=False).last_hidden_state
        # the token at t is predicted from position t-1
        sel = response_mask[:, 1:].bool()
        logp, ent = self._head(hidden[:, :-1][sel], input_ids[:, 1:][sel], temperature, with_entropy)
        out_logp = hidden.new_zeros(input_ids.shape, dtype=torch.float32)
        out_logp[:, 1:][sel] = logp
        out_ent = None
        if ent is not None:
            out_ent = hidden.new_zeros(input_ids.shape, dtype=torch.float32)
            out_ent[:, 1:][sel] = ent
        return out_logp, out_ent

    def _head(self, h, labels, temperature, with_entropy):
        return chunked_logprobs_entropy(h, self.lm.lm_head.weight, labels, self.chunk_size, temperature, with_entropy,
                                        self.compiled)

    def _packed(self, input_ids, attention_mask, position_ids, response_mask, temperature, with_entropy, multimodal,
                sp: Optional[SpGroup]):
        """The valid tokens of all rows as one row of documents. Under SP each rank runs 1/sp of that row (padded
        by one extra document to a multiple of sp) and the log-probs are gathered back. What depends on the whole
        sequence happens first, on every rank: image features merged into the embeddings, M-RoPE positions, the
        labels shifted by one."""
        valid = attention_mask.bool()
        base = self.lm.model
        text = base.language_model if hasattr(base, "language_model") else base
        if multimodal:
            embeds, positions = self._embeds_with_images(input_ids, attention_mask, multimodal)
            # a 4th row first: transformers takes it as the text positions, whose restarts mark the documents
            positions = torch.cat([(attention_mask.long().cumsum(1) - 1).clamp(min=0)[None], positions])
        else:
            embeds, positions = text.embed_tokens(input_ids), position_ids
        # position t predicts the token at t + 1; the last position of a row predicts nothing
        next_ids = torch.nn.functional.pad(input_ids[:, 1:], (0, 1))
        next_sel = torch.nn.functional.pad(response_mask[:, 1:].bool(), (0, 1))
        rows, pos, labels, sel = embeds[valid], positions[..., valid], next_ids[valid], next_sel[valid]
        lengths = valid.sum(1)
        lengths = lengths[lengths > 0]
        n = rows.shape[0]
        if sp is not None:
            pad = -n % sp.size
            if pad:  # a document of its own at the end: nothing before it sees it, and it predicts nothing
                rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[-1])])
                pad_pos = torch.arange(pad, device=pos.device, dtype=pos.dtype).expand(*pos.shape[:-1], pad)
                pos = torch.cat([pos, pad_pos], -1)
                labels = torch.nn.functional.pad(labels, (0, pad))
                sel = torch.nn.functional.pad(sel, (0, pad))
                lengths = torch.cat([lengths, lengths.new_full((1,), pad)])
            part = slice(sp.rank * (n + pad) // sp.size, (sp.rank + 1) * (n + pad) // sp.size)
            rows, pos, labels, sel = rows[part], pos[..., part], labels[part], sel[part]
        # under SP the masks are the mixers' business (this rank holds part of the row): none built
        masks = None if sp is None else {"full_attention": None, "linear_attention": None}
        with sequence_parallel(sp):
            hidden = text(inputs_embeds=rows[None], position_ids=pos[..., None, :], attention_mask=masks,
                          use_cache=False, **packed_call_kwargs(lengths)).last_hidden_state[0]
        logp, ent = self._head(hidden[sel], labels[sel], temperature, with_entropy)
        outs = []
        for values in (logp, ent):
            if values is None:
                outs.append(None)
                continue
            row = hidden.new_zeros(sel.shape, dtype=torch.float32).masked_scatter(sel, values)
            if sp is not None:
                row = gather_tokens(row, sp)[:n]
            per_pos = hidden.new_zeros(input_ids.shape, dtype=torch.float32)
            per_pos[valid] = row
            outs.append(torch.nn.functional.pad(per_pos[:, :-1], (1, 0)))  # the log-prob of token t sits at t
        return outs[0], outs[1]

    def _embeds_with_images(self, input_ids, attention_mask, multimodal):
        """Token embeddings with the image features at `image_mask` (the prompts' image tokens), and the 3-D
        positions [3, B, T] of every token. transformers would take every token with the image id as an image
        slot, also one a response sampled; so the embeddings and positions are built here."""
        base, image_mask = self.lm.model, multimodal["image_mask"]
        grid = multimodal.get("image_grid_thw")
        embeds = base.get_input_embeddings()(input_ids)
        if multimodal.get("pixel_values") is not None:
            feats = torch.cat(base.get_image_features(multimodal["pixel_values"], grid, return_dict=True).pooler_output)
            if feats.shape[0] != int(image_mask.sum()):
                raise ValueError(f"{int(image_mask.sum())} image tokens in the prompts for {feats.shape[0]} image "
                                 "features: prompt ids and images do not belong together")
            embeds = embeds.masked_scatter(image_mask[..., None], feats.to(embeds.dtype))
        return embeds, mrope_positions(input_ids, attention_mask, image_mask, grid, self.lm.config)

    def _hidden_with_images(self, input_ids, attention_mask, multimodal):
        embeds, positions = self._embeds_with_images(input_ids, attention_mask, multimodal)
        return self.lm.model(inputs_embeds=embeds, attention_mask=attention_mask, position_ids=positions,
                             use_cache=False).last_hidden_state


# ---------------------------------------------------------------------------------------------- the engine
class FsdpTrainEngine(TrainEngine):
    """The policy (or, with `reference=True`, a frozen reference copy without optimizer) on one rank.

    cfg: the resolved run config; layout: the driver's `Layout` (fsdp_size, sp, dp). `dp_group`: the ranks the engine
    spans (default: the world). `dp_rank` / `dp_size`: the data-parallel share this rank trains on (its SP group's:
    world / sp shares). `total_steps`: optimizer steps of the whole run (needed by the cosine schedule).
    """

    shard_single_rank = True
    """Shard with FSDP2 also when the engine has one rank (then FSDP's mixed-precision policy casts the weights);
    False runs that rank's model as a plain module under autocast."""

    copies_initial_weights = True
    """The reference policy takes its weights from the policy's shards (`init_from`) instead of drawing or reading
    them again: a random init of the 4B drew for ~45 s on the host."""

    def __init__(self, cfg: Any, *, layout: Layout, rank: int, world_size: int, device: Any,
                 dp_group: Optional[Any] = None, reference: bool = False, total_steps: Optional[int] = None,
                 init_from: Optional["FsdpTrainEngine"] = None):
        """`init_from`: a sharded engine of the same model and layout whose current weights this one starts from
        (the reference policy from the freshly built policy: its initial weights, cast to the compute dtype)."""
        self.cfg, self.layout, self.rank, self.world_size, self.reference = cfg, layout, rank, world_size, reference
        self.device = torch.device(device)
        # what the plan refuses, refused here with its problem; what it warns of, logged (once: not for the reference)
        for p in capabilities.check_engine(cfg, layout, capabilities.Stack.installed(self.device.type)):
            if not reference:
                log.warning("%s [%s]", p.message, p.code)
        self.backend = cfg.backend
        self.distributed = dist.is_available() and dist.is_initialized() and (world_size > 1 or self.shard_single_rank)
        if world_size > 1 and not self.distributed:
            raise RuntimeError(f"world_size={world_size} needs an initialised torch.distributed process group")
        self._groups(dp_group)
        self.compute_dtype = mixed_precision_dtype(self.backend.mixed_precision, self.device)
        self.temperature = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
        self.text_only = not trains_vision(cfg.model, cfg.data)
        self.pack = packs(self.backend.remove_padding, self.device, layout.sp)
        compiled = capabilities.compiles_log_probs(self.backend.use_torch_compile, self.device.type)
        if self.pack or self.device.type == "cuda":
            enable_packing()  # on CUDA padded batches too: their convolution goes to short_conv as well
            packed_gdn.COMPILE = compiled
        log.info("%s batches (backend.remove_padding=%s)", "packed" if self.pack else "padded",
                 str(self.backend.remove_padding).lower())
        self.skipped_steps = 0
        # FSDP2's CPU offload keeps parameter shards, gradients and optimizer states on the host (one policy)
        b = self.backend
        self.offloaded = self.distributed and self.device.type != "cpu" and bool(
            b.offload_policy or b.param_offload or b.optimizer_offload or b.grad_offload)
        self.host_threads = host_optimizer.node_thread_share(cfg.hw.devices_per_node)

        # A frozen reference never updates: keep it in the compute dtype. The policy keeps fp32 master weights.
        param_dtype = self.compute_dtype if reference else torch.float32
        seed = cfg.trainer.seed
        if self.distributed:
            lm = build_model(cfg.model, dtype=param_dtype, device="meta", text_only=self.text_only)
        else:
            lm = build_model(cfg.model, dtype=param_dtype, device=self.device, seed=seed, text_only=self.text_only)
        lm.config.use_cache = False
        if self.sp is not None:
            use_ulysses(lm)
        else:
            use_training_forward(lm)
            if self.pack:
                use_packed_attention(lm)
        if self.backend.gradient_checkpointing and not reference:
            enable_activation_checkpointing(lm)
        if self.backend.compile_layers:
            from qwen35rl.engines.compile_regions import compile_layer_parts

            compile_layer_parts(decoder_layers(lm))
        self.lm = lm
        self.module: nn.Module = PolicyWithLogProbs(
            lm, self.backend.logprob_chunk_size, compiled)
        if self.distributed:  # (a plain module, one rank without a process group, was built with its weights)
            self._shard()
            if not (init_from is not None and init_from.distributed and self._copy_weights(init_from)):
                self._materialise(param_dtype, seed)
        if reference:
            self.module.requires_grad_(False)
        elif cfg.model.freeze_vision_tower and not self.text_only:
            self.lm.model.visual.requires_grad_(False)  # no gradients, no optimizer state; still exported
        self.module.eval()

        self.optimizer = self.scheduler = None
        if not reference:
            trainable = [p for p in self.module.parameters() if p.requires_grad]
            self.optimizer = host_optimizer.adamw(trainable, b, on_host=self.offloaded)
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer,
                                                               lr_schedule.from_backend(b, total_steps))

    # ------------------------------------------------------------------------------------------ setup
    def _groups(self, group: Optional[Any]) -> None:
        """The meshes over the engine's ranks (consecutive ranks form an FSDP shard group and an SP group):
        `fsdp_mesh` (shard, or replicate x shard), the SP group and the DP group (one rank of each SP group)."""
        lay = self.layout
        self.grad_ranks = dist.get_world_size(group) if self.distributed else 1
        """Ranks FSDP averages gradients over: the loss scale undoes that average."""
        if self.grad_ranks != lay.world or lay.world % lay.fsdp_size or lay.world != lay.dp * lay.sp:
            raise ValueError(f"layout world {lay.world} = dp {lay.dp} x sp {lay.sp}, fsdp_size {lay.fsdp_size}: "
                             f"does not fit the engine's {self.grad_ranks} ranks")
        self.dp_size, self.dp_rank = lay.dp, (dist.get_group_rank(group, dist.get_rank()) if group is not None
                                              else self.rank) // lay.sp
        self.sp: Optional[SpGroup] = None
        self.dp_group = group
        self.fsdp_mesh = None
        if not self.distributed:
            return
        from torch.distributed.device_mesh import DeviceMesh

        ranks = torch.tensor(dist.get_process_group_ranks(group) if group is not None else range(lay.world))
        replicas = lay.world // lay.fsdp_size
        if replicas == 1:
            self.fsdp_mesh = DeviceMesh(self.device.type, ranks, mesh_dim_names=("shard",))
        else:
            self.fsdp_mesh = DeviceMesh(self.device.type, ranks.reshape(replicas, lay.fsdp_size),
                                        mesh_dim_names=("replicate", "shard"))
        self.shard_group = self.fsdp_mesh["shard"].get_group()
        if lay.sp > 1:
            seq_mesh = DeviceMesh(self.device.type, ranks.reshape(lay.dp, lay.sp), mesh_dim_names=("dp", "sp"))
            sp_group = seq_mesh["sp"].get_group()
            self.sp = SpGroup(sp_group, lay.sp, dist.get_rank(sp_group))
            self.dp_group = seq_mesh["dp"].get_group()

    def _shard(self) -> None:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
        offload = CPUOffloadPolicy() if self.offloaded else OffloadPolicy()
        kw = dict(mesh=self.fsdp_mesh, mp_policy=mp, offload_policy=offload)
        for unit in decoder_layers(self.lm):
            fully_shard(unit, reshard_after_forward=self.backend.reshard_after_forward, **kw)
        fully_shard(self.module, **kw)

    def _allocate(self) -> None:
        """Storage for this rank's shards (on the host when offloaded) and the buffers, still uninitialised."""
        self.module.to_empty(device="cpu" if self.offloaded else self.device)
        for module in self.module.modules():  # buffers (rotary inv_freq) are not offloaded: compute needs them on device
            for name, buf in module.named_buffers(recurse=False):
                module._buffers[name] = buf.to(self.device)
        init_rotary_buffers(self.lm)

    def _copy_weights(self, source: "FsdpTrainEngine") -> bool:
        """This rank's shards (and persistent buffers) copied from `source`'s, cast to this engine's dtype: no
        collective, no full model anywhere. False, and nothing allocated, where the two are not sharded alike."""
        mine, theirs = self.module.state_dict(), source.module.state_dict()

        def sharding(t: torch.Tensor) -> Any:
            return (tuple(t.shape), getattr(t, "placements", None))

        if mine.keys() != theirs.keys() or any(sharding(t) != sharding(theirs[k]) for k, t in mine.items()):
            log.info("the reference policy builds its own initial weights: its shards differ from the policy's")
            return False
        self._allocate()
        mine = self.module.state_dict()  # the allocated storage
        with torch.no_grad():
            for name, dst in mine.items():
                src = theirs[name]
                local = hasattr(dst, "to_local")
                (dst.to_local() if local else dst).copy_(src.to_local() if local else src)
        return True

    def _materialise(self, param_dtype: torch.dtype, seed: int) -> None:
        """Allocate this rank's shards and fill them from rank 0's full weights (random init or the checkpoint):
        only rank 0 ever holds the whole model, and only on CPU."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        self._allocate()
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
        """Packed micro batches cost their tokens (under SP: over the SP group, each rank 1/sp of them)."""
        return "packed" if self.pack else "padded"

    def _forward(self, batch: Batch, with_entropy: bool):
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
                               batch.response_mask.to(self.device), self.temperature, with_entropy, self.pack, mm, self.sp)

    @torch.no_grad()
    def compute_log_probs(self, batch: Batch, with_entropy: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        self.module.eval()
        logp, ent = self._forward(batch, with_entropy)
        return logp, ent

    # ------------------------------------------------------------------------------------------ update
    def _all_reduce(self, t: torch.Tensor, group: Optional[Any] = None) -> torch.Tensor:
        """Sum over the DP group (one rank per SP group: each micro batch once), or `group` (on the device:
        NCCL/HCCL reduce device tensors only); returned on the CPU."""
        if self.distributed:
            t = t.to(self.device)
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group or self.dp_group)
        return t.cpu()

    def train_mini_batch(self, micro_batches: List[Batch], loss_fn: TrainLoss,
                         global_scale: Optional[Dict[str, float]] = None) -> Dict[str, float]:
        if self.reference:
            raise RuntimeError("the reference engine is frozen: it has no optimizer")
        # every rank of an SP group computes its micro batch's whole loss from the gathered log-probs, but its
        # gradient only through its own tokens; FSDP averages over all grad_ranks: the loss scale undoes that
        scale = mini_batch_scale(micro_batches, global_scale or {}, self.grad_ranks, self._all_reduce)

        # offloaded: gradients accumulate and the optimizer steps on the host, on this device's share of its cores
        threads = host_optimizer.torch_threads(self.host_threads) if self.offloaded else contextlib.nullcontext()
        with threads:
            self.module.train()
            self.optimizer.zero_grad(set_to_none=True)
            # the loss's statistics over this rank's micro batches (kept on the device: reading them per micro
            # batch would stall the launch queue)
            stats = loss_fn.zeros(self.device)
            for mb in micro_batches:
                logp, ent = self._forward(mb, with_entropy=True)
                loss, mb_stats = loss_fn(LossInputs(
                    logp, ent, mb.response_mask.to(self.device), _on(mb.advantages, self.device),
                    _on(mb.old_log_probs, self.device), _on(mb.ref_log_probs, self.device),
                    _on(mb.rollout_log_probs, self.device)), scale)
                loss.backward()
                stats = loss_fn.combine(stats, mb_stats)
            stats = loss_fn.reduce(stats, self._all_reduce)
            grad_norm = self._clip_grad_norm()
            lr = self.optimizer.param_groups[0]["lr"]
            nonfinite_loss = loss_fn.nonfinite(stats)
            if nonfinite_loss or not math.isfinite(grad_norm):
                self.skipped_steps += 1
                log.warning("skipping optimizer step: non-finite %s",
                            "loss" if nonfinite_loss else f"grad norm {grad_norm}")
            else:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            # the schedule follows steps taken or skipped; torch warns on a skipped first
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
                self.scheduler.step()
        self.module.eval()
        return {
            **loss_fn.metrics(stats, self.grad_ranks, rollout_gap=micro_batches[0].rollout_log_probs is not None),
            "actor/grad_norm": grad_norm,
            "actor/lr": lr,
            "actor/skipped_steps": float(self.skipped_steps),
        }

    def _clip_grad_norm(self) -> float:
        """Global L2 norm of the gradients, then clipping to backend.grad_clip. FSDP shards every parameter over
        a shard group (each element on one rank of it; HSDP replicates the group), so the squared norm is the sum
        of local shards' over the shard group. Computed on local shards so it also works when they live on the host
        (CPU offload)."""
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        sq = host_optimizer.squared_norm(local, self.offloaded, self.device)
        norm = math.sqrt(float(self._all_reduce(sq, self.shard_group))) if self.distributed else math.sqrt(float(sq))
        clip = self.backend.grad_clip or 0
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
        self.skipped_steps = state.get("skipped_steps", 0)
