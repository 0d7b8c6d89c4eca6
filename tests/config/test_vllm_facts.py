"""What the plan learns about vLLM without importing it: the version (`rollout.vllm_version=auto`), the engine
arguments of the installed `EngineArgs`, whether it loads a text-only Qwen3.5 checkpoint, and the GDN prefill
kernel. A fake vLLM package on sys.path stands in for an installed release."""
import importlib
import sys
import textwrap

import pytest

from qwen35rl.cli.plan import main as plan
from qwen35rl.config import rules, vllm_facts
from qwen35rl.config.compose import compose
from qwen35rl.config.layout import derive_layout
from qwen35rl.config.memory import as_tree


def fake_vllm(root, version, fields=("model", "gpu_memory_utilization", "additional_config"),
              archs=("Qwen3_5ForConditionalGeneration",)):
    pkg = root / "vllm"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "model_executor" / "models").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('the plan must not import vllm')\n")
    (pkg / "_version.py").write_text(f"__version__ = version = '{version}'\n")
    body = "\n".join(f"    {f}: int = 0" for f in fields)
    (pkg / "engine" / "arg_utils.py").write_text(f"class EngineArgs:\n    '''fields'''\n{body}\n")
    (pkg / "model_executor" / "models" / "registry.py").write_text(
        "_MODELS = {\n" + "".join(f'    "{a}": ("qwen3_5", "{a}"),\n' for a in archs) + "}\n")
    return pkg


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """`installed(version, ...)`: a fake vLLM of that release is what this process finds."""
    def make(version, **kw):
        root = tmp_path / version
        fake_vllm(root, version, **kw)
        monkeypatch.syspath_prepend(str(root))
        monkeypatch.delitem(sys.modules, "vllm", raising=False)
        importlib.invalidate_caches()
        return vllm_facts.installed_vllm()
    return make


def test_the_installed_release_is_read_without_importing_it(installed):
    found = installed("0.26.0", fields=("model", "gdn_prefill_backend", "additional_config"))
    assert found.version == "0.26.0" and "vllm" not in sys.modules
    assert found.engine_args == {"model", "gdn_prefill_backend", "additional_config"}
    assert found.registry_archs == {"Qwen3_5ForConditionalGeneration"}


@pytest.mark.parametrize("configured,device,version,source", [
    ("auto", "npu", "0.18.0", "assumed"), ("auto", "cuda", "0.26.0", "assumed"), ("auto", "cpu", "0.32.0", "assumed"),
    ("0.33.1", "cuda", "0.33.1", "rollout.vllm_version"),
])
def test_auto_without_vllm_takes_the_devices_assumed_release(configured, device, version, source):
    got, why = vllm_facts.resolve_version(configured, device, None)
    assert got == version and why.startswith(source)


def test_auto_takes_the_installed_release_and_the_plan_says_so(installed, capsys):
    installed("0.31.2", archs=("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"))
    cfg = compose(["hw=gpu_1x", "model=qwen3_5_0_8b", "rollout=vllm", "model.init=random"])
    assert cfg.rollout.vllm_version == "auto"
    assert vllm_facts.resolve(cfg).rollout.vllm_version == "0.31.2"
    plan(["hw=gpu_1x", "model=qwen3_5_0_8b", "rollout=vllm", "model.init=random"])
    out = capsys.readouterr().out
    assert "vllm       0.31.2 (installed here" in out and "rollout checkpoint text-only (ForCausalLM)" in out


@pytest.mark.parametrize("value,ok", [("auto", True), ("0.26.0", True), ("0.11.0rc2", True), ("0.32.0+cpu", True),
                                      ("latest", False), ("26", False), ("", False)])
def test_a_version_that_is_not_a_release_is_refused(value, ok):
    t = as_tree(compose(["hw=cpu"]))
    t["rollout"]["vllm_version"] = value
    assert bool(rules.vllm_version_valid(t, derive_layout(t))) is not ok


