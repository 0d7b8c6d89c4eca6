"""Per-device memory terms against hand-computed values, and the ten reference runs fit."""
import math
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from qwen35rl.config import memory as M
from qwen35rl.config import params as P
from qwen35rl.config.compose import compose
from qwen35rl.config.layout import Layout, derive_layout
from tests.config.trees import updated

GIB = 2 ** 30
_trees = {}


def tree(overrides, **updates):
    key = tuple(overrides)
    if key not in _trees:
        _trees[key] = M.as_tree(compose(list(overrides)))
    return updated(_trees[key], **updates)


MG35 = ["model=qwen3_5_35b_a3b", "hw=gpu_1node", "backend=megatron"]
MG397 = ["model=qwen3_5_397b_a17b", "hw=a3_16node", "backend=megatron"]
FSDP27 = ["model=qwen3_5_27b", "hw=gpu_1node", "backend=fsdp"]
TINY = []


def layout(backend="megatron", world=64, tp=2, pp=2, cp=1, ep=8, etp=1, vpp=None, fsdp_size=-1, sp=1,
           rtp=1, rdp=None, rep=1):
    dp = world // (tp * pp * cp) if backend == "megatron" else world // sp
    return Layout(world=world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, dp=dp, vpp=vpp,
                  fsdp_size=world if fsdp_size == -1 else fsdp_size, sp=sp, rollout_tp=rtp,
                  rollout_dp=rdp if rdp is not None else world // rtp, rollout_ep=rep, backend=backend)


SHARD = M.TrainShard(dense=1e9, expert=2e9, layers=["linear", "full"], largest_unit=5e8, root=1e9)


def test_capacity():
    """The allocated peak may fill what the runtime leaves, less the caching allocator's slack on top of it."""
    assert M.capacity_gib(tree(MG35)) == pytest.approx((80e9 / GIB - 3.0) / 1.16)  # GPU: 16% slack (H200)
    assert M.capacity_gib(tree(MG397)) == pytest.approx((64e9 / GIB - 3.0) / 1.16)
    cfg = tree(MG35)
    cfg["hw"]["allocator_slack"] = 0.0
    assert M.capacity_gib(cfg) == pytest.approx(80e9 / GIB - 3.0)


def test_the_allocator_slack_covers_the_measured_reserved_bytes():
    """Reserved over allocated at the training peak of the H200 calibration (tests/config/data): the cuda
    platform's slack is at least the largest measured share, so an estimate that fits leaves room for it."""
    import json
    from pathlib import Path

    fixture = json.loads((Path(__file__).parent / "data" / "memory_h200_2026_11_29b.json").read_text())
    shares = [c["train_reserved_gib"] / c["train_allocated_gib"] - 1 for c in fixture["cases"]]
    assert shares and max(shares) <= float(tree(MG35)["hw"]["allocator_slack"])


def test_micro_batch_shapes():
    t = tree(MG35, backend__micro_batch_size_per_device=2)
    assert M.micro_batch_tokens(t) == 2 * (1024 + 2048)
    assert M.micro_batch_tokens(tree(MG35, backend__dynamic_batch_size=True)) == 4096
    lay = layout(world=8, tp=2, pp=1)  # dp 4
    assert M.micro_batches_per_mini_batch(tree(MG35), lay) == 32 * 5 // 4  # 40 micro batches of 1
    assert M.micro_batches_per_mini_batch(t, lay) == 20
    # dynamic: 40 responses x 3072 tokens packed into 4096-token micro batches
    assert M.micro_batches_per_mini_batch(tree(MG35, backend__dynamic_batch_size=True), lay) == math.ceil(40 * 3072 / 4096)


def test_megatron_weights_grads_optimizer():
    t, lay = tree(MG35), layout(world=64, tp=2, pp=2, ep=8)  # dp 16, edp = 64 / (2*8*1) = 4
    assert M.train_weights_gib(t, lay, SHARD) == pytest.approx(3e9 * 2 / GIB)
    assert M.train_grads_gib(t, lay, SHARD) == pytest.approx(3e9 * 4 / GIB)
    states = 1e9 / 16 + 2e9 / 4
    on = tree(MG35, backend__optimizer_cpu_offload=False)
    assert M.optimizer_states_gib(on, lay, SHARD) == pytest.approx(states * 12 / GIB)
    part = tree(MG35, backend__optimizer_offload_fraction=0.75)
    assert M.optimizer_states_gib(part, lay, SHARD) == pytest.approx(states * 12 * 0.25 / GIB)
    plain = tree(MG35, backend__optimizer_cpu_offload=False, backend__use_distributed_optimizer=False)
    assert M.optimizer_states_gib(plain, lay, SHARD) == pytest.approx(3e9 * 12 / GIB)


NO_OFFLOAD = dict(backend__offload_policy=False, backend__param_offload=False, backend__optimizer_offload=False)


def test_fsdp_states_and_gathered_blocks():
    lay = layout("fsdp", world=8, tp=1, pp=1, ep=1)
    resident = tree(FSDP27, **NO_OFFLOAD)  # the recipe turns offload_policy, param_offload, optimizer_offload on
    assert M.train_weights_gib(resident, lay, SHARD) == pytest.approx(3e9 * 4 / GIB)
    assert M.optimizer_states_gib(resident, lay, SHARD) == pytest.approx(3e9 * 8 / GIB)
    # gradients at the backward's peak are those of earlier micro batches: 16 x 5 responses / dp 8 = 10 micro batches
    assert M.train_grads_gib(resident, lay, SHARD) == pytest.approx(3e9 * 4 / GIB)
    single = tree(FSDP27, **NO_OFFLOAD, algorithm__mini_batch_size=8, rollout__n=1)  # 8 responses / dp 8: one
    assert M.train_grads_gib(single, lay, SHARD) == 0
    # the FSDP engine turns any one offload flag into CPUOffloadPolicy: everything of the policy on the host
    for flag in ("offload_policy", "param_offload", "optimizer_offload", "grad_offload"):
        on_host = tree(FSDP27, **{**NO_OFFLOAD, f"backend__{flag}": True})
        states = (M.train_weights_gib, M.train_grads_gib, M.optimizer_states_gib)
        assert [f(on_host, lay, SHARD) for f in states] == [0, 0, 0]
    # bf16 copies (cuda: bf16 compute): the root unit stays gathered, plus the layer computed and the one prefetched
    assert M.fsdp_gathered_params_gib(resident, lay, SHARD) == pytest.approx((1e9 + 2 * 5e8) * 2 / GIB)
    keep = tree(FSDP27, backend__reshard_after_forward=False)
    assert M.fsdp_gathered_params_gib(keep, lay, SHARD) == pytest.approx(3e9 * 8 * 2 / GIB)


def test_fsdp_optimizer_step():
    lay = layout("fsdp", world=8, tp=1, pp=1, ep=1)
    resident = tree(FSDP27, **NO_OFFLOAD)
    # every local fp32 gradient plus AdamW's sqrt of the second moments (4 B per local parameter), which exceeds
    # the grad norm's fp64 copy and square of the largest shard (the 248320 x 5120 lm_head / 8, 16 B per element)
    step = (3e9 * 4 + max(248320 * 5120 / 8 * 16, 3e9 * 4)) / GIB
    assert M.optimizer_step_gib(resident, lay, SHARD, backward_set=0.0) == pytest.approx(step)
    assert M.optimizer_step_gib(resident, lay, SHARD, backward_set=step - 1.0) == pytest.approx(1.0)
    assert M.optimizer_step_gib(resident, lay, SHARD, backward_set=step + 1.0) == 0
    small = M.TrainShard(dense=1e8, expert=0, layers=[], largest_unit=0)  # few parameters: the grad norm's copies win
    assert M.optimizer_step_gib(resident, lay, small, 0.0) == pytest.approx((1e8 * 4 + 248320 * 5120 / 8 * 16) / GIB)
    assert M.optimizer_step_gib(tree(FSDP27), lay, SHARD, 0.0) == 0  # offloaded: the step runs on the host


def test_megatron_optimizer_step():
    """torch's foreach Adam allocates a sqrt of the second moments (a third of the 12 B of on-device states); the
    gradient buffer outlives the backward, so only the rest of the backward's set is free for it."""
    t, lay = tree(MG35, backend__optimizer_cpu_offload=False), layout()
    sqrt = M.optimizer_states_gib(t, lay, SHARD) / 3
    grads = M.train_grads_gib(t, lay, SHARD)
    assert sqrt > 0 and grads > 0
    assert M.optimizer_step_gib(t, lay, SHARD, backward_set=grads) == pytest.approx(sqrt)
    assert M.optimizer_step_gib(t, lay, SHARD, backward_set=grads + sqrt - 1.0) == pytest.approx(1.0)
    assert M.optimizer_step_gib(t, lay, SHARD, backward_set=grads + sqrt + 1.0) == 0
    host = tree(MG35, backend__optimizer_cpu_offload=True, backend__optimizer_offload_fraction=1.0)
    assert M.optimizer_step_gib(host, lay, SHARD, backward_set=M.train_grads_gib(host, lay, SHARD)) == 0


def test_train_shard_counts():
    t = tree(MG397)
    lay = derive_layout(t)  # TP2 PP4 EP64 ETP1: 15 layers per stage
    shard = M.train_shard(t, lay)
    m = t["model"]
    expert_layer = 512 * 3 * 4096 * 1024
    assert shard.expert == pytest.approx(15 * expert_layer / 64)
    kinds = P.layer_kinds(m)[:15]  # stage 0 (and every stage: 15 = 3 x [l,l,l,f] + 3 linear ... same mix)
    first = P.layers_params(m, kinds) - 15 * expert_layer + 248320 * 4096
    last = P.layers_params(m, P.layer_kinds(m)[45:]) - 15 * expert_layer + 248320 * 4096 + 4096
    assert shard.dense == pytest.approx(max(first, last) / 2)
    fsdp = tree(FSDP27)
    s = M.train_shard(fsdp, derive_layout(fsdp))
    count = P.count_params(fsdp["model"])
    assert (s.dense + s.expert) * 8 == pytest.approx(count.text)  # text data: the text model, no vision tower
    assert s.root == 2 * 248320 * 5120 + 5120  # the root unit: untied embedding, lm_head and final norm
    m27 = fsdp["model"]
    assert s.largest_unit == max(P.layer_dense_params(m27, k) for k in ("linear", "full"))
    images = tree(FSDP27, data__has_images=True)
    s = M.train_shard(images, derive_layout(images))
    assert (s.dense + s.expert) * 8 == pytest.approx(count.total)  # image data: the VL model


def test_layer_activations_per_token():
    m = tree(TINY)["model"]  # h 128, 4 heads / 2 KV of 32, GDN 2 key / 4 value heads of 64, MLP 256
    assert M.layer_activation_elems_per_token(m, "full") == (2 * 128 + 5 * 4 * 32 + 3 * 2 * 32) + (2 * 128 + 3 * 256)
    conv_dim, value_dim = 2 * 2 * 64 + 4 * 64, 4 * 64
    assert M.layer_activation_elems_per_token(m, "linear") == (2 * 128 + 2 * conv_dim + 3 * value_dim + 2 * 4) + (
        2 * 128 + 3 * 256)
    moe = tree(["model=qwen3_5_tiny_moe"])["model"]  # 8 experts, top-2 of 64, shared 64
    assert M.layer_activation_elems_per_token(moe, "full") == (2 * 128 + 5 * 4 * 32 + 3 * 2 * 32) + (
        2 * 128 + 2 * 8 + 2 * 2 * 128 + 3 * 2 * 64 + 3 * 64)


def test_hf_layer_bytes_per_token():
    m = tree(TINY)["model"]  # h 128, MLP 256, 4 heads / 2 KV of 32 (output gate), GDN 2 key / 4 value heads of 64
    # two fp32-computing RMSNorms (fp32 copy, fp32 normed, output), the layer output, the MLP's gate/up/silu/product
    around = 2 * (4 + 4 + 2) * 128 + 2 * 128 + 2 * 4 * 256
    assert M.norm_mlp_bytes_per_token(m, 2) == around
    # bf16: rotated q, attention output, its copy, sigmoid gate, gated product; rotated k, v. fp32: q/k norms, lse
    attention = 2 * (5 * 4 * 32 + 2 * 2 * 32) + 4 * (2 * 4 * 32 + 2 * 2 * 32 + 4)
    assert M.hf_layer_bytes_per_token(m, "full", 2, "torch") == attention + around
    conv_dim, value_dim, qk = 2 * 2 * 64 + 4 * 64, 4 * 64, 4 * 64  # the fallback expands q, k to the 4 value heads
    fallback = (2 * (2 * conv_dim + 3 * value_dim)
                + 4 * (8 * qk + 6 * value_dim + 5 * 4 * 64 + 4 * 64 * 64 / 64 + 10 * 4))
    assert M.hf_layer_bytes_per_token(m, "linear", 2, "torch") == fallback + around
    # fla: conv input, normed q and k (2 key heads), contiguous v, beta, A (64 per value head) + the gated norm as
    # in the fallback (3 value-sized in bf16 and in fp32); g and rstd in fp32
    fla = 2 * (conv_dim + 2 * 2 * 64 + 4 * value_dim + 4 * 64 + 4) + 4 * (3 * value_dim + 2 * 2 + 3 * 4)
    assert M.hf_layer_bytes_per_token(m, "linear", 2, "fla") == fla + around
    assert M.gdn_kernels(tree(TINY)) == "torch" and M.gdn_kernels(tree(FSDP27)) == "fla"


def test_fsdp_activations_head_and_recompute():
    micro4 = dict(backend__micro_batch_size_per_device=4)  # 4 x (32 + 8) = 160 tokens, 32 of them response tokens
    ckpt = tree(TINY, **micro4, backend__gradient_checkpointing=True)  # cpu: fp32 compute, torch GDN
    full = tree(TINY, **micro4, backend__gradient_checkpointing=False)
    lay = derive_layout(ckpt)
    shard = M.train_shard(ckpt, lay)
    m = ckpt["model"]
    per_layer = sum(M.hf_layer_bytes_per_token(m, k, 4, "torch") for k in P.layer_kinds(m))
    final_norm, head_input = (4 + 4 + 4) * 128, 32 * 4 * 128
    # checkpointing: each of the 4 layers keeps its input; without it every layer's tensors
    saved = {"ckpt": 160 * (4 * 4 * 128 + final_norm) + head_input, "full": 160 * (per_layer + final_norm) + head_input}
    assert M.activations_gib(ckpt, lay, shard, "torch") == pytest.approx(saved["ckpt"] / GIB)
    assert M.activations_gib(full, lay, shard, "torch") == pytest.approx(saved["full"] / GIB)
    # the head's backward: the fp32 [V, h] lm_head gradient and three fp32 [chunk, V] tensors (32 response tokens)
    head = (320 * 128 * 4 + 3 * 32 * 320 * 4) / GIB
    assert M.logits_gib(ckpt, lay) == pytest.approx(head)
    # a recomputed layer (the widest: GDN) while the lm_head's gradient waits in the compute dtype
    widest = M.hf_layer_bytes_per_token(m, "linear", 4, "torch")
    assert M.recomputed_layer_gib(ckpt, lay, shard, "torch") == pytest.approx((160 * widest + 320 * 128 * 4) / GIB)
    assert M.recomputed_layer_gib(full, lay, shard, "torch") == 0
    assert M.backward_transient_gib(ckpt, lay, shard, "torch") == pytest.approx(
        max(head, M.recomputed_layer_gib(ckpt, lay, shard, "torch")))
    long = tree(TINY, **micro4, data__max_response_length=512, backend__logprob_chunk_size=1024)  # 2048: chunk 1024
    assert M.logits_gib(long, lay) == pytest.approx((320 * 128 * 4 + 3 * 1024 * 320 * 4) / GIB)


def test_activations_with_and_without_recompute():
    shard = M.TrainShard(dense=0, expert=0, layers=["linear", "full"], largest_unit=0)
    lay = layout(world=8, tp=2, pp=1, ep=1)
    m = tree(TINY)["model"]
    # bytes per token; the plan assumes fla on accelerators (`megatron_gdn_kernels`)
    full_b, lin_b = M.megatron_layer_bytes_per_token(m, "full", "fla"), M.megatron_layer_bytes_per_token(m, "linear", "fla")
    base = dict(model=m)
    t = tree(MG35, backend__recompute_granularity=None)
    t.update(base)
    tokens = 3072 / 2  # micro batch 1 x 3072 tokens, sequence parallel over TP2
    # the final norm (fp32 input copy and normalised tensor, bf16 output) on this rank's tokens; the head's input:
    # the 2048 response tokens of the micro batch, gathered over the sequence
    head = tokens * (4 + 4 + 2) * 128 + 2048 * 2 * 128
    assert M.activations_gib(t, lay, shard) == pytest.approx(((full_b + lin_b) * tokens + head) / GIB)
    torch_lin = M.megatron_layer_bytes_per_token(m, "linear", "torch")
    assert M.activations_gib(t, lay, shard, "torch") == pytest.approx(((full_b + torch_lin) * tokens + head) / GIB)
    t = tree(MG35)  # full, uniform, 1 layer per group
    t.update(base)
    assert M.activations_gib(t, lay, shard) == pytest.approx(((2 * 128 * 2 + 2 * lin_b) * tokens + head) / GIB)
    t = tree(MG35, backend__recompute_method="block", backend__recompute_num_layers=1)
    t.update(base)
    assert M.activations_gib(t, lay, shard) == pytest.approx(((128 * 2 + full_b + 2 * lin_b) * tokens + head) / GIB)


def test_in_flight_micro_batches():
    t = tree(MG35)  # 40 micro batches per mini batch at dp 4
    assert M.in_flight_micro_batches(t, layout(world=32, tp=2, pp=4)) == 4
    assert M.in_flight_micro_batches(t, layout(world=32, tp=2, pp=4, vpp=2)) == pytest.approx(4 * (1 + 3 / 8))
    few = tree(MG35, data__train_batch_size=4, algorithm__mini_batch_size=4)  # 20 responses / dp 4 = 5
    assert M.in_flight_micro_batches(few, layout(world=64, tp=2, pp=8)) == 5
    assert M.in_flight_micro_batches(t, layout(world=8, tp=2, pp=1)) == 1


def test_megatron_log_prob_head():
    """The chunked head over response tokens: the fp32 gradient of this TP rank's vocabulary rows and three fp32
    [chunk, V / tp] tensors; the chunk is at most the micro batch's response tokens (all of them on every TP rank)."""
    h, v = 2048, 248320
    assert M.logits_gib(tree(MG35), layout(world=8, tp=2, pp=1)) == pytest.approx(
        (v / 2 * h * 4 + 3 * 1024 * v / 2 * 4) / GIB)
    short = tree(MG35, data__max_prompt_length=200, data__max_response_length=300)
    assert M.head_tokens_per_device(short, layout(world=8, tp=2, pp=1)) == 300
    assert M.logits_gib(short, layout(world=8, tp=1, pp=1)) == pytest.approx((v * h * 4 + 3 * 300 * v * 4) / GIB)


def test_reference_model():
    lay = layout()
    assert M.reference_model_gib(tree(MG35, backend__param_offload=False), lay, SHARD) == pytest.approx(3e9 * 2 / GIB)
    assert M.reference_model_gib(tree(MG35), lay, SHARD) == 0  # follows param_offload
    no_kl = tree(MG35, backend__param_offload=False, algorithm__use_kl_loss=False)
    assert M.reference_model_gib(no_kl, lay, SHARD) == 0


def test_rollout_cache_terms():
    t = tree(MG397)
    assert M.kv_cache_bytes_per_token(t, layout(world=256, rtp=16)) == 15 * 2 * 1 * 256 * 2  # 2 KV heads replicated
    assert M.kv_cache_bytes_per_token(t, layout(world=256, rtp=1)) == 15 * 2 * 2 * 256 * 2
    expected = (45 * 64 * 128 * 128 * 4 + 45 * (2 * 16 * 128 + 64 * 128) * 3 * 2) / 16
    assert M.gdn_state_bytes_per_sequence(t, layout(world=256, rtp=16)) == pytest.approx(expected)
    assert M.sequence_cache_gib(t, layout(world=256, rtp=16)) == pytest.approx((3072 * 15360 + expected) / GIB)
    assert M.vllm_pool_gib(t) == pytest.approx(0.6 * 64e9 / GIB)


def test_rollout_weights_and_activations():
    t = tree(MG397)  # text data: vLLM skips the vision tower (limit_mm_per_prompt 0)
    experts = 60 * 512 * 3 * 4096 * 1024
    count = P.count_params(t["model"])
    ep = layout(world=256, rtp=16, rdp=16, rep=256)
    assert M.rollout_weights_params(t, ep) == pytest.approx((count.text - experts) / 16 + experts / 256)
    assert M.rollout_weights_params(t, layout(world=256, rtp=8)) == pytest.approx(count.text / 8)
    images = tree(MG397, data__has_images=True)  # image data: the tower too, split by rollout TP like the rest
    assert M.rollout_weights_params(images, ep) == pytest.approx((count.total - experts) / 16 + experts / 256)
    assert M.rollout_weights_params(images, layout(world=256, rtp=8)) == pytest.approx(count.total / 8)
    data_mode = tree(MG397, data__has_images=True, rollout__engine_kwargs={"mm_encoder_tp_mode": "data"})
    assert M.rollout_weights_params(data_mode, layout(world=256, rtp=8)) == pytest.approx(
        count.text / 8 + count.vision)  # the tower replicated on every TP rank
    tiny = tree(TINY)
    widest = max(M.layer_activation_elems_per_token(tiny["model"], k) for k in ("linear", "full"))
    expected = 8192 * (widest / 1 + 2 * 128) * 2 + 256 * 320 * 8
    assert M.rollout_activations_gib(tiny, layout("fsdp", world=2, tp=1, pp=1, ep=1)) == pytest.approx(expected / GIB)


def test_what_stays_between_phases():
    lay = layout()
    t = tree(MG35)  # param/grad/optimizer offload and a sleeping vLLM: nothing stays
    assert M.train_state_during_rollout_gib(t, lay, SHARD) == 0
    assert M.sleeping_engine_gib(t, lay) == 0
    kept = tree(MG35, backend__param_offload=False, backend__grad_offload=False)
    weights, grads = 3e9 * 2 / GIB, 3e9 * 4 / GIB
    assert M.train_state_during_rollout_gib(kept, lay, SHARD) == pytest.approx(weights + grads + weights)  # + reference
    awake = tree(MG35, rollout__free_cache_engine=False)
    assert M.sleeping_engine_gib(awake, lay) == pytest.approx(M.vllm_pool_gib(awake))
    hf = tree(TINY)  # the tiny model is fp32
    assert M.sleeping_engine_gib(hf, derive_layout(hf)) == pytest.approx(P.count_params(hf["model"]).total * 4 / GIB)
    asleep = tree(TINY, rollout__free_cache_engine=True, rollout__sleep_level=2)  # level 2 moves it to the host
    assert M.sleeping_engine_gib(asleep, derive_layout(asleep)) == 0
    assert M.rollout_terms(asleep, derive_layout(asleep))["host/sleeping_engine"] > 0
    vl = tree(["model=qwen3_5_0_8b", "rollout=hf"])  # a VL model on text data: the hf engine holds the text model
    count = P.count_params(vl["model"])
    assert M.sleeping_engine_gib(vl, derive_layout(vl)) == pytest.approx(count.text * 2 / GIB)
    images = tree(["model=qwen3_5_0_8b", "rollout=hf"], data__has_images=True)
    assert M.sleeping_engine_gib(images, derive_layout(images)) == pytest.approx(count.total * 2 / GIB)
    # the FSDP reference: bf16 shard plus its root unit, gathered after each of its forward passes
    ref = tree(FSDP27, **NO_OFFLOAD)
    assert M.reference_model_gib(ref, layout("fsdp", world=8, tp=1, pp=1, ep=1), SHARD) == pytest.approx(4e9 * 2 / GIB)


def test_hf_engine_cache_prefill_and_sampler():
    t = tree(TINY)  # 8 prompts x n 16 over 2 devices: 64 rows of 32 prompt + 8 new tokens, fp32 model
    lay = derive_layout(t)
    # per row: K and V of the one attention layer (2 KV heads of 32) for 40 positions; per GDN layer (3) the fp32
    # recurrent state (4 heads x 64 x 64) and 4 conv columns of the 512 conv channels
    per_row = 40 * 1 * 2 * 2 * 32 * 4 + 3 * (4 * 64 * 64 * 4 + 512 * 4 * 4)
    assert M.hf_static_cache_gib(t, lay) == pytest.approx(64 * per_row / GIB)
    # torch fallback prefill: conv output, z, residual stream (model dtype); 3 value-, 6 key-sized and 3 chunk-matrix
    # tensors (fp32) per token; 4 states + 2 chunk temporaries per row; the boolean mask
    per_token = 4 * (512 + 256 + 2 * 128) + 4 * (3 * 256 + 6 * 4 * 64 + 3 * 4 * 64)
    per_row = 4 * (4 * 4 * 64 * 64 + 2 * 4 * 64 * 64)
    assert M.hf_prefill_gib(t, lay, "torch") == pytest.approx(64 * (32 * per_token + per_row + 32 * 40) / GIB)
    # fla: conv output and contiguous q/k/v, normed q/k, z/u/v_new/output, w, A, per-chunk states, residual stream;
    # g in fp32; one fp32 final state per row
    fla_token = 4 * (2 * 512 + 2 * 2 * 64 + 4 * 256 + 4 * 64 + 4 * 64 + 4 * 64 * 64 / 64 + 2 * 128) + 4 * 4
    assert M.hf_prefill_gib(t, lay, "fla") == pytest.approx(64 * (32 * fla_token + 4 * 4 * 64 * 64 + 32 * 40) / GIB)
    # a decode step's sampling: logits (model dtype) and five fp32 vocabulary-sized tensors per row
    assert M.hf_sampler_gib(t, lay) == pytest.approx(64 * 320 * (4 + 5 * 4) / GIB)
    terms = M.rollout_terms(t, lay)
    transient = max(M.hf_prefill_gib(t, lay, "torch"), M.hf_sampler_gib(t, lay))
    assert terms["rollout/activations"] == pytest.approx(transient)
    est = M.estimate(t, lay)
    assert est.rollout_peak_gib == pytest.approx(est.terms["rollout/kept_by_trainer"] + terms["rollout/weights"]
                                                 + terms["rollout/kv_cache"] + terms["rollout/activations"])


def test_host_offload_term():
    t = tree(FSDP27)  # offload_policy: fp32 params + grads + Adam m, v on the host; reference offloaded too
    shard = M.TrainShard(dense=1e9, expert=0, layers=[], largest_unit=0)
    lay = layout("fsdp", world=8, tp=1, pp=1, ep=1)
    assert M.host_offloaded_gib(t, lay, shard) == pytest.approx(1e9 * 16 / GIB + 1e9 * 2 / GIB)


def test_assemble_pool_and_sequences():
    t = tree(MG397)
    est = M.estimate(t, derive_layout(t))
    pool, per_seq = est.terms["rollout/pool"], est.terms["rollout/sequence_cache"]
    free = pool - est.terms["rollout/weights"] - est.terms["rollout/activations"]
    assert est.rollout_sequences == int(free // per_seq)
    assert est.rollout_peak_gib == pytest.approx(est.terms["rollout/kept_by_trainer"] + pool)
    assert est.train_peak_gib == pytest.approx(sum(v for k, v in est.terms.items() if k.startswith("train/")))
    # FSDP: the peak is the larger of the backward and the optimizer step (train/optimizer_step is the step's excess)
    t = tree(FSDP27, **NO_OFFLOAD, algorithm__mini_batch_size=8, rollout__n=1)  # one micro batch: no grads in backward
    est = M.estimate(t, derive_layout(t))
    persistent = sum(est.terms[k] for k in ("train/weights", "train/optimizer", "train/reference",
                                            "train/sleeping_engine"))
    backward = sum(est.terms[k] for k in ("train/grads", "train/gathered_params", "train/activations",
                                          "train/backward_transient"))
    shard = M.train_shard(t, derive_layout(t))
    step = M.optimizer_step_gib(t, derive_layout(t), shard, backward_set=0.0)
    assert est.train_peak_gib == pytest.approx(persistent + max(backward, step))
    tight = tree(MG397, rollout__gpu_memory_utilization=0.05)
    small = M.estimate(tight, derive_layout(tight))
    assert not small.rollout_engine_fits and not small.fits and small.rollout_sequences == 0


REFERENCE_RUNS = [("qwen3_5_27b", "fsdp", "gpu_1node"), ("qwen3_5_27b", "fsdp", "a3_1node"),
                  ("qwen3_5_35b_a3b", "fsdp", "gpu_1node"), ("qwen3_5_35b_a3b", "fsdp", "a3_1node"),
                  ("qwen3_5_35b_a3b", "megatron", "gpu_1node"), ("qwen3_5_35b_a3b", "megatron", "a3_1node"),
                  ("qwen3_5_122b_a10b", "megatron", "h20_4node"), ("qwen3_5_122b_a10b", "megatron", "a3_4node"),
                  ("qwen3_5_397b_a17b", "megatron", "gpu_16node"), ("qwen3_5_397b_a17b", "megatron", "a3_16node")]


@pytest.mark.parametrize("model,backend,hw", REFERENCE_RUNS, ids=["-".join(r) for r in REFERENCE_RUNS])
def test_reference_runs_fit(model, backend, hw):
    cfg = compose([f"model={model}", f"backend={backend}", f"hw={hw}"])
    est = M.estimate(cfg, derive_layout(cfg))
    assert est.fits and 0 < est.train_peak_gib < est.capacity_gib and 0 < est.rollout_peak_gib <= est.capacity_gib
    assert est.rollout_sequences >= 64  # the KV cache holds a useful batch of full-length sequences
    d = est.to_dict()
    assert {"train_peak", "rollout_peak", "log_prob_peak", "capacity", "fits", "terms"} <= set(d)
    # the forward-only passes with the training micro batch keep less than the update's backward
    assert 0 < est.log_prob_peak_gib <= est.train_peak_gib


def test_log_prob_phase_has_its_own_micro_batch():
    """The old / reference log-prob passes keep the trainer's resident states plus one forward's working set: the
    hidden state and the larger of the widest layer and the head's chunk, for their own micro batch; no gradients
    (FSDP frees them after each step; Megatron's buffer stays)."""
    lay = layout("fsdp", world=8, tp=1, pp=1, ep=1)
    t = tree(FSDP27, backend__gradient_checkpointing=True)
    m, h, cb = t["model"], int(t["model"]["hidden_size"]), M.compute_bytes(t)
    shard = M.train_shard(t, lay)
    widest = max(M.hf_layer_bytes_per_token(m, k, cb, M.gdn_kernels(t)) for k in set(shard.layers))
    for micro in (None, 4):
        u = tree(FSDP27, backend__gradient_checkpointing=True, backend__log_prob_micro_batch_size_per_device=micro)
        tokens = (micro or int(t["backend"]["micro_batch_size_per_device"])) * M.sequence_length(t)
        head_tokens = tokens * int(t["data"]["max_response_length"]) / M.sequence_length(t)
        head = head_tokens * cb * h + 3 * min(int(t["backend"]["logprob_chunk_size"]), head_tokens) * int(
            m["vocab_size"]) * 4
        assert M.log_prob_activations_gib(u, lay, shard) == pytest.approx(
            (tokens * cb * h + max(tokens * widest, head)) / GIB)
    est, big = M.estimate(t, lay), M.estimate(tree(FSDP27, backend__log_prob_micro_batch_size_per_device=16), lay)
    beside = sum(est.terms[k] for k in M.LOG_PROB_BESIDE)
    assert est.terms["log_prob/grads"] == 0 and est.log_prob_peak_gib == pytest.approx(
        beside + est.terms["log_prob/activations"])
    assert big.log_prob_peak_gib > est.log_prob_peak_gib and big.train_peak_gib == pytest.approx(
        M.estimate(tree(FSDP27), lay).train_peak_gib)  # the update is untouched
    mg = M.estimate(tree(MG35), derive_layout(compose(MG35)))
    assert mg.terms["log_prob/grads"] == mg.terms["train/grads"] > 0
    # dynamic batch size: the token budget of its own
    dyn = tree(FSDP27, backend__dynamic_batch_size=True, backend__max_tokens_per_device=8192)
    more = tree(FSDP27, backend__dynamic_batch_size=True, backend__max_tokens_per_device=8192,
                backend__log_prob_max_tokens_per_device=32768)
    assert M.tokens_per_device(M.log_prob_tree(more), lay) == 4 * M.tokens_per_device(M.log_prob_tree(dyn), lay)
    assert M.estimate(more, lay).log_prob_peak_gib > M.estimate(dyn, lay).log_prob_peak_gib
    assert not M.estimate(tree(FSDP27, backend__log_prob_micro_batch_size_per_device=512), lay).fits


def test_offload_and_pipeline_lower_the_training_peak():
    def peak(**kw):
        t = tree(MG35, **kw)
        return M.estimate(t, derive_layout(t)).train_peak_gib

    assert peak(backend__optimizer_cpu_offload=False) > peak()
    assert peak(parallelism__pp=2, parallelism__ep=4) < peak(parallelism__ep=4)
    assert peak(backend__micro_batch_size_per_device=8) > peak()


def test_tied_embedding_is_counted_once_unless_split_over_stages():
    base = ["model=qwen3_5_0_8b", "hw=gpu_1node", "backend=megatron"]
    m = tree(base)["model"]
    layers = P.layers_params(m, P.layer_kinds(m))
    one = tree(base, parallelism__pp=1)
    assert M.train_shard(one, derive_layout(one)).dense == layers + 248320 * 1024 + 1024
    two = tree(base, parallelism__pp=2)
    half = P.layers_params(m, P.layer_kinds(m)[12:])
    assert M.train_shard(two, derive_layout(two)).dense == max(
        P.layers_params(m, P.layer_kinds(m)[:12]) + 248320 * 1024, half + 248320 * 1024 + 1024)


# ----------------------------------------------------------------------------------------- the vision tower
VISION_27 = dict(d=1152, inter=4304, heads=16, depth=27, out=4096, pixels=3 * 2 * 16 * 16)
"""The vision tower of 27B / 35B / 122B / 397B (conf/model_base/qwen3_5.yaml), out_hidden = 397B's text hidden."""


def vision_block_params(d, inter, **_):
    return 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * inter + inter) + (inter * d + d)


def test_vision_tower_params_are_the_formulas():
    v = tree(MG397)["model"]["vision"]
    assert P.vision_block_params(v) == vision_block_params(**VISION_27)
    d, merged = 1152, 4 * 1152
    stem = 1536 * d + d + 2304 * d + 2 * d + merged * merged + merged + merged * 4096 + 4096
    assert P.vision_params(v) == stem + 27 * vision_block_params(**VISION_27) == P.count_params(tree(MG397)["model"]).vision


def _first_stage_text(m, layers):
    """Non-expert text parameters of a first pipeline stage with these layers (embedding included) and its experts."""
    kinds = P.layer_kinds(m)[:layers]
    expert = layers * P.layer_expert_params(m)
    return P.layers_params(m, kinds) - expert + P.embedding_params(m), expert


def test_megatron_trains_the_vision_tower_on_the_first_stage_replicated_over_tp():
    t = tree(MG397, data__has_images=True, backend__optimizer_cpu_offload=False)
    lay = derive_layout(t)  # TP2 PP4 EP64 DP32: 15 layers per stage
    assert (lay.tp, lay.pp, lay.ep, lay.dp, lay.edp) == (2, 4, 64, 32, 1)  # edp = 256 / (PP4 x EP64)
    vision = P.count_params(t["model"]).vision
    dense, expert = _first_stage_text(t["model"], 15)
    shard = M.train_shard(t, lay)  # the first stage is now the heaviest: its text / TP plus the whole tower
    assert shard.dense == pytest.approx(dense / 2 + vision) and shard.expert == pytest.approx(expert / 64)
    assert shard.frozen == 0
    assert M.train_weights_gib(t, lay, shard) == pytest.approx((dense / 2 + vision + expert / 64) * 2 / GIB)
    assert M.train_grads_gib(t, lay, shard) == pytest.approx((dense / 2 + vision + expert / 64) * 4 / GIB)
    # the distributed optimizer shards the tower's fp32 master + moments over DP like the other replicated states
    states = (dense / 2 + vision) / 32 + expert / 64
    assert M.optimizer_states_gib(t, lay, shard) == pytest.approx(states * 12 / GIB)
    # text data: no tower on any stage (the heavier of the first stage and the last, with output layer and norm)
    m = t["model"]
    last = P.layers_params(m, P.layer_kinds(m)[45:]) - 15 * P.layer_expert_params(m) + 248320 * 4096 + 4096
    assert M.train_shard(tree(MG397), lay).dense == pytest.approx(max(dense, last) / 2)


def test_megatron_vision_tower_lives_on_the_first_stage_only():
    """A short first stage stays lighter than the middle ones even with the tower: the heaviest rank is the same
    with and without images."""
    uneven = dict(parallelism__pipeline_layout="E,t*6|t*18|t*18|t*18,L")
    images = tree(MG397, data__has_images=True, **uneven)
    text = tree(MG397, **uneven)
    lay = derive_layout(images)
    assert M.train_shard(images, lay) == M.train_shard(text, lay)


def test_megatron_vision_activations_per_micro_batch_in_flight():
    t = tree(MG397, data__has_images=True)  # PP4: 4 of the 5 micro batches in flight on the first stage
    lay = derive_layout(t)
    assert M.in_flight_micro_batches(t, lay) == 4
    d, inter, heads, depth, out, pixels = (VISION_27[k] for k in ("d", "inter", "heads", "depth", "out", "pixels"))
    patches = 1 * 1024 * 4  # micro batch 1: every one of the 1024 prompt tokens an image token of 2 x 2 patches
    assert M.vision_patches_per_micro_batch(t) == patches
    block = 2 * (11 * d + 2 * inter) + 4 * (heads + 4)
    stem = 2 * (pixels + 4 * d + out / 4) + 4 * (2 * (d // heads) + 6) + 8 * 4
    assert M.vision_block_bytes_per_patch(t["model"]["vision"], 2) == block
    assert M.vision_stem_bytes_per_patch(t["model"]["vision"], 2) == stem
    # full recompute: each block keeps its input; one block recomputed with its gradients; fp32 pixel values kept
    recomputed = patches * ((stem + depth * 2 * d + 4 * pixels) * 4 + 2 * block)
    assert M.vision_activations_gib(t, lay) == pytest.approx(recomputed / GIB)
    saved = tree(MG397, data__has_images=True, backend__recompute_granularity=None)
    assert M.vision_activations_gib(saved, lay) == pytest.approx(patches * (stem + depth * block + 4 * pixels) * 4 / GIB)
    # not split over TP: the same patches on every TP rank (TP1 and TP2 at the same DP size and pipeline depth)
    wide = tree(MG397, data__has_images=True, hw__nodes=32, parallelism__tp=4)
    assert derive_layout(wide).dp == lay.dp
    assert M.vision_activations_gib(wide, derive_layout(wide)) == pytest.approx(recomputed / GIB)
    assert M.estimate(t, lay).terms["train/vision_activations"] == pytest.approx(recomputed / GIB)


def test_frozen_vision_tower_counts_weights_only():
    kw = dict(data__has_images=True, backend__optimizer_cpu_offload=False, model__freeze_vision_tower=True)
    t = tree(MG397, **kw)
    lay = derive_layout(t)
    vision = P.count_params(t["model"]).vision
    dense, expert = _first_stage_text(t["model"], 15)
    shard = M.train_shard(t, lay)
    assert shard.dense == pytest.approx(dense / 2) and shard.frozen == vision
    assert M.train_weights_gib(t, lay, shard) == pytest.approx((dense / 2 + vision + expert / 64) * 2 / GIB)
    assert M.train_grads_gib(t, lay, shard) == pytest.approx((dense / 2 + expert / 64) * 4 / GIB)
    assert M.optimizer_states_gib(t, lay, shard) == pytest.approx(((dense / 2) / 32 + expert / 64) * 12 / GIB)
    # nothing kept for backward: the micro batches' pixel values and one block's forward tensors at a time
    d, inter, heads = 1152, 4304, 16
    block = 2 * (11 * d + 2 * inter) + 4 * (heads + 4)
    assert M.vision_activations_gib(t, lay) == pytest.approx(4096 * (4 * 1536 * 4 + block) / GIB)
    # the reference holds its own bf16 copy of the tower
    ref = tree(MG397, **kw, backend__param_offload=False)
    assert M.reference_model_gib(ref, lay, shard) == pytest.approx((dense / 2 + vision + expert / 64) * 2 / GIB)


def test_fsdp_vision_tower_trained_frozen_and_absent():
    lay = layout("fsdp", world=8, tp=1, pp=1, ep=1)
    count = P.count_params(tree(FSDP27)["model"])
    v = tree(FSDP27)["model"]["vision"]
    stem = count.vision - 27 * P.vision_block_params(v)  # patch embedding, position table, merger: the root unit's
    root = 2 * 248320 * 5120 + 5120
    trained = tree(FSDP27, **NO_OFFLOAD, data__has_images=True)
    s = M.train_shard(trained, lay)
    assert s.dense * 8 == pytest.approx(count.total) and s.frozen == 0 and s.root == root + stem
    frozen = tree(FSDP27, **NO_OFFLOAD, data__has_images=True, model__freeze_vision_tower=True)
    f = M.train_shard(frozen, lay)
    assert f.dense * 8 == pytest.approx(count.text) and f.frozen * 8 == pytest.approx(count.vision)
    assert f.root == root + stem
    # fp32 sharded weights of both; fp32 grads and Adam m, v of the trained parameters only
    assert M.train_weights_gib(frozen, lay, f) == pytest.approx(count.total / 8 * 4 / GIB)
    assert M.train_grads_gib(frozen, lay, f) == pytest.approx(count.text / 8 * 4 / GIB)
    assert M.optimizer_states_gib(frozen, lay, f) == pytest.approx(count.text / 8 * 8 / GIB)
    assert M.optimizer_states_gib(trained, lay, s) == pytest.approx(count.total / 8 * 8 / GIB)
    # the bf16 reference: its shard of everything plus the gathered root
    assert M.reference_model_gib(frozen, lay, f) == pytest.approx((count.total / 8 + root + stem) * 2 / GIB)
    # host: fp32 params + grads + m + v of the trained parameters, fp32 params of the frozen tower, the reference
    on_host = tree(FSDP27, data__has_images=True, model__freeze_vision_tower=True)
    assert M.host_offloaded_gib(on_host, lay, f) == pytest.approx(
        (count.text / 8 * 16 + count.vision / 8 * 4 + count.total / 8 * 2) / GIB)
    # checkpointing covers the vision blocks: each keeps its input, one recomputed at a time (bf16 on GPUs)
    d, inter, heads = 1152, 4304, 16
    block = 2 * (11 * d + 2 * inter) + 4 * (heads + 4)
    stem_bytes = 2 * (1536 + 4 * d + 5120 / 4) + 4 * (2 * 72 + 6) + 8 * 4
    assert M.vision_activations_gib(trained, lay) == pytest.approx(
        4096 * (stem_bytes + 27 * 2 * d + 4 * 1536 + block) / GIB)


def test_text_data_counts_no_vision_training_state():
    for base in (MG397, FSDP27):
        for freeze in (False, True):  # the freeze flag means nothing without the tower
            t = tree(base, model__freeze_vision_tower=freeze)
            lay = derive_layout(t)
            assert not M.trains_vision(t) and M.vision_tower_params(t) == 0
            shard = M.train_shard(t, lay)
            assert shard.frozen == 0
            est = M.estimate(t, lay)
            assert est.terms["train/vision_activations"] == 0
            assert shard == M.train_shard(tree(base), lay)
    fsdp = tree(FSDP27)
    s = M.train_shard(fsdp, derive_layout(fsdp))
    assert s.root == 2 * 248320 * 5120 + 5120  # no vision stem in the root
    assert s.largest_unit == max(P.layer_dense_params(fsdp["model"], k) for k in ("linear", "full"))


def test_megatron_recompute_needs_gradient_checkpointing():
    """The Megatron engine recomputes only with backend.gradient_checkpointing and a recompute granularity."""
    lay = layout(world=8, tp=2, pp=1, ep=1)
    assert M.recompute_groups(tree(MG35), lay) == {"method": "uniform", "n": 1}
    assert M.recompute_groups(tree(MG35, backend__gradient_checkpointing=False), lay) is None


def test_image_tokens_follow_the_prompt_share_of_a_micro_batch():
    t = tree(MG35, data__has_images=True, backend__micro_batch_size_per_device=2)
    assert M.image_tokens_per_micro_batch(t) == 2 * 1024  # padded: every prompt token of both rows
    dynamic = tree(MG35, data__has_images=True, backend__dynamic_batch_size=True)  # 4096 tokens, 1/3 of them prompt
    assert M.image_tokens_per_micro_batch(dynamic) == pytest.approx(4096 * 1024 / 3072)


@pytest.mark.parametrize("model,backend,hw", REFERENCE_RUNS, ids=["-".join(r) for r in REFERENCE_RUNS])
def test_reference_runs_on_geo3k_plan_valid_and_fit(model, backend, hw):
    """The reference runs as users launch them: their data is geo3k (image + text), the vision tower trains."""
    from qwen35rl.config.plan import build_plan

    plan = build_plan(compose([f"model={model}", f"backend={backend}", f"hw={hw}", "data=geo3k"]))
    assert plan["valid"], [p for p in plan["problems"] if p["severity"] == "error"]
    mem = plan["memory_gib"]
    assert mem["fits"] and 0 < mem["train_peak"] < mem["capacity"] and 0 < mem["rollout_peak"] <= mem["capacity"]
    assert mem["rollout_sequences"] >= 64
    assert mem["terms"]["train/vision_activations"] > 0



def test_ulysses_sp_splits_layer_activations_and_the_log_prob_head():
    """Each SP rank holds 1/sp of the row through the layers and the head; only per-token log-probs are gathered."""
    from qwen35rl.config.memory import activations_gib, logits_gib, train_shard

    def at(sp):
        cfg = M.as_tree(compose(["model=qwen3_5_0_8b", "hw=gpu_1node", "backend=fsdp", f"parallelism.sp={sp}",
                                 "backend.logprob_chunk_size=1000000"]))
        layout = derive_layout(cfg)
        return activations_gib(cfg, layout, train_shard(cfg, layout)), logits_gib(cfg, layout)

    (act1, head1), (act4, head4) = at(1), at(4)
    lm_head_grad = M.gib(248320 * 1024 * 4)  # the fp32 [V, h] gradient accumulator is not split
    assert act4 == pytest.approx(act1 / 4, rel=0.05)
    assert head4 - lm_head_grad == pytest.approx((head1 - lm_head_grad) / 4, rel=0.01)


def test_megatron_gdn_on_fla_counts_what_the_h200_history_showed():
    """megatron-core 0.19.2's GatedDeltaNet on fla, per token: on the 0.8B (16 key = 16 value heads of 128) the
    2026-12-04b allocator history held, per layer, the in_proj output (16448 B), fla's normalised q/k (8192 B) and
    rstd, the contiguous q, k, v and z (4 x 4096 B), A (2048 B), the recurrence's and the gated norm's outputs
    (4096 B each); with more value than key heads (4B: 16 / 32) q and k are repeated to the value heads."""
    m = tree(["model=qwen3_5_0_8b"])["model"]
    bf16 = 16448 + 8192 + 4 * 4096 + 2048 + 2 * 4096
    fp32 = 4 * (2 * 16 + 3 * 16)  # l2norm rstd (key heads); g, beta, the output norm's rstd (value heads)
    assert M.megatron_gdn_bytes_per_token(m, "fla") == bf16 + fp32
    m4 = tree(["model=qwen3_5_4b"])["model"]
    nk, nv, d = 16, 32, 128
    in_proj = 2 * (2 * nk * d + nv * d + nv * d + 2 * nv)
    repeated = 2 * (2 * nk * d + 2 * nv * d + 2 * nv * d + nv * 64 + 2 * nv * d)
    assert M.megatron_gdn_bytes_per_token(m4, "fla") == in_proj + repeated + 4 * (2 * nk + 3 * nv)
