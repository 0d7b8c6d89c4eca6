"""The everyday grid: every released Qwen3.5 size x every accelerator preset x both backends x text and image data,
read from `conf/` (a new model file with an `hf_id`, or a new hw preset that is not a CPU, joins it). Every cell
whose model plainly fits (`plainly_fits`) must plan valid with its defaults (tests/config/test_default_grid.py).

Where the default layout (Megatron TP1 / EP1, rollout TP1) does not fit, the cell gets a layout file of its own,
`conf/parallelism/<backend>/<model>@<hw>.yaml`, written by `python -m qwen35rl.config.default_grid --write`: the
layout search's best on image data (the larger: the vision tower trains), checked valid on text data too, with the
reason in its comment. Files that exist are never rewritten (the reference runs' tested layouts among them).
Torch-free."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

from omegaconf import OmegaConf

from qwen35rl.config.engine_specs import TRAIN_ENGINES, train_engine
from qwen35rl.config.paths import config_dir
from qwen35rl.config.physical_fit import plainly_fits

DATA = ("gsm8k", "geo3k")
"""Text and image data (the reference runs' geo3k)."""
BACKENDS = tuple(TRAIN_ENGINES)
def models() -> List[str]:
    """The released sizes: conf/model files that name a hub checkpoint (the tiny test models do not)."""
    out = []
    for f in sorted((config_dir() / "model").glob("*.yaml")):
        if OmegaConf.load(f).get("hf_id"):
            out.append(f.stem)
    return out


def hardware() -> List[str]:
    """The accelerator presets: conf/hw files not on the CPU platform."""
    out = []
    for f in sorted((config_dir() / "hw").glob("*.yaml")):
        node = OmegaConf.to_container(OmegaConf.load(f))
        if not any("platform/cpu" in str(d) for d in node.get("defaults", [])):
            out.append(f.stem)
    return out


def cells() -> Iterator[Tuple[str, str, str, str]]:
    for model in models():
        for hw in hardware():
            for backend in BACKENDS:
                for data in DATA:
                    yield model, hw, backend, data


def overrides(model: str, hw: str, backend: str, data: str) -> List[str]:
    return [f"model={model}", f"hw={hw}", f"backend={backend}", f"data={data}"]


def _errors(plan: Dict[str, Any]) -> List[Dict[str, Any]]:
    return [p for p in plan["problems"] if p["severity"] == "error"]


def layout_file(model: str, hw: str, backend: str) -> Path:
    return config_dir() / "parallelism" / backend / f"{model}@{hw}.yaml"


def searched(model: str, hw: str, backend: str) -> Optional[Any]:
    """The search's best layout on image data, from the default composition: there DP is the world's (TP1 / SP1), so
    the default batch sizes split over the DP of every layout and each is ranked on the same work. (The layout
    file's own DP then sets the batch sizes a run takes: `batch_scale`.)"""
    from qwen35rl.config import layout_search
    from qwen35rl.config.compose import compose

    found = layout_search.search(compose([*overrides(model, hw, backend, "geo3k"), "parallelism=auto"]))
    return found[0] if found else None


def file_text(model: str, hw: str, backend: str, candidate: Any, why: str) -> str:
    import textwrap

    keys = train_engine(backend).layout_keys
    s = candidate.settings
    engine = s["parallelism.rollout.ep"] > 1  # one DP-attention engine: its DP and EP are part of the layout
    rollout = ", ".join(f"{k}: {s[f'parallelism.rollout.{k}']}" for k in (("tp", "dp", "ep") if engine else ("tp",)))
    text = (f"Searched layout for {backend} {model} on {hw} (not yet run on that hardware). The default layout does "
            f"not fit here ({why}); this is parallelism=auto's best on image data (geo3k: the vision tower trains), "
            "which plans valid on text data too. Written by `python -m qwen35rl.config.default_grid --write`; "
            "tests/config/test_default_grid.py checks it.")
    if candidate.variant:
        text += " The search's best takes the trainer settings below (ranked with their cost)."
    lines = ["# @package _global_", *("# " + line for line in textwrap.wrap(text, 116)), "parallelism:",
             f"  name: {backend}/{model}@{hw}", *(f"  {k}: {s[f'parallelism.{k}']}" for k in keys),
             f"  rollout: {{{rollout}}}"]
    if candidate.variant:
        lines += ["backend:", *(f"  {k.split('.', 1)[1]}: {str(v).lower()}" for k, v in candidate.variant.items())]
    return "\n".join(lines) + "\n"


def _why(plan: Dict[str, Any]) -> str:
    errs = _errors(plan)
    return "; ".join(f"{p['code']}: {p['message']}" for p in errs[:1]).replace("\n", " ")


def plan_of(model: str, hw: str, backend: str, data: str) -> Dict[str, Any]:
    from qwen35rl.config.compose import compose
    from qwen35rl.config.plan import build_plan

    return build_plan(compose(overrides(model, hw, backend, data)))


def write_missing(out=sys.stdout) -> List[Path]:
    """A layout file for every (model, hw, backend) with a plainly fitting cell whose default plan is invalid and
    which has no layout file yet; each is written only when both data sets then plan valid."""
    from qwen35rl.config.compose import compose

    written = []
    for model in models():
        for hw in hardware():
            for backend in BACKENDS:
                path = layout_file(model, hw, backend)
                if path.exists():
                    continue
                failing = [d for d in DATA if plainly_fits(compose(overrides(model, hw, backend, d)))
                           and not plan_of(model, hw, backend, d)["valid"]]
                if not failing:
                    continue
                why = _why(plan_of(model, hw, backend, failing[-1]))
                best = searched(model, hw, backend)
                if best is None:
                    print(f"{backend}/{model}@{hw}: no layout fits ({why})", file=out)
                    continue
                path.write_text(file_text(model, hw, backend, best, why))
                bad = [d for d in DATA if not plan_of(model, hw, backend, d)["valid"]]
                if bad:
                    path.unlink()
                    print(f"{backend}/{model}@{hw}: the search's best {best.overrides} is invalid on {bad}", file=out)
                    continue
                written.append(path)
                print(f"wrote {path}: {' '.join(best.overrides)}", file=out)
    return written


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qwen35rl.config.default_grid", description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="write the missing layout files")
    args = parser.parse_args(argv)
    if args.write:
        write_missing()
        return 0
    total = fits = valid = 0
    for cell in cells():
        total += 1
        from qwen35rl.config.compose import compose

        if not plainly_fits(compose(overrides(*cell))):
            continue
        fits += 1
        plan = plan_of(*cell)
        valid += plan["valid"]
        if not plan["valid"]:
            print(" ".join(cell), [p["code"] for p in _errors(plan)])
    print(f"{total} cells, {fits} plainly fit, {valid} of them plan valid with their defaults")
    return 0


if __name__ == "__main__":
    sys.exit(main())