def test_engine_arguments_are_checked_against_the_installed_release(installed):
    installed("0.26.0", fields=("model", "gdn_prefill_backend", "additional_config", "mamba_backend"))
    t = as_tree(compose(["hw=gpu_1x", "rollout=vllm", "rollout.vllm_version=0.26.0"]))
    t["rollout"]["engine_kwargs"] = {"gdn_prefill_backend": "triton", "additional_config": {}, "swap_space": 4}
    found = rules.engine_kwargs_known(t, derive_layout(t))
    # swap_space is in the frozen list of older releases, not in this EngineArgs
    assert [p.key for p in found] == ["rollout.engine_kwargs.swap_space"]
    assert "vLLM 0.26.0's EngineArgs" in found[0].message
    t["rollout"]["vllm_version"] = "0.18.0"  # another release than the installed one: the frozen list
    assert rules.engine_kwargs_known(t, derive_layout(t)) == []


def test_the_frozen_list_knows_the_selectors_of_newer_releases():
    t = as_tree(compose(["hw=gpu_1x", "rollout=vllm"]))
    t["rollout"]["engine_kwargs"] = {"gdn_prefill_backend": "triton", "mamba_backend": "triton",
                                     "additional_config": {"gdn_prefill_backend": "triton"}}
    assert rules.engine_kwargs_known(t, derive_layout(t)) == []


@pytest.mark.parametrize("archs,loads", [(("Qwen3_5ForConditionalGeneration",), False),
                                         (("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"), True)])
def test_the_checkpoint_class_follows_the_installed_registry(installed, archs, loads):
    found = installed("0.27.0", archs=archs)
    assert vllm_facts.loads_text_checkpoint("0.27.0", found) is loads


def test_without_the_registry_the_version_bound_decides():
    assert not vllm_facts.loads_text_checkpoint("0.26.0", None)
    assert vllm_facts.loads_text_checkpoint("0.27.0", None) and vllm_facts.loads_text_checkpoint("0.33.0", None)


def test_a_text_only_pretrained_checkpoint_is_refused_for_vllm_026(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["Qwen3_5ForCausalLM"]}')
    t = as_tree(compose(["hw=gpu_1x", "model=qwen3_5_0_8b", "rollout=vllm", "rollout.vllm_version=0.26.0",
                         f"model.path={tmp_path}"]))
    [p] = rules.vllm_loads_rollout_checkpoint(t, derive_layout(t))
    assert p.key == "model.path" and "0.26.0" in p.message and "Qwen3_5ForCausalLM" in p.message
    (tmp_path / "config.json").write_text('{"architectures": ["Qwen3_5ForConditionalGeneration"]}')
    assert rules.vllm_loads_rollout_checkpoint(t, derive_layout(t)) == []


@pytest.mark.parametrize("kwargs,device,version,flashinfer,backend", [
    ({}, "cuda", "0.26.0", False, "triton"),
    ({}, "cuda", "0.26.0", None, "triton"),                      # not installed here: never count on FlashInfer
    ({}, "cuda", "0.26.0", True, None),                          # vLLM's own choice works
    ({}, "cuda", "0.18.0", False, None),                         # no selector before 0.26
    ({}, "npu", "0.26.0", False, None),
    ({"gdn_prefill_backend": "flashinfer"}, "cuda", "0.26.0", False, None),  # the user's choice is kept
    ({"additional_config": {"gdn_prefill_backend": "cutedsl"}}, "cuda", "0.26.0", False, None),
])
def test_gdn_prefill_backend_never_needs_an_absent_package(kwargs, device, version, flashinfer, backend):
    assert vllm_facts.gdn_prefill_choice(kwargs, device, version, flashinfer)[0] == backend


def test_the_resolved_config_carries_the_backend_and_keeps_other_settings():
    cfg = compose(["hw=gpu_1x", "rollout=vllm", "+rollout.engine_kwargs.additional_config.foo=1"])
    resolved = vllm_facts.resolve(cfg)
    assert resolved.rollout.vllm_version == "0.26.0"  # assumed: no vLLM in this environment
    assert dict(resolved.rollout.engine_kwargs.additional_config) == {"foo": 1, "gdn_prefill_backend": "triton"}
    assert vllm_facts.resolve(resolved) is resolved
    assert cfg.rollout.vllm_version == "auto"  # the composed config is not changed


