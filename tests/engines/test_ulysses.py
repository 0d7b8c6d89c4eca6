"""Ulysses SP of one token mixer (GDN, full attention) over real gloo groups equals the same mixer on one rank:
outputs, input gradients and parameter gradients, packed documents kept apart. SP4 on the tiny model (2 KV heads,
2 GDN key heads) runs the replication path."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qwen35rl.engines.ulysses import SpGroup, repeat_heads, sequence_parallel
from tests.shared_results import result_dict

LENGTHS = [5, 9, 2]  # 16 tokens: splits over SP 2 and 4


def _model():
    from qwen35rl.config.compose import compose
    from qwen35rl.models.build import build_model

    cfg = compose(["model=qwen3_5_tiny", "model.num_hidden_layers=2", "model.full_attention_interval=2"])
    return build_model(cfg.model, dtype=torch.float32, device="cpu", seed=0, text_only=True)


def _inputs(hidden: int):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, sum(LENGTHS), hidden, generator=g)
    w = torch.randn(1, sum(LENGTHS), hidden, generator=g)  # the loss's weights: sum(out * w)
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    return x, w, pos


def _mixers(model):
    layers = model.model.layers
    return layers[0].linear_attn, layers[1].self_attn


def _run(model, sp, rank):
    """Outputs, input grads (this rank's tokens) and parameter grads (summed over the SP group) of both mixers."""
    from qwen35rl.engines.fsdp_engine import packed_call_kwargs

    gdn, attn = _mixers(model)
    x, w, pos = _inputs(model.config.hidden_size)
    kw = packed_call_kwargs(torch.tensor(LENGTHS))
    cos, sin = model.model.rotary_emb(x, pos[None].expand(3, -1, -1))
    part = slice(None)
    if sp is not None:
        n = x.shape[1] // sp.size
        part = slice(rank * n, (rank + 1) * n)
    out = {}
    for name, mixer in (("gdn", gdn), ("attn", attn)):
        mixer.zero_grad()
        xi = x[:, part].clone().requires_grad_(True)
        with sequence_parallel(sp):
            if name == "gdn":
                y = mixer(xi, **kw)
            else:
                y = mixer(xi, position_embeddings=(cos[:, part], sin[:, part]), attention_mask=None,
                          position_ids=pos[:, part], **kw)[0]
        (y * w[:, part]).sum().backward()
        grads = {k: p.grad.clone() for k, p in mixer.named_parameters()}
        if sp is not None:
            for g in grads.values():
                dist.all_reduce(g, group=sp.group)
        out[name] = (y.detach(), xi.grad.clone(), grads)
    return out


def _worker(rank, world, init_file, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        from qwen35rl.engines.packed_gdn import enable_packing
        from qwen35rl.engines.ulysses import use_ulysses

        enable_packing()
        model = _model()
        use_ulysses(model)
        results[rank] = _run(model, SpGroup(dist.group.WORLD, world, rank), rank)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _reference():
    from qwen35rl.engines.packed_gdn import packing_enabled
    from qwen35rl.engines.ulysses import use_ulysses

    model = _model()
    use_ulysses(model)  # outside sequence_parallel: packed attention, transformers' GDN
    with packing_enabled():
        return _run(model, None, 0)


@pytest.mark.parametrize("sp", [2, 4])
def test_ulysses_mixers_equal_one_rank(sp):
    ref = _reference()
    results = result_dict()
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(sp, os.path.join(d, "init"), results), nprocs=sp, join=True)
    n = sum(LENGTHS) // sp
    for name in ("gdn", "attn"):
        y_ref, gx_ref, gp_ref = ref[name]
        for rank in range(sp):
            y, gx, gp = results[rank][name]
            part = slice(rank * n, (rank + 1) * n)
            torch.testing.assert_close(y, y_ref[:, part], rtol=1e-5, atol=1e-6, msg=f"{name} output, rank {rank}")
            torch.testing.assert_close(gx, gx_ref[:, part], rtol=1e-5, atol=1e-6, msg=f"{name} input grad")
            for k in gp_ref:
                torch.testing.assert_close(gp[k], gp_ref[k], rtol=1e-5, atol=1e-6, msg=f"{name} grad {k}")


def test_heads_fewer_than_sp_are_repeated_in_order():
    x = torch.arange(2)[None, :, None]  # heads 0, 1
    assert repeat_heads(x, 4, 1).flatten().tolist() == [0, 0, 1, 1]
    assert repeat_heads(torch.arange(4)[None, :], 2, 1).flatten().tolist() == [0, 1, 2, 3]
    assert repeat_heads(torch.arange(2)[None, :], 3, 1).flatten().tolist() == [0, 0, 0, 1, 1, 1]
