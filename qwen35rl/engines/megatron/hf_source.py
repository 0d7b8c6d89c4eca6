"""Where HF tensors come from when the Megatron engine fills its shards: a state dict in memory (a random init
built by transformers) or a checkpoint directory read lazily, one tensor at a time, from its safetensors files.

Names are those of `mapping.param_maps(hf_prefix="model.")`: a VL checkpoint's `model.language_model.` prefix is
accepted (its vision tower keeps the `model.visual.` names), MTP layers are skipped, and per-expert storage (`experts.{e}.gate_proj.weight`)
is fused into the transformers layout on demand.
"""
from __future__ import annotations

import json
import os
import re
from typing import Dict, Iterable, List, Mapping, Tuple

import torch
from torch import Tensor

from qwen35rl.engines.megatron.mapping import CAUSAL_LM_PREFIX, canonical_hf_name

_FUSED = re.compile(r"^(.*\.mlp\.experts\.)(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class DictSource:
    """HF tensors from a state dict (e.g. `model.state_dict()` of a transformers Qwen3.5)."""

    def __init__(self, state: Mapping[str, Tensor]):
        self.state: Dict[str, Tensor] = {}
        for name, t in state.items():
            canonical = canonical_hf_name(name, CAUSAL_LM_PREFIX)
            if canonical is not None:
                self.state[canonical] = t

    def __contains__(self, name: str) -> bool:
        return name in self.state

    def get(self, name: str) -> Tensor:
        if name not in self.state:
            raise KeyError(f"the HF state has no {name!r}")
        return self.state[name]


class CheckpointSource:
    """HF tensors read from a checkpoint directory (`*.safetensors`, sharded with an index or not)."""

    def __init__(self, path: str):
        self.path = path
        files = self._files(path)
        self.where: Dict[str, Tuple[str, str]] = {}
        self.per_expert: Dict[str, Dict[str, Dict[int, str]]] = {}
        for file, names in files.items():
            for name in names:
                canonical = canonical_hf_name(name, CAUSAL_LM_PREFIX)
                if canonical is None:
                    continue
                self.where[canonical] = (file, name)
                m = _PER_EXPERT.match(canonical)
                if m:
                    self.per_expert.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = canonical

    @staticmethod
    def _files(path: str) -> Dict[str, List[str]]:
        from safetensors import safe_open

        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files: Dict[str, List[str]] = {}
            for name, file in weight_map.items():
                files.setdefault(os.path.join(path, file), []).append(name)
            return files
        found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not found:
            raise FileNotFoundError(f"{path}: no *.safetensors files (a Hugging Face checkpoint directory is needed)")
        out = {}
        for f in found:
            with safe_open(os.path.join(path, f), framework="pt") as handle:
                out[os.path.join(path, f)] = list(handle.keys())
        return out

    def _read(self, canonical: str) -> Tensor:
        from safetensors import safe_open

        file, name = self.where[canonical]
        with safe_open(file, framework="pt") as handle:
            return handle.get_tensor(name)

    def __contains__(self, name: str) -> bool:
        if name in self.where:
            return True
        m = _FUSED.match(name)
        return bool(m) and m.group(1) in self.per_expert

    def get(self, name: str) -> Tensor:
        if name in self.where:
            return self._read(name)
        m = _FUSED.match(name)
        if m and m.group(1) in self.per_expert:
            parts = self.per_expert[m.group(1)]
            count = len(parts["down_proj"])
            if m.group(2) == "down_proj":
                return torch.stack([self._read(parts["down_proj"][e]) for e in range(count)])
            return torch.stack([torch.cat([self._read(parts["gate_proj"][e]), self._read(parts["up_proj"][e])])
                                for e in range(count)])
        raise KeyError(f"{self.path}: the checkpoint has no {name!r}")

    def names(self) -> Iterable[str]:
        return self.where.keys()
