"""Every export composes in verl's own config trees (verl 0.9.1, pinned, and the newest release PyPI carries):
each backend, each algorithm preset (conf/algorithm/), GPU and NPU hardware, with and without pass-through
entries; `+` exactly where the tree lacks the key, and verl reads back the exported value."""
from pathlib import Path

import pytest

from qwen35rl.config.compose import compose
from qwen35rl.config.verl.exporter import export
from qwen35rl.config.verl.importer import _same
from qwen35rl.config.verl.keys import IN_VERL_TREE, get
from tests.config.verl.verl_tree import ROOT, compose_verl, override_value, versions

VERSIONS = versions()
ALGORITHMS = sorted(p.stem for p in (ROOT / "conf" / "algorithm").glob("*.yaml"))
RUNS = {  # backend -> (model, GPU hw, NPU hw)
    "fsdp": ("qwen3_5_27b", "gpu_1node", "a3_1node"),
    "megatron": ("qwen3_5_35b_a3b", "gpu_1node", "a3_1node"),
}
EXTRAS = {  # pass-through entries: ones verl's tree has (no `+`) and ones it lacks
    "fsdp": ["+rollout.engine_kwargs.async_scheduling=true", "+rollout.engine_kwargs.compilation_config.mode=3"],
    "megatron": ["+backend.transformer_overrides.attention_backend=auto",
                 "+backend.transformer_overrides.recompute_modules=[core_attn,moe_act]",
                 "+backend.transformer_overrides.moe_router_dtype=fp32",
                 "+rollout.engine_kwargs.async_scheduling=true"],
}
MISSING = object()
_BASE = {}


def _base(version, backend):
    if (version, backend) not in _BASE:
        _BASE[version, backend] = compose_verl(["model_engine=megatron"] if backend == "megatron" else [], version)
    return _BASE[version, backend]


def _check(argv, version, backend):
    base = _base(version, backend)
    tree = compose_verl(argv, version)
    for override in argv:
        key = override.split("=", 1)[0]
        plus = key.startswith("+")
        key = key.lstrip("+")
        if key == "model_engine":
            continue
        in_tree = get(base, key, MISSING) is not MISSING
        assert plus != in_tree, f"{override}: verl {version}'s tree {'has' if in_tree else 'lacks'} the key"
        assert _same(get(tree, key, MISSING), override_value(override)), override


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("extras", [False, True], ids=["plain", "pass-through"])
@pytest.mark.parametrize("device", ["gpu", "npu"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("backend", sorted(RUNS))
def test_export_composes_in_verl_tree(backend, algorithm, device, extras, version):
    model, gpu, npu = RUNS[backend]
    groups = [f"model={model}", f"backend={backend}", f"hw={gpu if device == 'gpu' else npu}",
              f"algorithm={algorithm}", "data=geo3k"]
    argv = export(compose(groups + (EXTRAS[backend] if extras else [])))["argv"]
    _check(argv, version, backend)
    if extras and backend == "megatron":
        assert "actor_rollout_ref.actor.megatron.override_transformer_config.attention_backend=auto" in argv
        assert "+actor_rollout_ref.actor.megatron.override_transformer_config.moe_router_dtype=fp32" in argv


@pytest.mark.parametrize("version", VERSIONS)
def test_pass_through_keys_in_tree_match_the_table(version):
    """IN_VERL_TREE (what the exporter writes without `+`) is what the tree holds under each prefix."""
    tree = _base(version, "megatron")
    for prefix, keys in IN_VERL_TREE.items():
        node = get(tree, prefix, MISSING)
        have = set(node) if isinstance(node, dict) else set()
        assert have == set(keys), f"{prefix} in verl {version}: tree {sorted(have)}, table {sorted(keys)}"


def test_newest_pypi_tree_is_cached():
    """The newest release's tree is extracted next to the pinned one (.cache/verl-X/)."""
    for version in VERSIONS:
        assert (ROOT / ".cache" / f"verl-{version}" / "verl" / "trainer" / "config" / "ppo_trainer.yaml").is_file()
