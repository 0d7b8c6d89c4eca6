"""placement=colocated|split and algorithm.max_staleness in the config layer: composition, the layout of each pool,
every placement rule (passing and failing), per-pool memory, the pool-size search, the plan's text and JSON, the
resume checks and the verl export's classification of the new keys."""
import json
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from qwen35rl.config import capabilities, layout_search, rules
from qwen35rl.config import memory as M
from qwen35rl.config.compose import ConfigError, compose
from qwen35rl.config.layout import Layout, derive_layout, pools_per_node
from qwen35rl.config.plan import build_plan, render_text
from qwen35rl.config.problems import ERROR, WARNING
from tests.config.trees import updated
from qwen35rl.config.verl.exporter import export

SPLIT4 = ["hw.devices_per_node=4", "placement=split", "placement.rollout_devices=1", "data.train_batch_size=24",
          "algorithm.mini_batch_size=6", "rollout.n=8"]
"""The tiny model on 4 CPU workers: 3 train (DP3: 24 prompts x 8 responses split over them), 1 generates."""
MG_TINY = ["model=qwen3_5_tiny_moe", "backend=megatron", "backend.moe_permute_fusion=false",
           "backend.use_precision_aware_optimizer=false"]


def found(cfg, code=None):
    tree = M.as_tree(cfg)
    out = rules.check_all(tree, derive_layout(tree))
    return [p for p in out if code is None or p.code == code]


def errors(cfg):
    return sorted({p.code for p in found(cfg) if p.severity == ERROR})


def with_keys(cfg, **updates):
    """A plain copy of `cfg` with dotted updates (`a__b` spells `a.b`)."""
    return updated(M.as_tree(cfg), **updates)


# ------------------------------------------------------------------------------------------------- composition
def test_composition_defaults_and_the_split_group():
    cfg = compose([])
    assert cfg.placement.mode == "colocated" and cfg.placement.rollout_devices is None
    assert cfg.algorithm.max_staleness == 0 and cfg.algorithm.rollout_is == "auto"
    assert cfg.algorithm.rollout_is_threshold == 2.0
    split = compose(SPLIT4)
    assert split.placement.mode == "split" and split.placement.rollout_devices == 1
    # the split group leaves the Megatron engine's between-phase host offload off (its backend default is on)
    assert compose(MG_TINY).backend.param_offload is True
    mg = compose(MG_TINY + ["placement=split"])
    assert not (mg.backend.param_offload or mg.backend.grad_offload or mg.backend.optimizer_offload)
    assert mg.backend.optimizer_cpu_offload is True  # a training-memory setting: kept
    # FSDP recipes that offload (the CPU offload policy for the whole step) still do under split
    fsdp27 = compose(["model=qwen3_5_27b", "hw=gpu_1node", "placement=split"])
    assert fsdp27.backend.param_offload is True and fsdp27.backend.offload_policy is True


def test_unknown_placement_and_bad_types_fail_at_composition():
    with pytest.raises(ConfigError) as e:
        compose(["placement=splitt"])
    assert e.value.code == "unknown_group_option" and "split" in e.value.allowed
    with pytest.raises(ConfigError):
        compose(["placement.rollout_devices=two"])
    with pytest.raises(ConfigError) as e:
        compose(["~placement"])
    assert e.value.code == "required_group_deleted"
    cfg = compose(["placement.mode=splat"])
    assert [p.key for p in found(cfg, "known_choice")] == ["placement.mode"]
    assert [p.key for p in found(compose(["algorithm.rollout_is=tokens"]), "known_choice")] == ["algorithm.rollout_is"]
    assert [p.key for p in found(compose(["algorithm.rollout_is_threshold=1.0"]), "value_in_range")] == \
        ["algorithm.rollout_is_threshold"]
    assert [p.key for p in found(compose(["algorithm.max_staleness=-1"]), "value_in_range")] == \
        ["algorithm.max_staleness"]


