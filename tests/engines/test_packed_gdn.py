import importlib.util
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
import torch.nn.functional as F

from qwen35rl.engines.fsdp_engine import PolicyWithLogProbs
from qwen35rl.engines import packed_gdn
from qwen35rl.engines.packed_gdn import (CHUNK_RULE, CONV, cu_seqlens_from_seq_idx, disable_packing,
                                         dispatches_to_torch, enable_packing, is_packing_enabled, modeling_modules,
                                         original, packed_causal_conv1d, packed_chunk_gated_delta_rule,
                                         packing_enabled)
from tests.engines import packed_models as pm

W = 4  # Qwen3.5's linear_conv_kernel_dim
LAYOUTS = [[7], [3, 1, 5], [1, 1, 1], [2, 9, 1, 4, 70], [70, 2]]


# The model and recurrence tests run transformers' torch GDN on CPU; with fla installed it would pick fla's kernels.
torch_gdn = pytest.mark.skipif(importlib.util.find_spec("fla") is not None, reason="fla replaces the torch GDN rule")


def _state():
    return {m.__name__: (is_packing_enabled(m), getattr(m, CONV), getattr(m, CHUNK_RULE)) for m in modeling_modules()}


@pytest.fixture(autouse=True)
def transformers_left_as_found():
    """Every test leaves the modeling modules as it found them."""
    before = _state()
    yield
    assert _state() == before


def _per_document_conv(x, weight, bias, activation, lengths):
    """What each document gets alone: transformers' causal_conv1d_fn fallback on its own tokens."""
    outs, start = [], 0
    for n in lengths:
        doc = x[:, :, start:start + n].to(weight.dtype)
        y = F.conv1d(doc, weight.unsqueeze(1), bias, padding=W - 1, groups=x.shape[1])[:, :, :n]
        outs.append((F.silu(y) if activation else y).to(x.dtype))
        start += n
    return torch.cat(outs, 2)


# ------------------------------------------------------------------------------------------ convolution
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("lengths", LAYOUTS, ids=str)
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("time_major", [False, True], ids=["x-contiguous", "x-transposed"])
def test_conv_equals_per_document_conv(lengths, activation, dtype, rows, time_major):
    """time_major: x is the transposed view of a [B, T, D] projection, as the GDN layer passes it."""
    g = torch.Generator().manual_seed(len(lengths))
    dim, length = 24, sum(lengths)
    if time_major:
        x = torch.randn(rows, length, dim, generator=g).to(dtype).requires_grad_()
        x_in = x.transpose(1, 2)
    else:
        x = x_in = torch.randn(rows, dim, length, generator=g).to(dtype).requires_grad_()
    weight = torch.randn(dim, W, generator=g).to(dtype).requires_grad_()
    bias = torch.randn(dim, generator=g).to(dtype).requires_grad_()
    y = packed_causal_conv1d(x_in, weight, bias, activation, cu_seqlens=pm.cu(lengths))
    ref = _per_document_conv(x_in, weight, bias, activation, lengths)
    dy = torch.randn(y.shape, generator=g).to(dtype)
    grads = torch.autograd.grad(y, (x, weight, bias), dy)
    ref_grads = torch.autograd.grad(ref, (x, weight, bias), dy)
    assert y.dtype == dtype
    if activation is None and not time_major:  # the same conv kernel on the same numbers: bit for bit
        assert torch.equal(y, ref)
        assert torch.equal(grads[0], ref_grads[0])
    else:  # silu vectorises differently over one long row than over short ones, and on strided input the CPU
        # convolution picks its kernel by the row's length: last-bit differences
        torch.testing.assert_close(y, ref)
        torch.testing.assert_close(grads[0], ref_grads[0])
    # weight and bias gradients sum over documents in another order: in bf16 that rounds at the summands' scale
    for got, want in zip(grads[1:], ref_grads[1:]):
        atol = 2 * torch.finfo(dtype).eps * float(want.abs().max()) if dtype == torch.bfloat16 else None
        torch.testing.assert_close(got, want, atol=atol, rtol=None if atol is None else 1.6e-2)


def test_conv_without_boundaries_is_the_plain_causal_conv():
    x, weight = torch.randn(2, 8, 11), torch.randn(8, W)
    assert torch.equal(packed_causal_conv1d(x, weight), _per_document_conv(x, weight, None, None, [11]))


