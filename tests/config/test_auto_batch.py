"""`backend.micro_batch_size_per_device=auto` / `backend.gradient_checkpointing=auto`: resolved once in the config
layer from the memory estimate (the largest micro batch that fits, without checkpointing when any does), so that
rules, estimate, the verl export and the runtime only see an int and a bool. Expectations are derived from
`memory.estimate` itself, by trying every divisor, not typed in."""
import json
import os
import subprocess
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from qwen35rl.cli.plan import main
from qwen35rl.config import auto_batch, layout_search, rules, schema, vllm_facts
from qwen35rl.config.compose import compose
from qwen35rl.config.layout import derive_layout
from qwen35rl.config.memory import as_tree, estimate
from qwen35rl.config.plan import build_plan
from qwen35rl.config.resolved import resolve_auto
from qwen35rl.config.problems import errors

MICRO, CKPT = "backend.micro_batch_size_per_device", "backend.gradient_checkpointing"
AUTO = [f"{MICRO}=auto", f"{CKPT}=auto"]
SMALL = ["model=qwen3_5_0_8b", "hw=gpu_1x"]
# the 4B workload on one H200: random init, KL on, transformers rollout, 256 + 512 tokens, 16 x 8
H200_4B = ["model=qwen3_5_4b", "model.init=random", "hw=gpu_1x", "hw.memory_gb=141", "rollout=hf",
           "algorithm.use_kl_loss=true", "data.max_prompt_length=256", "data.max_response_length=512",
           "data.train_batch_size=16", "rollout.n=8", "algorithm.mini_batch_size=16"]


def _share(tree, layout):
    return int(tree["algorithm"]["mini_batch_size"]) * int(tree["rollout"]["n"]) // layout.dp


def _fits(tree, layout, micro, ckpt):
    t = auto_batch.with_settings(tree, micro, ckpt)
    est = estimate(t, layout)
    return est.train_peak_gib <= est.capacity_gib, est


def _brute_force(overrides, ckpts=(False, True)):
    """(micro, checkpointing) by the policy, over every divisor of the rank's share: the largest that fits without
    checkpointing, else with it, else (1, the last tried)."""
    tree = as_tree(compose(list(overrides)))
    layout = derive_layout(tree)
    share = _share(tree, layout)
    for ckpt in ckpts:
        fitting = [d for d in range(1, share + 1) if share % d == 0 and _fits(tree, layout, d, ckpt)[0]]
        if fitting:
            return max(fitting), ckpt
    return 1, ckpts[-1]


def _resolved(overrides):
    cfg, _, choice, problems = resolve_auto(compose(list(overrides)))
    assert not problems
    return cfg, choice


@pytest.mark.parametrize("overrides", [SMALL, H200_4B, [*H200_4B, "backend=megatron"]],
                         ids=["0.8b-gpu_1x", "4b-h200", "4b-h200-megatron"])
def test_auto_is_the_largest_micro_batch_that_fits(overrides):
    cfg, choice = _resolved([*overrides, *AUTO])
    tree, layout = as_tree(cfg), derive_layout(cfg)
    assert (choice.micro, choice.checkpointing) == _brute_force([*overrides, *AUTO])
    micro, ckpt = tree["backend"]["micro_batch_size_per_device"], tree["backend"]["gradient_checkpointing"]
    assert type(micro) is int and type(ckpt) is bool and (micro, ckpt) == (choice.micro, choice.checkpointing)
    assert _share(tree, layout) % micro == 0
    ok, est = _fits(tree, layout, micro, ckpt)
    assert ok and choice.train_peak_gib == pytest.approx(est.train_peak_gib)
    # the next larger micro batch does not fit (per the estimate), and the choice says so
    share = _share(tree, layout)
    larger = [d for d in range(micro + 1, share + 1) if share % d == 0]
    if larger:
        assert not _fits(tree, layout, larger[0], ckpt)[0]
        assert choice.larger["micro"] == larger[0]
    assert not [p for p in rules.check_all(cfg, layout) if p.code == "train_memory_fits"]


