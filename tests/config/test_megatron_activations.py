"""The Megatron activation estimate (`megatron_layer_bytes_per_token`) against what megatron-core's decoder layers
really save for backward: one layer of each kind built from the engine's specs in bf16 on CPU, with megatron-core's
torch GDN recurrence (`deterministic_mode`), its saved tensors counted in a subprocess
(tests/config/megatron_saved_bytes.py: megatron's CPU stand-ins change torch for the whole process).

Shapes: the 0.8B's real GDN heads (16 x 128 key and value dims; the recurrent state per chunk scales with them), the
same with 32 value heads (q and k repeated to the value heads), its gated full attention, and a tiny MoE with
distinct expert, shared-expert and hidden sizes. Skips where megatron-core is not installed."""
from tests.megatron_cpu import CPU_TRANSFORMER_OVERRIDES  # noqa: F401  first: the prelude (skips without megatron)

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qwen35rl.config import memory as M
from qwen35rl.config.compose import compose

TOLERANCE = 0.02
"""Relative; the formulas were exact (to the byte per token) on these shapes on 2026-12-02."""
MOE = ["model=qwen3_5_tiny_moe", "model.moe_intermediate_size=96", "model.shared_expert_intermediate_size=48",
       "model.num_experts=16", "model.num_experts_per_tok=3"]
CASES = {
    "0.8b-gdn": (["model=qwen3_5_0_8b"], "linear"),
    "0.8b-gdn-32v": (["model=qwen3_5_0_8b", "model.linear_num_value_heads=32"], "linear"),
    "0.8b-attention": (["model=qwen3_5_0_8b"], "full"),
    "moe-attention": (MOE, "full"),
    "moe-gdn": (MOE, "linear"),
}
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def measured():
    specs = [{"overrides": o, "kind": f"{k}_attention"} for o, k in CASES.values()]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "tests.config.megatron_saved_bytes", json.dumps(specs)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-4000:]
    return dict(zip(CASES, json.loads(run.stdout.strip().splitlines()[-1])))


@pytest.mark.parametrize("case", list(CASES))
def test_megatron_layer_bytes_per_token_are_what_the_layer_saves(measured, case):
    overrides, kind = CASES[case]
    m = M.as_tree(compose(overrides))["model"]
    formula = M.megatron_layer_bytes_per_token(m, kind, "torch")
    assert formula == pytest.approx(measured[case], rel=TOLERANCE), (formula, measured[case])


def test_the_torch_recurrence_keeps_far_more_than_the_old_fused_formula(measured):
    """What motivated the measurement: the fused-module formula (now vLLM's) gave a fifth of the GDN layer."""
    m = M.as_tree(compose(CASES["0.8b-gdn"][0]))["model"]
    assert measured["0.8b-gdn"] > 4 * M.layer_activation_elems_per_token(m, "linear") * M.BF16
    assert M.megatron_layer_bytes_per_token(m, "linear", "fla") < 0.5 * measured["0.8b-gdn"]


def test_plan_follows_deterministic_mode():
    base = ["model=qwen3_5_0_8b", "backend=megatron", "hw=gpu_1x", "hw.devices_per_node=1"]
    assert M.megatron_gdn_kernels(M.as_tree(compose(base))) == "fla"
    assert M.megatron_gdn_kernels(M.as_tree(compose(base + ["+backend.transformer_overrides.deterministic_mode=true"]))) == "torch"
    assert M.megatron_gdn_kernels(M.as_tree(compose(base + ["+backend.transformer_overrides.deterministic_mode=false"]))) == "fla"
    assert M.megatron_gdn_kernels(M.as_tree(compose(["model=qwen3_5_tiny", "backend=megatron", "hw=cpu"]))) == "torch"