# ------------------------------------------------------------------------------------------------------ layout
def test_split_layout_is_the_training_pool_and_the_rollout_pool():
    lay = derive_layout(compose(SPLIT4))
    assert (lay.world, lay.rollout_world, lay.split, lay.devices) == (3, 1, True, 4)
    assert lay.dp == 3 and lay.fsdp_size == 3 and (lay.rollout_tp, lay.rollout_dp) == (1, 1)
    co = derive_layout(compose(["hw.devices_per_node=4"]))
    assert (co.world, co.rollout_world, co.split, co.devices, co.rollout_dp) == (4, 4, False, 4, 4)
    mg = derive_layout(compose(["model=qwen3_5_0_8b", "hw=gpu_16node", "backend=megatron", "rollout=hf",
                                "placement=split", "placement.rollout_devices=32", "parallelism.tp=2"]))
    assert (mg.world, mg.dp, mg.edp, mg.rollout_world, mg.rollout_dp) == (96, 48, 96, 32, 32)


def test_a_layout_dict_from_before_placement_loads_as_colocated():
    lay = derive_layout(compose(SPLIT4))
    assert Layout.from_dict(lay.to_dict()) == lay
    old = {k: v for k, v in derive_layout(compose([])).to_dict().items() if k not in ("rollout_world", "split")}
    back = Layout.from_dict({**old, "some_future_field": 1})
    assert back.rollout_world == back.world == 2 and back.split is False
    assert Layout(**old).rollout_world == 2  # positional construction without the new fields still works


def test_the_rollout_pool_is_the_last_devices_in_node_major_order():
    cfg = compose(["model=qwen3_5_0_8b", "hw=gpu_16node", "rollout=hf", "placement=split",
                   "placement.rollout_devices=12"])
    nodes = pools_per_node(cfg)
    assert len(nodes) == 16 and nodes[0] == {"training": 8, "rollout": 0}
    assert nodes[14] == {"training": 4, "rollout": 4} and nodes[15] == {"training": 0, "rollout": 8}
    assert sum(n["training"] for n in nodes) == derive_layout(cfg).world == 116
    assert pools_per_node(compose([])) == [{"training": 2, "rollout": 2}]


# ------------------------------------------------------------------------------------------------------- rules
def test_split_needs_ray():
    assert not found(compose(SPLIT4), "split_needs_ray")
    p, = found(compose(SPLIT4 + ["trainer.launcher=local"]), "split_needs_ray")
    assert p.key == "trainer.launcher" and p.severity == ERROR and p.hint == "try trainer.launcher=ray"
    assert not found(compose(["hw.devices_per_node=1", "trainer.launcher=local"]), "split_needs_ray")


def test_split_rollout_needs_hf():
    assert not found(compose(SPLIT4), "split_rollout_needs_hf")
    p, = found(compose(SPLIT4 + ["rollout=vllm"]), "split_rollout_needs_hf")
    assert p.key == "rollout.engine" and "weight receiver" in p.message and "rollout=hf" in p.hint
    assert not found(compose(["rollout=vllm"]), "split_rollout_needs_hf")  # colocated vLLM is fine
    # on a GPU, rollout=default picks vLLM: split needs rollout=hf said explicitly
    assert found(compose(["model=qwen3_5_0_8b", "hw=gpu_1node", "placement=split", "placement.rollout_devices=2"]),
                 "split_rollout_needs_hf")


def test_staleness_needs_split():
    p, = found(compose(["algorithm.max_staleness=1"]), "staleness_needs_split")
    assert p.key == "algorithm.max_staleness" and p.severity == ERROR and "placement=split" in p.hint
    assert not found(compose(SPLIT4 + ["algorithm.max_staleness=3"]), "staleness_needs_split")
    assert not found(compose(["algorithm.max_staleness=0"]), "staleness_needs_split")


@pytest.mark.parametrize("overrides, message", [
    (["placement=split"], "no rollout-pool size of the 2 devices gives a valid plan"),
    (["placement=split", "placement.rollout_devices=0"], "between 1 and 1"),
    (["placement=split", "placement.rollout_devices=2"], "between 1 and 1"),
    (["placement=split", "placement.rollout_devices=-3"], "between 1 and 1"),
    (["placement=split", "hw.devices_per_node=1", "placement.rollout_devices=1"], "a device for each pool"),
])
def test_split_pool_sizes_refused(overrides, message):
    p, = found(compose(overrides), "split_pool_sizes")
    assert p.severity == ERROR and message in p.message and p.hint
    assert errors(compose(overrides)) == ["split_pool_sizes"]  # an empty pool: no layout rule runs over it


