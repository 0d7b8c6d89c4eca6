"""Every engine is declared once in qwen35rl/config/engine_specs.py: each has a config file, a builder class that
exists, and what the plan and the workers ask of it; an unknown name is refused with the choices."""
import ast
from pathlib import Path

import pytest

from qwen35rl.config import engine_specs as E
from qwen35rl.config import step_time
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
    assert set(step_time.DECODE_FLOOR_S) == set(E.ROLLOUT_ENGINES)  # every engine's measured floor per step
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
