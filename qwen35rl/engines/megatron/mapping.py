"""Qwen3.5 text-model parameters between the Hugging Face (transformers) layout and megatron-core's (a VL model's
vision tower keeps transformers' module and names: `vision_param_maps` maps it one to one, replicated over TP).

Pure torch: no megatron import, so CI checks the layout on CPU whatever megatron-core is installed.

One `ParamMap` per group of tensors that convert together (q/k/v -> the fused linear_qkv, gate/up -> linear_fc1,
the fused HF experts -> one Megatron tensor per expert, ...). Every transform is a view, a concatenation or an
index: bf16 goes through bitwise. Megatron-side names are those of a whole model (global layer and expert index,
TP=1 layout); `split_for_rank` / `merge_ranks` shard them for tensor / expert parallelism.

Layouts that are easy to get wrong, all as megatron-core 0.16-0.19 compute them:
- linear_qkv with the attention output gate is grouped by query group: for each KV head g,
  [q heads of g | gate heads of g | k_g | v_g]. HF's q_proj interleaves per head [q_h | gate_h].
  The grouped layout is TP-invariant: a TP rank holds a contiguous slice (Megatron all-gathers when TP > KV heads).
- GDN in_proj: each TP rank computes its own [q | k | v | z | beta | alpha] slice, so the full tensor is not
  [q | k | v | z | b | a] but every section sharded separately (`Split.sections`); conv1d likewise for [q | k | v].
  The TP=1 layout equals HF's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a concatenated.
- gated MLPs (linear_fc1 = [gate | up]) chunk gate and up per rank the same way.
- Norms: HF stores the layer norms, final norm and q/k norms zero-centred (x * (1 + w)); megatron's
  `layernorm_zero_centered_gamma` stores the same w, so they map unchanged. The GDN output norm is a plain x * w
  on both sides (the model must build it without zero-centring): no +-1 shift anywhere, which would lose bits in bf16.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
LM_HEAD = "lm_head.weight"
CAUSAL_LM_PREFIX = "model."
"""Text-model prefix of `Qwen3_5[Moe]ForCausalLM`."""
VL_PREFIX = "model.language_model."
"""Text-model prefix of `Qwen3_5[Moe]ForConditionalGeneration` (the official checkpoints)."""
VISION_PREFIX = "model.visual."
"""The vision tower's prefix in `Qwen3_5[Moe]ForConditionalGeneration` (and every official checkpoint)."""
MEGATRON_VISION_PREFIX = "visual."
"""Where the Megatron VL model keeps the (transformers) vision tower: a submodule of the first stage's chunk."""


# ------------------------------------------------------------------------------------------------ model shape
@dataclass(frozen=True)
class Qwen35Shape:
    """The architecture facts the layout depends on (text model only)."""

    num_layers: int
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    layer_types: Tuple[str, ...]
    tie_word_embeddings: bool = False
    intermediate_size: int = 0
    num_experts: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    @property
    def linear_qk_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_v_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @classmethod
    def from_model_config(cls, m: Any) -> "Qwen35Shape":
        """From our `ModelConfig` (conf/model/*.yaml)."""
        from qwen35rl.models.hf_config import layer_types

        moe = bool(m.moe)
        return cls(
            num_layers=int(m.num_hidden_layers), hidden_size=int(m.hidden_size), vocab_size=int(m.vocab_size),
            num_attention_heads=int(m.num_attention_heads), num_key_value_heads=int(m.num_key_value_heads),
            head_dim=int(m.head_dim), linear_num_key_heads=int(m.linear_num_key_heads),
            linear_num_value_heads=int(m.linear_num_value_heads), linear_key_head_dim=int(m.linear_key_head_dim),
            linear_value_head_dim=int(m.linear_value_head_dim), linear_conv_kernel_dim=int(m.linear_conv_kernel_dim),
            layer_types=tuple(layer_types(int(m.num_hidden_layers), int(m.full_attention_interval))),
            tie_word_embeddings=bool(m.tie_word_embeddings),
            intermediate_size=0 if moe else int(m.intermediate_size),
            num_experts=int(m.num_experts) if moe else 0,
            moe_intermediate_size=int(m.moe_intermediate_size) if moe else 0,
            shared_expert_intermediate_size=int(m.shared_expert_intermediate_size) if moe else 0,
        )

    @classmethod
    def from_hf_config(cls, config: Any) -> "Qwen35Shape":
        """From a transformers Qwen3.5 config: text config, or the VL config (whose top level owns the tying)."""
        text = getattr(config, "text_config", None) or config
        moe = bool(getattr(text, "num_experts", 0))
        return cls(
            num_layers=text.num_hidden_layers, hidden_size=text.hidden_size, vocab_size=text.vocab_size,
            num_attention_heads=text.num_attention_heads, num_key_value_heads=text.num_key_value_heads,
            head_dim=text.head_dim, linear_num_key_heads=text.linear_num_key_heads,
            linear_num_value_heads=text.linear_num_value_heads, linear_key_head_dim=text.linear_key_head_dim,
            linear_value_head_dim=text.linear_value_head_dim, linear_conv_kernel_dim=text.linear_conv_kernel_dim,
            layer_types=tuple(text.layer_types),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            intermediate_size=0 if moe else text.intermediate_size,
            num_experts=text.num_experts if moe else 0,
            moe_intermediate_size=text.moe_intermediate_size if moe else 0,
            shared_expert_intermediate_size=text.shared_expert_intermediate_size if moe else 0,
        )


