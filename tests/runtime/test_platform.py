"""Platform facts from hw: device type, backend, Ray resource, worker env; clear errors for missing stacks."""
import sys
import types

import pytest

from qwen35rl.config.compose import compose
from qwen35rl.runtime.platform import PlatformError, require_stack, resolve_platform


@pytest.mark.parametrize("hw,device,backend,resource", [
    ("cpu", "cpu", "gloo", "CPU"), ("gpu_1node", "cuda", "nccl", "GPU"), ("a3_1node", "npu", "hccl", "NPU")])
def test_platform_from_hw(hw, device, backend, resource):
    p = resolve_platform(compose([f"hw={hw}"]))
    assert (p.device_type, p.collective_backend, p.ray_resource) == (device, backend, resource)
    assert p.bundle() == ({"CPU": 1.0} if resource == "CPU" else {resource: 1.0, "CPU": 1.0})


def test_worker_env_merges_backend_over_hw():
    cfg = compose(["hw=a3_1node", "+backend.env.HCCL_BUFFSIZE=600", "+backend.env.EXTRA=1"])
    env = resolve_platform(cfg).worker_env
    assert env["HCCL_BUFFSIZE"] == "600" and env["EXTRA"] == "1"
    assert env["NDEVICES_PER_NODE"] == "16" and env["OMP_NUM_THREADS"] == "1"


def test_missing_stacks_name_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)   # `import torch_npu` fails
    monkeypatch.setitem(sys.modules, "vllm", None)
    npu = resolve_platform(compose(["hw=a3_1node"]))
    with pytest.raises(PlatformError, match="torch_npu"):
        require_stack(npu, "hf")
    with pytest.raises(PlatformError, match=r"qwen35rl\[gpu\]"):
        require_stack(resolve_platform(compose(["hw=gpu_1node"])), "vllm")
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))  # Ascend stack present
    with pytest.raises(PlatformError, match="vllm-ascend"):
        require_stack(npu, "vllm")
    require_stack(resolve_platform(compose(["hw=cpu"])), "hf")  # nothing extra needed on CPU
