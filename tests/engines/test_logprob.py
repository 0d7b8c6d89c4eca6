import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from qwen35rl.config.layout import derive_layout
from qwen35rl.engines.logprob import chunked_logprobs_entropy


def _reference(hidden, weight, labels, temperature):
    logits = (hidden @ weight.t()).float() / temperature
    log_probs = torch.log_softmax(logits, -1)
    logp = log_probs.gather(-1, labels[:, None]).squeeze(-1)
    return logp, -(log_probs.exp() * log_probs).sum(-1)


def _inputs(n=37, h=16, v=50, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=dtype, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, labels


@pytest.mark.parametrize("chunk", [1, 8, 37, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_match_full_computation(chunk, temperature):
    hidden, weight, labels = _inputs()
    logp, ent = chunked_logprobs_entropy(hidden, weight, labels, chunk, temperature, with_entropy=True)
    ref_logp, ref_ent = _reference(hidden, weight, labels, temperature)
    torch.testing.assert_close(logp, ref_logp.float())
    torch.testing.assert_close(ent, ref_ent.float())
    # a loss that mixes both outputs with per-token weights exercises both backward terms
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(labels.shape, generator=g), torch.randn(labels.shape, generator=g)
    gh, gw = torch.autograd.grad((a * logp + b * ent).sum(), (hidden, weight))
    rh, rw = torch.autograd.grad((a * ref_logp + b * ref_ent).sum(), (hidden, weight))
    torch.testing.assert_close(gh, rh, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, rw, rtol=1e-5, atol=1e-6)


def test_without_entropy_and_gradcheck():
    hidden, weight, labels = _inputs(n=5, h=3, v=7)
    logp, ent = chunked_logprobs_entropy(hidden, weight, labels, 2)
    assert ent is None
    torch.testing.assert_close(logp, _reference(hidden, weight, labels, 1.0)[0].float())
    # fp64 numerical check of the hand-written backward through both outputs (forward returns fp32: loose tol)
    f = lambda h, w: tuple(t.double() for t in chunked_logprobs_entropy(h, w, labels, 2, 0.5, True))
    assert torch.autograd.gradcheck(f, (hidden, weight), eps=1e-3, atol=1e-3, rtol=1e-2)


def test_bf16_inputs_give_fp32_outputs_and_input_dtype_grads():
    hidden, weight, labels = _inputs(dtype=torch.bfloat16)
    logp, ent = chunked_logprobs_entropy(hidden, weight, labels, 8, with_entropy=True)
    assert logp.dtype == ent.dtype == torch.float32
    (logp.sum() + ent.sum()).backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.bfloat16
    ref_logp, _ = _reference(hidden.detach().float(), weight.detach().float(), labels, 1.0)
    torch.testing.assert_close(logp, ref_logp, rtol=2e-2, atol=5e-2)


def test_autograd_keeps_no_logits():
    hidden, weight, labels = _inputs(n=64, h=8, v=512, dtype=torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        chunked_logprobs_entropy(hidden, weight, labels, 16, with_entropy=True)
    # the inputs and two numbers per token (log-sum-exp, entropy) are kept for backward: no [N, V] logits
    assert sum(saved) == hidden.numel() + weight.numel() + 3 * labels.numel()


@pytest.mark.parametrize("use", ["logp", "entropy"])
def test_one_output_unused(use):
    hidden, weight, labels = _inputs()
    logp, ent = chunked_logprobs_entropy(hidden, weight, labels, 8, 0.9, with_entropy=True)
    ref_logp, ref_ent = _reference(hidden, weight, labels, 0.9)
    out, ref = (logp, ref_logp) if use == "logp" else (ent, ref_ent)
    gh, gw = torch.autograd.grad(out.sum(), (hidden, weight))
    rh, rw = torch.autograd.grad(ref.sum(), (hidden, weight))
    torch.testing.assert_close(gh, rh, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, rw, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_compiled_chunks_match_eager(with_entropy):
    """backend.use_torch_compile: the per-chunk math through torch.compile (dynamic shapes: the last chunk of 37
    tokens in chunks of 16 is shorter) gives the eager values and gradients."""
    import torch._dynamo

    assert not torch._dynamo.config.disable, "torch.compile is off in this process: the comparison would be eager"
    hidden, weight, labels = _inputs(dtype=torch.float32)
    out = {}
    for compiled in (False, True):
        logp, ent = chunked_logprobs_entropy(hidden, weight, labels, 16, 0.7, with_entropy=with_entropy,
                                             compiled=compiled)
        loss = logp.sum() + (ent.sum() if with_entropy else 0)
        out[compiled] = (logp, ent, *torch.autograd.grad(loss, (hidden, weight)))
    for eager, compiled in zip(out[False], out[True]):
        if eager is None:
            assert compiled is None
        else:
            torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


def test_use_torch_compile_null_compiles_on_cuda_only():
    from qwen35rl.config.capabilities import compiles_log_probs
    from qwen35rl.config.compose import compose
    from qwen35rl.engines.fsdp_engine import FsdpTrainEngine

    assert compiles_log_probs(None, "cuda") and not compiles_log_probs(None, "cpu")
    assert not compiles_log_probs(None, "npu") and compiles_log_probs(True, "cpu") and not compiles_log_probs(False, "cuda")
    cfg = compose(["model=qwen3_5_tiny", "hw=cpu", "hw.devices_per_node=1", "algorithm.use_kl_loss=false"])
    assert cfg.backend.use_torch_compile is None
    engine = FsdpTrainEngine(cfg, layout=derive_layout(cfg), rank=0, world_size=1, device="cpu")
    assert engine.module.compiled is False


def test_fsdp_engine_with_compiled_log_probs_trains_as_eager():
    """backend.use_torch_compile reaches the FSDP engine: its log-probs and an update's metrics equal eager ones."""
    from qwen35rl.algo.loss import ActorLoss
    from qwen35rl.config.compose import compose
    from qwen35rl.engines.fsdp_engine import FsdpTrainEngine
    from qwen35rl.runtime.batching import Sequences, build_batch

    seqs = Sequences([[5, 6, 7], [8, 9]], [[10, 11, 12, 13], [14, 15]], advantages=[1.0, -1.0])
    batch = build_batch(seqs, 0)
    runs = {}
    for flag in (False, True):
        cfg = compose(["model=qwen3_5_tiny", "hw=cpu", "hw.devices_per_node=1", "algorithm.use_kl_loss=false",
                       f"backend.use_torch_compile={str(flag).lower()}"])
        engine = FsdpTrainEngine(cfg, layout=derive_layout(cfg), rank=0, world_size=1, device="cpu")
        assert engine.module.compiled is flag
        runs[flag] = (engine.compute_log_probs(batch)[0], engine.train_mini_batch([batch], ActorLoss.from_config(cfg)))
    (lp_eager, m_eager), (lp_compiled, m_compiled) = runs[False], runs[True]
    torch.testing.assert_close(lp_compiled, lp_eager, rtol=1e-5, atol=1e-5)
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert m_compiled[key] == pytest.approx(m_eager[key], rel=1e-4), key


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 matmuls with fp32 accumulation on CUDA")
def test_compiled_bf16_head_on_cuda_matches_fp32_reference():
    """The GPU path the engine runs: bf16 hidden and lm_head (FSDP's compute dtype), a realistic vocabulary, the
    compiled chunk math and the fp32-accumulated weight gradient, against fp32 math on the same bf16 numbers."""
    g = torch.Generator().manual_seed(0)
    n, h, v = 3000, 256, 32000
    hidden = (torch.randn(n, h, generator=g) * 0.5).to(torch.bfloat16).cuda().requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.05).to(torch.bfloat16).cuda().requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g).cuda()
    a, b = torch.randn(n, generator=g).cuda(), torch.randn(n, generator=g).cuda()
    logp, ent = chunked_logprobs_entropy(hidden, weight, labels, 1024, 0.8, with_entropy=True, compiled=True)
    gh, gw = torch.autograd.grad((a * logp + b * ent).sum(), (hidden, weight))
    hf, wf = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    ref_logp, ref_ent = _reference(hf, wf, labels, 0.8)
    rh, rw = torch.autograd.grad((a * ref_logp + b * ref_ent).sum(), (hf, wf))
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=3e-2)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=3e-2)
    for got, want in ((gh, rh), (gw, rw)):
        err = (got.float() - want).norm() / want.norm()
        assert err < 1e-2, err


def _split_vocab_worker(rank, world, port, hidden, weight, labels, a, b, out):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        h = hidden.clone().requires_grad_(True)
        w = weight.chunk(world)[rank].clone().requires_grad_(True)
        logp, ent = chunked_logprobs_entropy(h, w, labels, 5, 0.8, with_entropy=True, group=dist.group.WORLD)
        (a * logp + b * ent).sum().backward()
        out[rank] = (logp.detach(), ent.detach(), h.grad, w.grad)
        dist.barrier()  # a rank that leaves while its peer still talks to it aborts at exit (gloo)
    finally:
        dist.destroy_process_group()


def test_vocab_split_over_two_ranks_matches_the_whole_vocabulary():
    """Tensor parallelism: each rank holds half of the head's rows; labels fall on both halves."""
    import torch.multiprocessing as mp

    from qwen35rl.runtime.cluster import free_port
    from tests.shared_results import result_dict

    hidden, weight, labels = _inputs(n=13, h=6, v=20, dtype=torch.float32, seed=3)
    assert (labels < 10).any() and (labels >= 10).any()
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(labels.shape, generator=g), torch.randn(labels.shape, generator=g)
    ref_logp, ref_ent = _reference(hidden, weight, labels, 0.8)
    rh, rw = torch.autograd.grad((a * ref_logp + b * ref_ent).sum(), (hidden, weight))
    out = result_dict()
    mp.start_processes(_split_vocab_worker, nprocs=2, join=True, start_method="spawn",
                       args=(2, free_port(), hidden.detach(), weight.detach(), labels, a, b, out))
    for rank in range(2):
        logp, ent, _, gw = out[rank]
        torch.testing.assert_close(logp, ref_logp.float(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent, ref_ent.float(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gw, rw.chunk(2)[rank], rtol=1e-4, atol=1e-5)
    # each rank's hidden gradient is its part: the group's sum is the whole gradient
    torch.testing.assert_close(out[0][2] + out[1][2], rh, rtol=1e-4, atol=1e-5)