def test_conv_rejects_boundaries_that_do_not_cover_the_row():
    with pytest.raises(ValueError, match="from 0 to the sequence length 9"):
        packed_causal_conv1d(torch.randn(1, 8, 9), torch.randn(8, W), cu_seqlens=pm.cu([3, 4]))


def test_conv_builds_the_spread_index_once_per_boundaries_tensor(monkeypatch):
    """A packed forward hands every GDN layer the same cu_seqlens tensor: the index (whose checks wait for the device)
    is built for the first layer only; another tensor, even with equal values, gets its own."""
    built = []
    build = packed_gdn._build_spread_index
    monkeypatch.setattr(packed_gdn, "_build_spread_index", lambda *a: built.append(a) or build(*a))
    x, weight = torch.randn(1, 8, 9), torch.randn(8, W)
    cu = pm.cu([4, 5])
    first = [packed_causal_conv1d(x, weight, cu_seqlens=cu) for _ in range(3)]
    assert len(built) == 1 and all(torch.equal(y, first[0]) for y in first)
    assert torch.equal(packed_causal_conv1d(x, weight, cu_seqlens=pm.cu([4, 5])), first[0])
    assert len(built) == 2
    bad = pm.cu([3, 4])
    for _ in range(2):  # a rejected tensor is checked again, not remembered
        with pytest.raises(ValueError, match="from 0 to the sequence length 9"):
            packed_causal_conv1d(x, weight, cu_seqlens=bad)
    assert len(built) == 4


def test_conv_routing_keeps_cpu_tensors_on_torch_and_follows_the_switch(monkeypatch):
    """Where fla's convolution imports, CUDA tensors go to it (packed or padded calls); CPU tensors, and every tensor
    with FLA_CONV off, keep the torch convolutions the other tests pin."""
    calls = []

    def kernel(x, weight, bias=None, activation=None, cu_seqlens=None):
        calls.append((tuple(x.shape), x.is_contiguous(), cu_seqlens))
        return x, None

    monkeypatch.setattr(packed_gdn, "_fla_causal_conv1d", lambda: kernel)
    monkeypatch.setattr(packed_gdn, "FLA_CONV", True)
    wrapped = packed_gdn._packing_conv(lambda h, w, b=None, activation=None, **kw: ("torch", h))
    x, weight = torch.randn(1, 8, 9), torch.randn(8, W)
    assert wrapped(x, weight)[0] == "torch" and not calls
    assert not packed_gdn.fla_conv_applies(x)

    class FakeCuda(torch.Tensor):
        is_cuda = True

    xt = torch.randn(1, 9, 8).transpose(1, 2).as_subclass(FakeCuda)  # the GDN layer's [B, D, T] view of [B, T, D]
    assert packed_gdn.fla_conv_applies(xt)
    cu = pm.cu([4, 5])
    y = packed_gdn.fla_conv1d(xt, weight, cu_seqlens=cu)
    assert calls[-1] == ((1, 9, 8), True, cu) and y.shape == xt.shape  # handed over as [B, T, D], no copy
    packed_gdn.fla_conv1d(torch.randn(1, 8, 9), weight)  # [B, D, T] itself: made time-major first
    assert calls[-1][:2] == ((1, 9, 8), True)
    monkeypatch.setattr(packed_gdn, "FLA_CONV", False)
    assert not packed_gdn.fla_conv_applies(xt)


cuda_fla = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("fla") is None,
                              reason="fla's convolution kernel runs on CUDA")


