"""Engine versions and what they load: vLLM and megatron-core release numbers, whether the vLLM
release loads the rollout checkpoint (text-only or vision-language), and what its prefix caching does on the GDN
layers."""
from __future__ import annotations

import os
from typing import Any, List

from qwen35rl.config import quirks
from qwen35rl.config.layout import Layout
from qwen35rl.config.problems import WARNING, Problem
from qwen35rl.config.rules.registry import _err, _get, _megatron_core, _shown, _vllm, rule, val


@rule("config")
def vllm_version_valid(cfg: Any, layout: Layout) -> List[Problem]:
    """`rollout.vllm_version` is `auto` or a release number: quirks and engine facts compare versions."""
    from qwen35rl.config import vllm_facts

    v = val(cfg, "rollout.vllm_version")
    if str(v) == vllm_facts.AUTO or vllm_facts.valid_version(v):
        return []
    return _err("vllm_version_valid", "rollout.vllm_version", f"rollout.vllm_version={_shown(v)} is not a vLLM "
                "release number", "set rollout.vllm_version=auto (the installed vLLM's) or a release such as 0.26.0")


@rule("config")
def megatron_core_version_valid(cfg: Any, layout: Layout) -> List[Problem]:
    """`backend.megatron_core_version` is a release the Megatron backend supports: its version facts (GDN packing
    and CP, expert gradients) are compared against it."""
    from qwen35rl.config import megatron_versions as mv
    from qwen35rl.config.vllm_facts import valid_version  # a release number, whichever package's

    if not _megatron_core(layout):
        return []
    v, oldest = val(cfg, "backend.megatron_core_version"), ".".join(map(str, mv.MIN_SUPPORTED))
    hint = f"set the cluster's megatron-core release, e.g. backend.megatron_core_version={oldest}.0 (pip show megatron-core)"
    if not valid_version(v):
        return _err("megatron_core_version_valid", "backend.megatron_core_version", f"backend.megatron_core_version="
                    f"{_shown(v) or repr('')} is not a megatron-core release number", hint)
    if quirks.version_tuple(v)[:2] < mv.MIN_SUPPORTED:
        return _err("megatron_core_version_valid", "backend.megatron_core_version", f"megatron-core {v} is older "
                    f"than {oldest}, the oldest the Qwen3.5 backend supports (GDN layers)", hint)
    return []


@rule("config")
def vllm_loads_rollout_checkpoint(cfg: Any, layout: Layout) -> List[Problem]:
    """vLLM releases before 0.27 load no text-only Qwen3.5 checkpoint (`Qwen3_5ForCausalLM`): the rollout then starts
    from the vision-language form, which a model without a vision tower (or a text-only model.path) cannot give."""
    from qwen35rl.config import vllm_facts

    version = vllm_facts.version_of(cfg)
    if not _vllm(cfg) or version is None:
        return []
    install = vllm_facts.installed_vllm()
    same = install is not None and vllm_facts.version_tuple(install.version) == vllm_facts.version_tuple(version)
    if vllm_facts.loads_text_checkpoint(version, install if same else None):
        return []
    path = _get(cfg, "model.path", None)
    if _get(cfg, "model.init", "pretrained") == "pretrained" and path:
        archs = _checkpoint_architectures(str(path))
        if archs and not any(a.endswith("ForConditionalGeneration") for a in archs):
            return _err("vllm_loads_rollout_checkpoint", "model.path", f"model.path={str(path)!r} is a text-only "
                        f"checkpoint ({', '.join(archs)}), which vLLM {version} does not load (its Qwen3.5 classes "
                        f"are the vision-language ones; text-only checkpoints load from "
                        f"{vllm_facts.TEXT_CHECKPOINT_FROM})", "use the vision-language checkpoint of this model "
                        f"(text data runs it without images), vLLM >= {vllm_facts.TEXT_CHECKPOINT_FROM}, or rollout=hf")
        return []
    if _get(cfg, "model.vision", None) is None:
        return _err("vllm_loads_rollout_checkpoint", "model", f"model={val(cfg, 'model.name')} has no vision "
                    f"tower, and vLLM {version} loads only the vision-language form of a Qwen3.5 checkpoint",
                    f"pick a model with a vision tower (e.g. model=qwen3_5_tiny_vl), vLLM >= "
                    f"{vllm_facts.TEXT_CHECKPOINT_FROM}, or rollout=hf")
    return []


def _checkpoint_architectures(path: str) -> List[str]:
    """`architectures` of the checkpoint's config.json here ([] where it cannot be read)."""
    import json

    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            archs = json.load(f).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return []
    return [str(a) for a in archs] if isinstance(archs, list) else []


@rule("config")
def vllm_prefix_caching_on_gdn(cfg: Any, layout: Layout) -> List[Problem]:
    """`rollout.enable_prefix_caching` on Qwen3.5's hybrid GDN layers: the plan states what the vLLM found does
    (`vllm_facts.gdn_prefix_caching`); its 'align' mode needs chunked prefill (vLLM asserts it at start-up)."""
    from qwen35rl.config import vllm_facts

    version = vllm_facts.version_of(cfg)
    if not _vllm(cfg) or not val(cfg, "rollout.enable_prefix_caching") or version is None:
        return []
    install = vllm_facts.installed_vllm()
    mode = vllm_facts.gdn_prefix_caching(version, install)
    key = "rollout.enable_prefix_caching"
    if mode == "align" and not val(cfg, "rollout.enable_chunked_prefill"):
        return _err("vllm_prefix_caching_on_gdn", key, f"vLLM {version} caches the GDN layers' prefix state only in "
                    "its 'align' mode, which needs chunked prefill (the engine start fails without it)",
                    "set rollout.enable_chunked_prefill=true, or rollout.enable_prefix_caching=false")
    what = {"align": "in its experimental 'align' mode: the GDN state is cached only where a scheduler step ends "
                     "on a block boundary, so the n samples of a prompt share less of their prefill than a "
                     "transformer's would",
            "all": "in its 'all' mode (the GDN state at every block boundary)"}.get(
        mode, "in a way not known here for this release (no vLLM of it installed)")
    return [Problem("vllm_prefix_caching_on_gdn", key, f"vLLM {version} caches prefixes of Qwen3.5's GDN layers "
                    f"{what}", "rollout.enable_prefix_caching=false skips it (the default)", WARNING)]