def test_split_pool_sizes_accepted():
    for ok in (["placement=split", "placement.rollout_devices=1"],  # the embedded default on its 2 CPU workers
               ["placement=split", "parallelism=auto"]):  # null: searched
        assert not found(compose(ok), "split_pool_sizes")
    p, = found(compose(["placement=split"]), "split_pool_sizes")
    assert p.hint.startswith("try placement.rollout_devices=1") and "parallelism=auto" in p.hint


def test_rollout_devices_needs_split():
    p, = found(compose(["placement.rollout_devices=1"]), "rollout_devices_needs_split")
    assert p.key == "placement.rollout_devices" and p.severity == ERROR and "placement=split" in p.hint
    assert not found(compose([]), "rollout_devices_needs_split")
    assert not found(compose(SPLIT4), "rollout_devices_needs_split")


def test_split_offload_pointless():
    base = MG_TINY + ["hw.devices_per_node=4", "placement=split", "placement.rollout_devices=2"]
    assert not found(compose(base), "split_offload_pointless")
    p, = found(compose(base + ["backend.grad_offload=true", "backend.optimizer_offload=true"]),
               "split_offload_pointless")
    assert p.key == "backend.grad_offload" and p.severity == ERROR and "never generate" in p.message
    assert "backend.grad_offload=false backend.optimizer_offload=false" in p.hint
    # colocated, the same offload is what makes room for generation
    assert not found(compose(MG_TINY), "split_offload_pointless")
    # FSDP's offload keys are its CPU offload policy for the whole step: allowed under split
    assert not found(compose(SPLIT4 + ["backend.param_offload=true"]), "split_offload_pointless")


def test_rollout_is_with_rollout_log_probs_warns():
    p, = found(compose(SPLIT4 + ["algorithm.max_staleness=1", "algorithm.rollout_is=sequence",
                                 "backend.use_rollout_log_probs=true"]), "rollout_is_weights_are_one")
    assert p.severity == WARNING and p.key == "algorithm.rollout_is" and "every weight is 1" in p.message
    # auto resolves to off there: nothing to warn about
    assert not found(compose(SPLIT4 + ["algorithm.max_staleness=1", "backend.use_rollout_log_probs=true"]),
                     "rollout_is_weights_are_one")
    assert not found(compose(SPLIT4 + ["algorithm.max_staleness=1", "algorithm.rollout_is=token"]),
                     "rollout_is_weights_are_one")


def test_rollout_is_mode_resolves_auto():
    mode = lambda *o: capabilities.rollout_is_mode(compose(list(o)))  # noqa: E731
    assert mode() == "off"
    assert mode(*SPLIT4, "algorithm.max_staleness=1") == "token"
    assert mode(*SPLIT4, "algorithm.max_staleness=1", "backend.use_rollout_log_probs=true") == "off"
    assert mode(*SPLIT4, "algorithm.rollout_is=sequence") == "sequence"
    assert mode("algorithm.rollout_is=token") == "token"  # explicit: also on-policy (engine vs trainer numerics)
    assert mode(*SPLIT4, "algorithm.max_staleness=2", "algorithm.rollout_is=off") == "off"


def test_the_training_layout_is_checked_on_the_training_pool():
    bad = compose(SPLIT4 + ["placement.rollout_devices=2", "parallelism.fsdp_size=4"])
    p, = found(bad, "fsdp_size_divides_world")
    assert "training pool of 2 devices" in p.message
    mg = compose(MG_TINY + ["hw.devices_per_node=4", "placement=split", "placement.rollout_devices=1",
                            "parallelism.tp=2"])
    p, = found(mg, "world_size_matches_devices")
    assert "training pool of 3 devices" in p.message and "placement.rollout_devices=1" in p.message
    assert not found(compose(MG_TINY + ["hw.devices_per_node=4", "placement=split", "placement.rollout_devices=2",
                                        "parallelism.tp=2"]), "world_size_matches_devices")