@cuda_fla
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [[300], [7, 120, 1, 64], [2, 2, 2]], ids=str)
def test_fla_conv_equals_the_torch_conv_on_cuda(lengths, dtype):
    """fla's Triton convolution (packed with boundaries, and padded rows without) against the exact torch one
    (behind packed_gdn.FLA_CONV, off by default)."""
    g = torch.Generator().manual_seed(len(lengths))
    dim, length = 256, sum(lengths)
    x = torch.randn(2, length, dim, generator=g).to(dtype).cuda().requires_grad_()
    weight = torch.randn(dim, W, generator=g).to(dtype).cuda().requires_grad_()
    dy = torch.randn(2, dim, length, generator=g).to(dtype).cuda()
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    for cu in (pm.cu(lengths).cuda(), None):
        if cu is not None and x.shape[0] != 1:
            xs, dys = x[:1], dy[:1]
        else:
            xs, dys = x, dy
        got = packed_gdn.fla_conv1d(xs.transpose(1, 2), weight, None, "silu", cu_seqlens=cu)
        want = packed_causal_conv1d(xs.transpose(1, 2), weight, None, "silu", cu_seqlens=cu)
        torch.testing.assert_close(got, want, **tol)
        for a, b in zip(torch.autograd.grad(got, (x, weight), dys), torch.autograd.grad(want, (x, weight), dys)):
            scale = float(b.abs().max())  # the weight gradient sums over every token: bf16 rounds at its scale
            torch.testing.assert_close(a, b, rtol=tol["rtol"], atol=tol["atol"] * max(1.0, scale))


def test_cu_seqlens_from_seq_idx():
    seq_idx = torch.tensor([[0, 0, 0, 1, 2, 2, 3]], dtype=torch.int32)
    assert cu_seqlens_from_seq_idx(seq_idx).tolist() == [0, 3, 4, 6, 7]
    assert cu_seqlens_from_seq_idx(torch.zeros(5, dtype=torch.int32)).tolist() == [0, 5]
    with pytest.raises(ValueError, match="one row"):
        cu_seqlens_from_seq_idx(torch.zeros(2, 5, dtype=torch.int32))


# ------------------------------------------------------------------------------------------ recurrence
def _gdn_inputs(length, seed=0, heads=2, dk=8, dv=8):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, length, heads, dk, generator=g) for _ in range(2))
    v = torch.randn(1, length, heads, dv, generator=g)
    decay = -torch.rand(1, length, heads, generator=g)
    beta = torch.rand(1, length, heads, generator=g)
    return q, k, v, decay, beta


