"""The verl table against verl 0.9.1's own config tree, and the ten reference compositions through export -> verl's
tree and export -> import -> the same qwen35rl config."""
import json
import os
import subprocess
import sys

import pytest

from qwen35rl.config.compose import compose
from qwen35rl.config.verl.exporter import export, hydra_value
from qwen35rl.config.verl.importer import _same, import_launch
from qwen35rl.config.verl.keys import KEYS, UNSET, get
from tests.config.test_compose import REFERENCE_RUNS
from tests.config.verl.verl_tree import compose_verl, override_value

REFS = [[f"model={m}", f"backend={b}", f"hw={h}", "data=geo3k"] for m, b, h, *_ in REFERENCE_RUNS]
IDS = [f"{m}-{b}-{h}" for m, b, h, *_ in REFERENCE_RUNS]
MISSING = object()


@pytest.fixture(scope="module")
def verl_defaults():
    return {"fsdp": compose_verl([]), "megatron": compose_verl(["model_engine=megatron"])}


def test_table_defaults_and_plus_flags_match_verl_tree(verl_defaults):
    """Each entry's verl default is the tree's value; `+` exactly where the tree lacks the key."""
    checked = 0
    for k in KEYS:
        for backend in k.backends:
            tree = verl_defaults[backend]
            value = get(tree, k.verl, MISSING)
            if k.plus:
                assert value is MISSING, f"{k.verl} is in verl's {backend} tree: drop plus=True"
            elif k.exported:
                assert value is not MISSING, f"{k.verl} is not in verl's {backend} tree (needs plus=True?)"
            if k.verl_default is not UNSET:
                assert _same(value, k.verl_default), f"{k.verl} ({backend}): table {k.verl_default!r}, verl {value!r}"
                checked += 1
            for also in k.also:
                assert get(tree, also, MISSING) is not MISSING, also
    assert checked >= 80


@pytest.mark.parametrize("groups", REFS + [[]], ids=IDS + ["default"])
def test_export_composes_in_verl_tree_with_the_same_values(groups):
    exported = export(compose(groups))
    tree = compose_verl(exported["argv"])
    assert exported["argv"], "nothing exported"
    for override in exported["argv"]:
        key = override.split("=", 1)[0].lstrip("+")
        assert _same(get(tree, key, MISSING), override_value(override)), override
    # every setting the backend reads is exported or listed with a reason
    assert all(item["why"] for item in exported["not_exported"])


@pytest.mark.parametrize("groups", REFS, ids=IDS)
def test_reference_round_trip(groups):
    """export -> import picks the same options and finds every carried value already composed: the overlay is
    empty and nothing is reported as not carried (the per-reference counts are printed for the record)."""
    cfg = compose(groups)
    exported = export(cfg)
    device = "npu" if cfg.hw.device == "npu" else "gpu"
    imp = import_launch(exported["argv"], exported["env"], device=device)
    assert imp.groups == dict(g.split("=") for g in groups)
    assert imp.overlay == {} and imp.not_carried == [] and imp.env_not_carried == []
    assert not imp.verl_defaults  # every key verl defines was written explicitly
    assert len(imp.carried) + len(imp.defaults) + len(imp.fixed) == len(exported["argv"])
    print(f"{'-'.join(g.split('=')[1] for g in groups[:3])}: {len(exported['argv'])} verl keys, "
          f"{len(imp.carried)} carried, {len(imp.defaults)} defaults, {len(imp.not_carried)} not carried; "
          f"{len(exported['env'])} env; {len(exported['not_exported'])} qwen35rl settings not exported")


CHANGED = {  # values unlike the reference compositions, one per kind of table entry
    "backend.lr": 3e-6, "rollout.n": 8, "algorithm.mini_batch_size": 8, "algorithm.kl_loss_coef": 0.05,
    "data.max_response_length": 4096, "rollout.gpu_memory_utilization": 0.7, "trainer.total_epochs": 2,
    "backend.min_lr_ratio": 0.1, "trainer.max_keep_checkpoints": 0, "trainer.resume": "never",
    "trainer.trackers": ["console", "jsonl", "wandb"], "algorithm.clip_ratio_high": 0.28,
}


