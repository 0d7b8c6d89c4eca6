"""verl's `ray_kwargs.ray_init.runtime_env.py_executable` and `model.trust_remote_code` as qwen35rl settings that do
what verl does with them: hw.ray_runtime_env reaches ray.init (a real local cluster starts the run's actors with that
interpreter), model.trust_remote_code reaches every place a checkpoint is loaded (transformers' tokenizer, config and
model loading run the checkpoint's own code only with it; vLLM's engine arguments carry it). Import, export and
composition in verl 0.9.1's tree as for every other key."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from qwen35rl.config.compose import ConfigError, compose
from qwen35rl.config.verl.exporter import export
from qwen35rl.config.verl.importer import import_launch
from qwen35rl.config.verl.keys import MODEL, VLLM_KWARGS, get
from tests.config.verl.test_verl_real_scripts import BASE, _run
from tests.config.verl.verl_tree import compose_verl

PY_EXECUTABLE = "ray_kwargs.ray_init.runtime_env.py_executable"
TRUST = f"{MODEL}.trust_remote_code"
GROUPS = ["model=qwen3_5_35b_a3b", "backend=megatron", "hw=gpu_1node"]


# ------------------------------------------------------------------------------------------- import and export
@pytest.mark.parametrize("device", ["gpu", "npu"])
def test_py_executable_is_carried_to_hw_ray_runtime_env(device, tmp_path_factory):
    launch, imp, plan, exported, tree = _run("megatron_35b.sh", device, tmp_path_factory)
    want = launch.argv[[a.split("=", 1)[0] for a in launch.argv].index(PY_EXECUTABLE)].split("=", 1)[1]
    assert want.endswith("/venvs/verl/bin/python")
    assert imp.carried[PY_EXECUTABLE] == "hw.ray_runtime_env.py_executable"
    assert imp.overlay["hw.ray_runtime_env.py_executable"] == want
    assert plan["valid"]
    assert get(tree, PY_EXECUTABLE) == want


@pytest.mark.parametrize("script", ["real/qwen3_5_35b_megatron_npu.sh", "real/qwen3_5_122b_megatron_npu_32k.sh"])
def test_trust_remote_code_is_carried_to_the_model(script, tmp_path_factory):
    _, imp, plan, exported, tree = _run(script, "npu", tmp_path_factory)
    assert imp.carried[TRUST] == "model.trust_remote_code" and imp.overlay["model.trust_remote_code"] is True
    # one setting in qwen35rl: verl's driver (data.) and workers (model.) both get it
    assert f"{TRUST}=True" in exported["argv"] and "data.trust_remote_code=True" in exported["argv"]
    assert get(tree, TRUST) is True and get(tree, "data.trust_remote_code") is True


def test_export_writes_verls_keys_only_when_set():
    plain = export(compose(GROUPS))
    assert not [a for a in plain["argv"] if "py_executable" in a or "trust_remote_code" in a]
    assert not [x for x in plain["not_exported"]
                if x["key"] in ("model.trust_remote_code", "hw.ray_runtime_env.py_executable")]
    command = "uv run --frozen --extra vllm python3"
    exported = export(compose(GROUPS + [f"hw.ray_runtime_env.py_executable='{command}'",
                                        "model.trust_remote_code=true"]))
    assert f"{PY_EXECUTABLE}='{command}'" in exported["argv"]
    tree = compose_verl(exported["argv"])
    assert tree["ray_kwargs"]["ray_init"]["runtime_env"]["py_executable"] == command
    assert get(tree, TRUST) is True and get(tree, "data.trust_remote_code") is True
    back = import_launch(exported["argv"], exported["env"])
    assert back.overlay["hw.ray_runtime_env.py_executable"] == command
    assert back.overlay["model.trust_remote_code"] is True
    assert not back.not_carried


@pytest.mark.parametrize("value,carried", [("null", None), ("[python3,-u]", False), ("7", False)])
def test_py_executable_that_is_not_a_string(value, carried):
    imp = import_launch(BASE + [f"{PY_EXECUTABLE}={value}"], {})
    whys = {x["key"]: x["why"] for x in imp.not_carried}
    if carried is None:  # verl's default, Ray's interpreter: what qwen35rl composes
        assert PY_EXECUTABLE in imp.defaults and "hw.ray_runtime_env.py_executable" not in imp.overlay
    else:
        assert "not a string" in whys[PY_EXECUTABLE] and "hw.ray_runtime_env.py_executable" not in imp.overlay


def test_other_ray_init_settings_are_named():
    imp = import_launch(BASE + ["+ray_kwargs.ray_init.runtime_env.working_dir=/src", "ray_kwargs.ray_init.num_cpus=8"],
                        {})
    whys = {x["key"]: x["why"] for x in imp.not_carried}
    assert "py_executable carries" in whys["ray_kwargs.ray_init.runtime_env.working_dir"]
    assert "ray_address" in whys["ray_kwargs.ray_init.num_cpus"]


def test_data_trust_remote_code_unlike_the_models_is_named():
    imp = import_launch(BASE + [f"{TRUST}=True", "data.trust_remote_code=False"], {})
    whys = {x["key"]: x["why"] for x in imp.not_carried}
    assert imp.overlay["model.trust_remote_code"] is True and "differs from" in whys["data.trust_remote_code"]
    same = import_launch(BASE + [f"{TRUST}=True", "data.trust_remote_code=True"], {})
    assert same.carried["data.trust_remote_code"] == "model.trust_remote_code" and not same.not_carried


def test_vllm_engine_kwarg_carries_to_the_model_setting():
    """verl's vLLM server takes engine_kwargs.vllm.trust_remote_code over the model's: qwen35rl's one setting."""
    key = f"+{VLLM_KWARGS}.trust_remote_code"
    imp = import_launch(BASE + [f"{key}=True"], {})
    assert imp.overlay["model.trust_remote_code"] is True
    assert "rollout.engine_kwargs.trust_remote_code" not in imp.overlay
    both = import_launch(BASE + [f"{TRUST}=False", f"{key}=True"], {})
    whys = {x["key"]: x["why"] for x in both.not_carried}
    assert both.overlay["model.trust_remote_code"] is True and "overrides it" in whys[TRUST]


