"""Defaults that fit (issue 36): every released Qwen3.5 size x every accelerator preset x both backends x text and
image data, read from conf/, plans valid with its defaults wherever the model plainly fits
(`physical_fit.plainly_fits`); a new model or preset joins the grid by its file alone."""
import pytest

from qwen35rl.config import default_grid as G
from qwen35rl.config.compose import compose
from qwen35rl.config.paths import config_dir
from qwen35rl.config.plan import build_plan

CELLS = list(G.cells())


def test_the_grid_is_read_from_conf():
    models = {f.stem for f in (config_dir() / "model").glob("*.yaml") if "tiny" not in f.stem}
    assert set(G.models()) == models and len(models) >= 8
    hws = {f.stem for f in (config_dir() / "hw").glob("*.yaml")} - {"cpu"}
    assert set(G.hardware()) == hws and len(hws) >= 9
    assert len(CELLS) == len(models) * len(hws) * 2 * 2


def test_plainly_fits_is_the_physical_bound():
    """18 bytes per parameter over every device's memory, and rollout weights a rollout layout can hold."""
    fits = lambda *a: G.plainly_fits(compose(G.overrides(*a)))  # noqa: E731
    assert fits("qwen3_5_9b", "gpu_1node", "fsdp", "gsm8k") and fits("qwen3_5_0_8b", "gpu_1x", "megatron", "geo3k")
    assert not fits("qwen3_5_27b", "gpu_1x", "fsdp", "gsm8k")  # 27B x 18 B > 0.7 x 80 GB
    assert not fits("qwen3_5_397b_a17b", "gpu_16node", "fsdp", "geo3k")  # no EP rollout: 99 GB a device at TP8
    assert fits("qwen3_5_397b_a17b", "a3_16node", "megatron", "geo3k")  # the reference run
    assert sum(G.plainly_fits(compose(G.overrides(*c))) for c in CELLS) >= 200


@pytest.mark.parametrize("model,hw,backend,data", CELLS, ids=["-".join(c) for c in CELLS])
def test_default_plans_valid_where_the_model_plainly_fits(model, hw, backend, data):
    cfg = compose(G.overrides(model, hw, backend, data))
    if not G.plainly_fits(cfg):
        pytest.skip("the model does not plainly fit this hardware")
    plan = build_plan(cfg)
    errors = [f"[{p['code']}] {p['message']} (hint: {p['hint']})" for p in plan["problems"] if p["severity"] == "error"]
    if not plan["valid"] and not G.layout_file(model, hw, backend).exists():
        errors.append("no layout file for this cell: `python -m qwen35rl.config.default_grid --write` writes the "
                      "search's best")
    assert plan["valid"], errors


def test_batch_sizes_scale_with_dp_where_not_set():
    """64 / 16 prompts where they split over DP (every reference run keeps its own), more on more devices."""
    def batch(*overrides):
        c = compose(list(overrides))
        return c.data.train_batch_size, c.algorithm.mini_batch_size

    assert batch("model=qwen3_5_9b", "hw=gpu_1node") == (64, 16)
    assert batch("model=qwen3_5_9b", "hw=h20_4node") == (128, 32)  # DP32, n=5: 32 prompts per mini batch at least
    assert batch("model=qwen3_5_9b", "hw=gpu_16node") == (512, 128)
    assert batch("model=qwen3_5_9b", "hw=gpu_16node", "rollout.n=8") == (64, 16)  # 16 x 8 splits over DP128
    assert batch("model=qwen3_5_9b", "hw=gpu_16node", "data.train_batch_size=64")[0] == 64  # what the user sets stays
    assert batch("model=qwen3_5_9b", "hw=gpu_1node", "algorithm.mini_batch_size=48") == (96, 48)
    assert batch("model=qwen3_5_397b_a17b", "backend=megatron", "hw=gpu_16node") == (64, 32)  # DP32: the reference
    assert batch("model=qwen3_5_122b_a10b", "backend=megatron", "hw=h20_4node") == (128, 64)


def test_the_vllm_pool_is_sized_from_what_the_trainer_leaves():
    """The issue's first example: 9B on eight 80 GB GPUs was refused with the fixed 0.6 pool beside the trainer."""
    plan = build_plan(compose(["model=qwen3_5_9b", "hw=gpu_1node", "data=gsm8k"]))
    assert plan["valid"], plan["problems"]
    mem = plan["memory_gib"]
    assert mem["rollout_peak"] <= 0.9 * mem["capacity"] + 0.01 * 80e9 / 2**30
    util = [a for a in plan["verl"]["argv"] if "rollout.gpu_memory_utilization=" in a]  # the export: a number
    assert len(util) == 1 and 0.3 < float(util[0].split("=")[1]) < 0.6
    fixed = build_plan(compose(["model=qwen3_5_9b", "hw=gpu_1node", "data=gsm8k", "rollout.gpu_memory_utilization=0.6"]))
    assert not fixed["valid"] and "rollout_memory_fits" in {p["code"] for p in fixed["problems"]}


def test_layout_files_say_where_they_come_from():
    """Every layout file under conf/parallelism/<backend>/ is a reference run's tested layout or a searched one
    whose comment gives the reason."""
    for f in sorted((config_dir() / "parallelism").glob("*/*.yaml")):
        head = f.read_text().split("parallelism:")[0].replace("\n# ", " ")
        assert "Tested layout" in head or "H200 nodes run the same layout" in head or (
            "Searched layout" in head and "does not fit here" in head), f


@pytest.mark.parametrize("cell", [("qwen3_5_27b", "gpu_1x", "fsdp", "gsm8k"),
                                  ("qwen3_5_397b_a17b", "gpu_1node", "megatron", "geo3k"),
                                  ("qwen3_5_397b_a17b", "gpu_16node", "fsdp", "geo3k")], ids="-".join)
def test_where_it_cannot_fit_the_refusal_names_the_smallest_change_that_fits(cell):
    plan = build_plan(compose(G.overrides(*cell)))
    memory = [p for p in plan["problems"] if p["code"] in ("train_memory_fits", "rollout_memory_fits")]
    assert not plan["valid"] and memory
    hint = memory[0]["hint"]
    change = hint.split(" fits (")[0]
    assert change and all(p["hint"].startswith(change + " fits") for p in memory), hint
    overrides = G.overrides(*cell)
    if change.startswith("backend="):
        overrides = G.overrides(cell[0], cell[1], change.split("=")[1].split()[0], cell[3])
    elif change != "parallelism=auto":
        overrides.append(change)
    fixed = build_plan(compose([*overrides, "parallelism=auto"]))
    assert fixed["valid"], [p for p in fixed["problems"] if p["severity"] == "error"]