@pytest.mark.parametrize("groups,extra", [
    (REFS[0], {"parallelism.sp": 2, "backend.param_offload": False, "backend.remove_padding": False}),
    (REFS[4], {"parallelism.tp": 4, "parallelism.ep": 4, "backend.recompute_granularity": "selective",
               "backend.moe_aux_loss_coeff": 0.02, "parallelism.rollout.tp": 4}),
    (REFS[8], {"parallelism.rollout.dp": 8, "parallelism.rollout.ep": 64}),
], ids=["fsdp-27b", "megatron-35b", "megatron-397b-rollout-ep"])
def test_changed_values_round_trip(groups, extra):
    """Settings that differ from the composition come back as exactly those overlay entries."""
    changes = {**CHANGED, **extra}
    cfg = compose(groups + [f"{k}={hydra_value(v)}" for k, v in changes.items()] + ["+hw.env.NCCL_IB_HCA=mlx5"])
    exported = export(cfg)
    imp = import_launch(exported["argv"], exported["env"], device="gpu")
    expected = {**changes, "hw.env.NCCL_IB_HCA": "mlx5"}
    if "trainer.run_name" in imp.overlay:  # a run name derived from the settings comes back pinned, unchanged
        expected["trainer.run_name"] = cfg.trainer.run_name
    for k, v in expected.items():
        assert k in imp.overlay, f"{k} not carried back"
        assert _same(imp.overlay[k], v), (k, imp.overlay[k], v)
    assert set(imp.overlay) == set(expected), set(imp.overlay) ^ set(expected)
    assert imp.not_carried == []


def test_plan_prints_verl_launch():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    args = [sys.executable, "-m", "qwen35rl.cli.plan", "model=qwen3_5_35b_a3b", "backend=megatron", "hw=a3_1node",
            "data=geo3k"]
    text = subprocess.run(args + ["format=verl"], capture_output=True, text=True, env=env, timeout=120)
    assert text.returncode == 0, text.stderr
    out = text.stdout
    assert "export HCCL_CONNECT_TIMEOUT=1500" in out and "python3 -m verl.trainer.main_ppo \\" in out
    assert "    model_engine=megatron \\" in out
    assert "+actor_rollout_ref.rollout.engine_kwargs.vllm.mm_processor_cache_gb=0" in out
    assert "# qwen35rl settings verl has no key for:" in out
    # verl 0.9.1's param_offload offloads the gradients too: grad_offload=True goes with param_offload=True
    assert "actor_rollout_ref.actor.megatron.param_offload=True" in out and "backend.grad_offload" not in out
    js = subprocess.run(args + ["format=json"], capture_output=True, text=True, env=env, timeout=120)
    plan = json.loads(js.stdout)
    assert plan["verl"]["argv"][0] == "model_engine=megatron"
    assert plan["verl"]["env"]["HCCL_CONNECT_TIMEOUT"] == "1500"
    assert {"key", "value", "why"} <= set(plan["verl"]["not_exported"][0])


@pytest.mark.parametrize("value", [None, True, False, 0, -1, 1e-06, 0.66, "vllm", "0.18.0", "1e-6", "true", "null",
                                   "a b", "it's", "x=y", "/data/geo3k/train.parquet", "~/data", "${x}", "a,b",
                                   [1, "two", None], {"a": 1, "b": [True]}, [], "garbage_collection_threshold:0.8",
                                   "a\\b", "C:\\data\\", "\\", "\\\\", "\\'", "it\\'s", "\\${x}", "a\\\\${x}\\",
                                   "${oc.env:HOME}", "line\nbreak", "tab\tand \"quotes\"", "é ☃ \U0001d518"])
def test_hydra_value_parses_back(value):
    """What verl's config holds after composing the override (Hydra's quoting, then OmegaConf's `${` escape), and
    Hydra's parse alone (what the importer reads) where no `${` needs OmegaConf's escape."""
    if "${" not in str(value):
        assert _same(override_value(f"k={hydra_value(value)}"), value)
    assert _same(compose_verl([f"+trainer.k={hydra_value(value)}"])["trainer"]["k"], value)


def test_exported_environment_is_redacted_in_the_plan():
    from qwen35rl.config.plan import build_plan

    plan = build_plan(compose(REFS[0] + ["+hw.env.WANDB_API_KEY=s3cr3t-value", "+hw.env.NCCL_DEBUG=WARN"]))
    assert plan["verl"]["env"]["NCCL_DEBUG"] == "WARN"
    assert "s3cr3t-value" not in json.dumps(plan)


def test_grad_offload_rides_on_param_offload():
    """verl 0.9.1 has no grad_offload key; its Megatron param_offload moves the gradients with the parameters."""
    groups = ["model=qwen3_5_122b_a10b", "backend=megatron", "hw=h20_4node"]
    same = export(compose(groups + ["backend.param_offload=true", "backend.grad_offload=true"]))
    assert "actor_rollout_ref.actor.megatron.param_offload=True" in same["argv"]
    assert not [x for x in same["not_exported"] if x["key"] == "backend.grad_offload"]
    differ = export(compose(groups + ["backend.param_offload=true", "backend.grad_offload=false"]))
    listed = [x for x in differ["not_exported"] if x["key"] == "backend.grad_offload"]
    assert listed and "param_offload" in listed[0]["why"]
