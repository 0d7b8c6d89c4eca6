"""Where compiled kernels are kept between runs (`trainer.kernel_cache_dir`). A cold start of the vLLM rollout on an
H100 took minutes, most of it compiling and autotuning kernels (Triton's GDN kernels, torch.compile, CUDA graphs);
with the caches on a path that outlives the run, the next start reuses them. Each worker points the caches there
before anything compiles; a variable the user's environment already sets wins."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Dict

log = logging.getLogger(__name__)

CACHES = {
    "TRITON_CACHE_DIR": "triton",
    "TILELANG_CACHE_DIR": "tilelang",
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "VLLM_CACHE_ROOT": "vllm",
}
"""Environment variable -> subdirectory of the kernel cache."""


def cache_root(cfg: Any) -> Path:
    configured = cfg["trainer"]["kernel_cache_dir"]
    root = Path(str(configured)) if configured else Path(str(cfg["trainer"]["output_root"])) / ".kernel_cache"
    return root.resolve()


def cache_env(cfg: Any) -> Dict[str, str]:
    """The variables that put every kernel cache under `trainer.kernel_cache_dir`; Triton also keeps its autotuning
    results there (without them every start autotunes again)."""
    root = cache_root(cfg)
    env = {var: str(root / sub) for var, sub in CACHES.items()}
    env["TRITON_CACHE_AUTOTUNING"] = "1"
    return env


def apply(cfg: Any) -> Dict[str, str]:
    """Set the cache variables in this process (setdefault); returns what is in effect."""
    for key, value in cache_env(cfg).items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in cache_env(cfg)}


def is_cold(env: Dict[str, str]) -> bool:
    """No compiled Triton kernel and no vLLM compile cache yet: this start compiles from scratch."""
    def empty(path: str) -> bool:
        p = Path(path)
        return not p.is_dir() or not any(p.iterdir())

    return empty(env.get("TRITON_CACHE_DIR", "")) and empty(os.path.join(env.get("VLLM_CACHE_ROOT", ""),
                                                                          "torch_compile_cache"))
