"""Every engine is declared once in qwen35rl/config/engine_specs.py: each has a config file, a builder class that
exists, and what the plan and the workers ask of it; an unknown name is refused with the choices."""
import ast
from pathlib import Path

import pytest

from qwen35rl.config import engine_specs as E
from qwen35rl.config.compose import compose
from qwen35rl.config.rules import CHOICES

ROOT = Path(__file__).resolve().parents[2]


def _defines(builder: str) -> bool:
    module, _, name = builder.partition(":")
    path = ROOT / Path(*module.split(".")).with_suffix(".py")
    tree = ast.parse(path.read_text())
    return any(isinstance(n, ast.ClassDef) and n.name == name for n in tree.body)


@pytest.mark.parametrize("spec", [*E.TRAIN_ENGINES.values(), *E.ROLLOUT_ENGINES.values()], ids=lambda s: s.name)
def test_each_builder_names_a_class_that_exists(spec):
    assert _defines(spec.builder), spec.builder


def test_the_specs_are_the_configs_choices():
    assert set(E.TRAIN_ENGINES) == {p.stem for p in (ROOT / "conf" / "backend").glob("*.yaml")}
    assert set(CHOICES["backend.name"]) == set(E.TRAIN_ENGINES)
    assert set(CHOICES["rollout.engine"]) == set(E.ROLLOUT_ENGINES)
    for spec in E.ROLLOUT_ENGINES.values():  # every engine's measured floor per step: low <= typical <= high
        low, typical, high = spec.decode_floor_s
        assert 0 < low <= typical <= high
        low, typical, high = spec.decode_per_sequence_s
        assert 0 <= low <= typical <= high
    for name in E.ROLLOUT_ENGINES:
        assert compose([f"rollout={name}"]).rollout.engine == name


def test_a_spec_is_found_from_a_config_or_a_name():
    cfg = compose(["backend=megatron", "rollout=vllm"])
    assert E.train_engine(cfg) is E.TRAIN_ENGINES["megatron"] and E.train_engine("fsdp").reshardable_checkpoints
    assert E.rollout_engine(cfg).own_weights and not E.rollout_engine("hf").own_weights
    with pytest.raises(ValueError, match=r"rollout.engine='vlm': expected one of hf, vllm; did you mean 'vllm'\?"):
        E.rollout_engine("vlm")


def test_layout_keys_are_what_the_layout_reports():
    from qwen35rl.config.layout import derive_layout

    for name, spec in E.TRAIN_ENGINES.items():
        d = derive_layout(compose([f"backend={name}"])).train_dict()
        assert set(spec.layout_keys) <= set(d), (name, d)


# ------------------------------------------------------------------ dispatch goes through the registry
# Each test registers a spec under a new name with chosen facts (a copy of an existing engine with one or two facts
# changed) and checks that the plan, its rules and the memory model follow the declared facts, without any edit to
# them: that is what adding an engine has to be.
import dataclasses  # noqa: E402

from qwen35rl.config import capabilities, memory, plan, resolved, rules  # noqa: E402
from qwen35rl.config.layout import derive_layout  # noqa: E402


def _register(monkeypatch, table, base, name, **facts):
    spec = dataclasses.replace(table[base], name=name, **facts)
    monkeypatch.setitem(table, name, spec)
    return spec


def _codes(cfg):
    return {p.code for p in rules.check_all(cfg, derive_layout(cfg))}


def test_rollout_parallelism_follows_the_declared_ability(monkeypatch):
    _register(monkeypatch, E.ROLLOUT_ENGINES, "hf", "hf_tp", tensor_parallel=True)
    cfg = ["hw=gpu_1node", "model=qwen3_5_0_8b", "parallelism.rollout.tp=2"]
    assert "rollout_engine_parallelism" in _codes(compose(cfg + ["rollout=hf"]))
    assert "rollout_engine_parallelism" not in _codes(compose(cfg + ["rollout=hf", "rollout.engine=hf_tp"]))


