"""The device platform of a run, read from `cfg.hw` (the config layer already resolved cuda / npu / cpu): torch
device type, collective backend, Ray resource name and the environment every worker process gets."""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from omegaconf import OmegaConf

from qwen35rl.config import engine_specs

DEVICE_TYPES = ("cpu", "cuda", "npu")


class PlatformError(RuntimeError):
    """The software stack this platform needs is not installed."""


@dataclass(frozen=True)
class Platform:
    device_type: str
    """`cpu`, `cuda` or `npu` (torch device type)."""
    collective_backend: str
    """torch.distributed backend: gloo, nccl or hccl."""
    ray_resource: str
    """Ray resource that counts devices: CPU, GPU or NPU."""
    worker_env: Dict[str, str] = field(default_factory=dict)
    """hw.env with backend.env merged over it: the environment of every worker process."""

    @property
    def is_accelerator(self) -> bool:
        return self.device_type != "cpu"

    def bundle(self) -> Dict[str, float]:
        """One placement-group bundle = one device (plus a CPU for its worker process on accelerators)."""
        return {"CPU": 1.0} if self.ray_resource == "CPU" else {self.ray_resource: 1.0, "CPU": 1.0}

    def local_device_index(self, accelerator_ids: Optional[list]) -> int:
        """Index of this worker's device among those the process sees. Ray narrows CUDA_VISIBLE_DEVICES to the
        assigned GPU (index 0); on Ascend with RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES every die stays
        visible, so the index is the id Ray assigned."""
        if not self.is_accelerator:
            return 0
        visible = device_module(self.device_type).device_count()
        if visible <= 1 or not accelerator_ids:
            return 0
        return int(accelerator_ids[0]) % visible

    def torch_device(self, index: int = 0):
        import torch

        if not self.is_accelerator:
            return torch.device("cpu")
        device_module(self.device_type).set_device(index)
        return torch.device(self.device_type, index)

    def device_module(self):
        """torch.cuda / torch.npu of this platform, None on CPU."""
        return device_module(self.device_type) if self.is_accelerator else None

    def manual_seed_device(self, seed: int) -> None:
        if self.is_accelerator:
            device_module(self.device_type).manual_seed_all(seed)


def resolve_platform(cfg: Any) -> Platform:
    """The Platform of a resolved run config."""
    hw, backend = cfg.hw, cfg.backend
    device = str(hw.device)
    if device not in DEVICE_TYPES:
        raise PlatformError(f"hw.device={device!r}: expected one of {', '.join(DEVICE_TYPES)}")
    env = {str(k): str(v) for k, v in _plain(hw.get("env")).items()}
    env.update({str(k): str(v) for k, v in _plain(backend.get("env")).items()})
    return Platform(device_type=device, collective_backend=str(hw.collective_backend),
                    ray_resource=str(hw.ray_resource), worker_env=env)


def require_stack(platform: Platform, rollout_engine: str) -> None:
    """Import what the platform and the rollout engine need, failing with the install command when missing.
    Called in the driver before Ray starts and again in each worker (which may run on another image)."""
    if platform.device_type == "npu":
        try:
            importlib.import_module("torch_npu")
        except ImportError as e:
            raise PlatformError(
                f"hw.device=npu needs torch_npu ({e}). Install the Ascend stack: CANN, then "
                "`pip install 'qwen35rl[npu]'` (torch_npu matching your torch), and source "
                "/usr/local/Ascend/ascend-toolkit/set_env.sh") from None
    if engine_specs.rollout_uses(str(rollout_engine), "vllm"):
        try:
            importlib.import_module("vllm")
        except ImportError as e:
            where = ("vllm-ascend (from Ascend's sources, matching vLLM and CANN)" if platform.device_type == "npu"
                     else "`pip install 'qwen35rl[gpu]'` on the cluster image")
            raise PlatformError(f"rollout.engine={rollout_engine} needs vLLM ({e}): install {where}, "
                                "or use rollout=hf") from None


def device_module(device_type: str):
    """`torch.cuda` or `torch.npu` (registered by torch_npu)."""
    import torch

    if device_type == "npu":
        importlib.import_module("torch_npu")
    return getattr(torch, device_type)


def _plain(node: Any) -> Dict[str, Any]:
    if node is None:
        return {}
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node)


def apply_env(env: Dict[str, str]) -> None:
    """Set the worker environment in this process (Ray's runtime env sets it at process start; this also covers
    variables read lazily, and a driver that runs a worker in-process)."""
    for k, v in env.items():
        os.environ.setdefault(k, v)