def test_the_rollout_layout_is_checked_on_the_rollout_pool():
    p, = found(compose(SPLIT4 + ["placement.rollout_devices=2", "parallelism.rollout.dp=4"]),
               "rollout_replicas_cover_devices")
    assert "2 devices of the rollout pool" in p.message and p.hint == "try parallelism.rollout.dp=2"
    assert not found(compose(SPLIT4 + ["placement.rollout_devices=2", "parallelism.rollout.dp=2"]),
                     "rollout_replicas_cover_devices")
    # a rollout TP group must not straddle nodes: 4 training devices start the rollout pool at offset 4 of node 0
    across = ["model=qwen3_5_0_8b", "hw=gpu_1node", "hw.nodes=2", "rollout=hf", "placement=split",
              "parallelism.rollout.tp=8"]
    p, = found(compose(across + ["placement.rollout_devices=12"]), "rollout_tp_within_node")
    assert "cross nodes" in p.message
    assert not found(compose(across + ["placement.rollout_devices=8"]), "rollout_tp_within_node")


def test_dapo_and_the_kl_reference_work_under_staleness():
    cfg = compose(SPLIT4 + ["algorithm=dapo", "algorithm.max_staleness=2", "algorithm.use_kl_loss=true"])
    assert errors(cfg) == [] and cfg.algorithm.dynamic_sampling.enable
    assert M.estimate(cfg, derive_layout(cfg)).terms["train/reference"] > 0  # the reference lives on the trainer


def test_check_placement_refuses_for_the_runtime():
    capabilities.check_placement(compose(SPLIT4 + ["algorithm.max_staleness=1"]))
    with pytest.raises(capabilities.Unsupported) as e:
        capabilities.check_placement(compose(SPLIT4 + ["rollout=vllm"]))
    assert [p.code for p in e.value.problems] == ["split_rollout_needs_hf"]


# ------------------------------------------------------------------------------------------------------ memory
def test_each_pool_has_its_own_memory():
    colocated = compose(["hw.devices_per_node=3", "data.train_batch_size=24", "algorithm.mini_batch_size=6",
                         "rollout.n=8"])
    split = compose(SPLIT4)
    lay_c, lay_s = derive_layout(colocated), derive_layout(split)
    assert lay_c.train_dict() == lay_s.train_dict()  # the same training layout (DP3) on both
    est_c, est_s = M.estimate(colocated, lay_c), M.estimate(split, lay_s)
    # the training pool holds no rollout share: the hf engine's weights (it does not sleep at level 1) are gone
    assert est_c.terms["train/sleeping_engine"] > 0 and est_s.terms["train/sleeping_engine"] == 0
    assert est_s.train_peak_gib == pytest.approx(est_c.train_peak_gib - est_c.terms["train/sleeping_engine"])
    assert est_s.train_peak_gib < est_c.train_peak_gib
    # the rollout pool holds the engine alone: nothing kept by a trainer, all 192 responses on its one device
    assert est_c.terms["rollout/kept_by_trainer"] > 0 and est_s.terms["rollout/kept_by_trainer"] == 0
    assert M.hf_engine_sequences(split, lay_s) == 192 and M.hf_engine_sequences(colocated, lay_c) == 64
    assert est_s.rollout_peak_gib == pytest.approx(est_s.terms["rollout/weights"] + est_s.terms["rollout/kv_cache"]
                                                   + est_s.terms["rollout/activations"])
    assert "host/sleeping_engine" not in est_s.terms  # the engine has its devices to itself: it never sleeps


def test_each_pool_is_fitted_against_its_own_peak():
    # 24 prompts x 256 responses on one rollout device do not fit; the training pool's share would
    t = M.as_tree(compose(SPLIT4 + ["rollout.n=256", "hw.memory_gb=6"]))
    est = M.estimate(t, derive_layout(t))
    assert est.train_peak_gib <= est.capacity_gib < est.rollout_peak_gib and not est.fits
    assert [p.code for p in rules.rollout_memory_problems(t, est)] == ["rollout_memory_fits"]
    p, = rules.rollout_memory_problems(t, est)
    assert p.key == "placement.rollout_devices" and "rollout-pool device" in p.message
    assert not rules.train_memory_problems(t, est)


