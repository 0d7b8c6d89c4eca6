import copy
import importlib.util
import inspect
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from qwen35rl.engines import gdn_layer, packed_gdn
from qwen35rl.engines.gdn_layer import use_training_forward
from qwen35rl.engines.packed_gdn import packing_enabled
from tests.engines import packed_models as pm

torch_gdn = pytest.mark.skipif(importlib.util.find_spec("fla") is not None, reason="fla replaces the torch GDN rule")


def _pair(name):
    """transformers' model and a copy with the training forward (the tiny models have 4 value heads on 2 key heads)."""
    model = pm.tiny_model(name)
    fast = copy.deepcopy(model)
    assert use_training_forward(fast) == sum(gdn_layer.is_gdn(m) for m in fast.modules()) > 0
    assert use_training_forward(fast) > 0  # idempotent: one wrapper per layer
    layer = next(m for m in fast.modules() if gdn_layer.is_gdn(m))
    assert layer.forward.func is gdn_layer.training_forward and layer.forward.args[1].__self__ is layer
    return model, fast


@torch_gdn
@pytest.mark.parametrize("qk_norm_in_conv", [True, False], ids=["norm-in-conv", "norm-in-rule"])
@pytest.mark.parametrize("name", ["qwen3_5_tiny", "qwen3_5_tiny_moe"])
def test_training_forward_equals_transformers_on_a_padded_batch(name, qk_norm_in_conv, monkeypatch):
    """Right-padded rows with their attention mask: the same logits and parameter gradients as transformers' forward
    (both with the same convolution: packing enabled routes transformers' to short_conv too), with q and k normalised
    by the convolution or by the recurrence."""
    monkeypatch.setattr(gdn_layer, "QK_NORM_IN_CONV", qk_norm_in_conv)
    model, fast = _pair(name)
    split_calls = []  # the split form is the training forward's alone (transformers' forward gets the whole output)
    conv = packed_gdn.document_conv

    def counted(*a, **kw):
        if kw.get("splits") is not None:
            split_calls.append(kw["splits"])
        return conv(*a, **kw)

    monkeypatch.setattr(packed_gdn, "document_conv", counted)
    rows = pm.rows([9, 30, 4], seed=2)
    ids = torch.full((3, 30), 7)
    mask = torch.zeros(3, 30, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)] = r, 1
    with packing_enabled():
        outs = []
        for m in (model, fast):
            logits = m(input_ids=ids, attention_mask=mask, use_cache=False).logits
            loss = (logits.float().log_softmax(-1)[..., 0] * mask).sum()
            grads = torch.autograd.grad(loss, [p for p in m.parameters() if p.requires_grad])
            outs.append((logits, grads))
    (want, want_grads), (got, got_grads) = outs
    n_gdn = sum(gdn_layer.is_gdn(m) for m in fast.modules())
    assert len(split_calls) == n_gdn and len(set(split_calls)) == 1  # the fast model's layers, not transformers'
    valid = mask.bool()
    torch.testing.assert_close(got[valid], want[valid], rtol=1e-5, atol=1e-5)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@torch_gdn
@torch.no_grad()
def test_training_forward_keeps_packed_documents_apart():
    model, fast = _pair("qwen3_5_tiny")
    rows = pm.rows(pm.ROW_LENGTHS)
    alone = pm.alone(model, rows)
    with packing_enabled():
        packed = pm.packed_call(fast, rows)
    for i, (p, a) in enumerate(zip(packed, alone)):
        torch.testing.assert_close(p, a, rtol=1e-5, atol=1e-5, msg=f"row {i}")


@torch.no_grad()
def test_calls_with_a_cache_keep_transformers_forward():
    """Generation (a cache) goes to transformers' own forward: greedy tokens and logits equal the plain model's."""
    model, fast = _pair("qwen3_5_tiny")
    prompt = pm.rows([6], seed=4)[0][None]
    kwargs = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
    a, b = model.generate(prompt, **kwargs), fast.generate(prompt, **kwargs)
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.logits, b.logits):
        assert torch.equal(x, y)


fla_cuda = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("fla") is None,
                              reason="fla's kernels on a CUDA device")


