"""A verl launch (its override list and environment) -> a qwen35rl composition: `model= backend= hw= data=` picked
from the launch, and an `experiment/` overlay holding only the facts that differ from what those options already
compose. Every verl key is reported: carried (to which qwen35rl key), already the composed default, carried from
verl's own default (the script relied on it and qwen35rl composes something else), or not carried (why).

Reads the one table in `keys.py`; imports Hydra's override parser and the config layer, nothing heavy."""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from qwen35rl.config.verl.keys import (ACTOR, CHOICE_KEYS, FIXED, MODEL, OVERRIDE_TC, PASS_THROUGH, ROLLOUT,
                                       UNSET, VLLM_KWARGS, Key,
                                       NotCarried,
                                       effective_remove_padding, env_reason, get, keys_for, why_not_carried,
                                       worker_env)


class ImportFailure(Exception):
    """The launch cannot become a composition: one message naming the key and the fix (exit code 2)."""

    def __init__(self, key: str, message: str, hint: str = ""):
        super().__init__(message)
        self.key, self.message, self.hint = key, message, hint

    def render(self) -> str:
        lines = [f"qwen35rl-import: cannot import '{self.key}': {self.message}"]
        if self.hint:
            lines.append(f"  hint:    {self.hint}")
        return "\n".join(lines)


VERL_DATA_FORMAT = {"data.answer_key": "reward_model.ground_truth", "data.system_prompt": None}
"""verl's preprocessed parquet (prompt_key `prompt`) keeps the answer in reward_model.ground_truth and the
instruction inside the prompt's messages: the imported run reads the same rows the same way."""

HW_PREFERENCE = ("gpu_1node", "gpu_16node", "a3_1node", "a3_4node", "a3_16node", "a2_1node", "h20_4node",
                 "h200_1node", "gpu_1x")
"""When several hw presets have the same device kind and counts, the first of these is picked (generic before
specific). `--hw NAME` picks another."""


# ------------------------------------------------------------------------------------------- reading a launch
@dataclass
class VerlLaunch:
    values: Dict[str, Any]
    """verl key -> value, in command-line order (the last setting of a key wins)."""
    raw: Dict[str, str]
    """verl key -> the override as written."""
    config_name: Optional[str] = None
    deleted: List[str] = field(default_factory=list)
    sweeps: List[str] = field(default_factory=list)


_FLAGS_WITH_VALUE = {"--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd"}
_INTERP = re.compile(r"^\$\{([A-Za-z0-9_.]+)\}$")


