"""The final export loads as the source checkpoint's type: trained weights over a copy of the source, with what
training did not hold (the vision tower of a VL checkpoint trained on text, `mtp.*` tensors, tokenizer, processor,
chat template) unchanged. The source is a tiny VL checkpoint with extra mtp tensors in its own shard."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors import safe_open
from safetensors.torch import save_file

from qwen35rl.config.layout import derive_layout
from qwen35rl.config.compose import compose
from qwen35rl.models.build import build_model, save_hf
from qwen35rl.models.export import SAFETENSORS_INDEX, export_over_source, source_weight_files
from qwen35rl.models.processor import build_processor
from qwen35rl.models.tokenizer import build_tokenizer
from qwen35rl.runtime.batching import Sequences
from qwen35rl.runtime.worker import PolicyWorker

MTP_SHARD = "model-mtp.safetensors"
PROMPTS = [[ord(c) for c in "7 3 9 ="], [ord(c) for c in "1 2 ="]]


def _make_source(path: Path) -> Path:
    """A 'pretrained' tiny VL checkpoint saved in shards, plus multi-token-prediction tensors transformers does
    not model, in a shard of their own listed in the index (as official Qwen3.5 checkpoints carry them)."""
    m = compose(["model=qwen3_5_tiny_vl"]).model
    tok = build_tokenizer(m)
    model = build_model(m, dtype=torch.float32, seed=7, text_only=False)
    save_hf(model, tok, str(path), processor=build_processor(m, tok))
    model.save_pretrained(str(path), max_shard_size="300KB")  # sharded, with an index
    for f in path.glob("model.safetensors"):
        f.unlink()
    g = torch.Generator().manual_seed(11)
    h = m.hidden_size
    mtp = {"mtp.fc.weight": torch.randn(h, 2 * h, generator=g), "mtp.norm.weight": torch.randn(h, generator=g),
           "mtp.layers.0.mlp.gate_proj.weight": torch.randn(m.intermediate_size, h, generator=g)}
    save_file(mtp, str(path / MTP_SHARD), metadata={"format": "pt"})
    index = json.loads((path / SAFETENSORS_INDEX).read_text())
    index["weight_map"].update({k: MTP_SHARD for k in mtp})
    (path / SAFETENSORS_INDEX).write_text(json.dumps(index))
    return path


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return _make_source(tmp_path_factory.mktemp("pretrained"))


def _tensors(path: Path):
    out = {}
    for file in source_weight_files(str(path)):
        with safe_open(str(path / file), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _check_untrained_parts_are_the_source(final: Path, source: Path):
    src, out = _tensors(source), _tensors(final)
    assert set(out) == set(src) and len(list(source.glob("model-*.safetensors"))) >= 3
    for k in src:
        if k.startswith(("model.visual.", "mtp.")):
            assert torch.equal(out[k], src[k]) and out[k].dtype == src[k].dtype, k
    for p in source.iterdir():  # config, tokenizer, processor, chat template: the source's files, byte for byte
        if not p.name.endswith(".safetensors"):
            assert (final / p.name).read_bytes() == p.read_bytes(), p.name
    return src, out


def test_export_over_a_vl_source_keeps_vision_and_mtp(source, tmp_path):
    from transformers import AutoTokenizer, Qwen3_5ForConditionalGeneration

    cfg = compose(["model=qwen3_5_tiny_vl", "model.init=pretrained", f"model.path={source}",
                   "model.tokenizer=checkpoint", "hw.devices_per_node=1", "rollout.n=2",
                   "data.max_response_length=4"])
    w = PolicyWorker(OmegaConf.to_container(cfg, resolve=True), layout=derive_layout(cfg), rank=0, world_size=1,
                     local_rank=0, run_dir=str(tmp_path), optimizer_steps=10)
    w._build_engines()
    assert w.text_only and type(w.actor.lm).__name__ == "Qwen3_5ForCausalLM"  # text data: the text model trains
    w.sync_weights()
    result = w.generate(PROMPTS, dict(n=2, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=4, seed=5))
    seqs = Sequences([p for p in PROMPTS for _ in range(2)], result.response_ids, advantages=[1.0, -1.0] * 2)
    w.update_actor(seqs, {"global_tokens": float(seqs.token_count()), "global_seqs": 4.0})
    trained = {n: t.clone() for bucket in w.actor.export_weights(64) for n, t in bucket}

    final = tmp_path / "final"
    w.export_hf(str(final))
    src, out = _check_untrained_parts_are_the_source(final, source)
    changed = [n for n in trained if not torch.equal(trained[n], src["model.language_model." + n[len("model."):]])]
    assert changed, "the update changed no weight"

    loaded = Qwen3_5ForConditionalGeneration.from_pretrained(str(final))
    params = dict(loaded.named_parameters())
    for name, t in trained.items():     # text-model names -> the VL model's text part
        assert torch.equal(params["model.language_model." + name[len("model."):]], t), name
    assert all(torch.equal(p, src[n]) for n, p in params.items() if n.startswith("model.visual."))
    tok = AutoTokenizer.from_pretrained(str(final))
    assert tok.decode(tok.encode("7 3 9 =")) == "7 3 9 =" and tok.chat_template


def test_moe_experts_go_back_to_the_source_layout(tmp_path):
    """transformers fuses MoE experts on load and splits them on save: the export writes the trained fused experts
    under the source's per-expert names."""
    from transformers import AutoModelForCausalLM

    m = compose(["model=qwen3_5_tiny_moe"]).model
    src_model = build_model(m, dtype=torch.float32, seed=1)
    src_model.save_pretrained(str(tmp_path / "src"))
    assert any(".experts.0." in k for k in _tensors(tmp_path / "src"))
    trained_model = build_model(m, dtype=torch.float32, seed=2)
    trained = {n: p.detach() for n, p in trained_model.named_parameters()}
    counts = export_over_source(trained, trained_model, str(tmp_path / "src"), str(tmp_path / "out"))
    assert counts["copied"] == 0 and counts["trained"] == len(_tensors(tmp_path / "src"))
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert all(torch.equal(p, trained[n]) for n, p in back.named_parameters())


