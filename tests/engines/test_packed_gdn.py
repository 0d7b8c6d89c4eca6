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
from qwen35rl.engines.short_conv import short_causal_conv
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
    """time_major: x is the transposed view of a [B, T, D] projection, as the GDN layer passes it. The reference is
    transformers' fallback per document, in fp32 on the same inputs (short_conv rounds once, at the end)."""
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
    ref = _per_document_conv(x_in.float(), weight.float(), bias.float(), activation, lengths)
    dy = torch.randn(y.shape, generator=g).to(dtype)
    grads = torch.autograd.grad(y, (x, weight, bias), dy)
    ref_grads = torch.autograd.grad(ref, (x, weight, bias), dy.float())
    assert y.dtype == dtype and y.shape == x_in.shape
    torch.testing.assert_close(y, ref.to(dtype))
    for got, want in zip(grads, ref_grads):
        assert got.dtype == dtype
        torch.testing.assert_close(got, want.to(dtype))


def test_conv_backward_is_the_gradient_of_its_forward():
    """The hand-written backward against finite differences in float64, across document boundaries and with SiLU."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, 3, dtype=torch.float64, generator=g).requires_grad_()
    weight = torch.randn(3, W, dtype=torch.float64, generator=g).requires_grad_()
    bias = torch.randn(3, dtype=torch.float64, generator=g).requires_grad_()
    positions = packed_gdn._build_positions(pm.cu([4, 1, 4]), 9, x.device)
    for activation in (None, "silu"):
        assert torch.autograd.gradcheck(lambda *a: short_causal_conv(*a, positions, activation), (x, weight, bias))
    assert torch.autograd.gradcheck(lambda a, b: short_causal_conv(a, b, None, positions), (x, weight))


def test_conv_splits_are_the_output_cut_along_channels():
    """With splits, one contiguous tensor per part, equal to slices of the whole output; their gradients (an unused
    part's too) reach x and the weight as the whole output's do."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 7, 10, generator=g).requires_grad_()
    weight = torch.randn(10, W, generator=g).requires_grad_()
    positions = packed_gdn._build_positions(pm.cu([3, 4]), 7, x.device)
    whole = short_causal_conv(x, weight, None, positions, "silu")
    parts = short_causal_conv(x, weight, None, positions, "silu", splits=(4, 4, 2))
    assert [p.shape[-1] for p in parts] == [4, 4, 2] and all(p.is_contiguous() for p in parts)
    assert torch.equal(torch.cat(parts, -1), whole)
    dy = torch.randn(whole.shape, generator=g)
    want = torch.autograd.grad((whole[..., :8] * dy[..., :8]).sum(), (x, weight))
    got = torch.autograd.grad((parts[0] * dy[..., :4]).sum() + (parts[1] * dy[..., 4:8]).sum(), (x, weight))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match=r"splits \[4, 4\] do not add up to the 10 channels"):
        short_causal_conv(x, weight, None, positions, splits=(4, 4))


