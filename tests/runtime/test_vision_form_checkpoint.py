"""The rollout checkpoint of a text policy in the vision-language form (vLLM 0.26 loads no text-only Qwen3.5
checkpoint): the text model's weights under model.language_model., a zero vision tower, the processor; it computes
what the text model computes."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qwen35rl.config.compose import compose
from qwen35rl.models.build import build_model
from qwen35rl.models.tokenizer import build_tokenizer
from qwen35rl.runtime.worker import write_vision_form


def test_text_policy_written_as_the_vision_language_checkpoint(tmp_path):
    from transformers import AutoModelForImageTextToText

    cfg = compose(["model=qwen3_5_tiny_vl", "model.init=random", "model.dtype=float32", "hw=cpu", "data=synthetic"])
    text = build_model(cfg.model, dtype="float32", seed=3, text_only=True).eval()
    write_vision_form(cfg.model, {n: t.detach().clone() for n, t in text.state_dict().items()},
                      build_tokenizer(cfg.model), str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"] and "vision_config" in config
    assert (tmp_path / "processor_config.json").exists() or (tmp_path / "preprocessor_config.json").exists()
    saved = {}
    for f in tmp_path.glob("*.safetensors"):
        saved.update(load_file(str(f)))
    visual = [n for n in saved if n.startswith("model.visual.")]
    assert visual and all(not saved[n].any() for n in visual)
    assert not any(n.startswith("model.layers.") for n in saved)  # the text model sits under language_model
    vl = AutoModelForImageTextToText.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    ids = torch.tensor([[72, 101, 108, 108, 111, 44, 32, 49, 43, 49]])
    with torch.no_grad():
        assert torch.allclose(vl(input_ids=ids).logits, text(input_ids=ids).logits, atol=1e-5)


def test_a_model_without_a_vision_tower_has_no_such_form(tmp_path):
    cfg = compose(["model=qwen3_5_tiny", "model.init=random", "hw=cpu"])
    with pytest.raises(ValueError, match="no vision tower"):
        write_vision_form(cfg.model, {}, build_tokenizer(cfg.model), str(tmp_path))


@pytest.mark.parametrize("vision_form", [True, False])
def test_placeholder_checkpoint_is_the_full_one_without_weights(tmp_path, vision_form):
    """For an engine that starts on placeholders (vLLM's load_format=dummy) the rollout checkpoint is written without
    weight files, and what it does write is what the full checkpoint holds."""
    from qwen35rl.models.build import generation_config, save_hf, save_hf_config
    from qwen35rl.models.processor import build_processor

    cfg = compose(["model=qwen3_5_tiny_vl", "model.init=random", "hw=cpu", "data=synthetic"])
    tok = build_tokenizer(cfg.model)
    full, bare = tmp_path / "full", tmp_path / "bare"
    text = build_model(cfg.model, dtype=cfg.model.dtype, seed=3, text_only=True)
    if vision_form:
        write_vision_form(cfg.model, dict(text.state_dict()), tok, str(full))
        save_hf_config(cfg.model, tok, str(bare), text_only=False, processor=build_processor(cfg.model, tok))
    else:
        text.generation_config = generation_config(cfg.model)
        save_hf(text, tok, str(full))
        save_hf_config(cfg.model, tok, str(bare), text_only=True)
    assert list(full.glob("*.safetensors")) and not list(bare.glob("*.safetensors"))
    written = sorted(p.name for p in full.iterdir() if not p.name.startswith("model"))
    assert sorted(p.name for p in bare.iterdir()) == written
    for name in written:
        assert (bare / name).read_text() == (full / name).read_text(), name


def test_weightless_checkpoints_are_kept_by_content(tmp_path):
    """The same config written by two runs starts vLLM from one path (vLLM's compile cache is keyed by it); another
    config gets its own."""
    from qwen35rl.models.build import save_hf_config
    from qwen35rl.runtime.worker import shared_config_dir

    def written(name, *overrides):
        cfg = compose(["model=qwen3_5_tiny", "model.init=random", "hw=cpu", *overrides])
        save_hf_config(cfg.model, build_tokenizer(cfg.model), str(tmp_path / name))
        return str(tmp_path / name)

    root = tmp_path / "cache"
    first = shared_config_dir(written("run1"), root)
    assert shared_config_dir(written("run2"), root) == first != written("run1")
    other = shared_config_dir(written("run3", "model.num_hidden_layers=2"), root)
    assert other != first and sorted(p.name for p in root.iterdir()) == sorted({Path(first).name, Path(other).name})
    assert json.loads((Path(other) / "config.json").read_text())["num_hidden_layers"] == 2
    # a cache that cannot be written: the run's own copy, said in the log
    (tmp_path / "blocked").write_text("a file where the cache directory should be")
    assert shared_config_dir(written("run4"), tmp_path / "blocked" / "rollout_configs") == written("run4")
