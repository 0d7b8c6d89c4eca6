"""Forward and backward passes through megatron's pipeline schedule: per-token log-probs (and entropy) of a batch,
and a loss function's gradients over a mini batch. Results exist on the last pipeline stage; they are broadcast so
every rank returns the same."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from qwen35rl.algo.loss import LossInputs, LossScale, TrainLoss
from qwen35rl.engines.base import Batch
from qwen35rl.engines.megatron import batches
from qwen35rl.engines.megatron.batches import BatchShape
from qwen35rl.engines.logprob import chunked_logprobs_entropy
from qwen35rl.engines.megatron.ranks import Ranks


def head_weight(model: torch.nn.Module) -> Optional[torch.Tensor]:
    """This rank's vocabulary rows of the output projection ([V / tp, h]: the output layer's, or with tied
    embeddings the shared one) of a (DDP-wrapped) chunk; None off the last pipeline stage. Duck-typed: this module
    is imported before megatron may be (the CPU stand-ins go first)."""
    while not hasattr(model, "post_process") and hasattr(model, "module"):
        model = model.module
    if not model.post_process:
        return None
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


@dataclass
class Step:
    """`model`: the chunks the schedule runs (DDP-wrapped for the policy); `temperature` divides the logits;
    `compiled`: the log-prob head's chunk math through torch.compile (backend.use_torch_compile)."""

    model: Sequence[torch.nn.Module]
    ranks: Ranks
    shape: BatchShape
    temperature: float
    logprob_chunk_size: int
    compiled: bool = False

    # ------------------------------------------------------------------------------------------ the schedule
    def _forward_step(self, loss_fn, data_iterator, model):
        b = next(data_iterator)
        positions, images = b["position_ids"], {}
        if self.shape.vl_config is not None:
            positions = positions.permute(1, 0, 2)  # [3, rows, cols], as M-RoPE takes them
            if b["images"] is not None:
                images = dict(pixel_values=b["images"].pixel_values, image_grid_thw=b["images"].grid_thw,
                              image_mask=b["image_mask"])
        output = model(input_ids=b["input_ids"], position_ids=positions, attention_mask=None, **images)
        return output, partial(loss_fn, b, head_weight(model))

    def run(self, prepared: List[Dict[str, Any]], loss_fn, forward_only: bool) -> List[Dict[str, torch.Tensor]]:
        """megatron's pipeline schedule over `prepared`; `loss_fn(num_micro, batch, weight, hidden)` on the last
        stage (`hidden`: the final hidden states [b, s, h], `weight`: the output projection's rows here).
        Returns the last stage's per-micro-batch results (padding micro batches last)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        ready = batches.schedule_ready(prepared, self.shape)
        rows, cols = ready[0]["input_ids"].shape
        iterators = [iter(list(ready)) for _ in self.model]
        return get_forward_backward_func()(
            forward_step_func=partial(self._forward_step, partial(loss_fn, len(ready))),
            data_iterator=iterators if len(iterators) > 1 else iterators[0], model=list(self.model),
            num_microbatches=len(ready), seq_length=cols, micro_batch_size=rows, forward_only=forward_only)

    # ------------------------------------------------------------------------------------------ losses
    def _logprobs(self, b, weight, hidden, with_entropy: bool):
        """Per-position log-probs (and entropy) [b, s], computed at the response positions only (0 elsewhere):
        the head is a third of a small model's FLOPs, and prompt positions have no use for it."""
        sel = b["loss_mask"]
        h = hidden.reshape(-1, hidden.shape[-1])[sel.reshape(-1)]
        logp, ent = chunked_logprobs_entropy(h, weight, b["labels"][sel], self.logprob_chunk_size, self.temperature,
                                             with_entropy, self.compiled, self.ranks.tp_group())

        def spread(x):
            out = x.new_zeros(sel.shape)
            out[sel] = x
            return out

        return spread(logp), (spread(ent) if ent is not None else None)

    def _logprob_loss(self, with_entropy: bool, num_micro: int, b, weight, hidden):
        logp, ent = self._logprobs(b, weight, hidden, with_entropy)
        out = {"logp": logp.detach()}
        if ent is not None:
            out["ent"] = ent.detach()
        return hidden.new_zeros(()), out

    def train_loss(self, loss_fn: TrainLoss, scale: LossScale, num_micro: int, b, weight, hidden):
        logp, ent = self._logprobs(b, weight, hidden, with_entropy=True)
        loss, stats = loss_fn(LossInputs(logp, ent, b["loss_mask"], b["advantages"], b["old"], b["ref"], b["rollout"]),
                              scale)
        # megatron's schedule divides the loss by the number of micro batches; the loss already normalises over
        # the global mini batch (`scale`), so undo it
        return loss * num_micro, {"stats": stats}

    # ------------------------------------------------------------------------------------------ passes
    @torch.no_grad()
    def log_probs(self, batch: Batch, with_entropy: bool) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        for c in self.model:
            c.eval()
        prepared = batches.prepare(batch, self.shape, train=False)
        # the interleaved schedule wants a multiple of PP micro batches: split the rows
        parts = batches.split_rows(prepared, self.shape.micro_multiple)
        out = self.run(parts, partial(self._logprob_loss, with_entropy), forward_only=True)
        shape = prepared["input_ids"].shape
        stacked = torch.zeros((2 if with_entropy else 1, *shape), dtype=torch.float32, device=self.shape.device)
        if self.ranks.is_last_stage():
            sizes = [p["input_ids"].shape[0] for p in parts]
            stacked[0] = torch.cat([o["logp"][:r, :shape[1]] for o, r in zip(out, sizes)])
            if with_entropy:
                stacked[1] = torch.cat([o["ent"][:r, :shape[1]] for o, r in zip(out, sizes)])
        stacked = self.ranks.pp_broadcast(stacked)
        logp = batches.to_batch_layout(prepared, stacked[0], batch.response_mask)
        ent = batches.to_batch_layout(prepared, stacked[1], batch.response_mask) if with_entropy else None
        return logp, ent

    def backward(self, micro_batches: List[Batch], loss_fn: TrainLoss, scale: LossScale) -> torch.Tensor:
        """Gradients of `loss_fn` over `micro_batches` into megatron's gradient buffers (zeroed first); returns its
        statistics reduced over the micro batches and data-parallel ranks (`loss_fn.reduce`), on the host, the same
        on every rank of a pipeline."""
        prepared = [batches.prepare(mb, self.shape, train=True) for mb in micro_batches]
        for c in self.model:
            c.train()
            c.zero_grad_buffer()
        out = self.run(prepared, partial(self.train_loss, loss_fn, scale), forward_only=False)
        stats = loss_fn.zeros(self.shape.device)
        if self.ranks.is_last_stage():
            for o in out:
                stats = loss_fn.combine(stats, o["stats"].to(self.shape.device))
        return self.ranks.pp_broadcast(loss_fn.reduce(stats, self.ranks.sum_over_dp)).cpu()
