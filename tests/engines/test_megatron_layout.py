"""The Megatron engine's layout is the config layer's (`derive_layout`), checked against the process group the
engine runs in. No megatron-core needed."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from qwen35rl.config.compose import compose
from qwen35rl.engines.megatron.engine import megatron_layout, transformer_parallel


def _cfg(*overrides):
    return compose(["model=qwen3_5_tiny_moe", "backend=megatron", "hw=cpu", "hw.devices_per_node=4", *overrides])


def test_layout_and_its_megatron_names():
    layout = megatron_layout(_cfg("parallelism.tp=2", "parallelism.ep=2", "parallelism.etp=1"), 4)
    assert (layout.tp, layout.pp, layout.cp, layout.ep, layout.etp, layout.dp) == (2, 1, 1, 2, 1, 2)
    assert transformer_parallel(layout) == {
        "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1, "context_parallel_size": 1,
        "expert_model_parallel_size": 2, "expert_tensor_parallel_size": 1, "sequence_parallel": True}


def test_a_process_group_of_another_size_is_refused():
    with pytest.raises(ValueError, match="process group has 2 ranks but hw.nodes x hw.devices_per_node = 4"):
        megatron_layout(_cfg(), 2)


def test_a_layout_that_does_not_divide_the_world_is_refused():
    with pytest.raises(ValueError, match="not divisible by tp\\*pp\\*cp = 3"):
        megatron_layout(_cfg("parallelism.tp=3"), 4)
