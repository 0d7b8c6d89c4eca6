"""The smallest change that fits: for a plan refused because the model does not fit (`train_memory_fits`,
`rollout_memory_fits`, `no_valid_layout`), the first of these changes, in order of how little of the run they
change, under which `parallelism=auto` finds a layout (its search also tries offload and recomputation, each at
its cost):
1. another layout on the same devices (`parallelism=auto`), when the config did not ask for the search;
2. shorter responses (data.max_response_length halved, up to three times; the prompts kept);
3. the other backend (composed with its defaults for this model, hardware and data);
4. more devices: per node (hw.devices_per_node doubled, up to 16), then more nodes (hw.nodes doubled, up to 64
   times), from the first count where a rollout layout holds the weights (`physical_fit.rollout_weights_fit`).
Torch-free; a search per try (the refusal path only)."""
from __future__ import annotations

from typing import Any, Callable, Iterator, List, Optional, Tuple

from omegaconf import DictConfig, OmegaConf

from qwen35rl.config.engine_specs import TRAIN_ENGINES

MEMORY_CODES = ("train_memory_fits", "rollout_memory_fits", "no_valid_layout")


def _set(cfg: DictConfig, **updates: Any) -> DictConfig:
    out = cfg.copy()
    for key, value in updates.items():
        OmegaConf.update(out, key.replace("__", "."), value, merge=False)
    return out


def _searchable(cfg: DictConfig) -> DictConfig:
    return _set(cfg, parallelism__auto=True)


def _tries(cfg: DictConfig) -> Iterator[Tuple[str, Callable[[], Optional[DictConfig]]]]:
    if not cfg.parallelism.auto:
        yield "parallelism=auto", lambda: _searchable(cfg)
    response = int(cfg.data.max_response_length)
    for k in (2, 4, 8):
        if response // k >= 256:
            yield (f"data.max_response_length={response // k}",
                   lambda k=k: _searchable(_set(cfg, data__max_response_length=response // k)))
    for other in (name for name in TRAIN_ENGINES if name != str(cfg.backend.name)):
        yield f"backend={other} (its defaults)", lambda other=other: _other_backend(cfg, other)
    per_node = int(cfg.hw.devices_per_node)
    for k in (2, 4, 8, 16):
        if per_node * k <= 16:
            yield (f"hw.devices_per_node={per_node * k}",
                   lambda k=k: _more_devices(cfg, hw__devices_per_node=per_node * k))
    nodes = int(cfg.hw.nodes)
    for k in (2, 4, 8, 16, 32, 64):
        yield f"hw.nodes={nodes * k}", lambda k=k: _more_devices(cfg, hw__nodes=nodes * k)


def _other_backend(cfg: DictConfig, backend: str) -> Optional[DictConfig]:
    from qwen35rl.config.compose import ConfigError, compose

    try:
        return _searchable(compose([f"model={cfg.model.name}", f"hw={cfg.hw.name}", f"backend={backend}",
                                    f"data={cfg.data.name}"]))
    except ConfigError:  # an overlay's model or hardware that does not compose alone
        return None


def _more_devices(cfg: DictConfig, **hw: int) -> Optional[DictConfig]:
    from qwen35rl.config.physical_fit import STATE_BYTES, rollout_weights_fit
    from qwen35rl.config.params import count_params

    out = _searchable(_set(cfg, **hw))
    devices = int(out.hw.nodes) * int(out.hw.devices_per_node)
    state = STATE_BYTES * count_params(out.model).total / devices  # all of it on the host at best: the host's bound
    return out if rollout_weights_fit(out) and state <= 8 * float(out.hw.memory_gb) * 1e9 else None


def smallest_change(cfg: DictConfig) -> Optional[str]:
    """"<change> fits (parallelism=auto's best there: <layout>)" for the first change of the module's list that
    fits, None when none does."""
    from qwen35rl.config import layout_search

    for label, make in _tries(cfg):
        try:
            tried = make()
        except Exception:  # a try that cannot even be formed is no suggestion
            continue
        if tried is None:
            continue
        found = layout_search.search(tried)
        if found:
            best = " ".join(o.replace("parallelism.", "") for o in found[0].overrides)
            return f"{label} fits (parallelism=auto's best there: {best})"
    return None


def with_fit_hint(cfg: DictConfig, problems: List[Any]) -> List[Any]:
    """`problems` with the smallest change that fits put first in the hint of each memory refusal."""
    from dataclasses import replace

    if not any(p.code in MEMORY_CODES and p.severity == "error" for p in problems):
        return problems
    change = smallest_change(cfg)
    if change is None:
        return problems
    return [replace(p, hint=f"{change}; {p.hint}" if p.hint else change)
            if p.code in MEMORY_CODES and p.severity == "error" else p for p in problems]
