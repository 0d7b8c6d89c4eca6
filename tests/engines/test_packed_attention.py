import importlib.util
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from qwen35rl.config.compose import compose
from qwen35rl.config.layout import derive_layout
from qwen35rl.engines import fsdp_engine, packed_attention
from qwen35rl.engines.fsdp_engine import FsdpTrainEngine
from qwen35rl.engines.packed_attention import (NAME, cu_seqlens_from_position_ids, packed_sdpa_attention_forward,
                                               register, use_packed_attention)
from qwen35rl.engines.packed_gdn import disable_packing, is_packing_enabled, modeling_modules, packing_enabled
from qwen35rl.models.build import build_model
from qwen35rl.runtime.batching import Sequences, build_batch
from tests.engines import packed_models as pm
from tests.engines.test_fsdp_engine import _loss

# The model tests run transformers' torch GDN on CPU; with fla installed it would pick fla's kernels.
torch_gdn = pytest.mark.skipif(importlib.util.find_spec("fla") is not None, reason="fla replaces the torch GDN rule")

PAD = 259
ROW_LENGTHS = pm.ROW_LENGTHS


@pytest.fixture(autouse=True)
def registries_left_as_found():
    """`register` changes transformers' class-wide registries: every test puts them back as it found them."""
    saved = [(cls._global_mapping, dict(cls._global_mapping)) for cls in (AttentionInterface, AttentionMaskInterface)]
    yield
    for mapping, before in saved:
        mapping.clear()
        mapping.update(before)


# ------------------------------------------------------------------------------------------ the function
class _Attn(nn.Module):
    """What transformers' sdpa reads from the attention module."""

    def __init__(self, groups):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def _qkv(length, heads=4, kv_heads=2, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, length, dim, generator=g)
    k, v = (torch.randn(1, kv_heads, length, dim, generator=g) for _ in range(2))
    return [t.requires_grad_() for t in (q, k, v)]


def _per_document_reference(q, k, v, lengths, scale):
    """Each document alone through torch's causal sdpa, key/value heads repeated for GQA."""
    groups = q.shape[1] // k.shape[1]
    outs, start = [], 0
    for n in lengths:
        doc = slice(start, start + n)
        kd, vd = (t[:, :, doc].repeat_interleave(groups, dim=1) for t in (k, v))
        outs.append(F.scaled_dot_product_attention(q[:, :, doc], kd, vd, is_causal=True, scale=scale))
        start += n
    return torch.cat(outs, 2).transpose(1, 2)  # [1, T, H, D]


@pytest.mark.parametrize("kv_heads", [2, 4])
@pytest.mark.parametrize("lengths", [[1], [1, 1, 1], [5, 1, 17, 3], [2, 40], [33]], ids=str)
def test_function_equals_per_document_causal_sdpa(lengths, kv_heads):
    q, k, v = _qkv(sum(lengths), kv_heads=kv_heads)
    scale = 0.3
    out, weights = packed_sdpa_attention_forward(_Attn(4 // kv_heads), q, k, v, None, scaling=scale,
                                                 cu_seq_lens_q=pm.cu(lengths), cu_seq_lens_k=pm.cu(lengths),
                                                 max_length_q=max(lengths), max_length_k=max(lengths))
    ref = _per_document_reference(q, k, v, lengths, scale)
    assert weights is None and out.shape == ref.shape == (1, sum(lengths), 4, 16)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    for got, want in zip(torch.autograd.grad(out, (q, k, v), dy), torch.autograd.grad(ref, (q, k, v), dy)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_documents_from_position_ids_without_cu_seq_lens():
    lengths = [4, 1, 6]
    q, k, v = _qkv(sum(lengths))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    assert cu_seqlens_from_position_ids(positions).tolist() == pm.cu(lengths).tolist()
    assert cu_seqlens_from_position_ids(torch.arange(5)) is None
    by_positions, _ = packed_sdpa_attention_forward(_Attn(2), q, k, v, None, position_ids=positions)
    torch.testing.assert_close(by_positions, _per_document_reference(q, k, v, lengths, None), rtol=1e-6, atol=1e-6)
    # consecutive positions: one document, i.e. plain causal attention over the row
    plain, _ = packed_sdpa_attention_forward(_Attn(2), q, k, v, None, position_ids=torch.arange(11)[None])
    torch.testing.assert_close(plain, _per_document_reference(q, k, v, [11], None), rtol=1e-6, atol=1e-6)


def test_calls_that_are_not_packed_are_transformers_sdpa():
    sdpa = AttentionInterface._global_mapping["sdpa"]
    q, k, v = _qkv(7)
    mask = torch.ones(1, 1, 7, 7, dtype=torch.bool).tril()
    mask[..., :2] = False  # a padded row (left padding) as transformers' sdpa mask gives it
    for args, kw in [((mask,), {}), ((None,), {}), ((None,), {"position_ids": torch.arange(7)[None]})]:
        got, _ = packed_sdpa_attention_forward(_Attn(2), q, k, v, *args, scaling=0.2, **kw)
        want, _ = sdpa(_Attn(2), q, k, v, *args, scaling=0.2, **kw)
        assert torch.equal(got, want)


def test_packed_calls_must_be_causal_and_cover_the_row():
    q, k, v = _qkv(6)
    with pytest.raises(ValueError, match="causal"):
        packed_sdpa_attention_forward(_Attn(2), q, k, v, None, cu_seq_lens_q=pm.cu([3, 3]), is_causal=False)
    with pytest.raises(ValueError, match="row length 6"):
        packed_sdpa_attention_forward(_Attn(2), q, k, v, None, cu_seq_lens_q=pm.cu([3, 2]))


def test_varlen_api_is_used_only_in_its_causal_form():
    api = packed_attention.varlen_api()
    if api is not None:  # the torch installed here: window_size (-1, 0) is its causal mask
        import inspect
        params = inspect.signature(api[0]).parameters
        assert params["window_size"].default == (-1, -1) and "scale" in params
    q = torch.zeros(1, 2, 3, 8, dtype=torch.bfloat16)
    assert not packed_attention.uses_varlen(q, 0.0)  # CPU: one sdpa per document


def _documented_varlen_attn(takes_gqa, seen):
    """torch's `varlen_attn` as its docstring states it ([T, H, D] inputs, window (-1, 0) causal), on CPU."""

    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), **kw):
        seen.append(dict(window_size=window_size, max_q=max_q, cu_dtype=cu_q.dtype, kv_heads=k.shape[1], **kw))
        assert window_size == (-1, 0) and isinstance(max_q, int) and torch.equal(cu_q, cu_k)
        assert all(t.dim() == 3 and t.stride(-1) == 1 for t in (q, k, v))
        bounds = cu_q.tolist()
        lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
        assert max_q == max(lengths)
        as_rows = [t.transpose(0, 1)[None] for t in (q, k, v)]  # [1, H, T, D]
        return _per_document_reference(*as_rows, lengths, scale)[0]

    return varlen_attn


