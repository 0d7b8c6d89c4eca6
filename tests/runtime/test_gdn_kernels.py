"""GDN kernel facts of a GPU node: where flash-linear-attention's chunked backward refuses the device (Hopper,
Triton 3.4.0 to 3.7.0, no usable TileLang: fla issue #640), and what the preflight makes of it (an FSDP run would
fail in its first update: an error before launch; the Megatron engine falls back: a warning). GPU, Triton and
TileLang are faked."""
import os
from types import SimpleNamespace

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from qwen35rl.config.compose import compose
from qwen35rl.config.problems import ERROR, WARNING
from qwen35rl.config.resolved import resolve_run
from qwen35rl.engines import gdn_kernels
from qwen35rl.runtime import preflight

HOPPER, AMPERE, BLACKWELL = (9, 0), (8, 0), (10, 0)


@pytest.mark.parametrize("capability,triton,tilelang,refused", [
    (HOPPER, "3.6.0", False, True),
    (HOPPER, "3.4.0", False, True),          # the first Triton with the miscompile
    (HOPPER, "3.7.0", False, True),
    (HOPPER, "3.6.0+git1a2b3c", False, True),
    (HOPPER, "3.7.1", False, False),         # fixed
    (HOPPER, "3.8.0", False, False),
    (HOPPER, "3.3.1", False, False),         # before the miscompile
    (HOPPER, "3.6.0", True, False),          # TileLang runs the kernel instead
    ((9, 1), "3.6.0", False, True),
    (AMPERE, "3.6.0", False, False),
    (BLACKWELL, "3.6.0", False, False),
    (HOPPER, None, False, False),            # no Triton: fla is not what runs
    (None, "3.6.0", False, False),
])
def test_refused_on_hopper_with_the_miscompiling_triton_and_no_tilelang(capability, triton, tilelang, refused):
    assert gdn_kernels.fla_gdn_backward_refused(capability, triton, tilelang) is refused




def test_tilelang_counts_only_when_fla_may_dispatch_to_it(monkeypatch):
    """fla's dispatch skips TileLang without the package, without nvcc for its JIT, with FLA_TILELANG=0 or with
    FLA_DISABLE_BACKEND_DISPATCH=1."""
    import importlib.util
    import sys
    import types

    nvcc = {"found": True}
    fla_utils = types.ModuleType("fla.utils")
    fla_utils.has_usable_nvcc = lambda: nvcc["found"]
    monkeypatch.setitem(sys.modules, "fla", types.ModuleType("fla"))
    monkeypatch.setitem(sys.modules, "fla.utils", fla_utils)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: SimpleNamespace(name=name))
    monkeypatch.delenv("FLA_TILELANG", raising=False)
    monkeypatch.delenv("FLA_DISABLE_BACKEND_DISPATCH", raising=False)
    assert gdn_kernels.fla_tilelang_usable()
    nvcc["found"] = False
    assert not gdn_kernels.fla_tilelang_usable()
    nvcc["found"] = True
    for var in ("FLA_TILELANG", "FLA_DISABLE_BACKEND_DISPATCH"):
        with monkeypatch.context() as env:
            env.setenv(var, "0" if var == "FLA_TILELANG" else "1")
            assert not gdn_kernels.fla_tilelang_usable(), var
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert not gdn_kernels.fla_tilelang_usable()


def _fake_node(monkeypatch, *, fla, capability, triton, tilelang):
    monkeypatch.setattr(gdn_kernels, "fla_version", lambda: fla)
    monkeypatch.setattr(gdn_kernels, "triton_version", lambda: triton)
    monkeypatch.setattr(gdn_kernels, "fla_tilelang_usable", lambda: tilelang)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: capability is not None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


