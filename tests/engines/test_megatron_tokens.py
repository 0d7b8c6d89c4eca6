"""Token plumbing of the Megatron engine (qwen35rl.engines.megatron.tokens): left alignment of the runtime's
left-padded batches, and vocab-parallel log-probs / entropy against the full-vocabulary reference, values and
gradients, over a real 2-process gloo group."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")


import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qwen35rl.algo.core import entropy_from_logits, logprobs_from_logits
from qwen35rl.engines.megatron import tokens
from qwen35rl.runtime.cluster import free_port
from tests.shared_results import result_dict


def test_left_align_and_restore_round_trip():
    # prompt left-padded, response right-padded (runtime.batching layout)
    ids = torch.tensor([[0, 0, 5, 6, 7, 0], [1, 2, 3, 4, 5, 6], [0, 9, 8, 0, 0, 0]])
    mask = (ids != 0).long()
    mask[1, 0] = 1
    a = tokens.left_align(ids, mask, pad_token_id=0)
    assert a.input_ids.tolist() == [[5, 6, 7, 0, 0, 0], [1, 2, 3, 4, 5, 6], [9, 8, 0, 0, 0, 0]]
    assert a.valid.sum(1).tolist() == [3, 6, 2] and a.shift.tolist() == [2, 0, 1]
    values = torch.randn(3, 6, 2)
    assert torch.equal(a.restore(a.take(values)), values)
    assert torch.equal(a.take(ids)[a.valid], ids[mask.bool()])  # same tokens, same order


def test_left_align_refuses_holes():
    ids = torch.tensor([[1, 0, 2]])
    with pytest.raises(ValueError, match="contiguous"):
        tokens.left_align(ids, torch.tensor([[1, 0, 1]]))


def test_pad_columns():
    x = torch.ones(2, 5, dtype=torch.long)
    assert tokens.pad_columns(x, 4).shape == (2, 8) and tokens.pad_columns(x, 4)[:, 5:].sum() == 0
    assert tokens.pad_columns(x, 5) is x


def test_full_vocab_matches_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g, dtype=torch.float64).to(torch.bfloat16)
    labels = torch.randint(0, 11, (3, 5), generator=g)
    lp, ent = tokens.vocab_parallel_logprobs(logits, labels, temperature=0.7, with_entropy=True, chunk_tokens=4)
    torch.testing.assert_close(lp, logprobs_from_logits(logits.float() / 0.7, labels))
    torch.testing.assert_close(ent, entropy_from_logits(logits.float() / 0.7))


def _worker(rank, world, port, logits, labels, grad_lp, grad_ent, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        local = logits.chunk(world, dim=-1)[rank].clone().requires_grad_(True)
        lp, ent = tokens.vocab_parallel_logprobs(local, labels, dist.group.WORLD, temperature=1.3, with_entropy=True,
                                                 chunk_tokens=3)
        ((lp * grad_lp).sum() + (ent * grad_ent).sum()).backward()
        out[rank] = (lp.detach(), ent.detach(), local.grad)
        dist.barrier()  # a rank that leaves the group while its peer still talks to it aborts at exit (gloo)
    finally:
        dist.destroy_process_group()


def test_vocab_parallel_over_two_ranks_matches_full_vocab():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 4, 10, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 10, (2, 4), generator=g)
    grad_lp, grad_ent = torch.randn(2, 4, generator=g), torch.randn(2, 4, generator=g)
    ref = logits.clone().requires_grad_(True)
    lp_ref = logprobs_from_logits(ref / 1.3, labels)
    ent_ref = entropy_from_logits(ref / 1.3)
    ((lp_ref * grad_lp).sum() + (ent_ref * grad_ent).sum()).backward()

    out = result_dict()
    mp.start_processes(_worker, args=(2, free_port(), logits.float(), labels, grad_lp, grad_ent, out), nprocs=2,
                       join=True, start_method="spawn")
    for rank in range(2):
        lp, ent, grad = out[rank]
        torch.testing.assert_close(lp, lp_ref.float(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ent, ent_ref.float(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(grad, ref.grad.chunk(2, dim=-1)[rank].float(), atol=1e-5, rtol=1e-5)
