"""The memory estimate against peaks measured on an H200, and its per-token activation formula against the tensors
transformers' decoder layers really keep for backward.

Fixtures (tests/config/data/): memory_h200_2026_11_29b.json (bench/gpu/results/2026-11-29b) ran transformers' torch
GDN fallback, memory_h200_2026_11_30b_fla.json (bench/gpu/results/2026-11-30b) flash-linear-attention + TileLang.
Each is checked against the estimate for its own kernel path (`gdn`); the plan itself assumes fla on accelerators.
"""
import json
import os
import weakref
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from qwen35rl.config import memory as M
from qwen35rl.config.compose import compose
from qwen35rl.config.layout import derive_layout

TOLERANCE = 0.10
H200_GB = 141  # the card the fixtures were measured on
DATA = Path(__file__).parent / "data"
FIXTURE = json.loads((DATA / "memory_h200_2026_11_29b.json").read_text())  # torch GDN: spans every knob
FLA_FIXTURE = json.loads((DATA / "memory_h200_2026_11_30b_fla.json").read_text())
CASES = FIXTURE["cases"]
ALL_CASES = [(f, c) for f in (FIXTURE, FLA_FIXTURE) for c in f["cases"]]
ALL_RUNS = [(f, r) for f in (FIXTURE, FLA_FIXTURE) for r in f["runs"]]
_estimates = {}


def measured_config(overrides, fixture=FIXTURE):
    key = (fixture["gdn"], tuple(overrides))
    if key not in _estimates:
        tree = M.as_tree(compose(fixture["common_overrides"] + list(overrides)))
        layout = derive_layout(tree)
        _estimates[key] = tree, layout, M.estimate(tree, layout, gdn=fixture["gdn"])
    return _estimates[key]


def case_id(fixture_and_case):
    fixture, case = fixture_and_case
    return f"{fixture['gdn']}-{case['name']}"


def off_by(estimated, measured):
    return estimated / measured - 1


@pytest.mark.parametrize("fixture, case", ALL_CASES, ids=[case_id(fc) for fc in ALL_CASES])
def test_training_peak_within_10_percent(fixture, case):
    _, _, est = measured_config(case["overrides"], fixture)
    err = off_by(est.train_peak_gib, case["train_allocated_gib"])
    assert abs(err) <= TOLERANCE, f"{case['name']}: estimate {est.train_peak_gib:.2f} GiB vs allocated " \
                                  f"{case['train_allocated_gib']:.2f} GiB ({err:+.1%}); terms {est.terms}"


@pytest.mark.parametrize("fixture, case", ALL_CASES, ids=[case_id(fc) for fc in ALL_CASES])
def test_hf_rollout_peak_within_10_percent(fixture, case):
    tree, layout, est = measured_config(case["overrides"], fixture)
    expected = est.rollout_peak_gib
    if case["generation_before_first_update"]:
        # The estimate is the steady state. This generation ran before the worker's first update and first
        # reference forward: AdamW had not created its states, and the reference's root unit was not gathered yet.
        shard = M.train_shard(tree, layout)
        expected -= M.optimizer_states_gib(tree, layout, shard)
        expected -= M.gib(shard.root * M.BF16) if M.kl_on(tree) else 0.0
    err = off_by(expected, case["rollout_allocated_gib"])
    assert abs(err) <= TOLERANCE, f"{case['name']}: estimate {expected:.2f} GiB vs allocated " \
                                  f"{case['rollout_allocated_gib']:.2f} GiB ({err:+.1%}); terms {est.terms}"


def test_the_fixture_spans_the_calibrated_knobs():
    """Checkpointing on and off, KL on and off, one and several micro batches per optimizer step, and generations
    before and after the first update: the tests above cover each term's switch."""
    configs = [measured_config(c["overrides"]) for c in CASES]
    assert {t["backend"]["gradient_checkpointing"] for t, _, _ in configs} == {True, False}
    assert {M.kl_on(t) for t, _, _ in configs} == {True, False}
    assert {M.micro_batches_per_mini_batch(t, lay) > 1 for t, lay, _ in configs} == {True, False}
    assert {c["generation_before_first_update"] for c in CASES} == {True, False}
    assert {e.terms["train/optimizer_step"] > 0 for _, _, e in configs} == {True, False}


@pytest.mark.parametrize("fixture, run", ALL_RUNS, ids=[case_id(fr) for fr in ALL_RUNS])
def test_cli_run_peak_within_10_percent(fixture, run):
    """A whole CLI run (128 rows, 8 micro batches): max_memory_allocated after step 1 (no AdamW states during its
    update) and after later steps (steady state) against the estimate's higher phase."""
    tree, layout, est = measured_config(run["overrides"], fixture)
    first, *later = run["max_allocated_gib_by_step"]
    steady = max(est.train_peak_gib, est.rollout_peak_gib)
    assert abs(off_by(steady, max(later))) <= TOLERANCE
    without_adam = est.train_peak_gib - M.optimizer_states_gib(tree, layout, M.train_shard(tree, layout))
    assert abs(off_by(without_adam, first)) <= TOLERANCE


