"""Which transformers experts implementation our MoE models run, and that it is the grouped one.

transformers 5.x dispatches `Qwen3_5MoeExperts.forward` on `config._experts_implementation`. `build_model` leaves
transformers' default, "grouped_mm": all (token, expert) pairs sorted by expert, one grouped GEMM per projection.
On CPU it is as fast as "eager" (a loop over the experts hit); "batched_mm" gathers both weight matrices of every
(token, expert) pair and is 20x slower at 16 tokens, 24 GiB at 256 tokens of the 64-expert model
(bench/results/moe_experts_cpu.md). These tests fail if a transformers upgrade or a change of ours moves our
models off the grouped path.
"""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
import transformers.integrations.moe as moe_impl

from qwen35rl.config.compose import compose
from qwen35rl.models.build import build_model, init_rotary_buffers


@pytest.fixture(scope="module")
def tiny_moe():
    return compose(["model=qwen3_5_tiny_moe"]).model


def _experts_configs(model):
    return [m.config for m in model.modules() if type(m).__name__ == "Qwen3_5MoeExperts"]


def _built(model_cfg, how):
    if how == "meta+to_empty":  # the hf rollout engine's model with a random init (weights come by sync)
        model = build_model(model_cfg, dtype=torch.bfloat16, device="meta")
        model.to_empty(device="cpu")
        init_rotary_buffers(model)
        return model
    return build_model(model_cfg, dtype=how, seed=0)


@pytest.mark.parametrize("how", [torch.float32, torch.bfloat16, "meta+to_empty"])
def test_build_model_runs_the_experts_as_grouped_mm(tiny_moe, how):
    model = _built(tiny_moe, how)
    configs = _experts_configs(model)
    assert len(configs) == tiny_moe.num_hidden_layers
    assert {c._experts_implementation for c in configs} == {"grouped_mm"}


def test_grouped_mm_is_one_grouped_gemm_per_projection_whatever_the_tokens(tiny_moe, monkeypatch):
    """Two grouped GEMMs (gate_up, down) per MoE layer and forward, for one token or many: no per-token loop."""
    model = build_model(tiny_moe, dtype=torch.float32, seed=0).eval()
    calls = []
    real = moe_impl._grouped_mm
    monkeypatch.setattr(moe_impl, "_grouped_mm", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    top_k = tiny_moe.num_experts_per_tok
    for rows, tokens in [(1, 1), (3, 17)]:
        calls.clear()
        with torch.no_grad():
            model(input_ids=torch.randint(0, tiny_moe.vocab_size, (rows, tokens)), use_cache=False)
        assert calls == [rows * tokens * top_k] * (2 * tiny_moe.num_hidden_layers)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_grouped_mm_gives_the_logits_of_the_eager_expert_loop(tiny_moe, dtype, tol):
    model = build_model(tiny_moe, dtype=dtype, seed=0).eval()
    ids = torch.randint(0, tiny_moe.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    logits = {}
    for impl in ["grouped_mm", "eager"]:
        model.set_experts_implementation(impl)
        with torch.no_grad():
            logits[impl] = model(input_ids=ids, use_cache=False).logits.float()
    scale = logits["eager"].abs().max()
    assert (logits["grouped_mm"] - logits["eager"]).abs().max() <= tol * scale