@pytest.mark.parametrize("version,mode", [("0.18.0", None), ("0.26.0", "align"), ("0.33.0", "align")])
def test_prefix_caching_on_gdn_by_version_without_vllm(version, mode):
    assert vllm_facts.gdn_prefix_caching(version, None) == mode


def test_prefix_caching_on_gdn_read_from_the_installed_source(installed):
    found = installed("0.40.0")
    assert vllm_facts.gdn_prefix_caching("0.40.0", found) is None  # no mamba cache modes in this source
    cache = found.path + "/config"
    import os
    os.makedirs(cache)
    open(cache + "/cache.py", "w").write("mamba_cache_mode = 'none'\n")
    assert vllm_facts.gdn_prefix_caching("0.40.0", found) == "align"
    open(found.path + "/model_executor/models/qwen3_5.py", "w").write("class X(SupportsMambaPrefixCaching): pass\n")
    assert vllm_facts.gdn_prefix_caching("0.40.0", found) == "all"


def test_the_plan_states_what_prefix_caching_does_on_gdn():
    t = as_tree(compose(["hw=gpu_1x", "model=qwen3_5_0_8b", "rollout=vllm", "rollout.vllm_version=0.26.0",
                         "rollout.enable_prefix_caching=true"]))
    [p] = rules.vllm_prefix_caching_on_gdn(t, derive_layout(t))
    assert p.severity == "warning" and "'align' mode" in p.message and "0.26.0" in p.message


def test_weights_at_start_placeholders_on_text_the_checkpoints_on_images(capsys):
    """rollout.load_format: null picks placeholders on text data and the checkpoint on image data; placeholders set
    on image data are refused before launch, with the key and the fix."""
    text, images = compose(["rollout=vllm", "data=gsm8k"]), compose(["rollout=vllm", "data=geo3k"])
    assert vllm_facts.load_format(text)[0] == "dummy" and vllm_facts.load_format(images)[0] == "auto"
    assert vllm_facts.load_format(compose(["rollout=vllm", "data=gsm8k", "rollout.load_format=auto"]))[0] == "auto"
    # by default only where placeholders have trained (CPU, CUDA); an NPU reads the checkpoint and says why
    assert vllm_facts.load_format(compose(["rollout=vllm", "data=gsm8k", "hw=gpu_1x"]))[0] == "dummy"
    npu, why = vllm_facts.load_format(compose(["rollout=vllm", "data=gsm8k", "hw=a2_1node"]))
    assert npu == "auto" and "npu" in why and "rollout.load_format=dummy" in why

    def refused(overrides):
        t = as_tree(compose(overrides))
        return rules.placeholder_weights_need_a_sync(t, derive_layout(t))

    assert not refused(["rollout=vllm", "data=geo3k"]) and not refused(["rollout=vllm", "rollout.load_format=dummy"])
    problem, = refused(["rollout=vllm", "data=geo3k", "rollout.load_format=dummy"])
    assert problem.key == "rollout.load_format" and "vision tower" in problem.message and "auto" in problem.hint
    assert not refused(["rollout=hf", "data=geo3k", "rollout.load_format=dummy"])  # the hf engine has no load step
    # speculative decoding's draft weights come from the checkpoint only: read it by default, refuse placeholders
    draft = ["rollout=vllm", "data=gsm8k", "+rollout.engine_kwargs.speculative_config={method: mtp}"]
    assert vllm_facts.load_format(compose(draft))[0] == "auto" and not refused(draft)
    problem, = refused([*draft, "rollout.load_format=dummy"])
    assert "speculative_config" in problem.message and problem.key == "rollout.load_format"
    # vLLM's own argument is rollout.load_format's: set there, once
    t = as_tree(compose(["rollout=vllm", "+rollout.engine_kwargs.load_format=dummy"]))
    owned, = rules.engine_kwargs_not_owned(t, derive_layout(t))
    assert owned.key == "rollout.engine_kwargs.load_format" and "rollout.load_format" in owned.hint + owned.message
    assert plan(["rollout=vllm", "data=geo3k", "rollout.load_format=dummy"]) != 0
    assert "placeholder_weights_need_a_sync" in capsys.readouterr().out
