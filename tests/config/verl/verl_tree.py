"""verl's own Hydra config trees, from PyPI wheels (downloaded once into .cache/, never installed or imported), and
composition against them: verl 0.9.1 (pinned, what the exporter writes for) and the newest release PyPI carries
(asked once a day through pip, remembered in .cache/verl-newest.txt; the pinned one when PyPI cannot be asked).
Composing checks key names, `+` usage and values; verl's dataclass checks (omega_conf_to_dataclass at run time)
are not run, so this is weaker than verl accepting the config."""
from __future__ import annotations

import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any, Dict, List, Sequence

ROOT = Path(__file__).resolve().parents[3]
VERSION = "0.9.1"
CACHE_ROOT = ROOT / ".cache"
CACHE = CACHE_ROOT / f"verl-{VERSION}"
TREE = CACHE / "verl" / "trainer" / "config"
NEWEST_FILE = CACHE_ROOT / "verl-newest.txt"
NEWEST_MAX_AGE_S = 24 * 3600


def _key(version: str) -> tuple:
    return tuple(int(x) if x.isdigit() else -1 for x in re.split(r"[.+-]", version))


def newest_version() -> str:
    """The newest verl release PyPI carries (final releases only), at most a day old; the pinned VERSION when pip
    cannot tell and nothing is remembered."""
    if NEWEST_FILE.is_file() and time.time() - NEWEST_FILE.stat().st_mtime < NEWEST_MAX_AGE_S:
        text = NEWEST_FILE.read_text().strip()
        if text:
            return text
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "verl"], capture_output=True,
                             text=True, timeout=120).stdout
        m = re.search(r"Available versions:\s*(.+)", out)
        versions = [v.strip() for v in m.group(1).split(",")] if m else []
        versions = [v for v in versions if re.fullmatch(r"\d+(\.\d+)*(\.post\d+)?", v)]
    except (OSError, subprocess.SubprocessError):
        versions = []
    if not versions:
        return NEWEST_FILE.read_text().strip() if NEWEST_FILE.is_file() else VERSION
    newest = max(versions, key=_key)
    CACHE_ROOT.mkdir(parents=True, exist_ok=True)
    NEWEST_FILE.write_text(newest + "\n")
    return newest


def versions() -> List[str]:
    """The trees exports are composed in: the pinned release and PyPI's newest (once when they are the same)."""
    return sorted({VERSION, newest_version()}, key=_key)


def config_tree(version: str = VERSION) -> Path:
    """The extracted verl/trainer/config of that release's wheel (downloaded on first use)."""
    cache = CACHE_ROOT / f"verl-{version}"
    tree = cache / "verl" / "trainer" / "config"
    if (tree / "ppo_trainer.yaml").is_file():
        return tree
    cache.mkdir(parents=True, exist_ok=True)
    wheels = list(cache.glob(f"verl-{version}-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"verl=={version}", "-d",
                        str(cache)], check=True, timeout=300)
        wheels = list(cache.glob(f"verl-{version}-*.whl"))
    with zipfile.ZipFile(wheels[0]) as z:
        z.extractall(cache, [n for n in z.namelist() if n.startswith("verl/trainer/config/")])
    return tree


def compose_verl(overrides: Sequence[str], version: str = VERSION) -> Dict[str, Any]:
    """verl's composed config (ppo_trainer with the overrides, as `python3 -m verl.trainer.main_ppo` builds it),
    interpolations resolved. Raises Hydra's error when an override does not compose."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_tree(version)), version_base=None):
        cfg = compose("ppo_trainer", overrides=list(overrides))
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)


def override_value(override: str) -> Any:
    """The value Hydra parses from one override."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_override(override).value()
