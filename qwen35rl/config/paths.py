"""Where the Hydra config tree lives: inside the installed wheel, or `conf/` of a source checkout."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator, List, Optional

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


@contextlib.contextmanager
def config_path_set(value: Optional[str]) -> Iterator[None]:
    """QWEN35RL_CONFIG_PATH set to `value` for the block (None: left as it is), then restored."""
    old = os.environ.get(ENV_CONFIG_PATH)
    if value is not None:
        os.environ[ENV_CONFIG_PATH] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ENV_CONFIG_PATH, None)
        else:
            os.environ[ENV_CONFIG_PATH] = old


def unwritable_dir(path: str) -> Optional[str]:
    """Why the directory `path` cannot be made here (its nearest existing ancestor is a file, or not writable), or
    None when it can."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        return f"{probe} is not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable"
    return None