# ------------------------------------------------------------------------------------------------- the search
def test_auto_searches_the_pool_sizes():
    cfg = compose(["hw.devices_per_node=4", "placement=split", "parallelism=auto"])
    cands = layout_search.search(cfg)
    sizes = {c.settings["placement.rollout_devices"] for c in cands}
    assert sizes and sizes <= {1, 2, 3}
    for c in cands:
        assert c.layout.split and c.layout.world + c.layout.rollout_world == 4
        assert c.layout.rollout_world == c.settings["placement.rollout_devices"]
        assert f"placement.rollout_devices={c.layout.rollout_world}" in c.overrides
        assert c.to_dict()["pools"] == {"training": c.layout.world, "rollout": c.layout.rollout_world}
    assert [c.score for c in cands] == sorted(c.score for c in cands)
    applied = layout_search.apply(cfg, cands[0])
    assert applied.placement.rollout_devices == cands[0].layout.rollout_world and not applied.parallelism.auto
    assert derive_layout(applied) == cands[0].layout and errors(applied) == []
    plan = build_plan(cfg)
    assert plan["valid"] and plan["placement"]["pools"]["rollout"]["devices"] == cands[0].layout.rollout_world


def test_a_set_pool_size_is_kept_and_multi_node_pools_are_whole_nodes():
    fixed = compose(["hw.devices_per_node=4", "placement=split", "placement.rollout_devices=2", "parallelism=auto"])
    cands = layout_search.search(fixed)
    assert cands and {c.layout.rollout_world for c in cands} == {2}
    assert not any(o.startswith("placement.") for c in cands for o in c.overrides)
    assert layout_search.pool_size_options(compose(["hw.devices_per_node=4", "hw.nodes=3", "placement=split"])) == \
        [4, 8]
    assert layout_search.pool_size_options(compose(["hw.devices_per_node=4", "placement=split"])) == [1, 2, 3]
    assert layout_search.pool_size_options(compose(["hw.devices_per_node=4", "placement=split",
                                                    "placement.rollout_devices=4"])) == []


def test_overlapping_pools_cost_the_longer_part():
    base = ["hw.devices_per_node=4", "placement=split", "placement.rollout_devices=2"]
    for staleness, combine in ((0, sum), (1, max)):
        cfg = compose(base + [f"algorithm.max_staleness={staleness}"])
        plan = build_plan(cfg)
        c = plan["cost"]
        train_s = sum(v for k, v in c.items() if k.endswith("_s") and k != "rollout_s")
        assert c["score"] == pytest.approx(combine([train_s, c["rollout_s"]]) * c["headroom_penalty"])
        assert ("the pools overlap" in render_text(plan)) == (staleness > 0)


# --------------------------------------------------------------------------------------------------- the plan
def test_the_plan_shows_both_pools():
    plan = build_plan(compose(SPLIT4 + ["algorithm.max_staleness=1"]))
    assert plan["valid"] and plan["world_size"] == 3
    pl = plan["placement"]
    assert (pl["mode"], pl["max_staleness"], pl["rollout_is"], pl["rollout_is_threshold"]) == ("split", 1, "token", 2.0)
    training, rollout = pl["pools"]["training"], pl["pools"]["rollout"]
    assert (training["devices"], training["first_device"], training["per_node"]) == (3, 0, [3])
    assert (rollout["devices"], rollout["first_device"], rollout["per_node"]) == (1, 3, [1])
    assert training["ray_resources"] == {"CPU": 3} and rollout["ray_resources"] == {"CPU": 1}
    assert training["layout"] == plan["train"] and rollout["layout"] == {"engine": "hf", **plan["rollout"]}
    assert training["peak_gib"] == plan["memory_gib"]["train_peak"] and training["fits"] and rollout["fits"]
    assert rollout["peak_gib"] == plan["memory_gib"]["rollout_peak"]
    json.dumps(plan)
    text = render_text(plan).splitlines()
    line = lambda head: next(x for x in text if x.startswith(f"  {head}"))  # noqa: E731
    assert line("hardware") == ("  hardware   1 node(s) x 4 cpu = 4 devices: training pool 3, rollout pool 1; workers as "
                                "Ray actors (trainer.launcher=auto: placement=split places its pools as Ray actors)")
    pools = line("pools")
    assert pools.startswith("  pools      training 3 CPU (DP3 FSDP_SIZE3; peak ")
    assert ", rollout 1 CPU (hf TP1 DP1; peak " in pools and "node 0: 3" in pools and "node 0: 1" in pools
    assert line("staleness") == ("  staleness  max 1: the rollout pool generates up to 1 batch(es) ahead of "
                                 "training; rollout IS token (truncated at 2)")
    assert line("memory").startswith("  memory     training pool peak ")


