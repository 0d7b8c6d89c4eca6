"""The plan's promise on CPU: every kind of layout that `parallelism=auto` accepts for `hw=cpu` (2 and 4 devices)
trains one GRPO step through `qwen35rl-train`, with the user's defaults for everything but the batch size.

Layouts are grouped by the parallel mechanisms they use (which axes are above 1, FSDP's hybrid sharding; not the
data-parallel degree): one run per mechanism and engine family, the smallest world that has it, the models taken in
turn so that each tiny model (dense, MoE, VL) runs on each engine. On 4 devices only mechanisms of at most two
model-parallel axes that 2 devices lack are added (larger combinations repeat the same code paths). A case that another
test already runs through the CLI (`RUN_ELSEWHERE`) is left to it."""
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from qwen35rl.config import layout_search
from qwen35rl.config.compose import compose
from qwen35rl.config.layout import Layout
from qwen35rl.config.plan import build_plan
from qwen35rl.runtime.tracking import read_metrics
from tests.runtime.geo3k_fixture import write_geo3k

_BIN = Path(sys.executable).parent
TRAIN = [str(_BIN / "qwen35rl-train")] if (_BIN / "qwen35rl-train").exists() else [sys.executable, "-m",
                                                                                 "qwen35rl.cli.train"]
FAMILIES = {("fsdp", "any"): ["qwen3_5_tiny", "qwen3_5_tiny_moe", "qwen3_5_tiny_vl"],
            ("megatron", "dense"): ["qwen3_5_tiny", "qwen3_5_tiny_vl"],
            ("megatron", "moe"): ["qwen3_5_tiny_moe"]}
SMALL_BATCH = ["data.train_batch_size=4", "rollout.n=4", "algorithm.mini_batch_size=4", "data.val_batch_size=4",
               "backend.micro_batch_size_per_device=2",
               "trainer.total_steps=1", "trainer.export_hf=false"]


def _base(backend: str, model: str, world: int) -> List[str]:
    out = [f"backend={backend}", f"model={model}", "hw=cpu", f"hw.devices_per_node={world}"]
    return out + (["data=geo3k", "data.max_prompt_length=256", "data.reward=copy_digit"] if "vl" in model else [])


def mechanism(layout: Layout, moe: bool) -> Tuple[str, ...]:
    if layout.backend == "fsdp":
        shard = "replicate" if layout.fsdp_size == 1 else "hsdp" if layout.fsdp_size < layout.world else ""
        return tuple(["sp"] * (layout.sp > 1) + [shard] * bool(shard))
    axes = {"tp": layout.tp, "pp": layout.pp, "ep": layout.ep, "etp": layout.etp if moe else 1}
    return tuple(k for k, v in axes.items() if v > 1)


def _overrides(layout: Layout) -> List[str]:
    return [f"parallelism.{k}={'null' if v is None else v}" for k, v in layout.train_dict().items() if k != "dp"]


def cases() -> List[Tuple[str, str, int, List[str]]]:
    """(id, model, world, overrides) of one run per (engine family, mechanism)."""
    out = []
    for (backend, family), models in FAMILIES.items():
        picked: Dict[Tuple[str, ...], Tuple[int, Layout]] = {}
        for world in (2, 4):
            for cand in layout_search.search(compose(_base(backend, models[0], world) + ["parallelism=auto"])):
                mech = mechanism(cand.layout, family == "moe")
                if mech in picked or (world == 4 and len(mech) > 2):
                    continue
                picked[mech] = (world, cand.layout)
        for i, (mech, (world, layout)) in enumerate(sorted(picked.items())):
            model = models[i % len(models)]
            out.append((f"{backend}-{model}-w{world}-{'+'.join(mech) or 'dp'}", model, world, _overrides(layout)))
    # and the search's own pick, as a user runs it
    return out + [("fsdp-qwen3_5_tiny-w4-auto", "qwen3_5_tiny", 4, ["parallelism=auto"])]


ALL_CASES = cases()
RUN_ELSEWHERE = {
    # the same engine, model and mechanism through the same CLI, with more asserted
    "fsdp-qwen3_5_tiny-w2-dp": "tests/runtime/test_e2e.py::test_train_end_to_end (the embedded default)",
    "megatron-qwen3_5_tiny_vl-w2-pp": "tests/runtime/test_multimodal.py::test_geo3k_trains_on_megatron[dense-pp2-vpp2]",
}
CASES = [c for c in ALL_CASES if c[0] not in RUN_ELSEWHERE]


def test_the_cases_run_elsewhere_are_cases():
    """A case left to another test is one these rules pick (a change of the rules must not silently drop one)."""
    assert set(RUN_ELSEWHERE) <= {c[0] for c in ALL_CASES}, sorted(set(RUN_ELSEWHERE) - {c[0] for c in ALL_CASES})


def test_the_cases_cover_every_engine_model_and_mechanism():
    ids = [c[0] for c in ALL_CASES]
    for backend, model in [("fsdp", "qwen3_5_tiny"), ("fsdp", "qwen3_5_tiny_moe"), ("fsdp", "qwen3_5_tiny_vl"),
                           ("megatron", "qwen3_5_tiny"), ("megatron", "qwen3_5_tiny_vl"),
                           ("megatron", "qwen3_5_tiny_moe")]:
        assert any(i.startswith(f"{backend}-{model}-") for i in ids), (backend, model, ids)
    for mech in ("sp", "sp+hsdp", "replicate", "tp", "pp", "ep"):
        assert any(i.endswith(f"-{mech}") for i in ids), (mech, ids)
    run_here = [c[0] for c in CASES]  # each model still runs on each engine here
    for backend, model in {tuple(i.split("-")[:2]) for i in ids}:
        assert any(i.startswith(f"{backend}-{model}-") for i in run_here), (backend, model, run_here)


@pytest.fixture(scope="module")
def geo3k(tmp_path_factory):
    root = tmp_path_factory.mktemp("geo3k")
    return [f"data.train_files=[{write_geo3k(root / 'train.parquet', 8)}]",
            f"data.val_files=[{write_geo3k(root / 'test.parquet', 4, seed=1)}]"]


@pytest.fixture(scope="module")
def ray_address():
    """One local Ray cluster for all runs (each run would otherwise start and stop its own)."""
    import ray

    ctx = ray.init(num_cpus=8, include_dashboard=False, configure_logging=False)
    yield ctx.address_info["gcs_address"]
    ray.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("name,model,world,layout", CASES, ids=[c[0] for c in CASES])
def test_an_accepted_layout_trains(name, model, world, layout, geo3k, ray_address, tmp_path):
    args = _base(name.split("-")[0], model, world) + layout + (geo3k if "vl" in model else [])
    plan = build_plan(compose(args))  # what qwen35rl-plan prints, in this process (its CLI has its own tests)
    assert plan["valid"], json.dumps(plan["problems"], indent=1)
    run = tmp_path / "run"
    proc = subprocess.run([*TRAIN, *args, *SMALL_BATCH, f"hydra.run.dir={run}", f"ray_address={ray_address}"],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-6000:]
    (row,) = read_metrics(run / "metrics.jsonl")
    assert row["step"] == 1 and row["actor/grad_norm"] > 0 and row["actor/skipped_steps"] == 0
