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

The pieces: `support` (what builds on this stack), `ranks` (process groups), `build` (config and chunks),
`weights` (HF weights in and out), `batches` and `step` (the schedule's inputs and passes), `optimizer`,
`checkpoint_state`. Not here: packed (THD) sequences and context parallelism (they need TE attention in the specs;
the declaration in `config.capabilities` refuses or warns before launch).
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from qwen35rl.algo import lr_schedule
from qwen35rl.algo.loss import TrainLoss
from qwen35rl.config.capabilities import compiles_log_probs
from qwen35rl.config.layout import Layout
from qwen35rl.engines.base import Batch, TrainEngine, mini_batch_scale
from qwen35rl.engines.host_offload import HostOffload
from qwen35rl.engines.megatron import ascend, checkpoint_state
from qwen35rl.engines.megatron import mapping as mp
from qwen35rl.engines.megatron import optimizer as opt
from qwen35rl.engines.megatron.batches import BatchShape
from qwen35rl.engines.megatron.build import build, param_dtype
from qwen35rl.engines.megatron.ranks import Ranks, check_world, transformer_parallel
from qwen35rl.engines.megatron.step import Step
from qwen35rl.engines.megatron.support import check_stack
from qwen35rl.engines.megatron.weights import ChunkWeights, hf_source
from qwen35rl.models.build import torch_dtype, trains_vision


class MegatronTrainEngine(TrainEngine):
    """The policy (or, with `reference=True`, a frozen reference copy without optimizer) on one rank.

    cfg: the resolved run config; `layout`: the driver's layout of it (`config.layout.derive_layout`); the process
    group must be initialised (every rank constructs together). `hf_state`: HF tensors to start from instead of
    `model.init` (tests, weight hand-over).
    """

    # the pipeline schedule runs every micro batch of a step at the largest one's rows and columns
    micro_batch_layout = "uniform"

    def __init__(self, cfg: Any, *, layout: Layout, rank: int, world_size: int, device: Any, reference: bool = False,
                 total_steps: Optional[int] = None, hf_state: Optional[Dict[str, torch.Tensor]] = None):
        check_world(layout, world_size)
        self.cfg, self.layout, self.reference, self.total_steps = cfg, layout, reference, total_steps
        self.backend = cfg.backend
        self.device = torch.device(device)
        self._host = HostOffload()  # what offload_states moved to the host
        if self.device.type == "cpu":
            from qwen35rl.engines.megatron import cpu

            cpu.install()  # megatron-core assumes CUDA: its stand-ins, before megatron is imported
        # MindSpeed must patch megatron before anything imports it
        self.platform = ascend.prepare_platform(cfg.hw, transformer_parallel(layout))
        self.te = check_stack(cfg, layout, self.device)
        self.ranks = Ranks(layout, self.device, timeout_s=self.backend.dist_timeout_s, seed=cfg.trainer.seed)

        self.shape = mp.Qwen35Shape.from_model_config(cfg.model)
        self.vision = trains_vision(cfg.model, cfg.data)
        built = build(cfg, layout, self.shape, platform=self.platform, te=self.te, device=self.device,
                      reference=reference, vision=self.vision)
        self.tconfig, self.chunks = built.tconfig, built.chunks
        # the HF names exports carry: those of the model class the run loads and exports (VL on image data)
        self.weights = ChunkWeights(chunks=self.chunks, chunk_layers=built.chunk_layers, shape=self.shape,
                                    meta=built.meta, vision_names=built.vision_names,
                                    hf_prefix=mp.VL_PREFIX if self.vision else mp.CAUSAL_LM_PREFIX, ranks=self.ranks,
                                    device=self.device)
        self.weights.load(hf_source(cfg.model, hf_state, dtype=param_dtype(self.backend), seed=cfg.trainer.seed,
                                    vision=self.vision), strict=self.platform.strict_load)

        self.skipped_steps = 0
        self.steps = 0
        if reference:
            for c in self.chunks:
                c.requires_grad_(False)
                c.eval()
            self.model, self.optimizer = list(self.chunks), None
        else:
            self.model, self.optimizer = opt.wrap_and_optimize(self.tconfig, self.chunks, self.backend,
                                                               param_dtype(self.backend), self.device,
                                                               self.te.use_precision_aware_optimizer)
            self.lr_at = lr_schedule.from_backend(self.backend, total_steps)
        temperature = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
        batch_shape = BatchShape(tp=layout.tp, device=self.device, micro_multiple=layout.pp if layout.vpp else 1,
                                 vl_config=built.meta.config if self.vision else None)
        self.step = Step(self.model, self.ranks, batch_shape, temperature, self.backend.logprob_chunk_size,
                         compiles_log_probs(self.backend.use_torch_compile, self.device.type))

    # ------------------------------------------------------------------------------------------ ranks
    @property
    def dp_rank(self) -> int:
        return self.ranks.dp_rank

    @property
    def dp_size(self) -> int:
        return self.ranks.dp_size

    # ------------------------------------------------------------------------------------------ passes
    def compute_log_probs(self, batch: Batch, with_entropy: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        return self.step.log_probs(batch, with_entropy)

    def train_mini_batch(self, micro_batches: List[Batch], loss_fn: TrainLoss,
                         global_scale: Optional[Dict[str, float]] = None) -> Dict[str, float]:
        if self.reference:
            raise RuntimeError("the reference engine is frozen: it has no optimizer")
        scale = mini_batch_scale(micro_batches, global_scale or {}, self.dp_size, self.ranks.sum_over_dp)
        self.optimizer.zero_grad()
        stats = self.step.backward(micro_batches, loss_fn, scale)
        lr = self.backend.lr * self.lr_at(self.steps)
        grad_norm, applied = opt.guarded_step(self.optimizer, self.model, self.device, lr,
                                              nonfinite_loss=loss_fn.nonfinite(stats))
        self.skipped_steps += not applied
        self.steps += 1
        for c in self.model:
            c.eval()
        return {
            **loss_fn.metrics(stats, self.dp_size, rollout_gap=micro_batches[0].rollout_log_probs is not None),
            "actor/grad_norm": grad_norm,
            "actor/lr": lr,
            "actor/skipped_steps": float(self.skipped_steps),
        }

    # ------------------------------------------------------------------------------------------ weights out
    def export_weights(self, bucket_mb: int, device: Optional[Any] = None) -> Iterator[List[Tuple[str, torch.Tensor]]]:
        """HF-named full tensors (tied embedding once) in model.dtype, on CPU or on `device` (a rollout engine on
        the trainer's device skips the host). Collective over every rank, one map at a time."""
        return self.weights.export(bucket_mb, torch_dtype(self.cfg.model.dtype), device)

    # ------------------------------------------------------------------------------------------ offload
    def _torch_optimizers(self) -> List[Any]:
        return opt.torch_optimizers(self.optimizer)

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

    # ------------------------------------------------------------------------------------------ checkpoints
    def checkpoint_layout(self) -> Dict[str, Any]:
        """What decides this engine's checkpoint keys and shapes (`checkpoint_state.shard_layout`)."""
        return checkpoint_state.shard_layout(self.cfg, self.layout)

    def state_dict_for_checkpoint(self) -> Dict[str, Any]:
        key = self.ranks.key()
        model = {f"{key}/{ci}/{name}": p.data for ci, c in enumerate(self.chunks) for name, p in c.named_parameters()}
        state = {"model": model, checkpoint_state.LAYOUT_KEY: checkpoint_state.encode(self.checkpoint_layout())}
        if self.reference:
            return state
        counters = torch.tensor([self.steps, self.skipped_steps], dtype=torch.int64)
        return {**state, "optimizer": opt.optimizer_tensors(self.optimizer, f"rank{dist.get_rank()}"),
                f"counters_rank{dist.get_rank()}": counters}

    def load_checkpoint_state(self, state: Dict[str, Any]) -> None:
        # DCP loaded into the tensors handed out by state_dict_for_checkpoint, which are the live ones
        checkpoint_state.check_loaded(state, self.checkpoint_layout())
        if self.reference:
            return
        opt.restore_group_steps(self.optimizer, state["optimizer"], f"rank{dist.get_rank()}")
        counters = state[f"counters_rank{dist.get_rank()}"]
        self.steps, self.skipped_steps = int(counters[0]), int(counters[1])