def test_a_sweep_row_names_the_pools():
    from qwen35rl.config import sweep

    split, colocated = build_plan(compose(SPLIT4)), build_plan(compose([]))
    assert sweep._layout(split, None).endswith(" | rollout TP1 DP1 EP1 | pools 3+1")
    assert "pools" not in sweep._layout(colocated, None)
    assert sweep._layout({}, compose(SPLIT4)).endswith(" | pools 3+1")


def test_a_colocated_plan_keeps_its_lines():
    plan = build_plan(compose([]))
    assert plan["placement"]["mode"] == "colocated" and plan["placement"]["rollout_is"] == "off"
    assert plan["placement"]["pools"]["rollout"]["devices"] == plan["placement"]["pools"]["training"]["devices"] == 2
    text = render_text(plan)
    assert "  hardware   1 node(s) x 2 cpu = world 2" in text and "  memory     train peak " in text
    assert "  pools " not in text and "  staleness " not in text
    # a colocated run that weighs by the behaviour policy says so
    assert "rollout IS token" in render_text(build_plan(compose(["algorithm.rollout_is=token"])))


def test_the_plan_cli_prints_a_split_plan(capsys):
    from qwen35rl.cli.plan import main

    assert main(SPLIT4 + ["algorithm.max_staleness=1", "format=json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["placement"]["pools"]["rollout"]["devices"] == 1
    assert main(["placement=split"]) == 0                           # the pool size is chosen (see below)
    assert "pools      training 1 CPU" in capsys.readouterr().out
    assert main(["placement=split", "hw.devices_per_node=1"]) == 2
    assert "[split_pool_sizes]" in capsys.readouterr().out


# -------------------------------------------------------------------------------------------------- resume
def record(*overrides):
    cfg = compose(list(overrides))
    return capabilities.checkpoint_layout(cfg, derive_layout(cfg))


def test_the_checkpoint_records_placement_and_staleness():
    assert record(*SPLIT4, "algorithm.max_staleness=1") == {"backend": "fsdp", "placement": "split",
                                                            "rollout_devices": 1, "max_staleness": 1}
    assert record() == {"backend": "fsdp", "placement": "colocated", "rollout_devices": None, "max_staleness": 0}
    mg = record(*MG_TINY, "hw.devices_per_node=4", "placement=split", "placement.rollout_devices=2")
    assert mg["world"] == 2 and mg["placement"] == "split" and mg["rollout_devices"] == 2


def test_resume_refuses_another_staleness_or_placement():
    one, two = record(*SPLIT4, "algorithm.max_staleness=1"), record(*SPLIT4, "algorithm.max_staleness=2")
    assert capabilities.resume_problem(one, one) is None
    p = capabilities.resume_problem(one, two)
    assert p.code == "resume_staleness_changed" and p.key == "algorithm.max_staleness"
    assert "max_staleness=1, this run has 2" in p.message and "batches in flight" in p.message
    assert "algorithm.max_staleness=1" in p.hint and "trainer.resume=never" in p.hint
    p = capabilities.resume_problem(one, record(*SPLIT4, "placement.rollout_devices=2", "algorithm.max_staleness=1"))
    assert p.code == "resume_placement_changed" and p.key == "placement.rollout_devices"
    assert "placement.rollout_devices=1" in p.hint and "trainer.resume=never" in p.hint
    p = capabilities.resume_problem(record(), record("placement=split", "placement.rollout_devices=1"))
    assert p.code == "resume_placement_changed" and p.key == "placement.mode" and "placement=colocated" in p.hint
    # Megatron: the same check before the shard layout's
    mg = MG_TINY + ["hw.devices_per_node=4", "placement=split", "placement.rollout_devices=2"]
    assert capabilities.resume_problem(record(*mg), record(*mg, "algorithm.max_staleness=1")).code == \
        "resume_staleness_changed"


def test_records_from_before_placement_resume_as_colocated():
    assert capabilities.resume_problem({"backend": "fsdp"}, record()) is None
    assert capabilities.resume_problem(None, record()) is None
    assert capabilities.resume_problem(None, record(*SPLIT4)).code == "resume_placement_changed"
    mg = record(*MG_TINY)
    old = {k: v for k, v in mg.items() if k not in capabilities.RUN_SHAPE_DEFAULTS}
    assert capabilities.resume_problem(old, mg) is None
    assert capabilities.resume_problem(old, record(*MG_TINY, "parallelism.tp=2")).code == "resume_needs_saved_layout"


# ---------------------------------------------------------------------------------------------------- verl
def test_verl_export_carries_the_importance_sampling_and_names_the_rest():
    exported = export(compose(SPLIT4 + ["algorithm.max_staleness=1"]))
    assert "algorithm.rollout_correction.rollout_is=token" in exported["argv"]
    assert "algorithm.rollout_correction.rollout_is_threshold=2.0" in exported["argv"]
    why = {item["key"]: item["why"] for item in exported["not_exported"]}
    assert "one-step-off" in why["placement.mode"] and "one-step-off" in why["placement.rollout_devices"]
    assert "on-policy" in why["algorithm.max_staleness"]
    colocated = export(compose([]))
    assert "algorithm.rollout_correction.rollout_is=null" in colocated["argv"]  # auto: off, colocated
    # verl's main_ppo is colocated and on-policy: nothing to list for a colocated run
    assert not [i for i in colocated["not_exported"] if i["key"].startswith("placement.")
                or i["key"] == "algorithm.max_staleness"]


def test_a_null_pool_size_is_resolved_to_the_best_valid_one_for_the_given_layout():
    """`placement=split` alone plans (and trains) on the embedded default: the plan tries each rollout-pool size
    with the config's own layout and keeps the valid one with the lowest estimated step time; sizes a rule refuses
    are skipped (here TP2 training needs an even training pool)."""
    from qwen35rl.config.layout_search import best_pool_size, cost
    from qwen35rl.config.memory import estimate
    from qwen35rl.config.resolved import resolve_run

    run = resolve_run(compose(["placement=split", "algorithm.max_staleness=1"]))
    cfg = run.cfg
    assert run.problems == () and cfg.placement.rollout_devices == 1
    assert not [p for p in rules.check_all(cfg, derive_layout(cfg)) if p.severity == ERROR]
    four = compose(["placement=split", "hw.devices_per_node=4"])
    scores = {}
    for rd in (1, 2, 3):
        c = compose(["placement=split", "hw.devices_per_node=4", f"placement.rollout_devices={rd}"])
        if not [p for p in rules.check_all(c, derive_layout(c)) if p.severity == ERROR]:
            scores[rd] = cost(c, derive_layout(c), estimate(c, derive_layout(c)))["score"]
    assert 1 not in scores and len(scores) == 2          # 3 training ranks do not divide the 128 responses evenly
    assert best_pool_size(four) == min(scores, key=scores.get)
    tp2 = compose(["placement=split", "hw.devices_per_node=4", "backend=megatron", "parallelism.tp=2"])
    assert best_pool_size(tp2) == 2                                 # 1 and 3 leave an odd training pool
    assert best_pool_size(compose(["placement=split", "hw.devices_per_node=1"])) is None
