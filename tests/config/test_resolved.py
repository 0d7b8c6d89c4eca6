"""`ResolvedRun`: the run resolved once (every `auto` concrete, the layout, the memory estimate, the vLLM facts), frozen
and picklable; the plan renders it, and the training path carries it from the launch to the workers without
deriving the layout again."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import dataclasses
import pickle
import sys

import pytest
from omegaconf import OmegaConf

from qwen35rl.config import layout as layout_module, layout_search
from qwen35rl.config.compose import compose
from qwen35rl.config.plan import build_plan
from qwen35rl.config.problems import ERROR
from qwen35rl.config.resolved import ResolvedRun, resolve_run
from qwen35rl.config.schema import RunConfig

LOCAL = ["trainer.launcher=local", "hw.devices_per_node=1", "data.train_batch_size=4", "rollout.n=4",
         "algorithm.mini_batch_size=2", "backend.micro_batch_size_per_device=4", "trainer.test_freq=-1",
         "trainer.total_steps=1"]
GPU_AUTO = ["model=qwen3_5_0_8b", "hw=gpu_1x", "backend.micro_batch_size_per_device=auto",
            "backend.gradient_checkpointing=auto"]
"""A vLLM rollout whose micro batch, checkpointing, pool fraction and vLLM version are all `auto`."""


def test_auto_settings_are_resolved_and_the_plan_renders_the_same_object():
    cfg = compose(GPU_AUTO)
    assert cfg.rollout.gpu_memory_utilization == "auto" and cfg.rollout.vllm_version == "auto"
    run = resolve_run(cfg)
    assert isinstance(run.cfg.backend.micro_batch_size_per_device, int)
    assert isinstance(run.cfg.backend.gradient_checkpointing, bool)
    assert 0 < run.cfg.rollout.gpu_memory_utilization <= 0.9
    assert run.vllm is not None and run.cfg.rollout.vllm_version == run.vllm.version
    assert run.choice is not None and run.choice.micro == run.cfg.backend.micro_batch_size_per_device
    assert OmegaConf.get_type(run.cfg) is RunConfig  # the typed form the workers read
    plan = build_plan(cfg)
    assert (plan["world_size"], plan["train"], plan["rollout"]) == (
        run.layout.world, run.layout.train_dict(), run.layout.rollout_dict())
    assert plan["memory_gib"] == run.memory.to_dict() and plan["vllm"] == run.vllm.to_dict()
    assert plan["batch"]["auto"]["micro_batch_size_per_device"] == run.choice.micro


def test_frozen_and_a_pickle_round_trip_is_equal():
    run = resolve_run(compose(GPU_AUTO))
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.layout = None
    back = pickle.loads(pickle.dumps(run))  # what Ray does with the config and layout it ships to each worker
    assert back == run and OmegaConf.get_type(back.cfg) is RunConfig and back.layout == run.layout


def test_a_config_out_of_range_resolves_without_an_estimate():
    run = resolve_run(compose(["data.train_batch_size=0"]))
    assert run.memory is None and run.layout.world == 2


def _counted(monkeypatch, module, name):
    """Calls of `module.name` from anywhere: every module that imported the function gets the counting one."""
    original, calls = getattr(module, name), []

    def counting(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    for m in list(sys.modules.values()):
        if getattr(m, name, None) is original:
            monkeypatch.setattr(m, name, counting)
    return calls


def test_the_training_path_derives_the_layout_once_and_the_workers_get_the_plans(tmp_path, monkeypatch):
    """`qwen35rl-train`'s path without Hydra: resolved, checked, then the job (run identity, driver, data,
    preflight) up to the training worker's constructor, which records what it got and fails the start."""
    from qwen35rl.cli.train import launch_problems
    from qwen35rl.exit_codes import EXIT_WORKER_FAILURE
    from qwen35rl.runtime import driver, entry

    cfg = compose(LOCAL)  # (its interpolations derive the layout for the run name and batch sizes: composition's)
    derived = _counted(monkeypatch, layout_module, "derive_layout")
    searched = _counted(monkeypatch, layout_search, "search")
    given = {}

    class Worker:
        def __init__(self, cfg, *, layout, **placed):
            given.update(cfg=cfg, layout=layout)
            raise RuntimeError("stopped at the worker's start")

    monkeypatch.setattr(driver, "PolicyWorker", Worker)
    run = resolve_run(cfg, str(tmp_path))
    assert not [p for p in launch_problems(run) if p.severity == ERROR]
    assert entry.train(run, tmp_path) == EXIT_WORKER_FAILURE
    assert len(derived) == 1 and not searched
    assert given["cfg"] is run.cfg and given["layout"] is run.layout  # shipped as they are
    plan = build_plan(cfg)
    assert (plan["world_size"], plan["train"], plan["rollout"]) == (
        given["layout"].world, given["layout"].train_dict(), given["layout"].rollout_dict())
    assert isinstance(run, ResolvedRun)