def test_plan_points_the_engine_argument_to_the_model_setting():
    from qwen35rl.config.plan import build_plan

    plan = build_plan(compose(GROUPS + ["+rollout.engine_kwargs.trust_remote_code=true"]))
    errors = {p["key"]: p for p in plan["problems"] if p["severity"] == "error"}
    assert "model.trust_remote_code" in errors["rollout.engine_kwargs.trust_remote_code"]["hint"]


@pytest.mark.parametrize("override,key", [
    ("hw.ray_runtime_env.py_executable=[python3,-u]", "hw.ray_runtime_env.py_executable"),
    ("hw.ray_runtime_env=python3", "hw.ray_runtime_env"),
    ("+hw.ray_runtime_env.pip=[numpy]", "hw.ray_runtime_env.pip"),
    ("model.trust_remote_code=maybe", "model.trust_remote_code"),
])
def test_a_bad_value_is_a_config_error_naming_the_key(override, key):
    with pytest.raises(ConfigError) as e:
        compose([override])
    assert e.value.key == key


# ------------------------------------------------------------------------------------------------ ray.init
class _Platform:
    ray_resource = "CPU"


def _cfg(py_executable, address=None):
    from omegaconf import OmegaConf

    return OmegaConf.create({"ray_address": address, "hw": {"devices_per_node": 1,
                                                           "ray_runtime_env": {"py_executable": py_executable}}})


@pytest.mark.parametrize("address", [None, "10.0.0.1:6379"])
def test_connect_gives_ray_init_the_runtime_env(address, monkeypatch):
    import ray

    from qwen35rl.runtime import cluster

    calls = []
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setattr(cluster, "unreachable_cluster", lambda cfg, resolve_auto=False: None)
    cluster.connect(_cfg("/opt/venv/bin/python3", address), _Platform(), 1)
    cluster.connect(_cfg(None, address), _Platform(), 1)
    assert calls[0]["runtime_env"] == {"py_executable": "/opt/venv/bin/python3"}
    assert calls[0].get("address") == address
    assert "runtime_env" not in calls[1]  # unset: Ray's default interpreter