@pytest.mark.parametrize("takes_gqa", [True, False])
def test_varlen_call_as_documented(takes_gqa, monkeypatch):
    """The CUDA branch's glue (layout, causal window, GQA, boundaries) against the documented varlen semantics."""
    seen = []
    monkeypatch.setattr(packed_attention, "varlen_api", lambda: (_documented_varlen_attn(takes_gqa, seen), takes_gqa))
    monkeypatch.setattr(packed_attention, "uses_varlen", lambda query, dropout: True)
    lengths = [5, 1, 9]
    q, k, v = _qkv(sum(lengths))
    out, _ = packed_sdpa_attention_forward(_Attn(2), q, k, v, None, scaling=0.25, cu_seq_lens_q=pm.cu(lengths).long(),
                                           max_length_q=torch.tensor(max(lengths)))
    ref = _per_document_reference(q, k, v, lengths, 0.25)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    assert seen[0]["cu_dtype"] == torch.int32
    assert (seen[0].get("enable_gqa"), seen[0]["kv_heads"]) == ((True, 2) if takes_gqa else (None, 4))
    dy = torch.randn(out.shape)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), dy), torch.autograd.grad(ref, (q, k, v), dy)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available() or packed_attention.varlen_api() is None,
                    reason="torch's varlen flash kernel runs on CUDA")
def test_varlen_kernel_equals_per_document_sdpa_on_cuda():
    lengths = [300, 1, 17, 768, 64]
    q, k, v = (t.detach().to("cuda", torch.bfloat16).requires_grad_() for t in _qkv(sum(lengths), heads=8, dim=256))
    assert packed_attention.uses_varlen(q, 0.0)
    kw = dict(scaling=256 ** -0.5, cu_seq_lens_q=pm.cu(lengths).cuda(), max_length_q=max(lengths))
    out, _ = packed_sdpa_attention_forward(_Attn(4), q, k, v, None, **kw)
    ref = packed_attention._per_document_sdpa(_Attn(4), q, k, v, kw["cu_seq_lens_q"], 0.0, kw["scaling"])
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    dy = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), dy), torch.autograd.grad(ref, (q, k, v), dy)):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


# ------------------------------------------------------------------------------------------ the model
class _SquareTensors(TorchDispatchMode):
    """Records every tensor an op produces whose last two dims are both `n` (an [.., N, N] mask or score matrix)."""

    def __init__(self, n):
        super().__init__()
        self.n, self.seen = n, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and tuple(t.shape[-2:]) == (self.n, self.n):
                self.seen.append((str(func), tuple(t.shape)))
        return out


def _count_documents_attended(monkeypatch):
    calls = []
    per_document = packed_attention._per_document_sdpa

    def spy(module, query, key, value, cu, *args):
        calls.append(cu.tolist())
        return per_document(module, query, key, value, cu, *args)

    monkeypatch.setattr(packed_attention, "_per_document_sdpa", spy)
    return calls