def read_launch(argv: Sequence[str]) -> VerlLaunch:
    """Hydra flags are read (`--config-name=ppo_megatron_trainer` picks the Megatron engine), overrides parsed with
    Hydra's own grammar; `${other.key}` values are looked up in what the launch sets."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    out = VerlLaunch(values={}, raw={})
    args = list(argv)
    i = 0
    while i < len(args):
        a = args[i]
        i += 1
        flag, eq, val = a.partition("=")
        if flag in _FLAGS_WITH_VALUE:
            if not eq:
                val = args[i] if i < len(args) else ""
                i += 1
            if flag in ("--config-name", "-cn"):
                out.config_name = val.removesuffix(".yaml")
            continue
        if a.startswith("-"):
            continue  # --multirun and friends: nothing of the run's settings
        try:
            ov = parser.parse_override(a)
        except HydraException as e:
            raise ImportFailure(a.partition("=")[0], f"not a Hydra override: {str(e).splitlines()[0]}",
                                "fix the override in the script, or import its override list") from None
        key = ov.key_or_group
        if ov.type == OverrideType.DEL:
            out.deleted.append(key)
            continue
        if ov.is_sweep_override():
            out.sweeps.append(key)
            continue
        value = ov.value()
        if isinstance(value, str) and _INTERP.match(value):
            value = out.values.get(_INTERP.match(value).group(1), value)
        out.values[key] = _plain(value)
        out.raw[key] = a
    return out


def _plain(v: Any) -> Any:
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


# ------------------------------------------------------------------------------------------- what is refused
ENTRY_MODULE = "verl.trainer.main_ppo"
CONFIG_NAMES = ("ppo_trainer", "ppo_megatron_trainer")
STRATEGIES = ("fsdp", "fsdp2", "megatron")
_OTHER_MODELS = re.compile(r"(llama|mistral|mixtral|deepseek|glm|kimi|gemma|phi|internvl|minicpm|gpt|ernie|"
                           r"intern|baichuan|yi_|seed|moonlight|longcat)")


@dataclass
class Refusal:
    """A part of a launch qwen35rl does not run: refused (exit 2) unless `--force` drops it."""

    key: str
    value: Any
    why: str
    hint: str
    drops: Tuple[str, ...] = ()
    """The launch keys `--force` leaves out (none for an entry point or a config name: only the choice goes)."""
    instead: str = "left out"
    """What the run does instead (`{backend}` and `{data}` stand for the options picked)."""

    def as_dict(self) -> Dict[str, Any]:
        return {"key": self.key, "value": self.value, "why": self.why}


class Refused(ImportFailure):
    """Every refused part of a launch at once (exit 2); `--force` imports the rest."""

    def __init__(self, refusals: List[Refusal]):
        first = refusals[0]
        super().__init__(first.key, first.why, first.hint)
        self.refusals = refusals

    def render(self) -> str:
        lines = [f"qwen35rl-import: cannot import this launch: {len(self.refusals)} part(s) qwen35rl does not run"]
        for r in self.refusals:
            lines.append(_one_line(f"  {r.key}={_shown(r.value)}: {r.why}"))
            lines.append(f"    hint: {r.hint}")
        lines.append("  --force imports the rest: these parts are left out and listed")
        return "\n".join(lines)


def _shown(v: Any) -> str:
    text = v if isinstance(v, str) else json.dumps(v, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


ALGORITHM_HINT = "qwen35rl trains GRPO-family objectives (algorithm=grpo, dapo, dr_grpo): import a GRPO / DAPO / " \
                 "Dr.GRPO script"
ENGINE_HINT = "qwen35rl trains with FSDP2 (backend=fsdp) or Megatron (backend=megatron): import a script of one of " \
              "those engines"


def refusals(launch: VerlLaunch, entry: str = "") -> List[Refusal]:
    """What of a launch qwen35rl does not run, rather than importing part of it as something else: another verl
    entry point or config, a training strategy other than FSDP2 or Megatron, distillation, an advantage estimator
    other than GRPO's (verl's default, gae, included), a policy loss other than PPO-clip, a reward model, video
    data."""
    out: List[Refusal] = []
    module = next((w for w in entry.split() if w.startswith("verl.")), "")
    if module and module != ENTRY_MODULE:
        out.append(Refusal("SOURCE", module, f"the script runs {module}, not {ENTRY_MODULE}: qwen35rl imports "
                           "GRPO-family runs of verl's PPO trainer only", "import a main_ppo launch",
                           instead=f"the rest is imported as a run of {ENTRY_MODULE}"))
    if launch.config_name and launch.config_name not in CONFIG_NAMES:
        out.append(Refusal("--config-name", launch.config_name, f"verl's {launch.config_name} config has no qwen35rl "
                           "counterpart", f"qwen35rl imports launches of {' or '.join(CONFIG_NAMES)}",
                           instead="the run uses backend={backend} (--backend picks the other)"))
    values = launch.values
    for key, value in values.items():
        parts = key.split(".")
        if "megatron_lite" in parts or (parts[-1] == "strategy" and str(value) not in STRATEGIES) or (
                key == "model_engine" and str(value) not in ("dp", "fsdp", "megatron")):
            name = "megatron_lite" if "megatron_lite" in parts else value
            out.append(Refusal(key, value, f"verl's {name} strategy has no qwen35rl counterpart", ENGINE_HINT, (key,),
                               "the run uses backend={backend} (--backend picks the other)"))
        elif parts[0] == "distillation" and value not in (False, None):
            out.append(Refusal(key, value, "a distillation run (a teacher model's log-probs in the loss): qwen35rl "
                               "trains GRPO-family objectives only", ALGORITHM_HINT, (key,),
                               "the run trains without a teacher"))
        elif key == f"{ACTOR}.policy_loss.loss_mode" and value != "vanilla":
            out.append(Refusal(key, value, f"verl's {value} policy loss: qwen35rl's is PPO-clip (verl's vanilla)",
                               ALGORITHM_HINT, (key,), "the run trains with PPO-clip"))
        elif key in ("reward_model.enable", "reward.reward_model.enable") and value is True:
            out.append(Refusal(key, value, "a reward model scores the responses: qwen35rl scores them with a reward "
                               "function (data.reward)", "import a rule-based-reward script, or write the scoring "
                               "as data.reward=pkg.module:fn(response, answer, example)", (key,),
                               "the run scores with data.reward (data={data}'s reward function)"))
        else:
            words = [key.lower()] + [str(v).lower() for v in (value if isinstance(value, list) else [value])
                                     if key in ("data.train_files", "data.val_files")]
            if any("video" in w for w in words):
                files = key in ("data.train_files", "data.val_files")
                out.append(Refusal(key, value, "video data: qwen35rl trains on text and image prompts",
                                   "import a text or image (geo3k-style) script", (key,),
                                   "the run reads data={data}'s files (--data picks another)" if files else
                                   "the run reads the text and image columns only"))
    estimator = values.get("algorithm.adv_estimator", UNSET)
    if estimator is UNSET or estimator != "grpo":
        shown = "gae" if estimator is UNSET else estimator
        unset = " (verl's default: the script does not set algorithm.adv_estimator)" if estimator is UNSET else ""
        out.append(Refusal("algorithm.adv_estimator", shown, f"verl's {shown} advantage estimator{unset}: qwen35rl "
                           "computes GRPO's group-relative advantages", ALGORITHM_HINT + " (algorithm.adv_estimator="
                           "grpo)", ("algorithm.adv_estimator",), "the run computes GRPO's advantages"))
    return out


def check_qwen35(path: Any) -> None:
    """ImportFailure when the checkpoint is known not to be a Qwen3.5 model (its config.json here, else its name),
    whatever --model says: --model picks among Qwen3.5 options for a checkpoint whose name tells nothing."""
    if not path:
        return
    local = Path(os.path.expanduser(str(path))) / "config.json"
    if local.is_file():
        try:
            hf = json.loads(local.read_text())
        except (OSError, ValueError):
            hf = {}
        kind = " ".join([str(hf.get("model_type", ""))] + [str(a) for a in hf.get("architectures", []) or []]).lower()
        if kind.strip() and "qwen3_5" not in kind:
            raise ImportFailure(f"{MODEL}.path", f"{path} is a {hf.get('model_type') or kind} checkpoint, not "
                                "Qwen3.5: qwen35rl trains Qwen3.5 models only", "import a Qwen3.5 script")
        return
    name = _norm(str(path).rstrip("/").rsplit("/", 1)[-1])
    m = re.search(r"qwen(\d+(?:_\d+)?)", name)
    if (m and m.group(1) != "3_5") or (not m and _OTHER_MODELS.search(name)):
        raise ImportFailure(f"{MODEL}.path", f"{path} names a model other than Qwen3.5: qwen35rl trains Qwen3.5 "
                            "models only (--model does not change what the checkpoint is)",
                            "import a Qwen3.5 script")


# ------------------------------------------------------------------------------------------- picking options
def pick_backend(launch: VerlLaunch, forced: Optional[str] = None) -> str:
    if forced:
        if forced not in ("fsdp", "megatron"):
            raise ImportFailure("--backend", f"no backend option {forced!r}", "one of: fsdp, megatron")
        return forced
    engine = str(launch.values.get("model_engine", "") or "")
    strategy = str(launch.values.get(f"{ACTOR}.strategy", "") or "")
    if "megatron" in (launch.config_name or "") or engine == "megatron" or strategy == "megatron":
        return "megatron"
    if engine in ("", "dp", "fsdp") and strategy in ("", "fsdp", "fsdp2"):
        return "fsdp"
    raise ImportFailure("model_engine" if engine else f"{ACTOR}.strategy", f"verl's {engine or strategy} engine "
                        "has no qwen35rl counterpart", "qwen35rl trains with FSDP2 (backend=fsdp) or Megatron "
                        "(backend=megatron): import a script of one of those engines")


def _yaml_of(group: str) -> Dict[str, Path]:
    from qwen35rl.config.compose import search_dirs

    out: Dict[str, Path] = {}
    for root in search_dirs():
        for p in sorted((root / group).glob("*.yaml")) if (root / group).is_dir() else []:
            out[p.stem] = p
    return out


def hw_presets() -> Dict[str, Tuple[str, int, int]]:
    """hw option -> (device, nodes, devices_per_node), read from the files (their platform default names the
    device) without composing each."""
    from omegaconf import OmegaConf

    out = {}
    for name, path in _yaml_of("hw").items():
        node = OmegaConf.to_container(OmegaConf.load(path))
        device = node.get("device")
        for d in node.get("defaults", []) or []:
            m = re.search(r"platform/(\w+)", str(d))
            if m:
                device = device or m.group(1)
        if device and "nodes" in node and "devices_per_node" in node:
            out[name] = (str(device), int(node["nodes"]), int(node["devices_per_node"]))
    return out


def pick_hw(device: str, nodes: int, per_node: int, forced: Optional[str] = None) -> Tuple[str, Optional[str]]:
    """(hw option, the preset a new overlay extends or None when an existing preset matches)."""
    presets = hw_presets()
    if forced:
        if forced not in presets:
            raise ImportFailure("--hw", f"no hw option {forced!r}", f"one of: {', '.join(sorted(presets))}")
        return forced, None
    matches = [n for n, spec in presets.items() if spec == (device, nodes, per_node)]
    if matches:
        return sorted(matches, key=lambda n: (HW_PREFERENCE.index(n) if n in HW_PREFERENCE else len(HW_PREFERENCE), n))[0], None
    same = [n for n, spec in presets.items() if spec[0] == device]
    if not same:
        raise ImportFailure("trainer.device", f"no hw preset for device {device!r}", "pass --hw NAME")
    base = sorted(same, key=lambda n: (presets[n][2] != per_node, presets[n][1] != 1,
                                       HW_PREFERENCE.index(n) if n in HW_PREFERENCE else len(HW_PREFERENCE), n))[0]
    kind = "gpu" if device == "cuda" else device
    return f"{kind}_{nodes}x{per_node}", base


def _norm(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")


def pick_model(path: Any, forced: Optional[str] = None) -> Tuple[str, str]:
    """(model option, how it was found): from the checkpoint's config.json where the path exists here, else from
    the checkpoint's name (`Qwen3.5-35B-A3B` -> qwen3_5_35b_a3b)."""
    from omegaconf import OmegaConf

    files = _yaml_of("model")
    if forced:
        if forced not in files:
            raise ImportFailure("--model", f"no model option {forced!r}", f"one of: {', '.join(sorted(files))}")
        return forced, "--model"
    if not path:
        raise ImportFailure(f"{MODEL}.path", "the launch names no checkpoint",
                            "set actor_rollout_ref.model.path in the script, or pass --model NAME")
    local = Path(os.path.expanduser(str(path))) / "config.json"
    if local.is_file():
        found = _model_from_config(json.loads(local.read_text()), files)
        if found:
            return found, f"{local} (architecture)"
    names = {}
    for name, p in files.items():
        hf_id = OmegaConf.load(p).get("hf_id")
        names[name] = _norm(str(hf_id).rsplit("/", 1)[-1]) if hf_id else name
    base = _norm(str(path).rstrip("/").rsplit("/", 1)[-1])
    hits = [n for n, token in names.items() if re.search(rf"(^|_){re.escape(token)}($|_)", base)]
    if hits:
        return max(hits, key=lambda n: len(names[n])), f"the checkpoint's name ({Path(str(path)).name})"
    raise ImportFailure(f"{MODEL}.path", f"cannot tell which Qwen3.5 checkpoint {path!r} is (no config.json here, "
                        "and its name matches no model option)", f"pass --model, one of: {', '.join(sorted(files))}")