def test_the_runs_actors_start_with_py_executable(tmp_path, monkeypatch):
    """A local cluster started by `connect` runs an actor made as WorkerGroup makes them (its own env_vars) with the
    configured interpreter: a wrapper that marks the environment, then runs this Python."""
    import ray

    from qwen35rl.runtime.cluster import connect

    wrapper = tmp_path / "python with marker"
    wrapper.write_text(f"#!/bin/sh\nexport QWEN35RL_WRAPPED=yes\nexec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert not ray.is_initialized()
    started = connect(_cfg(f"'{wrapper}'"), _Platform(), 1)  # a command prefix: the shell reads it
    try:
        assert started

        @ray.remote(num_cpus=1)
        class Probe:
            def env(self):
                return os.environ.get("QWEN35RL_WRAPPED"), os.environ.get("OWN")

        probe = Probe.options(runtime_env={"env_vars": {"OWN": "1"}}).remote()
        assert ray.get(probe.env.remote(), timeout=120) == ("yes", "1")
    finally:
        ray.shutdown()


# ---------------------------------------------------------------------------------------------- remote code
REMOTE_CODE = '''
from transformers import PreTrainedTokenizerFast, Qwen3_5ForCausalLM, Qwen3_5TextConfig


class RemoteTokenizer(PreTrainedTokenizerFast):
    from_checkpoint_code = True


class RemoteConfig(Qwen3_5TextConfig):
    from_checkpoint_code = True


class RemoteForCausalLM(Qwen3_5ForCausalLM):
    config_class = RemoteConfig
    from_checkpoint_code = True
'''


@pytest.fixture
def checkpoint_with_code(tmp_path, monkeypatch):
    """A tiny Qwen3.5 checkpoint whose config.json and tokenizer_config.json point transformers at classes in its
    own remote.py (`auto_map`); transformers' module cache goes under tmp_path."""
    import transformers.dynamic_module_utils as dmu

    from qwen35rl.models.build import build_model, save_hf
    from qwen35rl.models.tokenizer import byte_tokenizer

    monkeypatch.setattr(dmu, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    cfg = compose(["model=qwen3_5_tiny", "model.init=random"])
    ckpt = tmp_path / "ckpt"
    save_hf(build_model(cfg.model, dtype="float32", seed=0), byte_tokenizer(), str(ckpt))
    (ckpt / "remote.py").write_text(REMOTE_CODE)
    config = json.loads((ckpt / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "remote.RemoteConfig", "AutoModelForCausalLM": "remote.RemoteForCausalLM"}
    (ckpt / "config.json").write_text(json.dumps(config))
    tok = json.loads((ckpt / "tokenizer_config.json").read_text())
    tok.update(tokenizer_class="RemoteTokenizer", auto_map={"AutoTokenizer": [None, "remote.RemoteTokenizer"]})
    (ckpt / "tokenizer_config.json").write_text(json.dumps(tok))
    yield ckpt
    for name in set(sys.modules) - before:
        if name.startswith("transformers_modules"):
            del sys.modules[name]


def _model_cfg(ckpt: Path, trust: bool):
    return compose(["model=qwen3_5_tiny", "model.init=pretrained", f"model.path={ckpt}", "model.tokenizer=checkpoint",
                    f"model.trust_remote_code={str(trust).lower()}"]).model


def test_tokenizer_runs_the_checkpoints_code_only_when_trusted(checkpoint_with_code):
    from qwen35rl.models.tokenizer import build_tokenizer

    local = build_tokenizer(_model_cfg(checkpoint_with_code, False))  # transformers' class for the model type
    assert not hasattr(local, "from_checkpoint_code")
    tok = build_tokenizer(_model_cfg(checkpoint_with_code, True))
    assert type(tok).__name__ == "RemoteTokenizer" and tok.from_checkpoint_code
    (checkpoint_with_code / "config.json").unlink()  # a tokenizer of its own code only
    with pytest.raises(ValueError, match="trust_remote_code"):  # at once: no interactive question
        build_tokenizer(_model_cfg(checkpoint_with_code, False))


def test_config_and_model_run_the_checkpoints_code_only_when_trusted(checkpoint_with_code):
    from qwen35rl.models.build import build_model

    untrusted = _model_cfg(checkpoint_with_code, False)
    model = build_model(untrusted, dtype="float32")
    assert not hasattr(model, "from_checkpoint_code") and not hasattr(model.config, "from_checkpoint_code")
    assert not hasattr(build_model(untrusted, dtype="float32", device="meta").config, "from_checkpoint_code")
    trusted = _model_cfg(checkpoint_with_code, True)
    model = build_model(trusted, dtype="float32")
    assert type(model).__name__ == "RemoteForCausalLM" and type(model.config).__name__ == "RemoteConfig"
    assert type(build_model(trusted, dtype="float32", device="meta").config).__name__ == "RemoteConfig"


@pytest.mark.parametrize("trust", [False, True])
def test_vllm_engine_arguments_carry_it(trust):
    from qwen35rl.config.layout import derive_layout
    from qwen35rl.engines.vllm_rollout import engine_args_from_config

    cfg = compose(GROUPS + [f"model.trust_remote_code={str(trust).lower()}"])
    assert engine_args_from_config(cfg, derive_layout(cfg), "/ckpt")["trust_remote_code"] is trust
