"""Log-probs and entropy of the vocab projection without materialising [tokens, vocab] fp32 logits.

With Qwen3.5's 248k vocabulary, fp32 logits of 16k tokens take 16 GB (and again for the softmax and the gradient).
Here tokens go through lm_head a chunk at a time. The forward keeps two numbers per token for the backward (the
log-sum-exp and the entropy); the backward recomputes each chunk's logits and turns them into the logit gradient in
one pass, so peak extra memory is one chunk's [chunk_size, V] logits plus its gradient.

Per chunk, the math over the [chunk, V] logits is two functions: the statistics (log-sum-exp, label log-prob,
entropy) and the logit gradient. With `compiled` (backend.use_torch_compile) they go through torch.compile, which
fuses the fp32 upcast, the temperature and the reductions into kernels that read the bf16 logits instead of writing
fp32 copies of them (1024 tokens x 248k vocabulary: 1 GB of fp32 per op).

With `group` (tensor parallelism, the Megatron engine) each rank holds a contiguous slice of the vocabulary's rows:
the statistics reduce max, sum-exp, label logit and E[z] over the group (two small all-reduces per chunk), the
backward needs no communication (the forward saved the group's log-sum-exp and entropy), and the hidden state's
gradient is this rank's part, which the caller sums over the group.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor


def _stats(z: Tensor, labels: Tensor, inv_t: float, with_entropy: bool) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """log-sum-exp, label log-prob and (optionally) entropy of softmax(z * inv_t) per row, in fp32."""
    zs = z.float() * inv_t
    lse = torch.logsumexp(zs, dim=-1)
    logp = zs.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse
    if not with_entropy:
        return lse, logp, None
    log_p = zs - lse.unsqueeze(-1)
    return lse, logp, -(torch.exp(log_p) * log_p).sum(-1)


def _stats_split(z: Tensor, labels: Tensor, inside: Tensor, inv_t: float, with_entropy: bool, group):
    """`_stats` for a vocabulary split over `group`: z holds this rank's columns, `labels` are local (clamped)
    and `inside` says which rows' label this rank holds. Eager: collectives sit between the reductions."""
    import torch.distributed as dist

    zs = z.float() * inv_t
    zmax = zs.max(-1).values
    dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
    e = torch.exp(zs - zmax.unsqueeze(-1))
    target = torch.where(inside, zs.gather(-1, labels.unsqueeze(-1)).squeeze(-1), 0.0)
    sums = torch.stack([e.sum(-1), target, (e * zs).sum(-1) if with_entropy else target])
    dist.all_reduce(sums, group=group)
    lse = zmax + torch.log(sums[0])
    # H = lse - E_p[zs], E_p[zs] = sum(e * zs) / sum(e)
    return lse, sums[1] - lse, (lse - sums[2] / sums[0]) if with_entropy else None


def _logit_grad(z: Tensor, labels: Tensor, lse: Tensor, grad_logp: Tensor, inv_t: float,
                entropy: Optional[Tensor] = None, grad_ent: Optional[Tensor] = None,
                inside: Optional[Tensor] = None) -> Tensor:
    """dL/dz for L = sum(grad_logp * logp) + sum(grad_ent * H), in z's dtype (the matmuls' input dtype).
    d logp_y / dzs = onehot(y) - p;  dH/dzs = -p (log p + H);  dzs/dz = inv_t. `inside`: rows whose label is
    among z's columns (a split vocabulary; None: all)."""
    zs = z.float() * inv_t
    log_p = zs - lse.unsqueeze(-1)
    p = torch.exp(log_p)
    coef = grad_logp.float().unsqueeze(-1)
    if grad_ent is not None:
        coef = coef + grad_ent.float().unsqueeze(-1) * (log_p + entropy.unsqueeze(-1))
    onehot = torch.arange(z.shape[-1], device=z.device) == labels.unsqueeze(-1)
    if inside is not None:
        onehot = onehot & inside.unsqueeze(-1)
    g = torch.where(onehot, grad_logp.float().unsqueeze(-1), 0.0) - p * coef
    return (g * inv_t).to(z.dtype)


def _stats_inplace(z: Tensor, labels: Tensor, inv_t: float, with_entropy: bool):
    """`_stats` eagerly with in-place ops: two fp32 [chunk, V] buffers at a time instead of one per op."""
    zs = z.float().mul_(inv_t) if z.dtype != torch.float32 else z * inv_t
    lse = torch.logsumexp(zs, dim=-1)
    logp = zs.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse
    if not with_entropy:
        return lse, logp, None
    log_p = zs.sub_(lse.unsqueeze(-1))
    return lse, logp, -(torch.exp(log_p).mul_(log_p)).sum(-1)


def _logit_grad_inplace(z: Tensor, labels: Tensor, lse: Tensor, grad_logp: Tensor, inv_t: float,
                        entropy: Optional[Tensor] = None, grad_ent: Optional[Tensor] = None,
                        inside: Optional[Tensor] = None) -> Tensor:
    """`_logit_grad` eagerly with in-place ops (two fp32 [chunk, V] buffers, like `_stats_inplace`)."""
    g = z.float().mul_(inv_t) if z.dtype != torch.float32 else z * inv_t
    g.sub_(lse.unsqueeze(-1))  # log p
    gl = grad_logp.float().unsqueeze(-1)
    if grad_ent is not None:
        p = torch.exp(g)
        g.add_(entropy.unsqueeze(-1)).mul_(grad_ent.float().unsqueeze(-1)).add_(gl).mul_(p).neg_()
        del p
    else:
        g.exp_().mul_(-gl)
    g.scatter_add_(-1, labels.unsqueeze(-1), gl if inside is None else gl * inside.unsqueeze(-1))
    return g.mul_(inv_t).to(z.dtype)