def test_vllm_facts_follow_the_package_a_spec_lists(monkeypatch):
    """An engine listing `vllm` gets vLLM's quirks and plan section; one that does not, none of them."""
    _register(monkeypatch, E.ROLLOUT_ENGINES, "vllm", "vllm_plain", packages=())
    _register(monkeypatch, E.ROLLOUT_ENGINES, "hf", "hf_on_vllm", packages=("vllm",))
    base = ["hw=gpu_1x", "model=qwen3_5_0_8b"]
    assert resolved.vllm_resolution(compose(base + ["rollout=vllm"])) is not None
    plain = compose(base + ["rollout=vllm", "rollout.engine=vllm_plain"])
    assert resolved.vllm_resolution(plain) is None
    on_vllm = compose(base + ["rollout=hf", "rollout.engine=hf_on_vllm"])
    assert E.rollout_uses(on_vllm, "vllm") and not E.rollout_uses(plain, "vllm")
    assert not E.rollout_uses("no_such_engine", "vllm")  # before engine_known reports it


def test_compile_settings_follow_the_specs(monkeypatch):
    _register(monkeypatch, E.TRAIN_ENGINES, "fsdp", "fsdp_eager", compiles_layers=False)
    _register(monkeypatch, E.ROLLOUT_ENGINES, "vllm", "vllm_compiled", compiles_decode=True)
    base = ["hw=gpu_1x", "model=qwen3_5_0_8b", "backend.compile_layers=true", "rollout.compile_decode=true"]
    cfg = compose(base + ["rollout=hf"])
    assert plan.compile_settings(cfg)["layers"] and plan.compile_settings(cfg)["decode"]
    cfg = compose(base + ["rollout=vllm", "rollout.engine=vllm_compiled", "backend.name=fsdp_eager"])
    got = plan.compile_settings(cfg)
    assert not got["layers"] and not got["conv"] and got["decode"]
    assert "compile_decode_is_hf_only" not in _codes(cfg)
    assert "compile_decode_is_hf_only" in _codes(compose(base + ["rollout=vllm"]))


def test_layout_rules_follow_the_declared_axes(monkeypatch):
    """A model-parallel engine without a pipeline: parallelism.vpp belongs to the engine that declares it, and the
    pipeline rule does not run for it; megatron-core's rules follow its package, not its name."""
    _register(monkeypatch, E.TRAIN_ENGINES, "megatron", "tp_only", layout_keys=("tp", "cp", "ep", "etp"),
              pipeline_keys=(), packages=())
    base = ["hw=cpu", "model=qwen3_5_tiny", "backend=megatron", "backend.megatron_core_version=0.1.0"]
    cfg = compose(base + ["backend.name=tp_only", "parallelism.pp=2", "parallelism.vpp=2"])
    problems = {p.code: p for p in rules.check_all(cfg, derive_layout(cfg))}
    assert "backend=megatron, not backend=tp_only" in problems["degrees_match_backend"].message
    assert "pipeline_splits_layers" not in problems and "megatron_core_version_valid" not in problems
    assert "megatron_core_version_valid" in _codes(compose(base))
    assert capabilities.AXES["megatron"] == E.TRAIN_ENGINES["megatron"].layout_axes


def test_checkpoint_size_follows_the_spec(monkeypatch):
    _register(monkeypatch, E.TRAIN_ENGINES, "fsdp", "fsdp_fat_checkpoints", checkpoint_bytes_per_param=24)
    cfg = compose(["hw=gpu_1x", "model=qwen3_5_0_8b"])
    other = compose(["hw=gpu_1x", "model=qwen3_5_0_8b", "backend.name=fsdp_fat_checkpoints"])
    assert memory.checkpoint_gib(other) == pytest.approx(2 * memory.checkpoint_gib(cfg))


def test_split_placement_follows_split_pool(monkeypatch):
    _register(monkeypatch, E.ROLLOUT_ENGINES, "vllm", "vllm_split", split_pool=True)
    base = ["hw=gpu_1node", "model=qwen3_5_0_8b", "placement=split", "placement.rollout_devices=2", "rollout=vllm"]
    assert "split_rollout_needs_hf" in {p.code for p in capabilities.placement_problems(compose(base))}
    split = compose(base + ["rollout.engine=vllm_split"])
    assert "split_rollout_needs_hf" not in {p.code for p in capabilities.placement_problems(split)}


def test_missing_packages_are_the_specs(monkeypatch):
    """environment_problems warns about every package a spec lists that is not importable here."""
    _register(monkeypatch, E.TRAIN_ENGINES, "fsdp", "fsdp_extra", packages=("qwen35rl_no_such_package",))
    cfg = compose(["hw=cpu", "backend.name=fsdp_extra"])
    found = {p.code: p for p in plan.environment_problems(cfg)}
    p = found["qwen35rl_no_such_package_not_installed"]
    assert p.key == "backend" and "backend=fsdp_extra needs it on every node" in p.message
