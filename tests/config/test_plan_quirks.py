"""The plan names the vLLM quirks a run gets (text and JSON), with their reason, and says when the user's
rollout.engine_kwargs override one; nothing where the vLLM version is fixed or the rollout is not vLLM."""
from qwen35rl.config.compose import compose
from qwen35rl.config.plan import build_plan, render_text

NPU_122B = ["model=qwen3_5_122b_a10b", "hw=a3_4node", "backend=megatron", "data=geo3k"]


def test_plan_names_the_quirk_that_applies():
    plan = build_plan(compose(NPU_122B))
    assert [(q["key"], q["value"], q["overridden"]) for q in plan["vllm_quirks"]] == [("mm_processor_cache_gb", 0, False)]
    assert "mm_hash" in plan["vllm_quirks"][0]["why"]
    assert "vllm quirk mm_processor_cache_gb=0 (applied)" in render_text(plan)


def test_plan_says_when_the_user_overrides_it():
    plan = build_plan(compose([*NPU_122B, "+rollout.engine_kwargs.mm_processor_cache_gb=4"]))
    assert plan["vllm_quirks"][0]["overridden"]
    assert "overridden by rollout.engine_kwargs" in render_text(plan)


def test_no_quirk_on_a_fixed_vllm_or_without_vllm():
    assert build_plan(compose([*NPU_122B, "rollout.vllm_version=0.22.0"]))["vllm_quirks"] == []
    assert build_plan(compose([*NPU_122B, "rollout=hf"]))["vllm_quirks"] == []
