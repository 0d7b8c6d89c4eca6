"""HF <-> Megatron layout of Qwen3.5 (qwen35rl.engines.megatron.mapping): bitwise round trips through TP and EP
sharding, and the fused layouts checked against megatron-core's own split rules re-stated on small tensors.
No megatron import: runs on CPU whatever is installed."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
import torch.nn.functional as F

from qwen35rl.config.compose import compose
from qwen35rl.engines.megatron import mapping as mp
from qwen35rl.models.build import build_model


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bits, so -0.0 vs 0.0 and NaN payloads count as differences."""
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _assert_bitwise(a, b):
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(_bits(a[k]), _bits(b[k])), k


def _hf_state(model_name: str, tie: bool):
    m = compose([f"model={model_name}", f"model.tie_word_embeddings={str(tie).lower()}"]).model
    model = build_model(m, dtype=torch.bfloat16, seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norms start at 0 / 1: make every tensor carry distinct bits
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    sd = dict(model.state_dict())
    if tie:  # checkpoints omit the tied head
        assert sd["lm_head.weight"].data_ptr() == sd["model.embed_tokens.weight"].data_ptr()
        del sd["lm_head.weight"]
    return m, model, sd


CASES = [("qwen3_5_tiny", True), ("qwen3_5_tiny", False), ("qwen3_5_tiny_moe", False)]


@pytest.fixture(scope="module", params=CASES, ids=[f"{n}-{'tied' if t else 'untied'}" for n, t in CASES])
def case(request):
    name, tie = request.param
    m, model, sd = _hf_state(name, tie)
    shape = mp.Qwen35Shape.from_model_config(m)
    assert shape == mp.Qwen35Shape.from_hf_config(model.config)
    return shape, sd


@pytest.mark.parametrize("names", [mp.MegatronNames(), mp.MegatronNames(fused_input_norms=True, grouped_experts=True)],
                         ids=["local", "te"])
def test_round_trip_is_bitwise_on_every_tensor(case, names):
    shape, hf = case
    maps = mp.param_maps(shape, names)
    meg = mp.hf_to_megatron(hf, maps)
    assert len(meg) == len(mp.megatron_params(maps))
    _assert_bitwise(mp.megatron_to_hf(meg, maps), hf)
    # every HF tensor is used exactly once, and no +-1 shift happened on any norm
    assert sorted(n for m in maps for n in m.hf) == sorted(hf)
    for m in maps:
        if len(m.hf) == 1 and len(m.megatron) == 1 and m.hf[0].endswith("norm.weight"):
            assert torch.equal(_bits(meg[m.megatron[0].name]), _bits(hf[m.hf[0]]))


def test_megatron_names_and_shapes(case):
    shape, hf = case
    meg = mp.hf_to_megatron(hf, mp.param_maps(shape))
    h, qk, v = shape.hidden_size, shape.linear_qk_dim, shape.linear_v_dim
    nv = shape.linear_num_value_heads
    full = shape.layer_types.index(mp.FULL_ATTENTION)
    lin = shape.layer_types.index(mp.LINEAR_ATTENTION)
    qkv_rows = (2 * shape.num_attention_heads + 2 * shape.num_key_value_heads) * shape.head_dim
    assert meg[f"decoder.layers.{full}.self_attention.linear_qkv.weight"].shape == (qkv_rows, h)
    assert meg[f"decoder.layers.{lin}.self_attention.in_proj.weight"].shape == (2 * qk + 2 * v + 2 * nv, h)
    assert meg[f"decoder.layers.{lin}.self_attention.conv1d.weight"].shape == (2 * qk + v, 1, shape.linear_conv_kernel_dim)
    assert (mp.OUTPUT_LAYER in meg) != shape.tie_word_embeddings
    assert {mp.EMBEDDING, mp.FINAL_NORM} <= meg.keys()
    if shape.moe:
        e = shape.num_experts - 1
        fc1 = meg[f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc1.weight"]
        assert fc1.shape == (2 * shape.moe_intermediate_size, h)
        assert torch.equal(fc1, hf["model.layers.0.mlp.experts.gate_up_proj"][e])
        assert meg["decoder.layers.0.mlp.shared_experts.gate_weight"].shape == (1, h)
        assert meg["decoder.layers.0.mlp.router.weight"].shape == (shape.num_experts, h)


@pytest.mark.parametrize("tp,ep,etp", [(2, 1, 1), (1, 2, 1), (2, 2, 2), (2, 2, 1)])
def test_tp_and_ep_shard_merge_is_bitwise(case, tp, ep, etp):
    shape, hf = case
    if not shape.moe and (ep, etp) != (1, 1):
        pytest.skip("expert parallel needs experts")
    maps = mp.param_maps(shape)
    meg = mp.hf_to_megatron(hf, maps)
    params = mp.megatron_params(maps)
    # megatron-core lays EP x ETP over the same ranks as TP x DP; enumerate every coordinate a rank can have
    ranks = [mp.RankLayout(t, tp, e, ep, x, etp) for t in range(tp) for e in range(ep) for x in range(etp)]
    shards = {r: mp.shard_for_rank(meg, params, r, shape.num_experts) for r in ranks}
    for r, sd in shards.items():
        qkv = next(k for k in sd if k.endswith("linear_qkv.weight"))
        assert sd[qkv].shape[0] == meg[qkv].shape[0] // tp
        if shape.moe:
            local = [k for k in sd if ".local_experts." in k and k.startswith("decoder.layers.0.") and "fc1" in k]
            assert len(local) == shape.num_experts // ep
            assert sd[local[0]].shape[0] == 2 * shape.moe_intermediate_size // etp
    merged = mp.merge_shards(shards, params, shape.num_experts)
    _assert_bitwise(merged, meg)
    _assert_bitwise(mp.megatron_to_hf(merged, maps), hf)


def test_pipeline_stage_maps_cover_the_model_once(case):
    shape, hf = case
    maps = mp.param_maps(shape)
    first = mp.param_maps(shape, layers=range(0, 2), post_process=False)
    last = mp.param_maps(shape, layers=range(2, shape.num_layers), pre_process=False)
    assert sorted(n for m in first + last for n in m.hf) == sorted(n for m in maps for n in m.hf)


def test_export_buckets_in_order_and_bounded(case):
    shape, hf = case
    maps = mp.param_maps(shape)
    meg = mp.hf_to_megatron(hf, maps)
    bucket_mb = 0.05
    buckets = list(mp.export_hf(maps, lambda m: [meg[p.name] for p in m.megatron], bucket_mb))
    assert len(buckets) > 2
    for b in buckets:
        size = sum(mp.tensor_bytes(t) for _, t in b)
        assert size <= bucket_mb * 2**20 or len(b) == 1
    out = [(n, t) for b in buckets for n, t in b]
    assert [n for n, _ in out] == [n for m in maps for n in m.hf]
    _assert_bitwise(dict(out), hf)


# ----------------------------------------------------------------------------------- layouts vs megatron rules
# The reference functions below re-state, on small tensors, how megatron-core (0.16-0.19) splits the output of its
# fused projections on one TP rank (SelfAttention.get_query_key_value_tensors, GatedDeltaNet.forward, MLP.forward).

def _megatron_split_qkv(mixed_full, rank, tp, nq, ng, hd):
    """SelfAttention with attention_output_gate: rank `rank` of `tp` -> its (query, gate, key, value) heads."""
    per_group = nq // ng
    if ng < tp:  # megatron all-gathers, then takes its query group and its share of that group's query heads
        size = mixed_full.shape[-1] // ng
        idx = rank // (tp // ng)
        mixed = mixed_full[..., idx * size:(idx + 1) * size]
        groups_local = 1
    else:
        mixed = mixed_full.chunk(tp, dim=-1)[rank]
        groups_local = ng // tp
    mixed = mixed.reshape(*mixed.shape[:-1], groups_local, (2 * per_group + 2) * hd)
    q, g, k, v = torch.split(mixed, [per_group * hd, per_group * hd, hd, hd], dim=-1)
    q = q.reshape(*q.shape[:-2], -1, hd)
    g = g.reshape(*g.shape[:-2], -1, hd)
    if ng < tp:
        share = (nq // tp)
        idx = rank % (tp // ng)
        q, g = q[..., idx * share:(idx + 1) * share, :], g[..., idx * share:(idx + 1) * share, :]
    return q, g, k, v


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_fused_qkv_matches_megatron_split(tp):
    nq, ng, hd, h = 4, 2, 3, 5
    g = torch.Generator().manual_seed(0)
    q_proj = torch.randn(nq * 2 * hd, h, generator=g)
    k_proj, v_proj = torch.randn(ng * hd, h, generator=g), torch.randn(ng * hd, h, generator=g)
    x = torch.randn(7, h, generator=g)
    # transformers Qwen3_5Attention: per head [q | gate], then kv heads
    q_hf, gate_hf = torch.chunk((x @ q_proj.T).view(7, nq, 2 * hd), 2, dim=-1)
    k_hf, v_hf = (x @ k_proj.T).view(7, ng, hd), (x @ v_proj.T).view(7, ng, hd)
    fused = mp.qkv_to_megatron(q_proj, k_proj, v_proj, nq, ng, hd)
    assert [torch.equal(a, b) for a, b in zip(mp.qkv_to_hf(fused, nq, ng, hd), (q_proj, k_proj, v_proj))] == [True] * 3
    shards = [mp.split_for_rank(fused, mp.Split(0), r, tp) for r in range(tp)]
    full_out = torch.cat([x @ s.T for s in shards], dim=-1)  # what an all-gather would see
    for r in range(tp):
        q, gate, k, v = _megatron_split_qkv(full_out, r, tp, nq, ng, hd)
        heads = slice(r * nq // tp, (r + 1) * nq // tp)
        kv = slice(r * ng // tp, (r + 1) * ng // tp) if ng >= tp else slice(r // (tp // ng), r // (tp // ng) + 1)
        torch.testing.assert_close(q, q_hf[:, heads])
        torch.testing.assert_close(gate, gate_hf[:, heads])
        torch.testing.assert_close(k, k_hf[:, kv])
        torch.testing.assert_close(v, v_hf[:, kv])


@pytest.mark.parametrize("tp", [1, 2])
def test_gdn_in_proj_and_conv_match_megatron_split(tp):
    nk, nv, dk, dv, h, kernel = 2, 4, 3, 2, 5, 4
    qk, vd = nk * dk, nv * dv
    shape = mp.Qwen35Shape(num_layers=1, hidden_size=h, vocab_size=8, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=4, linear_num_key_heads=nk, linear_num_value_heads=nv, linear_key_head_dim=dk,
                           linear_value_head_dim=dv, linear_conv_kernel_dim=kernel,
                           layer_types=(mp.LINEAR_ATTENTION,), intermediate_size=6)
    g = torch.Generator().manual_seed(0)
    hf = {f"model.layers.0.linear_attn.in_proj_{p}.weight": torch.randn(n, h, generator=g)
          for p, n in (("qkv", 2 * qk + vd), ("z", vd), ("b", nv), ("a", nv))}
    hf["model.layers.0.linear_attn.conv1d.weight"] = torch.randn(2 * qk + vd, 1, kernel, generator=g)
    maps = [m for m in mp.layer_param_maps(shape, 0) if "in_proj" in m.hf[0] or "conv1d" in m.hf[0]]
    meg = mp.hf_to_megatron(hf, maps)
    params = mp.megatron_params(maps)
    x = torch.randn(7, h, generator=g)
    q_hf, k_hf, v_hf = torch.split(x @ hf["model.layers.0.linear_attn.in_proj_qkv.weight"].T, [qk, qk, vd], dim=-1)
    z_hf, b_hf, a_hf = (x @ hf[f"model.layers.0.linear_attn.in_proj_{p}.weight"].T for p in ("z", "b", "a"))
    conv_q, conv_k, conv_v = torch.split(hf["model.layers.0.linear_attn.conv1d.weight"], [qk, qk, vd], dim=0)
    for r in range(tp):
        local = mp.shard_for_rank(meg, params, mp.RankLayout(tp_rank=r, tp_size=tp))
        out = x @ local["decoder.layers.0.self_attention.in_proj.weight"].T
        # GatedDeltaNet.forward: [qkv | z | beta | alpha] local sizes, then qkv -> [q | k | v] after the conv
        qkv, z, b, a = torch.split(out, [(2 * qk + vd) // tp, vd // tp, nv // tp, nv // tp], dim=-1)
        q, k, v = torch.split(qkv, [qk // tp, qk // tp, vd // tp], dim=-1)
        kh, vh = slice(r * qk // tp, (r + 1) * qk // tp), slice(r * vd // tp, (r + 1) * vd // tp)
        nh = slice(r * nv // tp, (r + 1) * nv // tp)
        for got, want in ((q, q_hf[:, kh]), (k, k_hf[:, kh]), (v, v_hf[:, vh]), (z, z_hf[:, vh]),
                          (b, b_hf[:, nh]), (a, a_hf[:, nh])):
            torch.testing.assert_close(got, want)
        conv = local["decoder.layers.0.self_attention.conv1d.weight"]
        assert torch.equal(conv, torch.cat([conv_q[kh], conv_k[kh], conv_v[vh]]))


@pytest.mark.parametrize("tp", [1, 2])
def test_gated_mlp_fc1_matches_megatron_split(tp):
    inter, h = 4, 3
    g = torch.Generator().manual_seed(0)
    gate, up, x = torch.randn(inter, h, generator=g), torch.randn(inter, h, generator=g), torch.randn(5, h, generator=g)
    fc1 = torch.cat([gate, up])
    for r in range(tp):
        local = mp.split_for_rank(fc1, mp.Split(0, (inter, inter)), r, tp)
        g_local, u_local = torch.chunk(x @ local.T, 2, dim=-1)  # MLP.forward with gated_linear_unit
        rows = slice(r * inter // tp, (r + 1) * inter // tp)
        torch.testing.assert_close(F.silu(g_local) * u_local, (F.silu(x @ gate.T) * (x @ up.T))[:, rows])


def test_name_helpers():
    names = mp.MegatronNames()
    seq = names.expert(3, 17, "linear_fc1")
    grouped = mp.MegatronNames(grouped_experts=True).expert(3, 17, "linear_fc2")
    assert seq == "decoder.layers.3.mlp.experts.local_experts.17.linear_fc1.weight"
    assert grouped == "decoder.layers.3.mlp.experts.linear_fc2.weight17"
    assert mp.expert_index(seq) == 17 and mp.expert_index(grouped) == 17
    assert mp.with_expert_index(seq, 1) == "decoder.layers.3.mlp.experts.local_experts.1.linear_fc1.weight"
    assert mp.with_expert_index(grouped, 2) == "decoder.layers.3.mlp.experts.linear_fc2.weight2"
    assert mp.expert_index("decoder.layers.3.mlp.shared_experts.linear_fc1.weight") is None
    assert mp.layer_index(seq) == 3 and mp.with_layer_index(seq, 0).startswith("decoder.layers.0.mlp")
    assert mp.layer_index(mp.EMBEDDING) is None


def test_checkpoint_names_and_per_expert_storage():
    assert mp.canonical_hf_name("model.language_model.layers.0.mlp.gate.weight") == "model.layers.0.mlp.gate.weight"
    assert mp.canonical_hf_name("model.layers.0.mlp.gate.weight", mp.VL_PREFIX) == "model.language_model.layers.0.mlp.gate.weight"
    assert mp.canonical_hf_name("model.visual.blocks.0.attn.qkv.weight") == "model.visual.blocks.0.attn.qkv.weight"
    assert mp.canonical_hf_name("mtp.fc.weight") is None
    assert mp.canonical_hf_name("lm_head.weight") == "lm_head.weight"
    g = torch.Generator().manual_seed(0)
    per = {}
    for e in range(3):
        for p, s in (("gate_proj", (2, 4)), ("up_proj", (2, 4)), ("down_proj", (4, 2))):
            per[f"model.layers.1.mlp.experts.{e}.{p}.weight"] = torch.randn(*s, generator=g)
    per["model.layers.1.mlp.gate.weight"] = torch.randn(3, 4, generator=g)
    fused = mp.fuse_per_expert(per)
    assert set(fused) == {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.gate_up_proj",
                          "model.layers.1.mlp.experts.down_proj"}
    assert fused["model.layers.1.mlp.experts.gate_up_proj"].shape == (3, 4, 4)
    assert torch.equal(fused["model.layers.1.mlp.experts.gate_up_proj"][2, 2:], per["model.layers.1.mlp.experts.2.up_proj.weight"])
    assert torch.equal(fused["model.layers.1.mlp.experts.down_proj"][1], per["model.layers.1.mlp.experts.1.down_proj.weight"])


def test_uneven_tp_is_refused():
    with pytest.raises(ValueError, match="cannot shard"):
        mp.split_for_rank(torch.zeros(6, 2), mp.Split(0, (3, 3)), 0, 2)


@pytest.mark.parametrize("model_name", ["qwen3_5_tiny_vl", "qwen3_5_tiny_vl_moe"])
def test_vl_checkpoint_round_trip_is_bitwise(model_name):
    """A Qwen3_5[Moe]ForConditionalGeneration state: HF -> Megatron (TP2 x EP2 shards) -> HF gives every tensor
    back bit for bit, vision tower included, under the VL names; the tower sits on the first stage only."""
    m = compose([f"model={model_name}"]).model
    model = build_model(m, dtype=torch.bfloat16, seed=0, text_only=False)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    hf = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied: saved once
    vision = [n[len(mp.VISION_PREFIX):] for n in hf if n.startswith(mp.VISION_PREFIX)]
    assert vision
    shape = mp.Qwen35Shape.from_hf_config(model.config)
    maps = mp.param_maps(shape, hf_prefix=mp.VL_PREFIX, vision_names=vision)
    assert sorted(n for mm in maps for n in mm.hf) == sorted(hf)
    meg = mp.hf_to_megatron(hf, maps)
    params = mp.megatron_params(maps)
    assert {mp.MEGATRON_VISION_PREFIX + n for n in vision} <= meg.keys()
    ep = 2 if shape.moe else 1
    ranks = [mp.RankLayout(t, 2, e, ep) for t in range(2) for e in range(ep)]
    shards = {r: mp.shard_for_rank(meg, params, r, shape.num_experts) for r in ranks}
    for sd in shards.values():  # replicated over TP: every rank holds the whole tower
        assert all(torch.equal(sd[mp.MEGATRON_VISION_PREFIX + n], meg[mp.MEGATRON_VISION_PREFIX + n]) for n in vision)
    _assert_bitwise(mp.megatron_to_hf(mp.merge_shards(shards, params, shape.num_experts), maps), hf)
    later = mp.param_maps(shape, hf_prefix=mp.VL_PREFIX, vision_names=vision, layers=range(2, 4), pre_process=False)
    assert not any(n.startswith(mp.VISION_PREFIX) for mm in later for n in mm.hf)
    # checkpoint names: the tower keeps its name, the text model maps onto the causal-LM names the engine loads
    assert mp.canonical_hf_name(mp.VISION_PREFIX + vision[0]) == mp.VISION_PREFIX + vision[0]
