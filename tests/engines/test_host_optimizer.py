"""The host-side optimizer step of an offloaded trainer: the fused AdamW and the row-wise norm give the values of
the default ones; the thread share is restored whatever happens inside."""
import pytest
import torch

from qwen35rl.engines import host_optimizer


class _Backend:
    lr, betas, weight_decay = 1e-2, (0.9, 0.95), 0.1


def _trained(on_host: bool):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 33)), torch.nn.Parameter(torch.randn(129))]
    opt = host_optimizer.adamw(params, _Backend, on_host=on_host)
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return opt, params


def test_host_adamw_is_fused_and_steps_like_the_default():
    fused, fused_params = _trained(on_host=True)
    plain, plain_params = _trained(on_host=False)
    assert fused.defaults["fused"] is True and not plain.defaults["fused"]
    for a, b in zip(fused_params, plain_params):
        assert not torch.equal(a, torch.zeros_like(a))
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("on_host", [True, False])
def test_squared_norm_matches_the_float64_sum(on_host):
    torch.manual_seed(1)
    grads = [torch.randn(300, 70) * 1e3, torch.randn(5) * 1e-3, torch.randn(4096), torch.randn(3, 4096) + 2]
    exact = sum(float((g.double() ** 2).sum()) for g in grads)
    sq = host_optimizer.squared_norm(grads, on_host, torch.device("cpu"))
    assert sq.dtype == torch.float64
    assert float(sq) == pytest.approx(exact, rel=1e-7 if on_host else 1e-12)


def test_torch_threads_restores_the_count_after_an_error():
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError):
        with host_optimizer.torch_threads(before + 1):
            assert torch.get_num_threads() == before + 1
            raise RuntimeError("step failed")
    assert torch.get_num_threads() == before


def test_node_thread_share(monkeypatch):
    monkeypatch.setattr(host_optimizer.os, "cpu_count", lambda: 128)
    assert host_optimizer.node_thread_share(8) == 16
    assert host_optimizer.node_thread_share(0) == 128
    monkeypatch.setattr(host_optimizer.os, "cpu_count", lambda: None)
    assert host_optimizer.node_thread_share(8) == 1
