"""Log-probs and entropy of the vocab projection without materialising [tokens, vocab] fp32 logits.

With Qwen3.5's 248k vocabulary, fp32 logits of 16k tokens take 16 GB (and again for the softmax and the gradient).
Here tokens go through lm_head a chunk at a time; the backward recomputes each chunk's logits instead of keeping
them, so peak extra memory is one chunk's [chunk_size, V] fp32 in both passes.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor


def _chunk_stats(h: Tensor, weight: Tensor, labels: Tensor, temperature: float):
    logits = (h @ weight.t()).float()
    if temperature != 1.0:
        logits = logits / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    token_logp = log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return log_probs, token_logp


def _chunk_token_logp(h: Tensor, weight: Tensor, labels: Tensor, temperature: float) -> Tensor:
    logits = (h @ weight.t()).float()
    if temperature != 1.0:
        logits.div_(temperature)
    return logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


@functools.lru_cache(maxsize=None)
def _chunk_fns(compiled: bool) -> Tuple[Callable, Callable]:
    """(token log-prob, log-softmax stats) per chunk; `compiled`: through torch.compile (backend.use_torch_compile),
    which fuses the fp32 upcast, the temperature and the reductions over the [chunk, V] logits into a few kernels
    instead of a pass over 1 GB of fp32 per op (1024 tokens x 248k vocabulary). Shapes are dynamic: the last chunk is
    shorter."""
    if not compiled:
        return _chunk_token_logp, _chunk_stats
    return torch.compile(_chunk_token_logp, dynamic=True), torch.compile(_chunk_stats, dynamic=True)


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size, temperature, with_entropy, compiled):
        token_logp_fn, stats_fn = _chunk_fns(compiled)
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        ent = torch.empty(n, dtype=torch.float32, device=hidden.device) if with_entropy else None
        for s in range(0, n, chunk_size):
            h, y = hidden[s:s + chunk_size], labels[s:s + chunk_size]
            if not with_entropy:  # logit of the label minus logsumexp: no [chunk, V] log-softmax written
                logp[s:s + chunk_size] = token_logp_fn(h, weight, y, temperature)
                continue
            log_probs, token_logp = stats_fn(h, weight, y, temperature)
            logp[s:s + chunk_size] = token_logp
            ent[s:s + chunk_size] = -(log_probs.exp() * log_probs).sum(-1)
            del log_probs
        ctx.save_for_backward(hidden, weight, labels)
        ctx.chunk_size, ctx.temperature, ctx.with_entropy, ctx.compiled = chunk_size, temperature, with_entropy, compiled
        ctx.mark_non_differentiable(labels)
        ctx.set_materialize_grads(False)  # an unused output (entropy with coef 0) costs no backward work
        return (logp, ent) if with_entropy else (logp,)

    @staticmethod
    def backward(ctx, grad_logp, grad_ent=None):
        hidden, weight, labels = ctx.saved_tensors
        if grad_logp is None and grad_ent is None:
            return None, None, None, None, None, None, None
        chunk, temp = ctx.chunk_size, ctx.temperature
        stats_fn = _chunk_fns(ctx.compiled)[1]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for s in range(0, hidden.shape[0], chunk):
            h, y = hidden[s:s + chunk], labels[s:s + chunk]
            log_probs, _ = stats_fn(h, weight, y, temp)
            probs = log_probs.exp()
            # d logp_y / dz = onehot(y) - p;  H = -sum p log p, dH/dz = -p * (log p + H)
            coef = -grad_logp[s:s + chunk, None].float() if grad_logp is not None else 0.0
            if ctx.with_entropy and grad_ent is not None:
                entropy = -(probs * log_probs).sum(-1, keepdim=True)
                g_ent = grad_ent[s:s + chunk, None].float()
                g = probs.mul_(log_probs.add_(entropy).mul_(-g_ent).add_(coef))
            else:
                g = probs.mul_(coef)
            del log_probs
            if grad_logp is not None:
                g.scatter_add_(-1, y.unsqueeze(-1), grad_logp[s:s + chunk, None].float())
            if temp != 1.0:
                g.div_(temp)  # z = logits / T
            # matmuls in the weight's dtype (bf16 tensor cores), accumulation of grad_w across chunks in fp32
            g = g.to(weight.dtype)
            if need_h:
                grad_h[s:s + chunk] = (g @ weight).to(hidden.dtype)
            if need_w:
                grad_w += (g.t() @ h.to(weight.dtype)).float()
            del g
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None, None, None, None


def chunked_logprobs_entropy(
    hidden: Tensor,
    lm_head_weight: Tensor,
    labels: Tensor,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    with_entropy: bool = False,
    compiled: bool = False,
) -> Tuple[Tensor, Optional[Tensor]]:
    """Log-prob of `labels` under softmax(hidden @ W^T / temperature) and (optionally) the entropy of that
    distribution, per token, in fp32. hidden [N, H], lm_head_weight [V, H], labels [N] (valid ids everywhere:
    mask afterwards). Differentiable in hidden and weight. `compiled`: the per-chunk math through torch.compile."""
    if hidden.dim() != 2 or labels.shape != hidden.shape[:1]:
        raise ValueError(f"hidden must be [N, H] and labels [N]; got {tuple(hidden.shape)} and {tuple(labels.shape)}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive (got {chunk_size})")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive for log-probs (got {temperature})")
    out = _ChunkedLogProbs.apply(hidden, lm_head_weight, labels.long(), int(chunk_size), float(temperature),
                                 bool(with_entropy), bool(compiled))
    return (out[0], out[1]) if with_entropy else (out[0], None)