@torch_gdn
@pytest.mark.parametrize("name", ["qwen3_5_tiny", "qwen3_5_tiny_moe"])
@torch.no_grad()
def test_packed_model_equals_each_row_alone_without_an_n_by_n_mask(name, monkeypatch):
    rows = pm.rows(ROW_LENGTHS)
    n = sum(ROW_LENGTHS)
    plain = pm.tiny_model(name)
    alone = pm.alone(plain, rows)
    with packing_enabled():
        with _SquareTensors(n) as sdpa_watch:
            pm.packed_call(plain, rows)
        model = pm.tiny_model(name, packed_attention=True)
        full_attention = sum(t == "full_attention" for t in model.config.layer_types)
        calls = _count_documents_attended(monkeypatch)
        with _SquareTensors(n) as watch:
            packed = pm.packed_call(model, rows)
    assert sdpa_watch.seen  # plain sdpa builds the block-diagonal [1, 1, N, N] mask
    assert watch.seen == []
    assert calls == [pm.cu(ROW_LENGTHS).tolist()] * full_attention
    for i, (p, a) in enumerate(zip(packed, alone)):
        torch.testing.assert_close(p, a, rtol=1e-5, atol=1e-5, msg=f"row {i}")


def _padded(rows, left=False):
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        cols = slice(width - len(r), width) if left else slice(0, len(r))
        ids[i, cols], mask[i, cols] = r, 1
    return ids, mask


@pytest.mark.parametrize("name", ["qwen3_5_tiny", "qwen3_5_tiny_moe"])
@torch.no_grad()
def test_padded_calls_and_generation_are_unchanged_bit_for_bit(name):
    plain, model = pm.tiny_model(name), pm.tiny_model(name, packed_attention=True)
    assert model.config._attn_implementation == NAME and plain.config._attn_implementation == "sdpa"
    rows = pm.rows([7, 3, 12], seed=2)
    for left in (False, True):
        ids, mask = _padded(rows, left)
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits,
                           plain(input_ids=ids, attention_mask=mask).logits)
    one = rows[2][None]
    assert torch.equal(model(input_ids=one).logits, plain(input_ids=one).logits)
    ids, mask = _padded(rows[:2], left=True)
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, return_dict_in_generate=True,
              output_logits=True, pad_token_id=PAD)
    got, want = model.generate(ids, **kw), plain.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))


def test_use_packed_attention_switches_the_language_model_only():
    cfg = compose(["model=qwen3_5_tiny_vl", "hw=cpu"])
    model = build_model(cfg.model, dtype=torch.float32, text_only=False)
    use_packed_attention(model)
    text = model.model.language_model
    attention = [m for m in text.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "config")]
    assert attention and all(m.config._attn_implementation == NAME for m in attention)
    assert text.config._attn_implementation == NAME
    assert model.model.visual.config._attn_implementation == "sdpa"
    register()  # idempotent
    assert AttentionInterface._global_mapping[NAME] is packed_sdpa_attention_forward


# ------------------------------------------------------------------------------------------ the engine
def _engine_cfg(remove_padding):
    return compose(["model=qwen3_5_tiny", "hw=cpu", "hw.devices_per_node=1", "backend.gradient_checkpointing=false", "backend.grad_clip=0",
                    "backend.mixed_precision=fp32", "algorithm.use_kl_loss=false",
                    f"backend.remove_padding={str(remove_padding).lower()}"])


@torch_gdn
def test_engine_packs_with_this_attention_and_matches_padded(monkeypatch):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 2, 9)]
    resps = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (4, 1, 6)]
    seqs = Sequences(prompts, resps, advantages=[1.0, -0.5, 0.25])
    batch = build_batch(seqs, PAD)
    mask = batch.response_mask.bool()
    before = {m.__name__ for m in modeling_modules() if is_packing_enabled(m)}
    monkeypatch.setattr(fsdp_engine, "packing_supported", lambda device, sp=1: True)
    try:
        packed, padded = (FsdpTrainEngine(cfg, layout=derive_layout(cfg), rank=0, world_size=1, device="cpu")
                          for cfg in (_engine_cfg(True), _engine_cfg(False)))
        assert packed.pack and not padded.pack
        assert packed.lm.config._attn_implementation == NAME and padded.lm.config._attn_implementation == "sdpa"
        calls = _count_documents_attended(monkeypatch)
        a, b = packed.compute_log_probs(batch)[0], padded.compute_log_probs(batch)[0]
        assert calls and all(len(c) == len(prompts) + 1 for c in calls)
        torch.testing.assert_close(a[mask], b[mask], rtol=1e-5, atol=1e-5)
        ga = packed.train_mini_batch([batch], _loss(packed))["actor/grad_norm"]
        gb = padded.train_mini_batch([batch], _loss(padded))["actor/grad_norm"]
        assert ga == pytest.approx(gb, rel=1e-4)
    finally:
        disable_packing(*[m for m in modeling_modules() if m.__name__ not in before])
