"""Where the Hydra config tree lives: inside the installed wheel, or `conf/` of a source checkout."""
from __future__ import annotations

import os
from pathlib import Path
from typing import List

ENV_CONFIG_PATH = "QWEN35RL_CONFIG_PATH"


def config_dir() -> Path:
    """The packaged `qwen35rl/conf` when installed from a wheel, else `<checkout>/conf`."""
    pkg = Path(__file__).resolve().parents[1]
    for candidate in (pkg / "conf", pkg.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError(f"qwen35rl's config tree is missing (looked in {pkg / 'conf'} and {pkg.parent / 'conf'})")


def extra_config_dirs() -> List[Path]:
    """Overlay directories from QWEN35RL_CONFIG_PATH (os.pathsep-separated), in order."""
    raw = os.environ.get(ENV_CONFIG_PATH, "")
    return [Path(p).expanduser().resolve() for p in raw.split(os.pathsep) if p.strip()]