def _model_from_config(hf: Dict[str, Any], files: Dict[str, Path]) -> Optional[str]:
    from qwen35rl.config.compose import compose

    text = hf.get("text_config", hf)
    want = (int(text.get("num_hidden_layers", -1)), int(text.get("hidden_size", -1)), int(text.get("num_experts", 0) or 0))
    for name in sorted(files):
        try:
            m = compose([f"model={name}"]).model
        except Exception:  # an overlay model that does not compose alone: not a candidate
            continue
        if (int(m.num_hidden_layers), int(m.hidden_size), int(m.num_experts)) == want:
            return name
    return None


def pick_data(values: Dict[str, Any], forced: Optional[str] = None) -> Tuple[str, str]:
    files = _yaml_of("data")
    if forced:
        if forced not in files:
            raise ImportFailure("--data", f"no data option {forced!r}", f"one of: {', '.join(sorted(files))}")
        return forced, "--data"
    train = values.get("data.train_files")
    text = " ".join(map(str, train if isinstance(train, list) else [train])).lower()
    for option, words in (("geo3k", ("geo3k", "geometry3k")), ("gsm8k", ("gsm8k",))):
        if any(w in text for w in words) and option in files:
            return option, "data.train_files"
    if "data.image_key" in values:
        return "geo3k", "data.image_key (image + text rows)"
    return "gsm8k", "default for text rows (pass --data to pick another)"