def test_4b_on_h200_fits_without_checkpointing_only_at_small_micro_batches():
    """The issue's numbers: with KL on and no checkpointing the plan fits the 4B on one H200 at micro <= 4."""
    _, choice = _resolved([*H200_4B, *AUTO])
    assert not choice.checkpointing and 1 < choice.micro <= 4
    assert choice.why == "largest that fits without checkpointing"


def test_nothing_fits_keeps_the_smallest_and_the_memory_rule_reports_it():
    base = ["model=qwen3_5_4b", "model.init=random", "hw=gpu_1x", "rollout=hf"]  # 80 GB, 1024 + 2048 tokens
    tree = as_tree(compose(base))
    layout = derive_layout(tree)
    assert not _fits(tree, layout, 1, True)[0]
    plan = build_plan(compose([*base, *AUTO]))
    auto = plan["batch"]["auto"]
    assert (auto["micro_batch_size_per_device"], auto["gradient_checkpointing"]) == (1, True)
    assert auto["why"].startswith("nothing fits")
    fit = [p for p in plan["problems"] if p["code"] == "train_memory_fits"]
    assert not plan["valid"] and fit and fit[0]["hint"]


def test_only_the_auto_key_is_searched():
    # checkpointing fixed on: the micro batch alone, the largest that fits with checkpointing
    cfg, choice = _resolved([*SMALL, f"{MICRO}=auto", f"{CKPT}=true"])
    assert choice.keys == (MICRO,) and cfg.backend.gradient_checkpointing is True
    assert (choice.micro, True) == _brute_force([*SMALL, f"{CKPT}=true"], ckpts=(True,))
    # the micro batch fixed: checkpointing off when that fits, else on (both per the estimate)
    tree = as_tree(compose(SMALL))
    layout = derive_layout(tree)
    for micro in (1, 8, 16):
        expected = not _fits(tree, layout, micro, False)[0]
        cfg, choice = _resolved([*SMALL, f"{MICRO}={micro}", f"{CKPT}=auto"])
        assert choice.keys == (CKPT,) and cfg.backend.micro_batch_size_per_device == micro
        assert cfg.backend.gradient_checkpointing is expected, micro
    assert not _fits(tree, layout, 16, False)[0]  # so the loop saw both outcomes
    assert _fits(tree, layout, 1, False)[0]


def test_dynamic_batch_size_resolves_the_count_to_1_and_checkpointing_for_the_budget():
    over = [*SMALL, "backend.dynamic_batch_size=true"]
    cfg, choice = _resolved([*over, *AUTO])
    assert cfg.backend.micro_batch_size_per_device == 1 and "dynamic_batch_size" in choice.why
    tree = as_tree(compose(over))
    assert cfg.backend.gradient_checkpointing is (not _fits(tree, derive_layout(tree), 1, False)[0])
    for budget in (4096, 65536):  # a budget that fits without checkpointing, one that does not
        t = as_tree(compose([*over, f"backend.max_tokens_per_device={budget}"]))
        cfg, _ = _resolved([*over, f"backend.max_tokens_per_device={budget}", *AUTO])
        assert cfg.backend.gradient_checkpointing is (not _fits(t, derive_layout(t), 1, False)[0]), budget


def test_megatron_pipeline_keeps_at_least_pp_micro_batches():
    over = ["model=qwen3_5_0_8b", "hw=gpu_1node", "backend=megatron", "parallelism.tp=1", "parallelism.pp=2",
            "data.max_prompt_length=256", "data.max_response_length=512"]
    cfg, choice = _resolved([*over, *AUTO])
    layout = derive_layout(cfg)
    share = _share(as_tree(cfg), layout)
    assert layout.pp == 2 and share // choice.micro >= 2
    sizes = auto_batch.micro_sizes(as_tree(cfg), layout)
    assert max(sizes) == share // 2 and all(share % d == 0 for d in sizes)
    assert not [p for p in rules.check_all(cfg, layout) if p.severity == "error" and p.code != "model_path_missing"]


