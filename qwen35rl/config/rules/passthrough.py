"""Pass-through dicts and engine switches: rollout.engine_kwargs are vLLM engine arguments and
backend.transformer_overrides TransformerConfig fields, neither sets what qwen35rl derives itself,
rollout.compile_decode applies to the engine that compiles its decode step, and a user value that replaces a
platform quirk is warned about."""
from __future__ import annotations

from typing import Any, List

from qwen35rl.config import engine_specs, known_keys, quirks
from qwen35rl.config.layout import Layout
from qwen35rl.config.problems import WARNING, Problem
from qwen35rl.config.rules.registry import _err, _megatron_core, _vllm, rule, val
from qwen35rl.names import did_you_mean


@rule("config")
def engine_kwargs_known(cfg: Any, layout: Layout) -> List[Problem]:
    """`rollout.engine_kwargs` keys are vLLM EngineArgs fields (a typo would fail only on the cluster), whatever
    engine this run picks (the same overrides often go to a vLLM run next): the installed vLLM's own fields when it
    is the configured version, else the names qwen35rl knows from 0.11 - 0.32."""
    from qwen35rl.config import vllm_facts

    install, version = vllm_facts.installed_vllm(), vllm_facts.version_of(cfg)
    if install is not None and (version is None
                                or vllm_facts.version_tuple(install.version) != vllm_facts.version_tuple(version)):
        install = None
    names, origin = vllm_facts.engine_arg_names(install)
    out = []
    for key in val(cfg, "rollout.engine_kwargs") or {}:
        if key not in names:
            out += _err("engine_kwargs_known", f"rollout.engine_kwargs.{key}", f"'{key}' is not a vLLM engine "
                        f"argument (checked against {origin})", did_you_mean(key, names)
                        or "see vllm.engine.arg_utils.EngineArgs for the names")
    return out


def _owned(section: str, key: str, owner: str) -> List[Problem]:
    if " " in owner:  # not a config key: the launcher decides it
        return _err(f"{section.split('.')[-1]}_not_owned", f"{section}.{key}", f"'{key}' is set by qwen35rl: {owner}",
                    f"remove {section}.{key}")
    return _err(f"{section.split('.')[-1]}_not_owned", f"{section}.{key}", f"'{key}' is set by qwen35rl from {owner}",
                f"remove it and set {owner} instead")


@rule("config")
def engine_kwargs_not_owned(cfg: Any, layout: Layout) -> List[Problem]:
    """Engine arguments qwen35rl derives from its own config are set there, once."""
    out = []
    for key in val(cfg, "rollout.engine_kwargs") or {}:
        if key in known_keys.VLLM_OWNED:
            out += _owned("rollout.engine_kwargs", key, known_keys.VLLM_OWNED[key])
    return out


@rule("config")
def transformer_overrides_known(cfg: Any, layout: Layout) -> List[Problem]:
    """`backend.transformer_overrides` keys are megatron-core TransformerConfig fields."""
    if not _megatron_core(layout):
        return []
    out = []
    for key in val(cfg, "backend.transformer_overrides") or {}:
        if key not in known_keys.MEGATRON_TRANSFORMER_CONFIG:
            out += _err("transformer_overrides_known", f"backend.transformer_overrides.{key}", f"'{key}' is not a "
                        "megatron-core TransformerConfig field", did_you_mean(key, known_keys.MEGATRON_TRANSFORMER_CONFIG)
                        or "see megatron/core/transformer/transformer_config.py for the names")
    return out


@rule("config")
def transformer_overrides_not_owned(cfg: Any, layout: Layout) -> List[Problem]:
    """TransformerConfig fields qwen35rl derives (architecture, layout, engine knobs) are set at their source."""
    if not _megatron_core(layout):
        return []
    out = []
    for key in val(cfg, "backend.transformer_overrides") or {}:
        if key in known_keys.MEGATRON_OWNED:
            out += _owned("backend.transformer_overrides", key, known_keys.MEGATRON_OWNED[key])
    return out


@rule("config")
def compile_decode_is_hf_only(cfg: Any, layout: Layout) -> List[Problem]:
    """rollout.compile_decode compiles the hf engine's decode step (the specs' `compiles_decode`); vLLM compiles
    by its own configuration."""
    engine = val(cfg, "rollout.engine")
    if engine_specs.rollout_engine(engine).compiles_decode or not val(cfg, "rollout.compile_decode"):
        return []
    takers = ", ".join(n for n, s in engine_specs.ROLLOUT_ENGINES.items() if s.compiles_decode)
    return [Problem("compile_decode_is_hf_only", "rollout.compile_decode", f"rollout.compile_decode applies to "
                    f"rollout.engine={takers}; rollout.engine={engine} ignores it",
                    "remove rollout.compile_decode; vLLM takes rollout.engine_kwargs.compilation_config", WARNING)]


@rule("config")
def quirk_overridden(cfg: Any, layout: Layout) -> List[Problem]:
    """A user value for a key a platform quirk sets wins over the quirk: warn, with the quirk's reason."""
    if not _vllm(cfg):
        return []
    user = val(cfg, "rollout.engine_kwargs") or {}
    out = []
    for q in quirks.applying_quirks(cfg):
        if q["key"] in user and user[q["key"]] != q["value"]:
            out.append(Problem("quirk_overridden", f"rollout.engine_kwargs.{q['key']}", f"{q['key']}={user[q['key']]!r} "
                               f"replaces the {val(cfg, 'hw.name')} quirk {q['key']}={q['value']!r} for vLLM "
                               f"{val(cfg, 'rollout.vllm_version')} (< {q.get('below_version')}): {q['why']}",
                               f"remove rollout.engine_kwargs.{q['key']} unless you know the quirk no longer applies",
                               WARNING))
    return out
