"""verl 0.9.1's own Hydra config tree, from the PyPI wheel (downloaded once into .cache/, never installed or
imported), and composition against it. Composing checks key names, `+` usage and values; verl's dataclass checks
(omega_conf_to_dataclass at run time) are not run, so this is weaker than verl accepting the config."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any, Dict, Sequence

ROOT = Path(__file__).resolve().parents[3]
VERSION = "0.9.1"
CACHE = ROOT / ".cache" / f"verl-{VERSION}"
TREE = CACHE / "verl" / "trainer" / "config"


def config_tree() -> Path:
    """The extracted verl/trainer/config of the pinned wheel (downloaded on first use)."""
    if (TREE / "ppo_trainer.yaml").is_file():
        return TREE
    CACHE.mkdir(parents=True, exist_ok=True)
    wheels = list(CACHE.glob(f"verl-{VERSION}-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"verl=={VERSION}", "-d",
                        str(CACHE)], check=True, timeout=300)
        wheels = list(CACHE.glob(f"verl-{VERSION}-*.whl"))
    with zipfile.ZipFile(wheels[0]) as z:
        z.extractall(CACHE, [n for n in z.namelist() if n.startswith("verl/trainer/config/")])
    return TREE


def compose_verl(overrides: Sequence[str]) -> Dict[str, Any]:
    """verl's composed config (ppo_trainer with the overrides, as `python3 -m verl.trainer.main_ppo` builds it),
    interpolations resolved. Raises Hydra's error when an override does not compose."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_tree()), version_base=None):
        cfg = compose("ppo_trainer", overrides=list(overrides))
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)


def override_value(override: str) -> Any:
    """The value Hydra parses from one override."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_override(override).value()
