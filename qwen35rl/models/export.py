"""The final Hugging Face export as the source checkpoint's own type: the trained tensors written over a copy of the
source (`model.path`), so everything the trainer did not hold comes along unchanged: the vision tower of a VL
checkpoint trained as its text model, the multi-token-prediction `mtp.*` tensors transformers does not model, and
config, tokenizer, processor and chat template files.

Source tensors are read lazily, one shard file at a time; each output shard keeps the source's file name and
tensors, so the index (`model.safetensors.index.json`) is the source's. A trained tensor takes the dtype of the
source tensor it replaces (the copied config.json states that dtype).
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any, Dict, List, Mapping

import torch

log = logging.getLogger(__name__)

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5", ".ckpt")
_TEXT_PREFIX, _VL_TEXT_PREFIX = "model.", "model.language_model."
"""A VL checkpoint keeps its text model under model.language_model.*; transformers loads it as a text model by
dropping `language_model.` (its qwen3_5_text conversion) and saves the text model without it."""


def source_weight_files(source_dir: str) -> Dict[str, List[str]]:
    """Shard file -> tensor names of a safetensors checkpoint directory; {} without safetensors weights."""
    src = Path(source_dir)
    if (src / SAFETENSORS_INDEX).is_file():
        weight_map = json.loads((src / SAFETENSORS_INDEX).read_text())["weight_map"]
        files: Dict[str, List[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(file, []).append(name)
        return files
    if (src / SAFETENSORS).is_file():
        from safetensors import safe_open

        with safe_open(str(src / SAFETENSORS), framework="pt") as f:
            return {SAFETENSORS: list(f.keys())}
    return {}


def checkpoint_names(model: Any, trained: Mapping[str, torch.Tensor], source_names: set) -> Dict[str, torch.Tensor]:
    """The trained tensors under the source checkpoint's names: as transformers saves them (its weight
    conversions reverted, e.g. fused MoE experts split per expert) or as the model names them, whichever the
    source uses, with the text model's prefix of a VL source. ValueError listing what the source lacks."""
    from transformers.core_model_loading import revert_weight_conversion

    def in_source(name: str) -> str:
        if name not in source_names and name.startswith(_TEXT_PREFIX) and not name.startswith(_VL_TEXT_PREFIX):
            vl = _VL_TEXT_PREFIX + name[len(_TEXT_PREFIX):]
            if vl in source_names:
                return vl
        return name

    candidates = [dict(trained)]
    try:
        saved = revert_weight_conversion(model, dict(trained))
        candidates.insert(0, saved)
    except Exception as e:  # noqa: BLE001 - no conversion known for this model: its own names only
        log.debug("no reverse weight conversion: %s", e)
    missing: List[str] = []
    for named in candidates:
        renamed = {in_source(k): v for k, v in named.items()}
        missing = sorted(k for k in renamed if k not in source_names)
        if not missing:
            return renamed
    raise ValueError(f"export: {len(missing)} trained tensors have no counterpart in the source checkpoint, e.g. "
                     f"{missing[:3]} (source names e.g. {sorted(source_names)[:3]})")


def export_over_source(trained: Mapping[str, torch.Tensor], model: Any, source_dir: str, out_dir: str) -> Dict[str, int]:
    """Write `out_dir`: the source checkpoint with `trained` (HF parameter names of `model`, the trained model,
    which may be on `meta`) in place of its tensors. Returns counts of trained and copied tensors."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, out = Path(source_dir), Path(out_dir)
    files = source_weight_files(source_dir)
    if not files:
        raise FileNotFoundError(f"export: {source_dir} has no safetensors weights to export over")
    named = checkpoint_names(model, trained, {n for names in files.values() for n in names})
    out.mkdir(parents=True, exist_ok=True)
    copy_non_weight_files(src, out)
    counts = {"trained": 0, "copied": 0}
    for file, names in files.items():
        shard: Dict[str, torch.Tensor] = {}
        with safe_open(str(src / file), framework="pt") as f:
            metadata = f.metadata() or {"format": "pt"}
            for name in names:
                source = f.get_tensor(name)
                if name in named:
                    t = named[name]
                    if tuple(t.shape) != tuple(source.shape):
                        raise ValueError(f"export: {name} is {tuple(t.shape)} after training, {tuple(source.shape)} "
                                         f"in the source")
                    shard[name] = t.detach().to("cpu", source.dtype).contiguous()
                    counts["trained"] += 1
                else:
                    shard[name] = source
                    counts["copied"] += 1
        save_file(shard, str(out / file), metadata=metadata)
        del shard
    if (src / SAFETENSORS_INDEX).is_file():
        shutil.copy2(src / SAFETENSORS_INDEX, out / SAFETENSORS_INDEX)
    log.info("exported %d trained tensors over %s (%d copied unchanged) to %s", counts["trained"], source_dir,
             counts["copied"], out_dir)
    return counts


def copy_non_weight_files(src: Path, out: Path) -> None:
    """config.json, generation config, tokenizer, processor and chat template files (every top-level file that
    holds no weights)."""
    for p in sorted(src.iterdir()):
        if p.is_file() and not p.name.endswith(_WEIGHT_SUFFIXES) and p.name != SAFETENSORS_INDEX:
            shutil.copy2(p, out / p.name)