def test_with_parallelism_auto_each_layout_carries_its_own_choice():
    cfg = compose(["model=qwen3_5_27b", "hw=gpu_1node", "backend=megatron", "parallelism=auto", *AUTO])
    cands = layout_search.search(cfg)
    assert cands
    for c in cands[:20]:
        assert c.batch is not None and c.memory.fits
        assert c.settings[MICRO] == c.batch.micro and c.settings[CKPT] == c.batch.checkpointing
        applied = layout_search.apply(cfg, c)
        layout = derive_layout(applied)
        assert layout == c.layout and _share(as_tree(applied), layout) % c.batch.micro == 0
        assert applied.backend.micro_batch_size_per_device == c.batch.micro
        assert "backend" not in str(applied.parallelism.name)
        assert not errors(rules.check_all(applied, layout))
    plan = build_plan(cfg)
    assert plan["valid"] and plan["batch"]["auto"]["micro_batch_size_per_device"] == cands[0].batch.micro
    assert plan["batch"]["auto"]["train_peak_gib"] == pytest.approx(plan["memory_gib"]["train_peak"], abs=1e-3)
    assert plan["auto_candidates"][0]["auto_batch"]["micro_batch_size_per_device"] == cands[0].batch.micro


@pytest.mark.parametrize("override,message", [
    (f"{MICRO}=fast", "must be an integer >= 1 (or auto)"), (f"{MICRO}=2.5", "must be an integer"),
    (f"{MICRO}=true", "must be an integer"), (f"{MICRO}=0", "must be >= 1 (or auto)"),
    (f"{CKPT}=fast", "must be true, false or auto"), (f"{CKPT}=1", "must be true, false or auto"),
])
def test_bad_values_are_refused_naming_the_key(override, message, capsys):
    key = override.split("=")[0]
    found = rules.gate_problems(as_tree(compose([*SMALL, override])))
    assert [(p.code, p.key) for p in found] == [("value_in_range", key)] and message in found[0].message
    assert main([*SMALL, override]) == 2
    out, err = capsys.readouterr()
    assert f"[value_in_range] {key}" in out + err and "Traceback" not in out + err


def test_defaults_are_unchanged_and_need_no_resolution():
    assert schema.FsdpConfig.__dataclass_fields__["micro_batch_size_per_device"].default == 1
    assert schema.FsdpConfig.__dataclass_fields__["gradient_checkpointing"].default is True
    cfg = vllm_facts.resolve(compose(SMALL))  # rollout.vllm_version=auto is one default resolved
    assert vllm_facts.resolve(cfg) is cfg
    same, candidates, choice, problems = resolve_auto(cfg)
    assert choice is None and not candidates and not problems
    # the others: the vLLM pool (rollout.gpu_memory_utilization=auto), sized for this layout, and the launcher;
    # nothing else changes
    assert cfg.rollout.gpu_memory_utilization == "auto" and 0 < same.rollout.gpu_memory_utilization <= 0.9
    assert cfg.trainer.launcher == "auto" and same.trainer.launcher in ("ray", "local")
    same.rollout.gpu_memory_utilization = same.trainer.launcher = "auto"
    assert same == cfg
    resolved = resolve_auto(cfg)[0]
    assert resolve_auto(resolved)[0] is resolved
    assert build_plan(cfg)["batch"]["auto"] is None


def test_cli_prints_the_choice_and_verl_gets_an_int(capsys):
    _, choice = _resolved([*SMALL, f"{MICRO}=auto"])
    main([*SMALL, f"{MICRO}=auto"])
    out = capsys.readouterr().out
    assert f"  auto       micro batch {choice.micro} (auto: largest that fits" in out
    assert f"in {80 // choice.micro} micro batch(es) of {choice.micro}" in out
    main([*SMALL, f"{MICRO}=auto", "format=json"])
    plan = json.loads(capsys.readouterr().out)
    assert plan["batch"]["micro_batch_size_per_device"] == choice.micro
    assert plan["batch"]["auto"]["keys"] == [MICRO] and plan["batch"]["auto"]["why"]
    main([*SMALL, *AUTO, "format=verl"])
    out = capsys.readouterr().out
    _, both = _resolved([*SMALL, *AUTO])
    assert f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={both.micro} " in out
    assert f"actor_rollout_ref.model.enable_gradient_checkpointing={both.checkpointing} " in out
    assert "micro_batch_size_per_gpu=auto" not in out and "checkpointing=auto" not in out


