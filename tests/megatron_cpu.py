"""The Megatron test modules' common prelude: one torch thread (two worker processes share a 2-core machine) and
the importing test module skipped where megatron-core is not installed. Import it before torch.

The CPU stand-ins megatron-core needs live in the product (`qwen35rl.engines.megatron.cpu`, installed by the engine
on a CPU device); worker processes that touch megatron before building an engine call `megatron_on_cpu()` first.
They go on in the worker processes only: in the pytest process torch.compile would stay off for every later test."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import importlib.util

import pytest
import torch

torch.set_num_threads(1)  # one thread per worker process (two share this 2-core machine)

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)

from qwen35rl.engines.megatron.cpu import install as megatron_on_cpu  # noqa: E402,F401

CPU_TRANSFORMER_OVERRIDES = {"deterministic_mode": True}
"""`backend.transformer_overrides` megatron needs on CPU (no fla kernels); the engine also sets it by default there."""
