"""The policy's DDP wrapping and megatron's (distributed) optimizer, the guarded optimizer step, and the optimizer
state as plain tensors for checkpoints."""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


def wrap_and_optimize(tconfig: Any, chunks: Sequence[torch.nn.Module], backend: Any, dtype: torch.dtype,
                      device: torch.device, precision_aware: bool) -> Tuple[List[Any], Any]:
    """The chunks under megatron's DDP (gradient buffers in fp32) and the optimizer over them; the loss scaling
    and gradient finalisation hooks go into `tconfig` for the schedule."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    b = backend
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=b.use_distributed_optimizer)
    model = [DistributedDataParallel(config=tconfig, ddp_config=ddp_config, module=c, disable_bucketing=i > 0)
             for i, c in enumerate(chunks)]
    opt = OptimizerConfig(
        optimizer="adam", lr=b.lr, min_lr=b.lr * b.min_lr_ratio, weight_decay=b.weight_decay,
        adam_beta1=b.betas[0], adam_beta2=b.betas[1], clip_grad=b.grad_clip if b.grad_clip and b.grad_clip > 0 else 0.0,
        bf16=dtype == torch.bfloat16, params_dtype=dtype, use_distributed_optimizer=b.use_distributed_optimizer,
        # on a CPU device the optimizer already runs on the host (megatron's hybrid optimizer expects a GPU)
        optimizer_cpu_offload=b.optimizer_cpu_offload and device.type != "cpu",
        optimizer_offload_fraction=b.optimizer_offload_fraction,
        overlap_cpu_optimizer_d2h_h2d=b.overlap_cpu_optimizer_d2h_h2d, use_precision_aware_optimizer=precision_aware)
    optimizer = get_megatron_optimizer(opt, model)
    tconfig.grad_scale_func = optimizer.scale_loss
    tconfig.finalize_model_grads_func = finalize_model_grads
    return model, optimizer


def torch_optimizers(optimizer: Any) -> List[Any]:
    """The torch optimizers over this rank's fp32 main-parameter shards (one per megatron optimizer: dense and
    expert parameters are chained)."""
    return [opt.optimizer for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]]


def grads_finite(model: Sequence[torch.nn.Module], device: torch.device) -> bool:
    """Whether every rank's reduced gradients are finite (checked before the step: megatron's bf16 optimizer
    would apply a NaN update)."""
    local = [p.main_grad.isfinite().all() for c in model for p in c.parameters()
             if getattr(p, "main_grad", None) is not None]
    bad = torch.tensor(0.0 if not local or torch.stack(local).all() else 1.0, device=device)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bad.item() == 0.0


def guarded_step(optimizer: Any, model: Sequence[torch.nn.Module], device: torch.device, lr: float,
                 nonfinite_loss: bool) -> Tuple[float, bool]:
    """One optimizer step at `lr` unless the loss or a gradient is non-finite: (grad norm or nan, applied)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    grad_norm, applied = float("nan"), False
    if nonfinite_loss or not grads_finite(model, device):
        log.warning("skipping optimizer step: non-finite %s", "loss" if nonfinite_loss else "gradients")
    else:
        applied, norm, _ = optimizer.step()
        grad_norm = float(norm) if norm is not None else float("nan")
        if not applied:
            log.warning("the optimizer skipped the step")
    optimizer.zero_grad()
    return grad_norm, bool(applied)


def optimizer_tensors(optimizer: Any, prefix: str) -> Dict[str, torch.Tensor]:
    """Main (fp32) params and Adam moments of this rank's optimizer shards, as plain tensors under keys unique
    to this rank (`prefix`; DCP stores each once), and each param group's step count: torch's Adam counts steps
    per parameter (a state tensor), Transformer Engine's FusedAdam (megatron's Adam wherever TE is installed) in
    the param group, which `restore_group_steps` puts back after loading. Which tensors a rank holds depends on
    the layout: see `checkpoint_state`."""
    out: Dict[str, torch.Tensor] = {}
    for i, torch_opt in enumerate(torch_optimizers(optimizer)):
        for g, group in enumerate(torch_opt.param_groups):
            out[f"{prefix}/{i}/{g}/group_step"] = torch.tensor(int(group.get("step", 0)), dtype=torch.int64)
            for j, p in enumerate(group["params"]):
                state = torch_opt.state[p]
                if not state:  # before the first step: placeholders DCP can load into, the keys a step makes
                    state.update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                    if isinstance(torch_opt, (torch.optim.Adam, torch.optim.AdamW)):
                        state["step"] = torch.zeros((), dtype=torch.float32)
                out[f"{prefix}/{i}/{g}/{j}/param"] = p.data
                for k, v in state.items():
                    if torch.is_tensor(v):
                        out[f"{prefix}/{i}/{g}/{j}/{k}"] = v
    return out


def restore_group_steps(optimizer: Any, tensors: Dict[str, torch.Tensor], prefix: str) -> None:
    """The param groups' step counts from loaded `optimizer_tensors` (the other entries were loaded in place)."""
    for i, torch_opt in enumerate(torch_optimizers(optimizer)):
        for g, group in enumerate(torch_opt.param_groups):
            step = int(tensors[f"{prefix}/{i}/{g}/group_step"])
            if step or "step" in group:
                group["step"] = step
