"""When flash-linear-attention's chunked GDN backward refuses the GPU (Hopper, Triton 3.4.0 to 3.7.0, no usable
TileLang: fla issue #640), the Megatron policy trains with megatron-core's torch GDN recurrence unless the user chose.
The GPU, Triton and TileLang are faked: no GPU or megatron-core needed."""
import logging
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from qwen35rl.engines.megatron import build

HOPPER, AMPERE, BLACKWELL = (9, 0), (8, 0), (10, 0)


def _gpu(monkeypatch, capability, triton, tilelang):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(build, "triton_version", lambda: triton)
    monkeypatch.setattr(build, "fla_tilelang_usable", lambda: tilelang)


def _choose(overrides, reference=False, device="cuda"):
    build.gdn_fallback(overrides, reference=reference, device=torch.device(device))
    return overrides


def test_policy_falls_back_to_the_torch_recurrence_with_one_log_line(monkeypatch, caplog):
    _gpu(monkeypatch, HOPPER, "3.6.0", tilelang=False)
    with caplog.at_level(logging.INFO, logger=build.__name__):
        assert _choose({"moe_token_dispatcher_type": "alltoall"}) == {"moe_token_dispatcher_type": "alltoall",
                                                                      "deterministic_mode": True}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "#640" in lines[0] and "9.0" in lines[0] and "3.6.0" in lines[0]


@pytest.mark.parametrize("chosen", [True, False])
def test_an_explicit_deterministic_mode_is_kept(monkeypatch, caplog, chosen):
    _gpu(monkeypatch, HOPPER, "3.6.0", tilelang=False)
    with caplog.at_level(logging.INFO, logger=build.__name__):
        assert _choose({"deterministic_mode": chosen}) == {"deterministic_mode": chosen}
    assert not caplog.records


@pytest.mark.parametrize("gpu,reference,device", [
    ((HOPPER, "3.6.0", True), False, "cuda"),    # TileLang present
    ((HOPPER, "3.7.1", False), False, "cuda"),   # fixed Triton
    ((AMPERE, "3.6.0", False), False, "cuda"),
    ((HOPPER, "3.6.0", False), True, "cuda"),    # the reference runs no backward
    ((HOPPER, "3.6.0", False), False, "cpu"),
])
def test_fla_kernels_stay_where_they_work(monkeypatch, gpu, reference, device):
    _gpu(monkeypatch, *gpu)
    assert _choose({}, reference=reference, device=device) == {}
