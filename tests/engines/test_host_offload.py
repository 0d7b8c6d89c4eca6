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
