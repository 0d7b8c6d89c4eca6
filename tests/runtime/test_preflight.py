"""Preflight: the config against the cluster (resources, device memory, installed versions) before any worker is
built, and a placement group that cannot be satisfied failing after its timeout with what is missing."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import subprocess
import sys
import time
from pathlib import Path

import pytest

from qwen35rl.config.compose import compose
from qwen35rl.config.problems import ERROR, WARNING
from qwen35rl.config.resolved import resolve_run
from qwen35rl.runtime import preflight
from qwen35rl.runtime.platform import resolve_platform
from qwen35rl.runtime.preflight import EXIT_PREFLIGHT, Node, PreflightError

_SCRIPT = Path(sys.executable).parent / "qwen35rl-train"
TRAIN = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "qwen35rl.cli.train"]


def _gpu_cfg(*overrides):
    return compose(["hw=gpu_1node", "rollout=hf", *overrides])


def _node(i, **res):
    return Node(f"id{i}", f"10.0.0.{i}", res)


def _probe(packages=None, **info):
    return {"hostname": "n1", "address": "10.0.0.1", "packages": packages or {}, **info}


# ------------------------------------------------------------------------------------------------ resources
def test_shortage_names_what_is_missing():
    cfg = _gpu_cfg("hw.nodes=2")
    platform = resolve_platform(cfg)
    per = cfg.hw.devices_per_node
    assert preflight.resource_shortage(cfg, platform, [_node(1, GPU=per, CPU=64), _node(2, GPU=per, CPU=64)]) is None
    msg = preflight.resource_shortage(cfg, platform, [_node(1, GPU=per, CPU=64), _node(2, CPU=64)])
    assert f"needs {per} GPU + {per} CPU on each of 2 node(s)" in msg
    assert f"cluster has {per} GPU on 2 node(s), 1 of them enough" in msg and "10.0.0.2: 0 GPU" in msg
    # enough GPUs but too few CPUs for one worker process each
    assert "1 of them enough" in preflight.resource_shortage(cfg, platform, [_node(1, GPU=per, CPU=64),
                                                                             _node(2, GPU=per, CPU=1)])


def test_waits_for_nodes_to_join_then_times_out(monkeypatch):
    monkeypatch.setattr(preflight, "POLL_S", 0.01)
    cfg = _gpu_cfg("hw.nodes=2")
    platform, per = resolve_platform(cfg), cfg.hw.devices_per_node
    joined = [[_node(1, GPU=per, CPU=64)]] * 3 + [[_node(1, GPU=per, CPU=64), _node(2, GPU=per, CPU=64)]]
    calls = iter(joined + joined[-1:] * 100)
    assert len(preflight.wait_for_resources(cfg, platform, 10, lambda: next(calls))) == 2

    t0 = time.monotonic()
    with pytest.raises(PreflightError) as e:
        preflight.wait_for_resources(cfg, platform, 0.2, lambda: [_node(1, GPU=per, CPU=64)])
    assert 0.2 <= time.monotonic() - t0 < 5
    assert "after waiting 0.2 s (trainer.placement_timeout_s)" in str(e.value)
    assert e.value.problems[0].code == "cluster_lacks_devices"


# --------------------------------------------------------------------------------------------------- memory
def test_device_memory_against_the_plan():
    cfg = _gpu_cfg()  # hw.memory_gb=80
    assert preflight.memory_problems(cfg, [_probe(device_memory_gb=85.0, device_name="H100")]) == []
    short = preflight.memory_problems(cfg, [_probe(device_memory_gb=42.0, device_name="A100-40GB")])
    assert [(p.code, p.severity) for p in short] == [("device_memory_short", ERROR)]
    assert "42.0 GB" in short[0].message and "hw.memory_gb=80" in short[0].message
    big = preflight.memory_problems(cfg, [_probe(device_memory_gb=143.8, device_name="H200")])
    assert [(p.code, p.severity) for p in big] == [("device_memory_unused", WARNING)]


# ------------------------------------------------------------------------------------------------- versions
def test_vllm_version_that_changes_a_quirk_is_an_error():
    cfg = resolve_run(compose(["hw=a3_1node", "model=qwen3_5_0_8b", "rollout.vllm_version=0.22.0"]))
    found = preflight.version_problems(cfg, [_probe({"vllm": "0.18.0"})])
    assert [(p.code, p.severity) for p in found] == [("vllm_version_changes_facts", ERROR)]
    assert "mm_processor_cache_gb" in found[0].message and found[0].hint == "set rollout.vllm_version=0.18.0"
    # a patch release that changes no fact: a warning
    found = preflight.version_problems(cfg, [_probe({"vllm": "0.22.1"})])
    assert [(p.code, p.severity) for p in found] == [("vllm_version_differs", WARNING)]
    assert preflight.version_problems(cfg, [_probe({"vllm": "0.22.0"})]) == []
    assert [p.code for p in preflight.version_problems(cfg, [_probe({"vllm": None})])] == ["vllm_missing_on_node"]


def test_megatron_version_that_changes_a_rule_is_an_error():
    # EP1 with ETP != TP gets wrong expert gradients before megatron-core 0.19: a rule the node's version brings
    cfg = resolve_run(compose(["backend=megatron", "model=qwen3_5_tiny_moe", "hw.devices_per_node=2",
                               "parallelism.tp=2", "parallelism.etp=1", "backend.megatron_core_version=0.19.2"]))
    found = preflight.version_problems(cfg, [_probe({"megatron-core": "0.16.1"})])
    assert found and found[0].severity == ERROR and "expert_grads_need_ep_or_etp_equal_tp" in found[0].message
    # the version of a package this run does not use is not checked
    assert preflight.version_problems(resolve_run(compose([])), [_probe({"megatron-core": "0.1.0", "vllm": "0.1.0"})]) == []


def test_settings_that_need_transformer_engine_are_decided_on_the_nodes_stack():
    cfg = resolve_run(compose(["backend=megatron", "model=qwen3_5_tiny_moe", "hw=gpu_1node", "rollout=hf"]))
    with_te = {"device": "cuda", "transformer_engine": True, "fla": True}
    assert preflight.capability_problems(cfg, [_probe(stack=with_te)]) == []
    found = preflight.capability_problems(cfg, [_probe(stack={**with_te, "transformer_engine": False})])
    assert {p.code for p in found} == {"megatron_permute_fusion_needs_te"}
    assert all(p.severity == WARNING and "(on n1)" in p.message for p in found)
    # what the plan already reported is not repeated
    assert "megatron_grouped_gemm" not in {p.code for p in found}


# --------------------------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_run_asking_for_gpus_on_a_cpu_cluster_fails_fast(tmp_path):
    t0 = time.monotonic()
    proc = subprocess.run([*TRAIN, f"hydra.run.dir={tmp_path / 'run'}", "hw.ray_resource=GPU", "trainer.total_steps=1",
                           "trainer.launcher=ray"],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert proc.returncode == EXIT_PREFLIGHT, proc.stderr[-3000:]
    assert time.monotonic() - t0 < 60
    assert "needs 2 GPU + 2 CPU on each of 1 node(s)" in proc.stderr and "cluster has 0 GPU" in proc.stderr
    assert "PolicyWorker" not in proc.stderr  # failed before any worker was built


@pytest.mark.slow
def test_placement_group_that_cannot_be_placed_times_out():
    import ray

    from qwen35rl.runtime.cluster import ClusterError, placement_groups

    cfg = compose(["hw.devices_per_node=2"])
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        hog = ray.util.placement_group([{"CPU": 2}])  # another job holds both CPUs
        ray.get(hog.ready(), timeout=60)
        t0 = time.monotonic()
        with pytest.raises(ClusterError) as e:
            placement_groups(resolve_platform(cfg), 1, 2, timeout_s=2)
        assert 2 <= time.monotonic() - t0 < 30
        assert "needs 1 node(s) x 2 bundles of {'CPU': 1.0}" in str(e.value)
        assert "after 2 s (trainer.placement_timeout_s)" in str(e.value) and "free now: 0 of 2 CPU" in str(e.value)
    finally:
        ray.shutdown()


def test_gpu_nodes_without_fla_get_a_warning_naming_what_runs_instead():
    cfg = resolve_run(compose(["backend=megatron", "model=qwen3_5_tiny_moe", "hw=gpu_1node", "rollout=hf"]))
    no_fla = _probe(gdn={"fla": None, "triton": "3.5.0", "capability": [9, 0], "fla_backward_refused": False})
    (p,) = preflight.gdn_problems(cfg, [no_fla])
    assert p.code == "fla_missing_on_node" and p.severity == WARNING and "megatron-core's torch" in p.message
    with_fla = _probe(gdn={"fla": "0.6.0", "triton": "3.7.1", "capability": [9, 0], "fla_backward_refused": False})
    assert preflight.gdn_problems(cfg, [with_fla]) == []


def test_an_output_directory_without_room_for_two_checkpoints_is_warned(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from qwen35rl.config.memory import checkpoint_gib

    cfg = compose(["model=qwen3_5_27b", "hw=gpu_1node", "rollout=hf", f"trainer.output_root={tmp_path}/runs"])
    one = checkpoint_gib(cfg)
    assert 27 * 12 / 1.1 < one < 29 * 12  # ~27 B trained parameters, fp32 weights and two Adam moments
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 ** 15, 0, int(1.5 * one * 2 ** 30)))
    (p,) = preflight.disk_problems(cfg)
    assert p.code == "output_disk_short" and p.severity == WARNING and str(tmp_path) in p.message
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 ** 15, 0, int(2.5 * one * 2 ** 30)))
    assert preflight.disk_problems(cfg) == []