def test_plan_assumes_fla_kernels_on_accelerators():
    tree, layout, torch_est = measured_config(CASES[0]["overrides"])
    assert M.gdn_kernels(tree) == "fla"
    assert M.gdn_kernels(M.as_tree(compose(["hw=cpu"]))) == "torch"
    plan = M.estimate(tree, layout)
    # fla keeps a fraction of the fallback's fp32 chunk tensors: without checkpointing the activations shrink
    assert plan.terms["train/activations"] < 0.6 * torch_est.terms["train/activations"]
    with pytest.raises(ValueError):
        M.estimate(tree, layout, gdn="triton")


# ------------------------------------------------------------------------ per-token activations, counted
class LiveBytes:
    """Bytes of tensor storages created inside the context and still alive (a dispatch mode that registers every
    op output's storage and forgets it when the storage is freed)."""

    def __init__(self, ignore=()):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        live = {t.untyped_storage()._cdata: 0 for t in ignore}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_flatten(out)[0]:
                    if hasattr(t, "untyped_storage"):
                        st = t.untyped_storage()
                        if st._cdata not in live:
                            live[st._cdata] = st.nbytes()
                            weakref.finalize(st, live.pop, st._cdata, None)
                return out

        self.live, self.mode = live, Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)

    @property
    def bytes(self):
        return sum(self.live.values())


def _one_layer(cfg, kind: str, width: int, rows: int = 2):
    """transformers' Qwen3.5 text model of `cfg` cut to one decoder layer of `kind` (bf16, training mode; a 1024-token
    vocabulary: a layer does not see it), and that layer's inputs: hidden states that require grad, the rotary
    tables and the positions of `rows` x `width` tokens."""
    import torch
    from transformers import Qwen3_5ForCausalLM

    from qwen35rl.models.hf_config import to_hf_config

    config = to_hf_config(cfg.model, text_only=True)
    config.num_hidden_layers, config.layer_types = 1, [f"{kind}_attention"]
    config._attn_implementation, config.use_cache = "sdpa", False
    config.vocab_size, config.pad_token_id = 1024, None
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM._from_config(config, dtype=torch.bfloat16).train()
    positions = torch.arange(width).expand(rows, width)
    hidden = model.model.embed_tokens(torch.randint(0, 100, (rows, width))).detach().requires_grad_(True)
    return model, hidden, model.model.rotary_emb(hidden, positions), positions


@pytest.mark.parametrize("overrides", [[], ["model=qwen3_5_0_8b"]], ids=["tiny", "0.8b"])
@pytest.mark.parametrize("kind", ["linear", "full"])
def test_layer_bytes_per_token_are_what_the_layer_keeps(overrides, kind):
    """One decoder layer of transformers' Qwen3.5 in bf16 with the torch GDN fallback: the storages alive after its
    forward (what autograd keeps for backward, plus its output) per token equal `hf_layer_bytes_per_token`."""
    cfg = compose(overrides)
    model, hidden, rotary, positions = _one_layer(cfg, kind, width=256)
    rows, width = hidden.shape[:2]
    with LiveBytes(ignore=[*model.parameters(), hidden, *rotary]) as live:
        out = model.model.layers[0](hidden, position_embeddings=rotary, attention_mask=None, position_ids=positions)
    kept = live.bytes / (rows * width)
    assert out is not None
    formula = M.hf_layer_bytes_per_token(M.as_tree(cfg)["model"], kind, M.BF16, "torch")
    assert formula == pytest.approx(kept, rel=0.02)


def _vision_tower(overrides, depth):
    """transformers' Qwen3.5 vision tower of a model config with `depth` blocks, bf16, in training mode."""
    import torch

    from qwen35rl.models.hf_config import to_hf_config
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    cfg = compose(overrides)
    vision_config = to_hf_config(cfg.model).vision_config
    vision_config.depth, vision_config._attn_implementation = depth, "sdpa"
    torch.manual_seed(0)
    return M.as_tree(cfg)["model"]["vision"], Qwen3_5VisionModel._from_config(vision_config, dtype=torch.bfloat16).train()


GRIDS = [[1, 16, 24], [1, 8, 8]]
"""Two images of 16 x 24 and 8 x 8 patches (96 + 16 merged tokens)."""


