"""The Megatron engine takes the driver's layout (`derive_layout`, derived once) and checks it against the process
group it runs in. No megatron-core needed."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from qwen35rl.config.compose import compose
from qwen35rl.config.layout import derive_layout
from qwen35rl.engines.megatron.ranks import check_world, transformer_parallel


def _layout(*overrides):
    return derive_layout(compose(["model=qwen3_5_tiny_moe", "backend=megatron", "hw=cpu", "hw.devices_per_node=4",
                                  *overrides]))


def test_layout_and_its_megatron_names():
    layout = _layout("parallelism.tp=2", "parallelism.ep=2", "parallelism.etp=1")
    check_world(layout, 4)
    assert transformer_parallel(layout) == {
        "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1, "context_parallel_size": 1,
        "expert_model_parallel_size": 2, "expert_tensor_parallel_size": 1, "sequence_parallel": True}


def test_a_process_group_of_another_size_is_refused():
    with pytest.raises(ValueError, match="process group has 2 ranks but the layout has 4"):
        check_world(_layout(), 2)