def test_resolution_imports_nothing_heavy():
    code = ("import sys; from qwen35rl.config.compose import compose; from qwen35rl.config.plan import build_plan;"
            "build_plan(compose(['model=qwen3_5_27b','hw=gpu_1node','backend=megatron','parallelism=auto',"
            f"'{MICRO}=auto','{CKPT}=auto']));"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch','ray','transformers','vllm'}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]"


TOKENS = "backend.max_tokens_per_device"
BUDGET_4B = [*H200_4B, "backend.dynamic_batch_size=true", f"{CKPT}=false"]


def _fits_budget(tree, layout, tokens, ckpt):
    t = auto_batch.with_settings(tree, 1, ckpt, tokens)
    est = estimate(t, layout)
    return est.train_peak_gib <= est.capacity_gib


@pytest.mark.parametrize("overrides", [[*SMALL, "backend.dynamic_batch_size=true", f"{CKPT}=false"], BUDGET_4B],
                         ids=["0.8b", "4b-h200"])
def test_auto_token_budget_is_the_largest_that_fits(overrides):
    """max_tokens_per_device=auto with dynamic batch size: the largest budget of `token_budgets` (one sequence, then
    steps of 1024 up to a rank's share of whole sequences) whose estimate fits, found by trying every one."""
    tree = as_tree(compose(overrides))
    layout = derive_layout(tree)
    budgets = auto_batch.token_budgets(tree, layout)
    seq = int(tree["data"]["max_prompt_length"]) + int(tree["data"]["max_response_length"])
    assert budgets[0] == seq and all(b % auto_batch.TOKEN_STEP == 0 for b in budgets[1:])
    assert budgets == sorted(set(budgets)) and budgets[-1] <= _share(tree, layout) * seq
    fitting = [b for b in budgets if _fits_budget(tree, layout, b, False)]
    assert fitting and fitting[-1] < budgets[-1]  # the search has a bound to find on both
    cfg, choice = _resolved([*overrides, f"{TOKENS}=auto"])
    assert cfg.backend.max_tokens_per_device == choice.tokens == fitting[-1]
    assert choice.larger["tokens"] == budgets[budgets.index(fitting[-1]) + 1]
    assert choice.larger["train_peak_gib"] > choice.capacity_gib >= choice.train_peak_gib
    assert "token budget" in choice.describe() and choice.to_dict()["max_tokens_per_device"] == fitting[-1]


def test_auto_token_budget_with_checkpointing_auto_prefers_no_checkpointing():
    over = [*SMALL, "backend.dynamic_batch_size=true"]
    cfg, choice = _resolved([*over, f"{TOKENS}=auto", f"{CKPT}=auto"])
    tree = as_tree(compose(over))
    assert cfg.backend.gradient_checkpointing is False  # the smallest budget fits without: it is searched without
    assert _fits_budget(tree, derive_layout(tree), choice.tokens, False)


def test_auto_token_budget_without_dynamic_batch_size_is_one_sequence():
    cfg, choice = _resolved([*SMALL, f"{TOKENS}=auto"])
    assert cfg.backend.max_tokens_per_device == cfg.data.max_prompt_length + cfg.data.max_response_length
    assert "unused without dynamic_batch_size" in choice.why


def test_auto_token_budget_reaches_the_plan_and_verl_as_an_int(capsys):
    over = [*SMALL, "backend.dynamic_batch_size=true", f"{CKPT}=false", f"{TOKENS}=auto"]
    _, choice = _resolved(over)
    assert main(over) == 0
    out = capsys.readouterr().out
    assert f"micro batches of at most {choice.tokens} tokens" in out and f"token budget {choice.tokens}" in out
    main([*over, "format=verl"])
    out = capsys.readouterr().out
    assert f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={choice.tokens} " in out
    assert "max_token_len_per_gpu=auto" not in out
    found = rules.gate_problems(as_tree(compose([*SMALL, f"{TOKENS}=many"])))
    assert [(p.code, p.key) for p in found] == [("value_in_range", TOKENS)]