@torch_gdn
def test_chunk_rule_keeps_documents_apart():
    lengths = [5, 1, 70, 3]
    q, k, v, decay, beta = _gdn_inputs(sum(lengths))
    kw = dict(use_qk_l2norm_in_kernel=True, output_final_state=True)
    out, state = packed_chunk_gated_delta_rule(q, k, v, decay, beta, cu_seqlens=pm.cu(lengths), **kw)
    # the rule that transformers' GDN layer calls when it runs the torch recurrence
    reference = original(modeling_modules()[0], CHUNK_RULE)
    leaky, _ = reference(q, k, v, g=decay, beta=beta, **kw)
    assert state.shape[0] == len(lengths)
    start = 0
    for i, n in enumerate(lengths):
        doc = slice(start, start + n)
        alone, alone_state = reference(q[:, doc], k[:, doc], v[:, doc], g=decay[:, doc], beta=beta[:, doc], **kw)
        torch.testing.assert_close(out[:, doc], alone, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(state[i:i + 1], alone_state, rtol=1e-6, atol=1e-6)
        if i > 0:  # the unpacked recurrence carries the previous documents' state into this one
            assert not torch.allclose(leaky[:, doc], alone, atol=1e-4)
        start += n
    seq_idx = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    by_seq_idx, _ = packed_chunk_gated_delta_rule(q, k, v, decay, beta, seq_idx=seq_idx, **kw)
    assert torch.equal(by_seq_idx, out)


@torch_gdn
def test_chunk_rule_without_boundaries_is_the_reference():
    q, k, v, decay, beta = _gdn_inputs(9)
    reference = original(modeling_modules()[0], CHUNK_RULE)
    out, _ = packed_chunk_gated_delta_rule(q, k, v, decay, beta, use_qk_l2norm_in_kernel=True)
    assert torch.equal(out, reference(q, k, v, g=decay, beta=beta, use_qk_l2norm_in_kernel=True)[0])


# ------------------------------------------------------------------------------------------ patching
def test_enable_and_disable_packing():
    modules = modeling_modules()
    assert [m.__name__.rsplit(".", 1)[-1] for m in modules] == ["modeling_qwen3_5", "modeling_qwen3_5_moe"]
    transformers_own = {m.__name__: (getattr(m, CONV), getattr(m, CHUNK_RULE)) for m in modules}
    enable_packing()
    patched = {m.__name__: (getattr(m, CONV), getattr(m, CHUNK_RULE)) for m in modules}
    enable_packing(*modules)  # idempotent: the originals stay reachable, not the first wrappers
    try:
        for m in modules:
            own_conv, own_rule = transformers_own[m.__name__]
            assert getattr(m, CONV) is patched[m.__name__][0] is not own_conv
            assert original(m, CONV) is own_conv
            # the recurrence is replaced only where it is transformers' torch fallback (always, without fla)
            assert (getattr(m, CHUNK_RULE) is not own_rule) == dispatches_to_torch(own_rule)
            assert original(m, CHUNK_RULE) is own_rule
    finally:
        disable_packing(*modules)
    with packing_enabled(modules[0]):
        assert is_packing_enabled(modules[0]) and not is_packing_enabled(modules[1])
    assert not is_packing_enabled(modules[0])


# ------------------------------------------------------------------------------------------ the model
ROW_LENGTHS = pm.ROW_LENGTHS  # documents shorter than the conv window, a 1-token one, one across a 64-token chunk


@torch_gdn
@pytest.mark.parametrize("name", ["qwen3_5_tiny", "qwen3_5_tiny_moe"])
@torch.no_grad()
def test_packed_model_equals_each_row_alone(name):
    model = pm.tiny_model(name)
    rows = pm.rows(ROW_LENGTHS)
    alone = pm.alone(model, rows)
    with packing_enabled():
        packed = pm.packed_call(model, rows)
    for i, (p, a) in enumerate(zip(packed, alone)):
        torch.testing.assert_close(p, a, rtol=1e-5, atol=1e-5, msg=f"row {i}")


@torch_gdn
@torch.no_grad()
def test_without_packing_the_packed_call_mixes_documents():
    model = pm.tiny_model()
    rows = pm.rows(ROW_LENGTHS)
    alone = pm.alone(model, rows)
    try:
        packed = pm.packed_call(model, rows)
    except ValueError as e:  # transformers 5.24 refuses packed GDN calls without causal-conv1d / fla
        assert "packed sequences" in str(e)
        return
    # transformers 5.17: the conv and the recurrence run across document boundaries
    assert torch.allclose(packed[0], alone[0], rtol=1e-5, atol=1e-5)  # the first document has nothing before it
    assert not all(torch.allclose(p, a, rtol=1e-5, atol=1e-5) for p, a in zip(packed[1:], alone[1:]))


@torch_gdn
def test_engine_packed_forward_equals_padded():
    """`PolicyWithLogProbs` with pack=True (what FsdpTrainEngine does when it packs) against pack=False on a
    right-padded batch: the same response log-probs, entropies and parameter gradients."""
    model = pm.tiny_model()
    policy = PolicyWithLogProbs(model, chunk_size=16)
    rows = pm.rows(ROW_LENGTHS, seed=1)
    width = max(ROW_LENGTHS)
    input_ids = torch.full((len(rows), width), 259)
    attention_mask = torch.zeros(len(rows), width, dtype=torch.long)
    response_mask = torch.zeros_like(attention_mask)
    for i, r in enumerate(rows):
        input_ids[i, :len(r)] = r
        attention_mask[i, :len(r)] = 1
        response_mask[i, len(r) // 2:len(r)] = 1  # the second half of each row is its response
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)

    def run(pack):
        model.zero_grad(set_to_none=True)
        logp, ent = policy(input_ids, attention_mask, position_ids, response_mask, 1.0, True, pack=pack)
        (logp.sum() + ent.sum()).backward()
        return logp, ent, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    padded = run(pack=False)
    with packing_enabled():
        packed = run(pack=True)
    mask = response_mask.bool()
    assert mask[:, 1:].sum() > 0
    torch.testing.assert_close(packed[0], padded[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[1], padded[1], rtol=1e-5, atol=1e-5)
    assert packed[2].keys() == padded[2].keys()
    conv_grads = [n for n in padded[2] if "conv1d" in n]
    assert conv_grads and all(padded[2][n].abs().sum() > 0 for n in conv_grads)
    for name in padded[2]:
        torch.testing.assert_close(packed[2][name], padded[2][name], rtol=1e-4, atol=1e-6, msg=name)
