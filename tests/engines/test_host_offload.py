"""Device storages to the host and back in place: views stay valid, a shared storage moves once."""
import torch

from qwen35rl.engines.host_offload import HostOffload


def test_offload_frees_storages_and_reload_restores_them_in_place():
    buffer = torch.randn(10)
    a, b = buffer[:4], buffer[4:].view(2, 3)  # views into one buffer, as megatron's parameters are
    other = torch.randn(3)
    before = [t.clone() for t in (buffer, other)]
    host = HostOffload()
    assert host.offload([a, b, other]) == 10 * 4 + 3 * 4  # the buffer once, then `other`
    assert buffer.untyped_storage().nbytes() == 0 and other.untyped_storage().nbytes() == 0
    assert host.offloaded_bytes == 52 and host.offload([a]) == 0  # already away
    assert host.reload() == 52 and host.offloaded_bytes == 0
    assert torch.equal(buffer, before[0]) and torch.equal(other, before[1])
    assert torch.equal(b, before[0][4:].view(2, 3))
    a.add_(1)  # the view still writes into the buffer
    assert torch.equal(buffer[:4], before[0][:4] + 1)
    assert host.reload() == 0  # nothing away: a no-op


def test_empty_storages_are_skipped():
    assert HostOffload().offload([torch.empty(0)]) == 0


def test_host_buffers_are_reused_across_cycles():
    t = torch.randn(6)
    host = HostOffload()
    host.offload([t])
    first = host._host[t.untyped_storage()._cdata]
    host.reload()
    t.mul_(2)
    expected = t.clone()
    host.offload([t])
    assert host._host[t.untyped_storage()._cdata] is first  # the same host buffer, refilled
    host.reload()
    assert torch.equal(t, expected)


def test_megatron_engine_offloads_only_what_is_on_its_device():
    """With backend.optimizer_cpu_offload megatron's hybrid optimizer keeps its fp32 states on the host (some in
    pinned storages that cannot be resized): the between-phase offload leaves them alone and moves only device
    tensors (here the 'meta' device stands in for the accelerator)."""
    from functools import partial
    from types import SimpleNamespace

    from qwen35rl.engines.megatron.engine import MegatronTrainEngine

    layer = torch.nn.Linear(2, 2, device="meta")
    host_param = torch.zeros(6)
    host_opt = torch.optim.Adam([host_param])
    host_opt.state[host_param] = {"exp_avg": torch.zeros(6), "exp_avg_sq": torch.zeros(6)}
    eng = SimpleNamespace(device=torch.device("meta"), chunks=[layer], reference=False, optimizer=object(),
                          backend=SimpleNamespace(param_offload=True, grad_offload=False, optimizer_offload=True),
                          _torch_optimizers=lambda: [host_opt])
    eng._offload_candidates = partial(MegatronTrainEngine._offload_candidates, eng)
    assert len(list(eng._offload_candidates())) == 2 + 3  # the layer's weight and bias, the host param and moments
    moved = list(MegatronTrainEngine._offloadable(eng))
    assert [t.device.type for t in moved] == ["meta", "meta"]