# ------------------------------------------------------------------------------------------ megatron naming
@dataclass(frozen=True)
class MegatronNames:
    """Where megatron-core puts each parameter; it depends on the module specs.

    `fused_input_norms`: Transformer Engine specs fold the input / pre-MLP norms into the following linear
    (`linear_qkv.layer_norm_weight`, `in_proj.layer_norm_weight`, dense `linear_fc1.layer_norm_weight`); the local
    specs keep `input_layernorm` / `pre_mlp_layernorm`. `grouped_experts`: TEGroupedMLP names expert weights
    `experts.linear_fc1.weight{e}`; the local SequentialMLP `experts.local_experts.{e}.linear_fc1.weight`.
    """

    fused_input_norms: bool = False
    grouped_experts: bool = False

    @staticmethod
    def layer(i: int) -> str:
        return f"decoder.layers.{i}."

    def input_norm(self, i: int, layer_type: str) -> str:
        if not self.fused_input_norms:
            return self.layer(i) + "input_layernorm.weight"
        linear = "linear_qkv" if layer_type == FULL_ATTENTION else "in_proj"
        return self.layer(i) + f"self_attention.{linear}.layer_norm_weight"

    def pre_mlp_norm(self, i: int, moe: bool) -> str:
        # TE folds the norm into a dense linear_fc1 only; a MoE layer keeps its own pre-MLP norm.
        if self.fused_input_norms and not moe:
            return self.layer(i) + "mlp.linear_fc1.layer_norm_weight"
        return self.layer(i) + "pre_mlp_layernorm.weight"

    def expert(self, i: int, e: int, linear: str) -> str:
        if self.grouped_experts:
            return self.layer(i) + f"mlp.experts.{linear}.weight{e}"
        return self.layer(i) + f"mlp.experts.local_experts.{e}.{linear}.weight"


EMBEDDING = "embedding.word_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
OUTPUT_LAYER = "output_layer.weight"

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT_RE = re.compile(r"(\.local_experts\.)(\d+)(\.)|(\.weight)(\d+)$")


def layer_index(name: str) -> Optional[int]:
    """The decoder layer of a Megatron parameter name (None outside the decoder layers)."""
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else None


def with_layer_index(name: str, i: int) -> str:
    """`name` moved to decoder layer `i` (global <-> pipeline-stage-local numbering)."""
    if not _LAYER_RE.match(name):
        raise ValueError(f"{name!r} is not a decoder layer parameter")
    return _LAYER_RE.sub(f"decoder.layers.{i}.", name, count=1)


def expert_index(name: str) -> Optional[int]:
    """The expert index in a Megatron expert weight name (None for a non-expert parameter)."""
    if ".mlp.experts." not in name:
        return None
    m = _EXPERT_RE.search(name)
    if m is None:
        return None
    return int(m.group(2) if m.group(2) is not None else m.group(5))


def with_expert_index(name: str, e: int) -> str:
    """`name` relabelled to expert `e` (global <-> expert-parallel-local numbering)."""
    if expert_index(name) is None:
        raise ValueError(f"{name!r} is not an expert weight")
    return _EXPERT_RE.sub(lambda m: f"{m.group(1)}{e}{m.group(3)}" if m.group(1) else f"{m.group(4)}{e}", name, count=1)