def test_probe_reports_a_refusing_node_only_when_fla_is_there(monkeypatch):
    _fake_node(monkeypatch, fla="0.6.0", capability=HOPPER, triton="3.6.0", tilelang=False)
    assert gdn_kernels.probe() == {"fla": "0.6.0", "triton": "3.6.0", "capability": [9, 0], "tilelang_usable": False,
                                   "fla_backward_refused": True}
    _fake_node(monkeypatch, fla=None, capability=HOPPER, triton="3.6.0", tilelang=True)
    assert gdn_kernels.probe()["fla_backward_refused"] is False  # transformers runs its torch code: nothing refuses
    _fake_node(monkeypatch, fla="0.6.0", capability=HOPPER, triton="3.6.0", tilelang=True)
    assert gdn_kernels.probe()["fla_backward_refused"] is False


def _probe(host, refused, fla="0.6.0"):
    return {"hostname": host, "address": "10.0.0.1", "packages": {}, "device_name": "NVIDIA H200",
            "gdn": {"fla": fla, "triton": "3.6.0", "capability": [9, 0], "tilelang_usable": False,
                    "fla_backward_refused": refused}}


def test_fsdp_run_on_a_refusing_node_is_refused_before_launch():
    cfg = resolve_run(compose(["hw=gpu_1node", "backend=fsdp", "rollout=hf"]))
    found = preflight.gdn_problems(cfg, [_probe("n1", True), _probe("n2", True), _probe("n3", False)])
    assert [(p.code, p.severity, p.key) for p in found] == [("fla_gdn_backward_refused", ERROR, "backend.name")]
    msg = found[0].message
    assert "n1, n2" in msg and "n3" not in msg and "0.6.0" in msg and "Triton 3.6.0" in msg and "#640" in msg
    assert "tilelang" in found[0].hint and "3.7.1" in found[0].hint and "uninstall flash-linear-attention" in found[0].hint
    assert preflight.gdn_problems(cfg, [_probe("n1", False)]) == []
    assert preflight.gdn_problems(cfg, [{"hostname": "cpu", "packages": {}}]) == []  # CPU probes carry no GDN facts


def test_megatron_run_on_a_refusing_node_is_warned_about():
    cfg = resolve_run(compose(["hw=gpu_1node", "backend=megatron", "rollout=hf"]))
    found = preflight.gdn_problems(cfg, [_probe("n1", True)])
    assert [(p.code, p.severity) for p in found] == [("fla_gdn_backward_refused", WARNING)]
    assert "torch GDN recurrence" in found[0].message


def test_megatron_on_a_refusing_node_is_checked_against_the_torch_recurrences_memory():
    """The torch recurrence keeps several times fla's activations: the preflight re-estimates with it and refuses
    the run when that no longer fits, where the plan (which assumes fla's kernels) said it did."""
    from qwen35rl.config.layout import derive_layout
    from qwen35rl.config.memory import estimate

    base = ["model=qwen3_5_0_8b", "hw=gpu_1x", "backend=megatron", "rollout=hf", "data.max_response_length=512",
            "backend.param_offload=false", "backend.grad_offload=false", "backend.optimizer_offload=false",
            "backend.optimizer_cpu_offload=false"]
    fits = compose(base + ["backend.micro_batch_size_per_device=4"])
    (p,) = preflight.gdn_problems(resolve_run(fits), [_probe("n1", True)])
    torch_est = estimate(fits, derive_layout(fits), gdn="torch")
    torch_peak = max(torch_est.train_peak_gib, torch_est.rollout_peak_gib)
    assert p.severity == WARNING and f"estimated {torch_peak:.1f} GiB per device" in p.message
    tight = compose(base + ["backend.micro_batch_size_per_device=16", "hw.memory_gb=75"])
    plan, torch_est = (estimate(tight, derive_layout(tight), gdn=g) for g in ("fla", "torch"))
    assert plan.fits and not torch_est.fits                      # the plan alone would let it start
    (p,) = preflight.gdn_problems(resolve_run(tight), [_probe("n1", True)])
    assert p.severity == ERROR and "would run out of memory" in p.message