def test_conv_l2norm_normalises_the_first_parts_per_head():
    """With l2norm=(2, head_dim), q and k come normalised over each head as transformers' l2norm does it; the third
    part is untouched; the hand-written backward is the gradient (finite differences in float64)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 8, 10, dtype=torch.float64, generator=g).requires_grad_()
    weight = torch.randn(10, W, dtype=torch.float64, generator=g).requires_grad_()
    bias = torch.randn(10, dtype=torch.float64, generator=g)
    positions = packed_gdn._build_positions(pm.cu([5, 3]), 8, x.device)
    plain = short_causal_conv(x, weight, bias, positions, "silu", splits=(4, 4, 2))
    normed = short_causal_conv(x, weight, bias, positions, "silu", splits=(4, 4, 2), l2norm=(2, 2))
    for a, b in zip(plain[:2], normed[:2]):
        heads = a.unflatten(-1, (2, 2))
        want = heads * torch.rsqrt((heads * heads).sum(-1, keepdim=True) + 1e-6)
        torch.testing.assert_close(b, want.flatten(-2))
    assert torch.equal(normed[2], plain[2])
    for activation in (None, "silu"):
        assert torch.autograd.gradcheck(
            lambda a, b, c: short_causal_conv(a, b, c, positions, activation, splits=(4, 4, 2), l2norm=(2, 2)),
            (x, weight, bias.requires_grad_()))
    with pytest.raises(ValueError, match=r"l2norm \(2, 3\): the first 2 of splits"):
        short_causal_conv(x, weight, None, positions, splits=(4, 4, 2), l2norm=(2, 3))
    with pytest.raises(ValueError, match="are not whole heads"):
        short_causal_conv(x, weight, None, positions, l2norm=(1, 2))


def test_conv_positions_count_from_each_document_start():
    assert packed_gdn._build_positions(pm.cu([3, 1, 2]), 6, torch.device("cpu")).tolist() == [0, 1, 2, 0, 0, 1]
    assert packed_gdn._build_positions(None, 4, torch.device("cpu")).tolist() == [0, 1, 2, 3]
    cu = torch.tensor([0, 2, 2, 3], dtype=torch.int32)  # an empty document changes nothing
    assert packed_gdn._build_positions(cu, 3, torch.device("cpu")).tolist() == [0, 1, 0]


def test_conv_without_boundaries_is_the_plain_causal_conv():
    x, weight = torch.randn(2, 8, 11), torch.randn(8, W)
    torch.testing.assert_close(packed_causal_conv1d(x, weight), _per_document_conv(x, weight, None, None, [11]))
    # shorter than the kernel: only the zeros before the row's start are seen
    x = torch.randn(1, 8, 2)
    torch.testing.assert_close(packed_causal_conv1d(x, weight), _per_document_conv(x, weight, None, None, [2]))


def test_conv_rejects_boundaries_that_do_not_cover_the_row():
    with pytest.raises(ValueError, match="from 0 to the sequence length 9"):
        packed_causal_conv1d(torch.randn(1, 8, 9), torch.randn(8, W), cu_seqlens=pm.cu([3, 4]))
    with pytest.raises(ValueError, match="activation='relu'"):
        packed_causal_conv1d(torch.randn(1, 8, 9), torch.randn(8, W), activation="relu")


def test_conv_builds_the_positions_once_per_boundaries_tensor(monkeypatch):
    """A packed forward hands every GDN layer the same cu_seqlens tensor: the positions (whose checks wait for the
    device) are built for the first layer only; another tensor, even with equal values, gets its own."""
    built = []
    build = packed_gdn._build_positions
    monkeypatch.setattr(packed_gdn, "_build_positions", lambda *a: built.append(a) or build(*a))
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


def test_conv_routing_sends_every_call_to_short_conv_and_compiles_only_cuda_tensors(monkeypatch):
    """The patched causal_conv1d_fn takes packed calls (boundaries from cu_seq_lens_q or seq_idx) and padded ones;
    COMPILE applies to CUDA tensors only."""
    calls = []

    def fake(x, weight, bias, positions, activation=None, compiled=False, splits=None, l2norm=None):
        assert splits is None and l2norm is None  # transformers' forward splits and normalises itself
        calls.append((tuple(x.shape), positions.tolist(), compiled))
        return x

    monkeypatch.setattr(packed_gdn, "short_causal_conv", fake)
    wrapped = packed_gdn._packing_conv(lambda *a, **kw: pytest.fail("transformers' convolution was called"))
    x, weight = torch.randn(1, 3, 5).transpose(1, 2), torch.randn(5, W)  # the GDN layer's [B, D, T] view
    monkeypatch.setattr(packed_gdn, "COMPILE", True)
    assert wrapped(x, weight).shape == x.shape
    wrapped(x, weight, cu_seq_lens_q=pm.cu([1, 2]))
    wrapped(x, weight, seq_idx=torch.tensor([[0, 0, 1]]))
    assert calls == [((1, 3, 5), [0, 1, 2], False), ((1, 3, 5), [0, 0, 1], False), ((1, 3, 5), [0, 1, 0], False)]

    class FakeCuda(torch.Tensor):
        is_cuda = True

    wrapped(x.as_subclass(FakeCuda), weight)
    assert calls[-1][2] is True
    monkeypatch.setattr(packed_gdn, "COMPILE", False)
    wrapped(x.as_subclass(FakeCuda), weight)
    assert calls[-1][2] is False


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled convolution runs on CUDA")


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [[300], [7, 120, 1, 64], [2, 2, 2]], ids=str)
def test_compiled_conv_equals_eager_on_cuda(lengths, dtype):
    """The torch.compile'd forward and backward against the same math eagerly (packed, and padded rows)."""
    g = torch.Generator().manual_seed(len(lengths))
    dim, length = 256, sum(lengths)
    x = torch.randn(2, length, dim, generator=g).to(dtype).cuda().requires_grad_()
    weight = torch.randn(dim, W, generator=g).to(dtype).cuda().requires_grad_()
    dy = torch.randn(2, length, dim, generator=g).to(dtype).cuda()
    tol = dict(rtol=1.6e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    for cu in (pm.cu(lengths).cuda(), None):
        positions = packed_gdn._build_positions(cu, length, x.device)
        got = short_causal_conv(x, weight, None, positions, "silu", compiled=True)
        want = short_causal_conv(x, weight, None, positions, "silu", compiled=False)
        torch.testing.assert_close(got, want, **tol)
        got_grads = torch.autograd.grad(got, (x, weight), dy)
        for a, b in zip(got_grads, torch.autograd.grad(want, (x, weight), dy)):
            scale = float(b.abs().max())  # the weight gradient sums over every token: bf16 rounds at its scale
            torch.testing.assert_close(a, b, rtol=tol["rtol"], atol=tol["atol"] * max(1.0, scale))
        parts = short_causal_conv(x, weight, None, positions, "silu", compiled=True, splits=(100, 100, 56))
        assert all(p.is_contiguous() for p in parts)
        torch.testing.assert_close(torch.cat(parts, -1), got, **tol)
        split_grads = torch.autograd.grad(parts, (x, weight), torch.split(dy, [100, 100, 56], -1))
        for a, b in zip(split_grads, got_grads):
            torch.testing.assert_close(a, b, rtol=tol["rtol"], atol=tol["atol"] * max(1.0, float(b.abs().max())))
        normed = [short_causal_conv(x, weight, None, positions, "silu", compiled=c, splits=(96, 96, 64), l2norm=(2, 32))
                  for c in (True, False)]
        dparts = torch.split(dy, [96, 96, 64], -1)
        for a, b in zip(normed[0], normed[1]):
            torch.testing.assert_close(a, b, **tol)
        for a, b in zip(*(torch.autograd.grad(n, (x, weight), dparts) for n in normed)):
            torch.testing.assert_close(a, b, rtol=tol["rtol"], atol=tol["atol"] * max(1.0, float(b.abs().max())))


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
    for name in padded[2]:  # fp32 noise scales with the tensor (the embedding's gradient sums many positions)
        atol = 1e-6 * max(1.0, padded[2][name].abs().max().item())
        torch.testing.assert_close(packed[2][name], padded[2][name], rtol=1e-4, atol=atol, msg=name)
