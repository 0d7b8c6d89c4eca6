"""The Megatron checkpoint records the layout it was saved with (its shards cannot be resharded), and a resume
under another layout is refused with what differs. No megatron-core needed."""
import json
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from qwen35rl.config.compose import compose
from qwen35rl.config.layout import derive_layout
from qwen35rl.engines.megatron import checkpoint_state as cs


def _record(*overrides):
    cfg = compose(["model=qwen3_5_tiny_moe", "backend=megatron", "hw=cpu", "hw.devices_per_node=4", *overrides])
    return cs.shard_layout(cfg, derive_layout(cfg))


def test_the_record_names_every_degree_and_the_optimizer_placement():
    rec = _record("parallelism.tp=2", "parallelism.ep=2", "parallelism.etp=1")
    assert {k: rec[k] for k in ("world", "tp", "pp", "vpp", "cp", "ep", "etp")} == \
        {"world": 4, "tp": 2, "pp": 1, "vpp": None, "cp": 1, "ep": 2, "etp": 1}
    assert {"pipeline_layout", "use_distributed_optimizer", "optimizer_cpu_offload"} <= rec.keys()
    assert json.loads(cs.encode(rec)) == rec


@pytest.mark.parametrize("change", [["hw.devices_per_node=2"], ["parallelism.tp=2"], ["parallelism.ep=2"],
                                    ["parallelism.pp=2", "parallelism.pipeline_layout=Et|tttL"],
                                    ["backend.use_distributed_optimizer=false"]])
def test_another_layout_is_refused_with_what_differs(change):
    saved, current = _record(), _record(*change)
    why = cs.layout_change(saved, current)
    assert why and "cannot be resharded" in why
    key = change[0].split(".")[-1].split("=")[0]
    assert (key if key != "devices_per_node" else "world: 4 -> 2") in why
    with pytest.raises(RuntimeError, match="cannot be resharded"):
        cs.check_loaded({cs.LAYOUT_KEY: cs.encode(saved)}, current)


def test_the_same_layout_resumes():
    assert cs.layout_change(_record(), _record()) is None
    cs.check_loaded({cs.LAYOUT_KEY: cs.encode(_record())}, _record())