# ------------------------------------------------------------------------------------------------ the import
@dataclass
class Imported:
    name: str
    groups: Dict[str, str]
    """model / backend / hw / data (/ rollout) options, in command-line order."""
    picked: Dict[str, str]
    """group -> how the option was found."""
    overlay: Dict[str, Any]
    """qwen35rl dotted key -> value: what the experiment overlay sets."""
    carried: Dict[str, str] = field(default_factory=dict)
    defaults: List[str] = field(default_factory=list)
    verl_defaults: Dict[str, str] = field(default_factory=dict)
    not_carried: List[Dict[str, Any]] = field(default_factory=list)
    implied: Dict[str, Any] = field(default_factory=dict)
    env_carried: Dict[str, str] = field(default_factory=dict)
    env_defaults: List[str] = field(default_factory=list)
    env_not_carried: List[Dict[str, Any]] = field(default_factory=list)
    new_hw: Optional[Dict[str, Any]] = None
    """A new hw overlay {name, base, nodes, devices_per_node} where no preset matches."""
    verl_values: Dict[str, Any] = field(default_factory=dict)
    """What the launch set, by verl key."""
    fixed: Dict[str, str] = field(default_factory=dict)
    """verl keys whose value asks for what qwen35rl always does (no setting needed) -> what that is."""
    dropped: List[Dict[str, Any]] = field(default_factory=list)
    """Refused parts left out with `force`: {key, value, why, instead}."""


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or (isinstance(a, bool) and isinstance(b, bool) and a == b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    return a == b


def import_launch(argv: Sequence[str], env: Optional[Dict[str, str]] = None, device: str = "gpu",
                  name: Optional[str] = None, model: Optional[str] = None, hw: Optional[str] = None,
                  data: Optional[str] = None, fallback_name: Optional[str] = None, entry: str = "",
                  force: bool = False, backend: Optional[str] = None) -> Imported:
    """The composition of a verl launch (nothing is written: see `write_overlay`). A launch with parts qwen35rl does
    not run is refused (`Refused`, every part named) unless `force`, which leaves those parts out and lists them in
    `Imported.dropped`. A checkpoint that is not Qwen3.5 is refused whatever `force` says."""
    from omegaconf import OmegaConf

    from qwen35rl.config.compose import compose

    launch = read_launch(argv)
    original = dict(launch.values)
    check_qwen35(launch.values.get(f"{MODEL}.path"))
    model_name, model_how = pick_model(launch.values.get(f"{MODEL}.path"), model)
    refused = refusals(launch, entry)
    if refused and not force:
        raise Refused(refused)
    suppressed = set()  # dropped keys: neither the script's value nor verl's default is carried
    for r in refused:
        if r.key == "--config-name":
            launch.config_name = None
        for key in r.drops:
            launch.values.pop(key, None)
            suppressed.add(key)
    values = dict(launch.values)
    forced_backend = backend
    backend = pick_backend(launch, forced_backend)
    dev = str(values.get("trainer.device") or {"gpu": "cuda", "npu": "npu", "cpu": "cpu"}.get(device, device))
    nodes = int(values.get("trainer.nnodes", 1) or 1)
    per_node = int(values.get("trainer.n_gpus_per_node", 8) or 8)
    hw_name, hw_base = pick_hw(dev, nodes, per_node, hw)
    data_name, data_how = pick_data(values, data)
    groups = {"model": model_name, "backend": backend, "hw": hw_base or hw_name, "data": data_name}
    engine = str(values.get(f"{ROLLOUT}.name") or "vllm")
    if engine == "hf":
        groups["rollout"] = "hf"
    new_hw = {"name": hw_name, "base": hw_base, "nodes": nodes, "devices_per_node": per_node} if hw_base else None
    if new_hw:
        groups["hw"] = hw_name
    with _hw_on_search_path(new_hw):  # compose what the command will compose (no tested layout on new hardware)
        base = OmegaConf.to_container(compose([f"{g}={o}" for g, o in groups.items()]), resolve=True)
    picked = {"model": model_how, "backend": "--backend" if forced_backend else _backend_how(launch, backend),
              "hw": f"{nodes} node(s) x {per_node} {dev} device(s)" + (f" (new overlay on {hw_base})" if hw_base else ""),
              "data": data_how}
    if name is not None and not _norm(name):  # '..', '.', '': no file name (and nothing to compose by)
        raise ImportFailure("--name", f"{name!r} has no letter or digit to name experiment/NAME.yaml by",
                            "pass --name with letters or digits, e.g. --name my_run")
    out = Imported(name=_norm(name) if name else _default_name(values, fallback_name), groups=groups, picked=picked, overlay={},
                   verl_values=original)
    out.new_hw = new_hw
    out.dropped = [_dropped(r, groups) for r in refused]
    consumed = set(CHOICE_KEYS) & set(values)
    for key in consumed:
        out.carried[key] = CHOICE_KEYS[key]
    if f"{ACTOR}.clip_ratio" in values:  # verl's fallback for both bounds
        for side in ("low", "high"):
            values.setdefault(f"{ACTOR}.clip_ratio_{side}", values[f"{ACTOR}.clip_ratio"])
    if engine not in ("vllm", "hf"):
        out.not_carried.append({"key": f"{ROLLOUT}.name", "value": engine, "why": "qwen35rl rolls out with vLLM "
                                "(vllm-ascend on NPU) or transformers: the run uses vLLM"})
        consumed.add(f"{ROLLOUT}.name")
    for k in keys_for(backend):
        if k.verl not in suppressed:
            consumed |= _carry(k, values, base, out)
    for f in FIXED:
        if f.verl in values and backend in f.backends:
            consumed.add(f.verl)
            if f.holds(values[f.verl], backend):
                out.fixed[f.verl] = f.does
            else:
                out.not_carried.append({"key": f.verl, "value": values[f.verl], "why": f.does})
    _pass_through(values, base, backend, consumed, out)
    for key, value in values.items():
        if key in consumed:
            continue
        other = [k for k in [*_all_keys(), *FIXED] if key in _names(k) and backend not in k.backends]
        why = (f"verl reads it for its {other[0].backends[0]} engine only; this run uses {backend}" if other
               else why_not_carried(key))
        out.not_carried.append({"key": key, "value": value, "why": why})
    for key in launch.deleted:
        out.not_carried.append({"key": f"~{key}", "value": None, "why": "a deletion from verl's tree: qwen35rl "
                                "keeps every key of its schema"})
    for key in launch.sweeps:
        out.not_carried.append({"key": key, "value": launch.raw.get(key), "why": "a sweep: import one value"})
    prompt_key = out.overlay.get("data.prompt_key", get(base, "data.prompt_key"))
    if prompt_key == "prompt":  # verl's preprocessed parquet
        for k, v in VERL_DATA_FORMAT.items():
            if not _same(get(base, k), v):
                out.overlay[k] = out.implied[k] = v
    _carry_env(env or {}, base, out)
    return out


def _all_keys() -> List[Key]:
    from qwen35rl.config.verl.keys import KEYS

    return KEYS


def _names(k: Any) -> Tuple[str, ...]:
    return k.names() if isinstance(k, Key) else (k.verl,)


def _dropped(r: Refusal, groups: Dict[str, str]) -> Dict[str, Any]:
    """A refused part `force` left out, with what the run does instead."""
    return {**r.as_dict(), "instead": r.instead.format(backend=groups["backend"], data=groups["data"])}


def _backend_how(launch: VerlLaunch, backend: str) -> str:
    if launch.config_name and "megatron" in launch.config_name:
        return f"--config-name={launch.config_name}"
    if "model_engine" in launch.values:
        return f"model_engine={launch.values['model_engine']}"
    if f"{ACTOR}.strategy" in launch.values:
        return f"{ACTOR}.strategy={launch.values[f'{ACTOR}.strategy']}"
    return "verl's default engine (FSDP)"


def _default_name(values: Dict[str, Any], fallback: Optional[str] = None) -> str:
    return _norm(str(values.get("trainer.experiment_name") or fallback or "imported_verl")) or "imported_verl"


def _carry(k: Key, values: Dict[str, Any], base: Dict[str, Any], out: Imported) -> set:
    """Carry one table entry: the script's value (primary name first, then its aliases) or verl's default."""
    present = [n for n in k.names() if n in values]
    source = present[0] if present else None
    if source is None and k.verl_default is UNSET:
        return set()
    raw = values[source] if source else k.verl_default
    try:
        value = k.to_qwen(raw, values)
    except NotCarried as e:
        out.not_carried.append({"key": source or k.verl, "value": raw, "why": str(e)})
        return set(present)
    current = k.qwen_value(base)
    default = _same(value, current) or _same(raw, k.to_verl(current, base)) or (
        k.canon is not None and _same(k.canon(value, base), k.canon(current, base)))
    if k.only_equal and not default:
        if source:
            out.not_carried.append({"key": source, "value": raw, "why": f"{k.only_equal} ({k.qwen} is "
                                    f"{current!r} here)"})
        return set(present)
    shared = False
    if k.qwen in out.overlay and not default:  # two verl keys for one qwen35rl key (resume_mode + resume_from_path)
        shared = default = _same(out.overlay[k.qwen], value)
    if source:  # a key whose value another key already carried is carried too (custom_reward_function's name)
        (out.defaults.append(source) if default and not shared else out.carried.__setitem__(source, k.qwen))
    elif not default:
        out.verl_defaults[k.verl] = k.qwen
    for other in present[1:]:  # an alias that agrees shares the primary's fate
        try:
            agrees = _same(k.to_qwen(values[other], values), value)
        except NotCarried:
            agrees = False
        if agrees:
            (out.defaults.append(other) if default and not shared else out.carried.__setitem__(other, k.qwen))
        else:
            out.not_carried.append({"key": other, "value": values[other], "why": f"differs from {source}: qwen35rl "
                                    f"has one {k.qwen} (it takes {source}'s value)"})
    if not default:
        out.overlay[k.qwen] = value
    return set(present)


VLLM_FIRST_CLASS = ("max_model_len", "gpu_memory_utilization", "max_num_batched_tokens", "max_num_seqs",
                    "enable_chunked_prefill", "enable_prefix_caching", "enforce_eager", "cudagraph_capture_sizes",
                    "trust_remote_code")
"""vLLM engine arguments qwen35rl sets through a key of its own (known_keys.VLLM_OWNED): a script's
`engine_kwargs.vllm.<name>` (which verl's vLLM server applies over its own setting) carries to that key."""


def _pass_through(values: Dict[str, Any], base: Dict[str, Any], backend: str, consumed: set, out: Imported) -> None:
    from qwen35rl.config.known_keys import MEGATRON_TRANSFORMER_CONFIG, VLLM_OWNED
    from qwen35rl.config.quirks import effective_engine_kwargs

    current = {"rollout.engine_kwargs.": effective_engine_kwargs(base),
               "backend.transformer_overrides.": get(base, "backend.transformer_overrides") or {},
               "hw.mindspeed.": get(base, "hw.mindspeed") or {}}
    npu = get(base, "hw.device") == "npu"
    for key, value in values.items():
        if key in consumed:
            continue
        for prefix, target in PASS_THROUGH.items():
            if not key.startswith(prefix):
                continue
            if prefix.startswith(OVERRIDE_TC) and backend != "megatron":
                break
            rest = key[len(prefix):]
            consumed.add(key)
            if prefix == f"{VLLM_KWARGS}." and rest in VLLM_FIRST_CLASS:
                _carry_first_class(key, value, VLLM_OWNED[rest], values, base, out)
                break
            if prefix == f"{OVERRIDE_TC}." and rest == "sequence_parallel":
                tp = int(values.get(f"{ACTOR}.megatron.tensor_model_parallel_size",
                                    get(base, "parallelism.tp", 1)) or 1)
                if bool(value) == (tp > 1):
                    out.defaults.append(key)
                else:
                    out.not_carried.append({"key": key, "value": value, "why": "qwen35rl turns Megatron sequence "
                                            f"parallel on exactly when TP > 1 (TP is {tp} here)"})
                break
            if prefix == f"{OVERRIDE_TC}." and npu and rest.split(".")[0] not in MEGATRON_TRANSFORMER_CONFIG:
                target = "hw.mindspeed."  # a MindSpeed switch: verl hands the whole dict to MindSpeed on NPU
            if _same(get(current[target], rest, UNSET), value):
                out.defaults.append(key)
            else:
                out.carried[key] = target + rest
                out.overlay[target + rest] = value
            break


def _carry_first_class(key: str, value: Any, qwen: str, values: Dict[str, Any], base: Dict[str, Any],
                       out: Imported) -> None:
    """An engine argument verl's vLLM server takes over verl's own setting of the same name (a rollout key, or
    model.trust_remote_code): carried to qwen35rl's key; verl's setting, if the script also gave it another value,
    is reported overridden."""
    first = next((k.verl for k in _all_keys() if k.qwen == qwen), f"{ROLLOUT}.{qwen.split('.', 1)[1]}")
    if first in values and first in out.carried and not _same(values[first], value):
        del out.carried[first]
        out.not_carried.append({"key": first, "value": values[first], "why": f"{key} overrides it in verl's "
                                f"vLLM engine (qwen35rl has one {qwen}, it takes {key}'s value)"})
    elif first in values and first in out.defaults and not _same(values[first], value):
        out.defaults.remove(first)
        out.not_carried.append({"key": first, "value": values[first], "why": f"{key} overrides it in verl's "
                                f"vLLM engine (qwen35rl has one {qwen}, it takes {key}'s value)"})
    out.verl_defaults.pop(first, None)
    if _same(get(base, qwen, UNSET), value):
        out.defaults.append(key)
        out.overlay.pop(qwen, None)
    else:
        out.carried[key] = qwen
        out.overlay[qwen] = value


def _carry_env(env: Dict[str, str], base: Dict[str, Any], out: Imported) -> None:
    have = worker_env(base)
    backend_env = get(base, "backend.env") or {}
    for name, value in sorted(env.items()):
        why = env_reason(name)
        if why:
            from qwen35rl.config.redact import REDACTED, is_secret_name

            out.env_not_carried.append({"key": name, "value": REDACTED if is_secret_name(name) else value, "why": why})
        elif have.get(name) == str(value):
            out.env_defaults.append(name)
        else:
            target = f"{'backend' if name in backend_env else 'hw'}.env.{name}"
            out.env_carried[name] = target
            out.overlay[target] = str(value)


# ------------------------------------------------------------------------------------------------ the overlay
def nested(dotted: Dict[str, Any]) -> Dict[str, Any]:
    """{'a.b': 1, 'a.c': 2} -> {'a': {'b': 1, 'c': 2}} (env names and pass-through keys nest the same way)."""
    out: Dict[str, Any] = {}
    for key, value in dotted.items():
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return out


def hw_overlay_text(hw: Dict[str, Any], source: str) -> str:
    """A new hw option: the preset of the same device kind with the launch's node and device counts."""
    return (f"# {hw['nodes']} node(s) x {hw['devices_per_node']} devices, imported from {source}: memory, FLOP/s and\n"
            f"# environment are {hw['base']}'s; edit them if these devices differ.\n"
            f"defaults:\n  - /hw/{hw['base']}@_here_\n  - _self_\n\n"
            f"name: {hw['name']}\nnodes: {hw['nodes']}\ndevices_per_node: {hw['devices_per_node']}\n")


@contextlib.contextmanager
def _hw_on_search_path(hw: Optional[Dict[str, Any]]) -> Iterator[None]:
    if not hw:
        yield
        return
    from qwen35rl.config.paths import ENV_CONFIG_PATH, config_path_set

    old = os.environ.get(ENV_CONFIG_PATH, "")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "hw").mkdir()
        (Path(tmp) / "hw" / f"{hw['name']}.yaml").write_text(hw_overlay_text(hw, "the launch"))
        with config_path_set(os.pathsep.join([p for p in old.split(os.pathsep) if p] + [tmp])):
            yield


