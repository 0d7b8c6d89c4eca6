"""What the trainer's parameters put on the most loaded device (`TrainShard`): FSDP's shard of every parameter and
its gathered units, Megatron's heaviest pipeline rank after TP and EP splits, the vision tower and the largest
single tensor."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List

from qwen35rl.config import params as P
from qwen35rl.config.layout import Layout, pipeline_stages
from qwen35rl.config.memory.common import BF16, FP32, _model_parallel, freezes_vision, trains_vision


def largest_parameter(m: Any) -> int:
    """Elements of the largest single tensor: the embedding / lm_head [V, h], or the fused routed experts' gate_up
    [E, 2I, h] of an MoE layer."""
    experts = int(m["num_experts"]) * 2 * int(m["moe_intermediate_size"]) * int(m["hidden_size"]) if m["moe"] else 0
    return max(P.embedding_params(m), experts)


@dataclass(frozen=True)
class TrainShard:
    """The trainer's parameters on the most loaded device."""

    dense: float
    """Non-expert parameters per device (FSDP: already divided by fsdp_size)."""
    expert: float
    """Routed-expert parameters per device."""
    layers: List[str]
    """Kinds ('linear'/'full') of the decoder layers whose activations this device keeps."""
    largest_unit: float
    """FSDP: parameters of the largest decoder layer (an FSDP unit all-gathered at once); Megatron: 0."""
    root: float = 0.0
    """FSDP: parameters of the root unit (embedding, untied lm_head, final norm; with the vision tower its patch
    embedding, position table and merger), gathered for a whole pass."""
    frozen: float = 0.0
    """Parameters per device without gradients or optimizer state: the vision tower under
    `model.freeze_vision_tower` (FSDP: already divided by fsdp_size). `dense` holds a trained tower."""

    @property
    def trained(self) -> float:
        """Parameters per device that get gradients and optimizer states."""
        return self.dense + self.expert

    @property
    def held(self) -> float:
        """Every parameter per device, frozen ones included."""
        return self.dense + self.expert + self.frozen


def pipeline_ranks(cfg: Any, layout: Layout) -> List[Dict[str, Any]]:
    """What each pipeline rank holds: its layer kinds (virtual stage i on rank i % pp, layers numbered in stage
    order) and whether it has the embedding (E) or the output layer + loss (L)."""
    kinds = P.layer_kinds(cfg["model"])
    ranks = [{"layers": [], "E": False, "L": False} for _ in range(max(layout.pp, 1))]
    i = 0
    for s, stage in enumerate(pipeline_stages(cfg, layout)):
        rank, n = ranks[s % len(ranks)], stage.count("t")
        rank["layers"].extend(kinds[i:i + n])
        rank["E"] |= "E" in stage
        rank["L"] |= "L" in stage
        i += n
    return ranks


def vision_tower_params(cfg: Any) -> int:
    """Parameters of the vision tower the policy holds (`trains_vision`; 0 for the text model)."""
    return P.vision_params(cfg["model"]["vision"]) if trains_vision(cfg) else 0


def train_shard(cfg: Any, layout: Layout) -> TrainShard:
    """Megatron builds the text model (no MTP) and, on image data (`trains_vision`), the vision tower: dense
    weights / TP, experts / (EP*ETP), embedding and the whole vision tower (replicated over TP, not divided) on the
    first stage, the output layer (or the tied copy) + final norm on the last; the heaviest rank counts (by its
    bf16 weights + fp32 gradients). FSDP trains the transformers model (the text model, with the vision tower on
    image data; no MTP), every parameter / fsdp_size; its vision blocks are FSDP units and the rest of the tower
    belongs to the root. A frozen tower (`freezes_vision`) moves from `dense` to `frozen`."""
    m = cfg["model"]
    tower = vision_tower_params(cfg)
    frozen_tower = tower if freezes_vision(cfg) else 0
    if not _model_parallel(layout):
        kinds = P.layer_kinds(m)
        expert = len(kinds) * P.layer_expert_params(m)
        dense = P.count_params(m).text - expert + tower - frozen_tower
        unit = max(P.layer_dense_params(m, k) + P.layer_expert_params(m) for k in set(kinds))
        root = P.embedding_params(m) + P.lm_head_params(m) + int(m["hidden_size"])
        if tower:
            v = m["vision"]
            unit = max(unit, P.vision_block_params(v))
            root += tower - int(v["depth"]) * P.vision_block_params(v)
        f = max(layout.fsdp_size, 1)
        return TrainShard(dense=dense / f, expert=expert / f, layers=kinds, largest_unit=unit, root=root,
                          frozen=frozen_tower / f)
    h, embed = int(m["hidden_size"]), P.embedding_params(m)
    shards = []
    ranks = pipeline_ranks(cfg, layout)
    for rank in ranks:
        expert = len(rank["layers"]) * P.layer_expert_params(m)
        dense = P.layers_params(m, rank["layers"]) - expert
        # The output layer: its own weights, or a copy of the tied embedding when that lives on another stage.
        output = embed if rank["L"] and not (m["tie_word_embeddings"] and rank["E"]) else 0
        dense += (embed if rank["E"] else 0) + output + (h if rank["L"] else 0)
        on_rank = tower if rank["E"] else 0
        frozen = frozen_tower if rank["E"] else 0
        shards.append((dense / max(layout.tp, 1) + on_rank - frozen, expert / max(layout.ep * layout.etp, 1), frozen))
    dense, expert, frozen = max(shards, key=lambda s: (s[0] + s[1]) * (BF16 + FP32) + s[2] * BF16)
    most_layers = max((r["layers"] for r in ranks), key=len)
    return TrainShard(dense=dense, expert=expert, layers=most_layers, largest_unit=0.0, frozen=frozen)
