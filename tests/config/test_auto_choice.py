"""parallelism=auto that users trust (issue 36): the tested layout stays unless the model says another is better by
more than its error, offload and recomputation are options with their cost, and the choice and the runner-up are
explained in one line each."""
from qwen35rl.config import layout_search as S
from qwen35rl.config.compose import compose
from qwen35rl.config.plan import build_plan, render_text

MG35 = ["model=qwen3_5_35b_a3b", "backend=megatron", "hw=gpu_1node", "data=geo3k"]


def test_a_tested_layout_stays_within_the_margin():
    cfg = compose([*MG35, "parallelism=auto"])
    cands = S.search(cfg)
    tested = S.tested_candidate(cfg, cands)
    assert tested is not None and tested.variant == {}
    assert cands[0] is not tested and cands[0].score * (1 + S.KEEP_TESTED_MARGIN) >= tested.score  # a few % better
    assert S.pick(cfg, cands) is tested
    plan = build_plan(cfg)
    assert (plan["train"]["tp"], plan["train"]["ep"], plan["rollout"]["tp"]) == (2, 8, 8)
    why = plan["auto_choice"]
    assert why["kept_tested"] and why["margin"] == S.KEEP_TESTED_MARGIN
    assert "is kept" in why["chosen"] and "within its error" in why["chosen"]
    assert why["runner_up"] and "not taken" in why["runner_up"]
    text = render_text(plan)
    assert f"  auto chose {why['chosen']}" in text and f"  runner-up  {why['runner_up']}" in text


def test_a_tested_layout_is_replaced_beyond_the_margin(monkeypatch):
    cfg = compose([*MG35, "parallelism=auto"])
    cands = S.search(cfg)
    monkeypatch.setattr(S, "KEEP_TESTED_MARGIN", 0.0)
    assert S.pick(cfg, cands) is cands[0]
    why = S.explain(cfg, cands)
    assert not why["kept_tested"] and "replacing the tested layout" in why["chosen"]


def test_without_a_tested_layout_the_best_is_taken_and_the_runner_up_says_why_it_lost():
    cfg = compose(["model=qwen3_5_4b", "hw=gpu_1node", "parallelism=auto"])
    cands = S.search(cfg)
    assert S.tested_candidate(cfg, cands) is None and S.pick(cfg, cands) is cands[0]
    why = S.explain(cfg, cands)
    assert "no tested layout" in why["chosen"] and why["runner_up"].split(": ")[0] != why["chosen"].split(": ")[0]
    assert "more " in why["runner_up"] or "within rounding" in why["runner_up"]


def test_offload_and_recomputation_are_searched_with_their_cost():
    """122B on four A3 nodes with FSDP fits only with the trainer's state on the host: the search finds it."""
    cfg = compose(["model=qwen3_5_122b_a10b", "hw=a3_4node", "backend=fsdp", "data=geo3k", "parallelism=auto",
                   "parallelism.fsdp_size=-1", "parallelism.rollout.tp=1", "backend.offload_policy=false",
                   "backend.param_offload=false", "backend.optimizer_offload=false"])
    cands = S.search(cfg)
    assert cands and all(c.variant.get("backend.offload_policy") for c in cands)
    assert cands[0].cost["offload_s"] > 0
    variants = S.backend_variants(S.M.as_tree(compose(["model=qwen3_5_4b", "hw=gpu_1node"])))
    assert variants[0] == {} and {"backend.gradient_checkpointing": False} in variants
    assert any(v.get("backend.offload_policy") is True for v in variants)
    small = S.search(compose(["model=qwen3_5_0_8b", "hw=gpu_1node", "parallelism=auto"]))
    off = [c for c in small if c.variant.get("backend.gradient_checkpointing") is False]
    on = [c for c in small if not c.variant]
    assert off and on and min(c.cost["compute_s"] for c in off) < min(c.cost["compute_s"] for c in on)