def test_names_the_source_lacks_are_refused(source, tmp_path):
    m = compose(["model=qwen3_5_tiny"]).model
    model = build_model(m, dtype=torch.float32)
    with pytest.raises(ValueError, match="no counterpart in the source"):
        export_over_source({"model.extra.weight": torch.zeros(2)}, model, str(source), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


_SCRIPT = Path(sys.executable).parent / "qwen35rl-train"
TRAIN = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "qwen35rl.cli.train"]


@pytest.mark.slow
def test_training_from_a_vl_checkpoint_exports_that_checkpoint_type(source, tmp_path):
    from transformers import Qwen3_5ForConditionalGeneration

    run = tmp_path / "run"
    proc = subprocess.run([*TRAIN, f"hydra.run.dir={run}", "model=qwen3_5_tiny_vl", "model.init=pretrained",
                           f"model.path={source}", "model.tokenizer=checkpoint", "hw.devices_per_node=2",
                           "data.train_batch_size=4", "rollout.n=4", "algorithm.mini_batch_size=2",
                           "backend.micro_batch_size_per_device=4", "trainer.total_steps=2", "trainer.test_freq=-1"],
                          capture_output=True, text=True, timeout=900, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-4000:]
    final = run / "final"
    src, out = _check_untrained_parts_are_the_source(final, source)
    text = [k for k in src if k.startswith("model.language_model.")]
    assert any(not torch.equal(out[k], src[k]) for k in text), "two steps changed no text weight"
    loaded = Qwen3_5ForConditionalGeneration.from_pretrained(str(final))
    assert all(torch.equal(p, out[n]) for n, p in loaded.named_parameters())