# ------------------------------------------------------------------------------------------- tensor parallel
@dataclass(frozen=True)
class Split:
    """How a tensor-parallel layer shards a parameter: along `dim` (0 column-parallel / vocab-parallel, 1 row-
    parallel), each of `sections` (sizes along `dim` in the TP=1 layout; None: one section) chunked separately."""

    dim: int
    sections: Optional[Tuple[int, ...]] = None

    def _sections(self, full: int) -> Tuple[int, ...]:
        return self.sections if self.sections is not None else (full,)


def split_for_rank(t: Tensor, split: Optional[Split], rank: int, size: int) -> Tensor:
    """The shard of TP=1 tensor `t` that TP rank `rank` of `size` holds (`split=None`: replicated)."""
    if split is None or size == 1:
        return t
    sections = split._sections(t.shape[split.dim])
    for s in sections:
        if s % size:
            raise ValueError(f"cannot shard {tuple(t.shape)} along dim {split.dim} (sections {sections}) over {size} ranks")
    parts = torch.split(t, list(sections), dim=split.dim)
    return torch.cat([p.chunk(size, dim=split.dim)[rank] for p in parts], dim=split.dim)


def merge_ranks(shards: Sequence[Tensor], split: Optional[Split]) -> Tensor:
    """The TP=1 tensor from the shards of every TP rank, in rank order (inverse of `split_for_rank`)."""
    if split is None or len(shards) == 1:
        return shards[0]
    size = len(shards)
    full = shards[0].shape[split.dim] * size
    local = [s // size for s in split._sections(full)]
    per_rank = [torch.split(s, local, dim=split.dim) for s in shards]
    return torch.cat([torch.cat([r[k] for r in per_rank], dim=split.dim) for k in range(len(local))], dim=split.dim)


# ------------------------------------------------------------------------------------------ tensor transforms
def qkv_to_megatron(q: Tensor, k: Tensor, v: Tensor, num_heads: int, num_kv_heads: int, head_dim: int) -> Tensor:
    """HF q_proj ([q_h | gate_h] per head), k_proj, v_proj -> linear_qkv grouped per query group
    [q heads | gate heads | k | v]."""
    rest = q.shape[1:]
    per_group = num_heads // num_kv_heads
    qg = q.reshape(num_heads, 2, head_dim, *rest)
    query = qg[:, 0].reshape(num_kv_heads, per_group * head_dim, *rest)
    gate = qg[:, 1].reshape(num_kv_heads, per_group * head_dim, *rest)
    key = k.reshape(num_kv_heads, head_dim, *rest)
    value = v.reshape(num_kv_heads, head_dim, *rest)
    return torch.cat([query, gate, key, value], dim=1).reshape(-1, *rest)


def qkv_to_hf(qkv: Tensor, num_heads: int, num_kv_heads: int, head_dim: int) -> List[Tensor]:
    """Inverse of `qkv_to_megatron`: [q_proj, k_proj, v_proj]."""
    rest = qkv.shape[1:]
    per_group = num_heads // num_kv_heads
    grouped = qkv.reshape(num_kv_heads, (2 * per_group + 2) * head_dim, *rest)
    query, gate, key, value = torch.split(grouped, [per_group * head_dim, per_group * head_dim, head_dim, head_dim], dim=1)
    q = torch.stack([query.reshape(num_heads, head_dim, *rest), gate.reshape(num_heads, head_dim, *rest)], dim=1)
    return [q.reshape(num_heads * 2 * head_dim, *rest), key.reshape(-1, *rest), value.reshape(-1, *rest)]


def _identity(ts: Sequence[Tensor]) -> List[Tensor]:
    return list(ts)


def _concat(ts: Sequence[Tensor]) -> List[Tensor]:
    return [torch.cat(list(ts), dim=0)]


def _splitter(sizes: Sequence[int]) -> Callable[[Sequence[Tensor]], List[Tensor]]:
    return lambda ts: list(torch.split(ts[0], list(sizes), dim=0))


def _unbind(ts: Sequence[Tensor]) -> List[Tensor]:
    return list(ts[0].unbind(0))


def _stack(ts: Sequence[Tensor]) -> List[Tensor]:
    return [torch.stack(list(ts), dim=0)]


# ------------------------------------------------------------------------------------------------ param maps
@dataclass(frozen=True)
class MegatronParam:
    name: str
    """Whole-model name: global layer and expert index."""
    split: Optional[Split]
    """Tensor-parallel sharding (expert tensor parallel for experts); None: replicated."""
    expert: Optional[int] = None
    """Global expert index of a routed-expert weight (expert-parallel ranks own contiguous ranges)."""


@dataclass(frozen=True)
class ParamMap:
    """HF tensors `hf` <-> Megatron tensors `megatron`, converted together."""

    hf: Tuple[str, ...]
    megatron: Tuple[MegatronParam, ...]
    to_megatron: Callable[[Sequence[Tensor]], List[Tensor]]
    to_hf: Callable[[Sequence[Tensor]], List[Tensor]]
    layer: Optional[int] = None
    """Decoder layer (None: embedding, final norm, output layer)."""


def _one(hf: str, megatron: str, split: Optional[Split], layer: Optional[int] = None) -> ParamMap:
    return ParamMap((hf,), (MegatronParam(megatron, split),), _identity, _identity, layer)


def layer_param_maps(shape: Qwen35Shape, i: int, names: MegatronNames = MegatronNames(),
                     hf_prefix: str = CAUSAL_LM_PREFIX) -> List[ParamMap]:
    """The maps of decoder layer `i`."""
    kind = shape.layer_types[i]
    h, m = f"{hf_prefix}layers.{i}.", names.layer(i)
    col, row = Split(0), Split(1)
    maps = [_one(h + "input_layernorm.weight", names.input_norm(i, kind), None, i)]
    if kind == FULL_ATTENTION:
        nq, nkv, hd = shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim
        a = h + "self_attn."
        maps += [
            ParamMap((a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
                     (MegatronParam(m + "self_attention.linear_qkv.weight", col),),
                     lambda ts: [qkv_to_megatron(*ts, nq, nkv, hd)], lambda ts: qkv_to_hf(ts[0], nq, nkv, hd), i),
            _one(a + "o_proj.weight", m + "self_attention.linear_proj.weight", row, i),
            _one(a + "q_norm.weight", m + "self_attention.q_layernorm.weight", None, i),
            _one(a + "k_norm.weight", m + "self_attention.k_layernorm.weight", None, i),
        ]
    elif kind == LINEAR_ATTENTION:
        qk, v, nv = shape.linear_qk_dim, shape.linear_v_dim, shape.linear_num_value_heads
        a = h + "linear_attn."
        maps += [
            ParamMap(tuple(a + f"in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")),
                     (MegatronParam(m + "self_attention.in_proj.weight", Split(0, (qk, qk, v, v, nv, nv))),),
                     _concat, _splitter((2 * qk + v, v, nv, nv)), i),
            _one(a + "conv1d.weight", m + "self_attention.conv1d.weight", Split(0, (qk, qk, v)), i),
            _one(a + "dt_bias", m + "self_attention.dt_bias", col, i),
            _one(a + "A_log", m + "self_attention.A_log", col, i),
            _one(a + "norm.weight", m + "self_attention.out_norm.weight", None, i),
            _one(a + "out_proj.weight", m + "self_attention.out_proj.weight", row, i),
        ]
    else:
        raise ValueError(f"layer {i}: unknown layer type {kind!r}")
    maps.append(_one(h + "post_attention_layernorm.weight", names.pre_mlp_norm(i, shape.moe), None, i))
    p = h + "mlp."
    if not shape.moe:
        inter = shape.intermediate_size
        maps += [
            ParamMap((p + "gate_proj.weight", p + "up_proj.weight"),
                     (MegatronParam(m + "mlp.linear_fc1.weight", Split(0, (inter, inter))),),
                     _concat, _splitter((inter, inter)), i),
            _one(p + "down_proj.weight", m + "mlp.linear_fc2.weight", row, i),
        ]
        return maps
    inter, shared = shape.moe_intermediate_size, shape.shared_expert_intermediate_size
    experts = range(shape.num_experts)
    maps += [
        _one(p + "gate.weight", m + "mlp.router.weight", None, i),
        ParamMap((p + "experts.gate_up_proj",),
                 tuple(MegatronParam(names.expert(i, e, "linear_fc1"), Split(0, (inter, inter)), e) for e in experts),
                 _unbind, _stack, i),
        ParamMap((p + "experts.down_proj",),
                 tuple(MegatronParam(names.expert(i, e, "linear_fc2"), row, e) for e in experts),
                 _unbind, _stack, i),
        ParamMap((p + "shared_expert.gate_proj.weight", p + "shared_expert.up_proj.weight"),
                 (MegatronParam(m + "mlp.shared_experts.linear_fc1.weight", Split(0, (shared, shared))),),
                 _concat, _splitter((shared, shared)), i),
        _one(p + "shared_expert.down_proj.weight", m + "mlp.shared_experts.linear_fc2.weight", row, i),
        _one(p + "shared_expert_gate.weight", m + "mlp.shared_experts.gate_weight", None, i),
    ]
    return maps


def vision_param_maps(vision_names: Iterable[str]) -> List[ParamMap]:
    """One map per vision-tower parameter (`vision_names`: relative to the tower, as its `named_parameters()`
    gives them): the same tensor on both sides, replicated over tensor parallelism."""
    return [_one(VISION_PREFIX + n, MEGATRON_VISION_PREFIX + n, None) for n in vision_names]


def param_maps(shape: Qwen35Shape, names: MegatronNames = MegatronNames(), hf_prefix: str = CAUSAL_LM_PREFIX,
               layers: Optional[Iterable[int]] = None, pre_process: bool = True,
               post_process: bool = True, vision_names: Sequence[str] = ()) -> List[ParamMap]:
    """The maps of the model, in model order. A pipeline stage passes its `layers` and whether it holds the
    embedding (`pre_process`: and then the vision tower of a VL model, `vision_names`) and the final norm + output
    layer (`post_process`). With tied embeddings the output layer has no weight of its own (HF checkpoints then
    omit lm_head.weight)."""
    maps: List[ParamMap] = []
    if pre_process:
        maps += vision_param_maps(vision_names)
        maps.append(_one(hf_prefix + "embed_tokens.weight", EMBEDDING, Split(0)))
    for i in range(shape.num_layers) if layers is None else layers:
        maps += layer_param_maps(shape, i, names, hf_prefix)
    if post_process:
        maps.append(_one(hf_prefix + "norm.weight", FINAL_NORM, None))
        if not shape.tie_word_embeddings:
            maps.append(_one(LM_HEAD, OUTPUT_LAYER, Split(0)))
    return maps


def tied_output_layer_map(hf_prefix: str = CAUSAL_LM_PREFIX) -> ParamMap:
    """With tied embeddings, a last pipeline stage without the embedding keeps its own copy of the tied weight as
    output_layer.weight: it loads from the HF embedding (and is never exported)."""
    return _one(hf_prefix + "embed_tokens.weight", OUTPUT_LAYER, Split(0))


def megatron_params(maps: Iterable[ParamMap]) -> Dict[str, MegatronParam]:
    return {p.name: p for m in maps for p in m.megatron}


# ------------------------------------------------------------------------------------------ whole-model dicts
def hf_to_megatron(hf: Mapping[str, Tensor], maps: Iterable[ParamMap]) -> Dict[str, Tensor]:
    """Whole-model (TP=1, global expert index) Megatron tensors from HF tensors."""
    out: Dict[str, Tensor] = {}
    for m in maps:
        missing = [n for n in m.hf if n not in hf]
        if missing:
            raise KeyError(f"HF state lacks {missing} (needed for {[p.name for p in m.megatron][:2]}...)")
        for p, t in zip(m.megatron, m.to_megatron([hf[n] for n in m.hf])):
            out[p.name] = t
    return out


def megatron_to_hf(meg: Mapping[str, Tensor], maps: Iterable[ParamMap]) -> Dict[str, Tensor]:
    """HF tensors from whole-model Megatron tensors (inverse of `hf_to_megatron`)."""
    out: Dict[str, Tensor] = {}
    for m in maps:
        for name, t in zip(m.hf, m.to_hf([meg[p.name] for p in m.megatron])):
            out[name] = t
    return out


@dataclass(frozen=True)
class RankLayout:
    """One rank's coordinates in the tensor / expert / expert-tensor parallel groups."""

    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1

    def local_experts(self, num_experts: int) -> range:
        if num_experts % self.ep_size:
            raise ValueError(f"{num_experts} experts do not divide over expert parallel size {self.ep_size}")
        n = num_experts // self.ep_size
        return range(self.ep_rank * n, (self.ep_rank + 1) * n)


def shard_for_rank(meg: Mapping[str, Tensor], params: Mapping[str, MegatronParam], rank: RankLayout,
                   num_experts: int = 0) -> Dict[str, Tensor]:
    """The part of the whole-model Megatron state one rank holds, under the names its model uses (experts
    renumbered from 0 within the rank's expert-parallel range)."""
    local = rank.local_experts(num_experts) if num_experts else range(0)
    out: Dict[str, Tensor] = {}
    for name, t in meg.items():
        p = params[name]
        if p.expert is None:
            out[name] = split_for_rank(t, p.split, rank.tp_rank, rank.tp_size)
        elif p.expert in local:
            out[with_expert_index(name, p.expert - local.start)] = split_for_rank(t, p.split, rank.etp_rank, rank.etp_size)
    return out


def merge_shards(shards: Mapping[RankLayout, Mapping[str, Tensor]], params: Mapping[str, MegatronParam],
                 num_experts: int = 0) -> Dict[str, Tensor]:
    """Whole-model Megatron tensors from every rank's shard (inverse of `shard_for_rank`). `shards` must cover
    every (tp) rank for non-expert weights and every (ep, etp) pair for expert weights."""
    out: Dict[str, Tensor] = {}
    for name, p in params.items():
        if p.expert is None:
            by_rank = {r.tp_rank: sd[name] for r, sd in shards.items()}
            out[name] = merge_ranks([by_rank[k] for k in sorted(by_rank)], p.split)
            continue
        by_rank: Dict[int, Tensor] = {}
        for r, sd in shards.items():
            local = r.local_experts(num_experts)
            if p.expert in local:
                by_rank[r.etp_rank] = sd[with_expert_index(name, p.expert - local.start)]
        out[name] = merge_ranks([by_rank[k] for k in sorted(by_rank)], p.split)
    return out


# ------------------------------------------------------------------------------------------------- exporting
def tensor_bytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def iter_buckets(named: Iterable[Tuple[str, Tensor]], bucket_mb: float) -> Iterator[List[Tuple[str, Tensor]]]:
    """Group (name, tensor) pairs, in order, into lists of about `bucket_mb` MiB: a bucket closes before the
    tensor that would overflow it; a tensor larger than a bucket travels alone."""
    limit = int(bucket_mb * 2**20)
    bucket: List[Tuple[str, Tensor]] = []
    size = 0
    for name, t in named:
        n = tensor_bytes(t)
        if bucket and size + n > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


def export_hf(maps: Iterable[ParamMap], fetch: Callable[[ParamMap], Sequence[Tensor]], bucket_mb: float,
              dtype: Optional[torch.dtype] = None) -> Iterator[List[Tuple[str, Tensor]]]:
    """HF-named full tensors in buckets of about `bucket_mb`, one ParamMap at a time: `fetch(m)` returns the
    whole-model Megatron tensors of `m.megatron` (a dict lookup, or the engine's TP/EP/PP gather), so at most
    one map's tensors plus one bucket are alive. `dtype` casts on the way out (e.g. an fp32 router to bf16)."""

    def named() -> Iterator[Tuple[str, Tensor]]:
        for m in maps:
            for name, t in zip(m.hf, m.to_hf(list(fetch(m)))):
                yield name, (t if dtype is None else t.to(dtype)).contiguous()

    return iter_buckets(named(), bucket_mb)


# ------------------------------------------------------------------------------------ HF checkpoint naming
_PER_EXPERT_RE = re.compile(r"^(.*\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def canonical_hf_name(name: str, hf_prefix: str = CAUSAL_LM_PREFIX) -> Optional[str]:
    """A checkpoint tensor name as `param_maps(hf_prefix=...)` names it (vision-tower tensors keep their
    `model.visual.` name), or None for tensors the engine never trains (MTP layers). Official checkpoints use the
    VL prefix `model.language_model.` for the text model."""
    if name.startswith("mtp."):
        return None
    if name.startswith(VISION_PREFIX):
        return name
    for prefix in (VL_PREFIX, CAUSAL_LM_PREFIX):
        if name.startswith(prefix):
            return hf_prefix + name[len(prefix):]
    return name


def fuse_per_expert(hf: Mapping[str, Tensor]) -> Dict[str, Tensor]:
    """Checkpoints that store experts one by one (`experts.{e}.gate_proj.weight`, ...) in the fused transformers
    layout (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]); other tensors pass through."""
    out: Dict[str, Tensor] = {}
    experts: Dict[str, Dict[str, Dict[int, Tensor]]] = {}
    for name, t in hf.items():
        m = _PER_EXPERT_RE.match(name)
        if m is None:
            out[name] = t
        else:
            experts.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = t
    for prefix, parts in experts.items():
        count = len(parts["down_proj"])
        out[prefix + "gate_up_proj"] = torch.stack(
            [torch.cat([parts["gate_proj"][e], parts["up_proj"][e]], dim=0) for e in range(count)])
        out[prefix + "down_proj"] = torch.stack([parts["down_proj"][e] for e in range(count)])
    return out
