"""FLOP count: the matmul parameters it assumes per token are exactly the weights of the transformers model
(dense and MoE, where only the top-k experts count), and the sequence terms scale as they should."""
import pytest
import torch

from qwen35rl.config.compose import compose
from qwen35rl.models.build import build_model
from qwen35rl.runtime import flops


def _matmul_weights(model, moe_cfg=None) -> float:
    """Weights multiplied per token, read off the built model: every Linear / Conv1d weight, plus for MoE the
    router, k/E of the fused expert tensors and the shared expert."""
    total = 0.0
    for name, p in model.named_parameters():
        if "embed_tokens" in name or p.dim() < 2:
            continue
        if ".experts." in name:
            total += p.numel() * moe_cfg.num_experts_per_tok / moe_cfg.num_experts
        else:
            total += p.numel()
    if model.config.tie_word_embeddings:
        total += model.lm_head.weight.numel()  # tied: the lm_head matmul still happens
    return total


@pytest.mark.parametrize("name", ["qwen3_5_tiny", "qwen3_5_tiny_moe"])
def test_active_matmul_params_match_the_model(name):
    cfg = compose([f"model={name}"])
    model = build_model(cfg.model, dtype="float32", device="meta")
    expected = _matmul_weights(model, cfg.model if cfg.model.moe else None)
    assert flops.active_matmul_params(cfg.model) == pytest.approx(expected)


def test_moe_counts_active_experts_only():
    m = compose(["model=qwen3_5_tiny_moe"]).model
    dense_all = dict(m)
    dense_all["num_experts_per_tok"] = m.num_experts
    assert flops.active_matmul_params(dense_all) > flops.active_matmul_params(m)


def test_forward_flops_terms():
    m = compose(["model=qwen3_5_tiny"]).model
    one = flops.forward_flops(m, [100])
    # linear in the number of sequences, superlinear in length (full attention is quadratic)
    assert flops.forward_flops(m, [100, 100]) == pytest.approx(2 * one)
    assert flops.forward_flops(m, [200]) > 2 * one
    assert flops.train_flops(m, [100]) == pytest.approx(3 * one)
    # at least the 2 FLOPs per active weight per token
    assert one >= 2 * flops.active_matmul_params(m) * 100


def test_mfu():
    assert flops.mfu(2e12, 1.0, 2, 1.0) == pytest.approx(1.0)
    assert flops.mfu(1e12, 0.0, 2, 1.0) == 0.0