@fla_cuda
@pytest.mark.parametrize("fused", [False, True], ids=["repeated-heads", "fused-gates"])
@pytest.mark.parametrize("name", ["qwen3_5_tiny", "qwen3_5_tiny_moe"])
def test_fla_training_forward_equals_transformers_on_cuda(name, fused, monkeypatch):
    """On fla's kernels the training forward (q and k normalised by the convolution, fla's in-kernel L2 norm off;
    2 key heads repeated for 4 value heads, or with FLA_FUSED_GATES handed to fla unrepeated with the raw gate
    inputs) gives transformers' forward (fla with its in-kernel norm) in logits and gradients of a packed bf16 call,
    to bf16 rounding."""
    monkeypatch.setattr(gdn_layer, "FLA_FUSED_GATES", fused)
    model, fast = _pair(name)
    model, fast = (m.to("cuda", torch.bfloat16) for m in (model, fast))
    layer = next(m for m in fast.modules() if gdn_layer.is_gdn(m))
    modeling = sys.modules[type(layer).__module__]
    assert not packed_gdn.dispatches_to_torch(packed_gdn.original(modeling, packed_gdn.CHUNK_RULE))
    assert (gdn_layer.fused_gates_rule(modeling, torch.device("cuda")) is not None) is fused
    docs = [d.cuda() for d in pm.rows([40, 3, 90, 17], seed=5)]
    with packing_enabled():
        outs = []
        for m in (model, fast):
            logps = pm.packed_call(m, docs)
            loss = torch.cat(logps).float().sum()
            grads = torch.autograd.grad(loss, [p for p in m.parameters() if p.requires_grad])
            outs.append((torch.cat(logps).float(), grads))
    (want, want_grads), (got, got_grads) = outs

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))

    assert rel(got, want) < 2e-2
    names = [n for n, p in fast.named_parameters() if p.requires_grad]
    errors = {n: rel(a, b) for n, a, b in zip(names, got_grads, want_grads)}
    worst = max(errors, key=errors.get)
    assert errors[worst] < 0.1, (worst, errors[worst])  # a head or gate mix-up is off by order 1


def _fake_fla(monkeypatch, autograd_params):
    """A stand-in `fla.ops.gated_delta_rule.chunk` whose autograd function takes `autograd_params`."""
    import types

    def forward(ctx, *args, **kwargs):
        pass

    forward.__signature__ = inspect.Signature(
        [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in ["ctx", "q", "k", *autograd_params]])
    chunk = types.ModuleType("fla.ops.gated_delta_rule.chunk")
    chunk.chunk_gated_delta_rule = lambda *a, **kw: None
    chunk.ChunkGatedDeltaRuleFunction = type("ChunkGatedDeltaRuleFunction", (), {"forward": staticmethod(forward)})
    names = ["fla", "fla.ops", "fla.ops.gated_delta_rule", "fla.ops.gated_delta_rule.chunk"]
    mods = [types.ModuleType(n) for n in names[:-1]] + [chunk]
    for parent, child, name in zip(mods, mods[1:], names[1:]):
        setattr(parent, name.rsplit(".", 1)[1], child)
    for name, mod in zip(names, mods):
        monkeypatch.setitem(sys.modules, name, mod)
    gdn_layer._fla_rule_with_fused_gates.cache_clear()
    return chunk


def test_fused_gates_need_an_fla_whose_autograd_function_takes_them(monkeypatch):
    """fla's public function passes use_gate_in_kernel on through **kwargs, which an fla without it drops: the
    autograd function's parameters decide. Off by default, off on CPU, off where the modeling rule is torch's."""
    modeling = sys.modules[type(next(m for m in pm.tiny_model().modules() if gdn_layer.is_gdn(m))).__module__]
    try:
        chunk = _fake_fla(monkeypatch, ["use_qk_l2norm_in_kernel"])
        assert gdn_layer._fla_rule_with_fused_gates() is None
        chunk = _fake_fla(monkeypatch, ["use_gate_in_kernel", "A_log", "dt_bias", "use_beta_sigmoid_in_kernel"])
        assert gdn_layer._fla_rule_with_fused_gates() is chunk.chunk_gated_delta_rule
        monkeypatch.setattr(packed_gdn, "dispatches_to_torch", lambda fn: False)  # the modeling rule as fla's
        assert gdn_layer.fused_gates_rule(modeling, torch.device("cuda")) is None  # FLA_FUSED_GATES is off
        monkeypatch.setattr(gdn_layer, "FLA_FUSED_GATES", True)
        assert gdn_layer.fused_gates_rule(modeling, torch.device("cuda")) is chunk.chunk_gated_delta_rule
        assert gdn_layer.fused_gates_rule(modeling, torch.device("cpu")) is None
        monkeypatch.setattr(packed_gdn, "dispatches_to_torch", lambda fn: True)
        assert gdn_layer.fused_gates_rule(modeling, torch.device("cuda")) is None
    finally:
        gdn_layer._fla_rule_with_fused_gates.cache_clear()
