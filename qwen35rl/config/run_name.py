"""The default run name and the hardware label: what a run directory and the plan's first line call a run.

`trainer.run_name` defaults to `${model.name}-${data.name}-${algorithm.name}-${qwen35rl_layout:}-${qwen35rl_hw:}`,
e.g. `qwen3_5_4b-gsm8k-dapo-megatron-tp2-dp4-gpu_1node`: the same command again resumes in the same directory, and
runs that differ in data, algorithm or layout do not share one. A name the user sets is kept as it is.

- The layout tag (`layout_tag`) is the training layout's degrees above 1: FSDP `fsdp<shard group>` (`x<replicas>`
  for HSDP, `-sp<n>` for Ulysses SP), e.g. `fsdp8`, `fsdp4x2-sp2`; Megatron `megatron-tp2-pp2-ep8-dp4` (its data
  parallel always). `parallelism=auto` is `<backend>-auto` (the search's choice may change; the directory does
  not), and placement=split adds `-split<rollout devices>` (`-split-auto` while the pool size is searched).
- The hardware label (`hw_label`) is `hw.name` while the node and device counts are the preset's; when an overlay
  or the command line changes them (`hw=gpu_1node` with `hw.nodes=4`), it is `<kind>_<nodes>x<devices per node>`
  (`gpu_4x8`), as `qwen35rl-import verl` names new hardware. The preset's counts are read from its file on the
  search path.

Standard library and omegaconf only."""
from __future__ import annotations

import re
from typing import Any, Dict, Optional, Tuple

LAYOUT_RESOLVER = "qwen35rl_layout"
HW_RESOLVER = "qwen35rl_hw"


def _get(node: Any, key: str, default: Any = None) -> Any:
    try:
        return node[key]
    except (KeyError, TypeError, AttributeError):
        return default


def layout_tag(root: Any) -> str:
    """The training layout in a few characters (see the module's doc)."""
    backend = str(_get(_get(root, "backend"), "name", "engine"))
    p = _get(root, "parallelism") or {}
    pl = _get(root, "placement") or {}
    split = str(_get(pl, "mode", "colocated")) == "split"
    rollout_devices = _get(pl, "rollout_devices")
    if bool(_get(p, "auto", False)):
        return f"{backend}-auto"
    if split and rollout_devices is None:
        return f"{backend}-split-auto"
    from qwen35rl.config.engine_specs import TRAIN_ENGINES, declared
    from qwen35rl.config.layout import derive_layout

    try:
        layout = derive_layout(root)
    except Exception:  # a value out of range: the rules say so; the name needs only to exist
        return backend
    spec = declared(TRAIN_ENGINES, backend)
    if spec is not None and not spec.model_parallel:  # its shard group and replicas, and Ulysses SP
        shard = layout.fsdp_size if layout.fsdp_size > 0 else layout.world
        replicas = layout.world // shard if shard and layout.world % shard == 0 else 1
        tag = (f"{backend}{shard}" + (f"x{replicas}" if replicas > 1 else "")
               + (f"-sp{layout.sp}" if layout.sp > 1 else ""))
    else:
        degrees = [f"{k}{v}" for k, v in (("tp", layout.tp), ("pp", layout.pp), ("vpp", layout.vpp or 1),
                                           ("cp", layout.cp), ("ep", layout.ep), ("etp", layout.etp)) if v > 1]
        tag = "-".join([backend, *degrees, f"dp{layout.dp}"])
    return tag + (f"-split{rollout_devices}" if split else "")


_PRESETS: Dict[Tuple[str, int, int], Optional[Tuple[int, int]]] = {}


def preset_counts(name: str) -> Optional[Tuple[int, int]]:
    """(nodes, devices per node) that the hw option `name` sets in its file (the last on the search path; through
    its `/hw/<base>` defaults when it sets neither), or None where that file is not found."""
    from qwen35rl.config.paths import config_dir, extra_config_dirs

    if not re.fullmatch(r"[\w.\-]+", name or ""):
        return None
    try:
        dirs = [config_dir(), *extra_config_dirs()]
    except FileNotFoundError:
        return None
    for d in reversed(dirs):
        path = d / "hw" / f"{name}.yaml"
        try:
            st = path.stat()
        except OSError:
            continue
        key = (str(path), st.st_mtime_ns, st.st_size)
        if key not in _PRESETS:
            _PRESETS[key] = _read_counts(str(path))
        return _PRESETS[key]
    return None


def _read_counts(path: str, depth: int = 0) -> Optional[Tuple[int, int]]:
    from omegaconf import OmegaConf

    try:
        node = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception:  # not YAML: the composition reports it
        return None
    if not isinstance(node, dict):
        return None
    nodes, per_node = node.get("nodes"), node.get("devices_per_node")
    if (nodes is None or per_node is None) and depth < 3:
        for entry in node.get("defaults") or []:
            m = re.fullmatch(r"/?hw/([\w.\-]+)(@_here_)?", str(entry)) if isinstance(entry, str) else None
            base = preset_counts(m.group(1)) if m else None
            if base:
                nodes = base[0] if nodes is None else nodes
                per_node = base[1] if per_node is None else per_node
    if isinstance(nodes, int) and isinstance(per_node, int):
        return nodes, per_node
    return None


def hw_label(hw: Any) -> str:
    """`hw.name`, or `<kind>_<nodes>x<devices per node>` when the counts differ from the preset's."""
    name = str(_get(hw, "name", "hw"))
    nodes, per_node = _get(hw, "nodes"), _get(hw, "devices_per_node")
    preset = preset_counts(name)
    if preset is None or not isinstance(nodes, int) or not isinstance(per_node, int) or (nodes, per_node) == preset:
        return name
    return f"{name.split('_', 1)[0]}_{nodes}x{per_node}"


def register() -> None:
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver(LAYOUT_RESOLVER):
        OmegaConf.register_new_resolver(LAYOUT_RESOLVER, lambda *, _root_: layout_tag(_root_))
    if not OmegaConf.has_resolver(HW_RESOLVER):
        OmegaConf.register_new_resolver(HW_RESOLVER, lambda *, _root_: hw_label(_root_["hw"]))