@functools.lru_cache(maxsize=None)
def _chunk_fns(compiled: bool) -> Tuple[Callable, Callable]:
    """(statistics, logit gradient) per chunk: the functional forms through torch.compile (Inductor fuses them into
    reductions over the logits), or the in-place forms eagerly. Shapes are dynamic: the last chunk is shorter."""
    if not compiled:
        return _stats_inplace, _logit_grad_inplace
    return torch.compile(_stats, dynamic=True), torch.compile(_logit_grad, dynamic=True)


def _accumulate_weight_grad(acc: Tensor, g: Tensor, h: Tensor) -> None:
    """acc += g^T @ h in fp32, without rounding each chunk's product to g's dtype first (rounding every chunk's
    bf16 product before the sum biases the head's gradient). CUDA has a bf16 matmul with fp32 output."""
    if acc.device.type == "cuda" and g.dtype in (torch.bfloat16, torch.float16) and h.dtype == g.dtype:
        torch.addmm(acc, g.t(), h, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(g.t().float(), h.float())


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size, temperature, with_entropy, compiled, group):
        inv_t = 1.0 / temperature
        n = hidden.shape[0]
        inside = None
        if group is not None:  # this rank's rows of the vocabulary: [rank * V_local, (rank + 1) * V_local)
            import torch.distributed as dist

            local = labels - dist.get_rank(group) * weight.shape[0]
            inside = (local >= 0) & (local < weight.shape[0])
            labels = local.clamp(0, weight.shape[0] - 1)
            stats_fn = functools.partial(_stats_split, group=group)
        else:
            stats_fn = _chunk_fns(compiled)[0]
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        logp = torch.empty_like(lse)
        ent = torch.empty_like(lse) if with_entropy else None
        for s in range(0, n, chunk_size):
            part = slice(s, s + chunk_size)
            z = hidden[part] @ weight.t()
            args = (labels[part],) if inside is None else (labels[part], inside[part])
            lse[part], logp[part], e = stats_fn(z, *args, inv_t, with_entropy)
            if with_entropy:
                ent[part] = e
            del z
        saved_inside = () if inside is None else (inside,)
        ctx.save_for_backward(hidden, weight, labels, lse, *((ent,) if with_entropy else ()), *saved_inside)
        ctx.chunk_size, ctx.inv_t, ctx.compiled = chunk_size, inv_t, compiled
        ctx.with_entropy, ctx.split = with_entropy, inside is not None
        ctx.set_materialize_grads(False)  # an unused output (entropy with coef 0) costs no backward work
        return (logp, ent) if with_entropy else (logp,)

    @staticmethod
    def backward(ctx, grad_logp, grad_ent=None):
        none = (None,) * 6
        if grad_logp is None and grad_ent is None:
            return None, None, *none
        hidden, weight, labels, lse, *rest = ctx.saved_tensors
        entropy = rest.pop(0) if ctx.with_entropy else None
        inside = rest[0] if ctx.split else None
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        if entropy is None:
            grad_ent = None
        chunk, grad_fn = ctx.chunk_size, _chunk_fns(ctx.compiled)[1]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for s in range(0, hidden.shape[0], chunk):
            part = slice(s, s + chunk)
            h = hidden[part]
            z = h @ weight.t()
            g = grad_fn(z, labels[part], lse[part], grad_logp[part], ctx.inv_t,
                        *((entropy[part], grad_ent[part]) if grad_ent is not None else (None, None)),
                        *((inside[part],) if inside is not None else ()))
            del z
            if need_h:
                grad_h[part] = (g @ weight).to(hidden.dtype)
            if need_w:
                _accumulate_weight_grad(grad_w, g, h.to(g.dtype))
            del g
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), *none


def chunked_logprobs_entropy(
    hidden: Tensor,
    lm_head_weight: Tensor,
    labels: Tensor,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    with_entropy: bool = False,
    compiled: bool = False,
    group=None,
) -> Tuple[Tensor, Optional[Tensor]]:
    """Log-prob of `labels` under softmax(hidden @ W^T / temperature) and (optionally) the entropy of that
    distribution, per token, in fp32. hidden [N, H], lm_head_weight [V, H], labels [N] (valid ids everywhere:
    mask afterwards). Differentiable in hidden and weight. `compiled`: the per-chunk math through torch.compile.
    `group`: the vocabulary is split over this process group, `lm_head_weight` being this rank's contiguous slice
    of its rows (rank r: [r * V_local, (r + 1) * V_local)); every rank returns the same values, and hidden's
    gradient is this rank's part of the sum over the group."""
    if hidden.dim() != 2 or labels.shape != hidden.shape[:1]:
        raise ValueError(f"hidden must be [N, H] and labels [N]; got {tuple(hidden.shape)} and {tuple(labels.shape)}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive (got {chunk_size})")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive for log-probs (got {temperature})")
    out = _ChunkedLogProbs.apply(hidden, lm_head_weight, labels.long(), int(chunk_size), float(temperature),
                                 bool(with_entropy), bool(compiled), group)
    return (out[0], out[1]) if with_entropy else (out[0], None)
