"""The declaration of what each engine builds: the plan and the engines read the same entries, with the same codes."""
import pytest

from qwen35rl.config import capabilities as C
from qwen35rl.config import rules
from qwen35rl.config.compose import compose
from qwen35rl.config.layout import derive_layout
from qwen35rl.config.problems import ERROR, WARNING


def _found(overrides, stack=None):
    cfg = compose(list(overrides))
    return {(p.code, p.severity) for p in C.problems(cfg, derive_layout(cfg), stack)}


def test_context_parallel_is_refused_with_the_plan_code_by_the_engine_check():
    cfg = compose(["backend=megatron", "hw.devices_per_node=2", "parallelism.cp=2",
                   "backend.megatron_core_version=0.18.0"])
    layout = derive_layout(cfg)
    plan = [p for p in rules.check_all(cfg, layout) if p.code == "megatron_context_parallel"]
    assert [p.severity for p in plan] == [ERROR] and "parallelism.cp=2" in plan[0].message
    with pytest.raises(C.Unsupported) as e:
        C.check_engine(cfg, layout, C.Stack("cuda", transformer_engine=True, fla=True))
    assert [p.to_dict() for p in e.value.problems] == [p.to_dict() for p in plan]
    assert "megatron_context_parallel" in str(e.value)


def test_settings_not_applied_are_warnings_the_engine_returns_for_its_log():
    cfg = compose(["backend=megatron", "model=qwen3_5_tiny_moe", "backend.moe_grouped_gemm=true",
                   "backend.remove_padding=true", "backend.use_precision_aware_optimizer=true"])
    warned = C.check_engine(cfg, derive_layout(cfg), C.Stack("cpu", transformer_engine=False, fla=False))
    assert {p.code for p in warned} == {"megatron_grouped_gemm", "megatron_pads_sequences",
                                        "megatron_permute_fusion_needs_te", "megatron_precision_aware_optimizer"}
    assert all(p.severity == WARNING for p in warned)


def test_stack_dependent_entries_wait_for_the_nodes_stack():
    gpu = ["backend=megatron", "model=qwen3_5_tiny_moe", "hw=gpu_1node", "rollout=hf"]
    te_codes = {("megatron_permute_fusion_needs_te", WARNING)}
    assert not _found(gpu) & te_codes  # the plan cannot know whether the GPU nodes have Transformer Engine
    assert _found(gpu, C.Stack("cuda", transformer_engine=False)) >= te_codes
    assert not _found(gpu, C.Stack("cuda", transformer_engine=True)) & te_codes
    assert _found(["backend=megatron", "model=qwen3_5_tiny_moe", "hw=a3_1node"]) >= te_codes  # no TE on Ascend


def test_entries_only_speak_of_their_own_engine():
    assert _found(["backend=fsdp", "backend.entropy_from_logits_with_chunking=false"]) == {
        ("fsdp_chunked_entropy", WARNING)}
    assert _found(["backend=fsdp"]) == set()
    assert all(e.engine in C.AXES for e in C.DECLARATION)
    assert len({e.code for e in C.DECLARATION}) == len(C.DECLARATION)


def test_the_layout_search_stays_inside_the_declared_degrees():
    from qwen35rl.config import layout_search

    cfg = compose(["backend=megatron", "hw.devices_per_node=4"])
    assert {o["cp"] for o in layout_search.train_options(cfg, 4)} == {1}