@pytest.mark.parametrize("overrides", [["model=qwen3_5_0_8b"], ["model=qwen3_5_27b"]], ids=["0.8b", "27b"])
def test_vision_block_bytes_per_patch_are_what_the_block_keeps(overrides):
    """One vision block in bf16: the storages alive after its forward (what autograd keeps, plus its output) per
    patch equal `vision_block_bytes_per_patch` (on CPU the LayerNorm statistics are bf16, not fp32: 8 B less)."""
    import torch

    v, tower = _vision_tower(overrides, depth=1)
    grid = torch.tensor(GRIDS)
    patches = int(grid.prod(-1).sum())
    hidden = torch.randn(patches, int(v["hidden_size"]), dtype=torch.bfloat16, requires_grad=True)
    cos = torch.randn(patches, int(v["hidden_size"]) // int(v["num_heads"]))
    sin = torch.randn_like(cos)
    cu = torch.tensor([0, *grid.prod(-1).cumsum(0).tolist()], dtype=torch.int32)
    with LiveBytes(ignore=[*tower.parameters(), hidden, cos, sin, cu]) as live:
        out = tower.blocks[0](hidden, cu_seqlens=cu, position_embeddings=(cos, sin))
    assert out is not None
    assert M.vision_block_bytes_per_patch(v, M.BF16) == pytest.approx(live.bytes / patches, rel=1e-3)


@pytest.mark.parametrize("mode", ["saved", "checkpointed", "frozen"])
def test_vision_tower_bytes_per_patch_are_what_the_tower_keeps(mode):
    """A 3-block tower of 0.8B's shape in bf16 on two images: what stays alive after its forward per patch is the
    stem plus every block's tensors (`saved`), the stem plus each block's input (`checkpointed`, transformers'
    gradient checkpointing as the FSDP engine enables it), or only the output features (`frozen`: no autograd)."""
    import torch

    depth = 3
    v, tower = _vision_tower(["model=qwen3_5_0_8b"], depth)
    if mode == "checkpointed":
        tower.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if mode == "frozen":
        tower.requires_grad_(False)
    grid = torch.tensor(GRIDS)
    patches = int(grid.prod(-1).sum())
    pixels = torch.randn(patches, 3 * 2 * 16 * 16)
    with LiveBytes(ignore=[*tower.parameters(), *tower.buffers(), pixels]) as live:
        out = tower(pixels, grid_thw=grid)
    kept = live.bytes / patches
    d, merged = int(v["hidden_size"]), int(v["spatial_merge_size"]) ** 2
    stem, block = M.vision_stem_bytes_per_patch(v, M.BF16), M.vision_block_bytes_per_patch(v, M.BF16)
    expected = {"saved": stem + depth * block, "checkpointed": stem + depth * M.BF16 * d,
                "frozen": M.BF16 * (d + int(v["out_hidden_size"]) / merged)}[mode]  # last hidden state + features
    assert out is not None
    assert expected == pytest.approx(kept, rel=0.01), (expected, kept)


def _saved_bytes_per_token(model, hidden, rotary, positions) -> float:
    """Bytes of the storages one decoder layer's forward saves for its backward (autograd's saved-tensor hooks see
    what compiled regions save too), per token; parameters, the layer input and the rotary tables not counted."""
    import torch

    ignore = {t.untyped_storage()._cdata for t in [*model.parameters(), hidden, *rotary]}
    saved = {}

    def pack(t):
        st = t.untyped_storage()
        if st._cdata not in ignore:
            saved[st._cdata] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model.model.layers[0](hidden, position_embeddings=rotary, attention_mask=None, position_ids=positions)
    out.float().sum().backward()  # a compiled region's first call traces its backward too: a second forward counts
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model.layers[0](hidden, position_embeddings=rotary, attention_mask=None, position_ids=positions)
    return sum(saved.values()) / hidden.shape[:2].numel()


@pytest.mark.parametrize("kind", ["linear", "full"])
def test_compiled_layer_parts_keep_what_the_formula_says(kind):
    """backend.compile_layers on the 0.8B layer (bf16, the engine's GDN forward): what compiling the norms and the MLP
    saves for backward equals the formula's difference (46 KB a token on a GDN layer, 33 KB on an attention layer)."""
    from qwen35rl.engines.compile_regions import compile_layer_parts
    from qwen35rl.engines.gdn_layer import use_training_forward

    cfg = compose(["model=qwen3_5_0_8b"])
    kept = []
    for compiled in (False, True):
        model, hidden, rotary, positions = _one_layer(cfg, kind, width=128)
        use_training_forward(model)
        if compiled:
            compile_layer_parts(model.model.layers)
        kept.append(_saved_bytes_per_token(model, hidden, rotary, positions))
    m = M.as_tree(cfg)["model"]
    formula = [M.hf_layer_bytes_per_token(m, kind, M.BF16, "torch", compiled=c) for c in (False, True)]
    assert kept[0] - kept[1] == pytest.approx(formula[0] - formula[1], rel=0.01)
    assert kept[0] - kept[1] > 30_000


PHASES_H200 = Path(__file__).parents[2] / "bench/gpu/results/2026-12-03c/call2/phases/phases_regions.json"


def test_estimate_with_compiled_layers_meets_the_h200_peak():
    """The 0.8B phases on an H200 (fla + TileLang, micro 16, bench/gpu/train_phases.py, 2026-12-03c): the training
    peak of all-at-cap rows within 10% of the estimate, with and without backend.compile_layers (variant `regions`
    and `head`); on the realistic rows the cap-length estimate bounds the peak from above."""
    from bench.gpu.grpo_h200 import workload
    from qwen35rl.config.memory import estimate

    measured = {(r["variant"], r["workload"]): r["train_peak_gib"] for r in json.loads(PHASES_H200.read_text())}
    for variant, extra in (("head", []), ("regions", ["backend.compile_layers=true"])):
        cfg = compose(workload(model="qwen3_5_0_8b", micro=16, kl=True, steps=2, memory_gb=H200_GB) + extra)
        est = estimate(cfg, derive_layout(cfg), gdn="fla").train_peak_gib
        assert est == pytest.approx(measured[(variant, "cap")], rel=TOLERANCE), variant
        assert est > measured[(variant, "realistic")]
    assert measured[("regions", "cap")] < 0.8 * measured[("head", "cap")]


RESULTS_0412 = Path(__file__).parents[2] / "bench/gpu/results/2026-12-04"


@pytest.mark.parametrize("run, model, micro, extra", [
    ("call4/phases/phases_budget.json", "qwen3_5_0_8b", 16,
     ["backend.dynamic_batch_size=true", "backend.max_tokens_per_device=24576", "backend.compile_layers=true"]),
    ("call4/phases/phases_4b.json", "qwen3_5_4b", 8, ["backend.compile_layers=true"]),
], ids=["0.8b-token-budget", "4b-micro-8"])
def test_estimate_meets_the_h200_peak_of_fuller_micro_batches(run, model, micro, extra):
    """The H200 phases of 2026-12-04 (train_phases.py, compiled layers, q/k normalised in the convolution): micro
    batches filled to 24k tokens on the 0.8B (both workloads) and the 4B at micro 8 peak within 10% of the plan's
    estimate; the estimate is not below the peak."""
    from bench.gpu.grpo_h200 import workload
    from qwen35rl.config.memory import estimate

    cfg = compose(workload(model=model, micro=micro, kl=True, steps=2, memory_gb=H200_GB) + extra)
    est = estimate(cfg, derive_layout(cfg), gdn="fla").train_peak_gib
    rows = json.loads((RESULTS_0412 / run).read_text())
    assert rows
    for r in rows:
        assert est == pytest.approx(r["train_peak_gib"], rel=TOLERANCE), r["workload"]
        assert est >= r["train_peak_gib"]


RESULTS_0412B = Path(__file__).parents[2] / "bench/gpu/results/2026-12-04b"
MEGATRON_ON_DEVICE = ["backend.megatron_core_version=0.19.2", "backend.param_offload=false", "backend.grad_offload=false",
                      "backend.optimizer_offload=false", "backend.optimizer_cpu_offload=false"]


@pytest.mark.parametrize("run, model, micro", [
    ("call2-megatron-0.8b/phases/megatron_0_8b.json", "qwen3_5_0_8b", 16),
    ("call3-megatron-4b/phases/megatron_4b.json", "qwen3_5_4b", 2),
], ids=["0.8b-micro-16", "4b-micro-2"])
def test_megatron_estimate_meets_the_h200_peak(run, model, micro):
    """The Megatron engine at TP1 on an H200 (fla + TileLang, megatron-core 0.19.2, nothing offloaded, all-at-cap
    rows, 2026-12-04b): its training peak within 10% of the plan's estimate, and not above it. The 0.8B's peak is
    its backward (the update's allocator history placed the GDN terms); the 4B's is the optimizer step (torch's
    foreach Adam)."""
    from bench.gpu.grpo_h200 import workload
    from qwen35rl.config.memory import estimate

    cfg = compose(workload(model=model, micro=micro, kl=True, backend="megatron", steps=2, memory_gb=H200_GB) + MEGATRON_ON_DEVICE)
    est = estimate(cfg, derive_layout(cfg)).train_peak_gib
    (row,) = json.loads((RESULTS_0412B / run).read_text())
    assert est == pytest.approx(row["train_peak_gib"], rel=TOLERANCE)
    assert est >= row["train_peak_gib"]