def _one_line(text: str) -> str:
    """A comment line that stays one line whatever a value holds."""
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def command(imp: Imported) -> List[str]:
    return ["qwen35rl-train", *(f"{g}={o}" for g, o in imp.groups.items()), f"+experiment={imp.name}"]


def write_overlay(imp: Imported, directory: Path, source: str, force: bool = False) -> Tuple[Path, Optional[Path]]:
    """Write `experiment/<name>.yaml` (and `hw/<name>.yaml` for new hardware) under `directory`. An existing file
    is replaced only with `force`."""
    from omegaconf import OmegaConf

    directory = Path(directory)
    exp = directory / "experiment" / f"{imp.name}.yaml"
    hw_path = directory / "hw" / f"{imp.new_hw['name']}.yaml" if imp.new_hw else None
    for p in (exp, hw_path):
        if p is not None and p.exists() and not force:
            raise ImportFailure("--name", f"{p} exists", "pass --force to replace it, or --name NEW_NAME")
    exp.parent.mkdir(parents=True, exist_ok=True)
    header = [f"# @package _global_",
              f"# Imported from {source} by qwen35rl-import verl: the settings that differ from",
              f"#   {' '.join(f'{g}={o}' for g, o in imp.groups.items())}",
              f"# Run: {' '.join(command(imp))}"]
    if imp.dropped:
        header.append("# Left out with --force (qwen35rl does not run them):")
        header += [_one_line(f"#   {x['key']}={_shown(x['value'])}: {x['why']}") for x in imp.dropped]
    body = OmegaConf.to_yaml(OmegaConf.create(nested(imp.overlay))) if imp.overlay else "{}\n"
    exp.write_text("\n".join(header) + "\n" + body)
    if hw_path:
        hw_path.parent.mkdir(parents=True, exist_ok=True)
        hw_path.write_text(hw_overlay_text(imp.new_hw, source))
    return exp, hw_path
