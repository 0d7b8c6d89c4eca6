"""Image data end to end: data=geo3k (parquet with images and questions) on the tiny VL model through the
processor, the hf rollout with images, log-probs and the update; text-only models reject image data at plan time."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from geo3k_fixture import write_geo3k
from qwen35rl.config import rules
from qwen35rl.config.compose import compose
from qwen35rl.config.layout import derive_layout
from qwen35rl.data import DataError, build_dataset
from qwen35rl.models.tokenizer import build_tokenizer
from qwen35rl.runtime.image_prompts import tokenize_image_prompts
from qwen35rl.runtime.tracking import read_metrics

_SCRIPT = Path(sys.executable).parent / "qwen35rl-train"
TRAIN = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "qwen35rl.cli.train"]


@pytest.fixture(scope="module")
def geo3k(tmp_path_factory):
    root = tmp_path_factory.mktemp("geo3k")
    return write_geo3k(root / "train.parquet", 16), write_geo3k(root / "test.parquet", 4, seed=1)


def _data(geo3k):
    return [f"data.train_files=[{geo3k[0]}]", f"data.val_files=[{geo3k[1]}]"]


def test_text_only_model_rejects_image_data_at_plan_time(geo3k):
    cfg = compose(["data=geo3k", "model=qwen3_5_tiny", *_data(geo3k)])
    assert "images_need_vision_model" in [p.code for p in rules.check_all(cfg, derive_layout(cfg))]
    proc = subprocess.run([*TRAIN, "data=geo3k", "model=qwen3_5_tiny", *_data(geo3k)], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ))
    assert proc.returncode == 2 and "images_need_vision_model" in proc.stderr


def test_image_prompts_get_their_image_tokens(geo3k):
    cfg = compose(["data=geo3k", "model=qwen3_5_tiny_vl", "data.max_prompt_length=256", *_data(geo3k)])
    tok = build_tokenizer(cfg.model)
    examples = tokenize_image_prompts(build_dataset(cfg.data, tok, "train"), cfg.model, cfg.data, tok)
    image_pad = tok.convert_tokens_to_ids("<|image_pad|>")
    assert len(examples) == 16
    for ex in examples:
        assert len(ex.images) == 1 and 1 <= ex.prompt_ids.count(image_pad) <= 4
        assert tok.decode(ex.prompt_ids).endswith("<|im_start|>assistant\n")
    short = compose(["data=geo3k", "model=qwen3_5_tiny_vl", "data.max_prompt_length=20", *_data(geo3k)])
    with pytest.raises(DataError, match=r"all 16 train image prompts .* filtered out for length"):
        tokenize_image_prompts(build_dataset(short.data, tok, "train"), short.model, short.data, tok, "train")


def _train_two_steps(geo3k, run, *overrides):
    """Two GRPO steps of a small geo3k run on two CPU ranks through the CLI; the metrics of both steps, checked:
    rollout and trainer saw the same images (their log-probs agree), the update moved, validation ran."""
    proc = subprocess.run(
        [*TRAIN, f"hydra.run.dir={run}", "data=geo3k", *_data(geo3k), "data.reward=copy_digit",
         "data.max_prompt_length=256", "hw.devices_per_node=2", "data.train_batch_size=4", "rollout.n=4",
         "algorithm.mini_batch_size=2", "backend.micro_batch_size_per_device=4", "data.val_batch_size=4",
         "trainer.total_steps=2", "trainer.test_freq=2", *overrides],
        capture_output=True, text=True, timeout=900, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["prompt_length/min"] > 10 and r["actor/grad_norm"] > 0 and r["actor/skipped_steps"] == 0
        assert "critic/score/mean" in r
        assert r["rollout/logprob_diff_max"] < 1e-3
    assert "val/score/mean" in rows[1]
    return rows


@pytest.mark.slow
def test_geo3k_trains_on_the_tiny_vl_model(geo3k, tmp_path):
    run = tmp_path / "run"
    _train_two_steps(geo3k, run, "model=qwen3_5_tiny_vl", "trainer.save_freq=-1")
    # the policy included the vision tower: the export is the VL model, with its processor
    from transformers import Qwen3_5ForConditionalGeneration

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    model = Qwen3_5ForConditionalGeneration.from_pretrained(run / "final")
    assert any(n.startswith("model.visual.") for n, _ in model.named_parameters())
    assert Qwen2VLImageProcessorPil.from_pretrained(run / "final").merge_size == 2


@pytest.mark.slow
@pytest.mark.parametrize("model,layout", [
    ("qwen3_5_tiny_vl", ["parallelism.tp=2"]),
    ("qwen3_5_tiny_vl", ["parallelism.pp=2", "parallelism.vpp=2"]),
    ("qwen3_5_tiny_vl_moe", ["parallelism.ep=2"]),
], ids=["dense-tp2", "dense-pp2-vpp2", "moe-ep2"])
def test_geo3k_trains_on_megatron(geo3k, tmp_path, model, layout):
    """The Megatron engine trains the VL model on image data through the CLI (two CPU ranks, the hf rollout):
    rollout and trainer agree on the image prompts' log-probs (fp32), checkpoints are written, and the export is
    the VL checkpoint type with a vision tower that training changed."""
    run = tmp_path / "run"
    _train_two_steps(geo3k, run, "backend=megatron", f"model={model}", *layout, "backend.use_rollout_log_probs=false",
                     "backend.bf16=false", "backend.lr=1e-3", "trainer.save_freq=1")
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_")) == ["step_1", "step_2"]
    import transformers

    from qwen35rl.config.compose import compose
    from qwen35rl.models.build import build_model

    cfg = compose([f"model={model}"])
    model_cls = getattr(transformers, "Qwen3_5MoeForConditionalGeneration" if cfg.model.moe else
                        "Qwen3_5ForConditionalGeneration")
    exported = dict(model_cls.from_pretrained(run / "final").named_parameters())
    init = dict(build_model(cfg.model, dtype="float32", seed=int(cfg.trainer.seed), text_only=False).named_parameters())
    assert exported.keys() == init.keys()
    moved = {n for n in init if not torch.equal(exported[n], init[n])}
    assert any(n.startswith("model.visual.") for n in moved) and any(n.startswith("model.language_model.") for n in moved)
