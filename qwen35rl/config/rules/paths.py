"""Names, paths and packages on this machine (before launch): the checkpoint, tokenizer, data files,
output root, resume directory and a custom reward's module (`path_findings`, which the preflight also runs on
every node), the data files' first rows, trackers and their packages, the run name, ray_address and Adam's
betas."""
from __future__ import annotations

import importlib.util
import os
import re
from typing import Any, List, Optional, Tuple

from qwen35rl.config.launcher import launcher_of
from qwen35rl.config.layout import Layout
from qwen35rl.config.problems import ERROR, WARNING, Problem
from qwen35rl.config.rules.registry import _err, _get, rule
from qwen35rl.names import REWARDS, TRACKERS, did_you_mean, parse_verl_reward, reward_is_file


TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
BUILTIN_TOKENIZERS = ("checkpoint", "byte", "qwen")
RAY_ADDRESS = re.compile(r"^(auto|(ray://)?[A-Za-z0-9]([A-Za-z0-9.\-]*[A-Za-z0-9])?:\d{1,5})$")
NAME_MAX = 255
"""Bytes per file-name component on common file systems."""


def is_local_run(cfg: Any) -> bool:
    """The run executes on this machine, so its files are this machine's files and a missing path is an error here:
    no Ray cluster to join (ray_address null, RAY_ADDRESS unset) and either trainer.launcher=local or a CPU target
    (a local Ray cluster of this host). A GPU/NPU target is usually planned on a login node: warnings there, and
    the preflight checks every node."""
    if _get(cfg, "ray_address", None) not in (None, "") or os.environ.get("RAY_ADDRESS"):
        return False
    return launcher_of(cfg) == "local" or _get(cfg, "hw.device", "cpu") == "cpu"


def _find_module(name: str) -> bool:
    """Whether `a.b.c` is importable, without importing anything (not even the parent packages)."""
    import sys
    from importlib.machinery import PathFinder

    if name.rpartition(".")[0] in sys.modules:  # the parent is imported already (os.path): nothing new is imported
        try:
            return importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            return False
    path = None
    for i, part in enumerate(name.split(".")):
        if not part.isidentifier():
            return False
        spec = importlib.util.find_spec(part) if i == 0 else PathFinder.find_spec(part, path)
        if spec is None:
            return False
        path = spec.submodule_search_locations
        if path is None and i < len(name.split(".")) - 1:
            return False
    return True


def _data_file_hint(path: str, key: str, data_name: Any) -> str:
    """The way to the missing data file: the `qwen35rl-data prepare` command that writes it, when it is one."""
    from qwen35rl.config.datasets import prepare_command

    command = prepare_command(path, None if data_name is None else str(data_name))
    if command:
        return f"{command} (README: Data); or fix the path, or remove it from {key}"
    return (f"fix the path, or remove it from {key}; for GSM8K or Geometry3K, `qwen35rl-data prepare gsm8k|geo3k "
            "--out DIR` writes DIR/<name>/train.parquet and test.parquet (README: Data)")


def path_findings(cfg: Any) -> List[Tuple[str, str, str, str]]:
    """(code, key, message, hint) for each file-system fact this machine contradicts: tokenizer and checkpoint
    directories, local data files, the output root and a resume directory. The plan reports them (errors when the
    run is local); the preflight's node probe runs the same function on every node."""
    out: List[Tuple[str, str, str, str]] = []
    tok, path, init = str(_get(cfg, "model.tokenizer", "checkpoint")), _get(cfg, "model.path", None), \
        _get(cfg, "model.init", "pretrained")
    if tok not in BUILTIN_TOKENIZERS and not os.path.isdir(tok):
        out.append(("tokenizer_dir_missing", "model.tokenizer", f"model.tokenizer={tok!r} is neither a built-in "
                    f"tokenizer ({', '.join(BUILTIN_TOKENIZERS)}) nor a directory here",
                    did_you_mean(tok, BUILTIN_TOKENIZERS) or "give a tokenizer directory, or model.tokenizer=byte"))
    if path is not None and init == "pretrained" and "://" not in str(path) and not os.path.isdir(str(path)):
        hint = "give the Hugging Face checkpoint directory, or model.init=random"
        if re.fullmatch(r"[\w.-]+/[\w.-]+", str(path)) and not str(path).startswith("."):
            name = str(path).split("/")[1]
            hint = (f"give the checkpoint directory; if '{path}' is a Hugging Face hub id, qwen35rl does not fetch it "
                    f"(the nodes need not reach the hub): `huggingface-cli download {path} --local-dir "
                    f"/shared/models/{name}` where the nodes can read it, then model.path=/shared/models/{name}")
        out.append(("checkpoint_dir_missing", "model.path", f"model.init=pretrained loads model.path={path!r}, "
                    "which is not a directory here", hint))
    for key in ("data.train_files", "data.val_files"):
        for f in _get(cfg, key, None) or []:
            if "://" not in str(f) and not os.path.exists(str(f)):
                out.append(("data_file_missing", key, f"{key} lists {str(f)!r}, which does not exist here",
                            _data_file_hint(str(f), key, _get(cfg, "data.name", None))))
    root = str(_get(cfg, "trainer.output_root", "runs"))
    probe = os.path.abspath(root)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        what = "is not a directory" if os.path.exists(probe) and not os.path.isdir(probe) else "is not writable"
        out.append(("output_root_unwritable", "trainer.output_root", f"trainer.output_root={root!r}: {probe} {what}",
                    "try trainer.output_root=runs (a directory you can write)"))
    resume = str(_get(cfg, "trainer.resume", "auto"))
    if resume not in ("auto", "never", "force") and not os.path.isfile(os.path.join(resume, "meta.json")):
        out.append(("resume_not_a_checkpoint", "trainer.resume", f"trainer.resume={resume!r} is neither auto, never, "
                    "force nor a finished checkpoint directory here (one with meta.json)",
                    did_you_mean(resume, ("auto", "never", "force")) or "try trainer.resume=auto"))
    reward = str(_get(cfg, "data.reward", "exact_match"))
    verl = parse_verl_reward(reward)
    if verl is not None:
        out += _verl_reward_findings(reward, *verl)
    elif ":" in reward and reward not in REWARDS:
        module = reward.partition(":")[0]
        if reward_is_file(module):
            if not os.path.isfile(module):
                out.append(("reward_not_importable", "data.reward", f"data.reward={reward!r}: the file {module} "
                            "does not exist here", "give an existing .py file, or a pkg.module:function path"))
        elif not _find_module(module):
            out.append(("reward_not_importable", "data.reward", f"data.reward={reward!r}: module {module!r} is not "
                        "importable here", "install the package that provides it (pip install ...), or set "
                        "PYTHONPATH; e.g. data.reward=exact_match"))
    return out


def _verl_reward_findings(reward: str, target: str, name: str) -> List[Tuple[str, str, str, str]]:
    """A verl-signature reward (`data.reward=verl:FILE.py:FUNCTION`, verl's custom_reward_function): the file
    exists and defines the function at module level, read without running it (user code may import anything)."""
    if not reward_is_file(target):
        if _find_module(target):
            return []
        return [("reward_not_importable", "data.reward", f"data.reward={reward!r}: module {target!r} is not "
                 "importable here", "install the package that provides it, or give verl's file: "
                 "data.reward=verl:path/to/file.py:compute_score")]
    if not os.path.isfile(target):
        return [("reward_not_importable", "data.reward", f"data.reward={reward!r} (verl's "
                 f"custom_reward_function.path): the file {target} does not exist here", "give the existing .py "
                 "file that defines the function: data.reward=verl:path/to/file.py:compute_score")]
    defined = _defines(target, name)
    if defined is None or defined:
        return []
    return [("reward_function_missing", "data.reward", f"data.reward={reward!r} (verl's "
             f"custom_reward_function.name): {target} defines no function {name!r} at module level",
             f"name a function the file defines: data.reward=verl:{target}:FUNCTION (verl's default name is "
             f"compute_score)")]


def _defines(path: str, name: str) -> Optional[bool]:
    """Whether the Python file binds `name` at module level (def, class, assignment, import); None when that
    cannot be told without running it (a star import, a file that does not parse or read)."""
    import ast

    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    return None
                if (alias.asname or alias.name.split(".")[0]) == name:
                    return True
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            if any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(t)):
                return True
        if isinstance(node, (ast.If, ast.Try, ast.With)):  # a definition inside a guard: not told statically
            if any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name for n in ast.walk(node)):
                return True
    return False


@rule("config")
def model_path_missing(cfg: Any, layout: Layout) -> List[Problem]:
    """model.init=pretrained needs model.path (the checkpoint to load): an error for a run on this machine; a
    warning for a run planned for a cluster (qwen35rl-train refuses it before launch either way)."""
    if _get(cfg, "model.init", "pretrained") != "pretrained" or _get(cfg, "model.path", None) not in (None, ""):
        return []
    return [Problem("model_path_missing", "model.path", "model.init=pretrained needs the checkpoint directory, "
                    "and model.path is null", "set model.path=/path/to/hf/checkpoint, or model.init=random",
                    ERROR if is_local_run(cfg) else WARNING)]


@rule("config")
def paths_exist(cfg: Any, layout: Layout) -> List[Problem]:
    """Tokenizer/checkpoint directories, data files, the output root, a resume directory and a custom reward's
    module, on this machine: errors for a local run; for a run on a cluster, warnings (a login node need not see the
    cluster's storage; the preflight checks them on every node)."""
    local = is_local_run(cfg)
    out = []
    for code, key, message, hint in path_findings(cfg):
        if not local:
            message += " (the run joins a Ray cluster: its nodes' preflight checks this there)"
        out.append(Problem("paths_exist", key, f"{message} [{code}]", hint, ERROR if local else WARNING))
    return out


@rule("config")
def data_unusable(cfg: Any, layout: Layout) -> List[Problem]:
    """The first rows of every data file here read as the run reads them (`data_check`: file type, columns, nulls,
    images, <image> placeholders; verl's preprocessed parquet is read too): a file that cannot make prompts is
    refused before launch, a bad row too unless data.skip_bad_rows=true (then a warning)."""
    from qwen35rl.config import data_check

    return data_check.problems(cfg)


@rule("config")
def names_valid(cfg: Any, layout: Layout) -> List[Problem]:
    """Trackers, the run name, ray_address and the optimizer's betas."""
    out = []
    trackers = [str(t) for t in _get(cfg, "trainer.trackers", None) or []]
    for t in trackers:
        if t not in TRACKERS:
            out += _err("names_valid", "trainer.trackers", f"trainer.trackers lists {t!r}, which is not one of "
                        f"{', '.join(TRACKERS)}", did_you_mean(t, TRACKERS) or "try trainer.trackers=[console,jsonl]")
        elif t in TRACKER_PACKAGES and importlib.util.find_spec(TRACKER_PACKAGES[t]) is None:
            # the driver builds the trackers: a plan on a login node without them only warns; train refuses
            out.append(Problem("names_valid", "trainer.trackers", f"trainer.trackers lists {t!r} but the "
                               f"{TRACKER_PACKAGES[t]} package is not installed here", f"pip install "
                               f"{TRACKER_PACKAGES[t]} (or pip install 'qwen35rl[trackers]'), or drop {t!r} from "
                               "trainer.trackers", ERROR if is_local_run(cfg) else WARNING))
    name = str(_get(cfg, "trainer.run_name", "run"))
    size = len(name.encode("utf-8", "surrogatepass"))
    if not name or name in (".", "..") or "/" in name or "\0" in name or size > NAME_MAX:
        why = (f"is {size} bytes; a file name holds at most {NAME_MAX}" if size > NAME_MAX else
               "contains '/'" if "/" in name else "is not a usable directory name")
        out += _err("names_valid", "trainer.run_name", f"trainer.run_name names the run directory and {why}",
                    f"try trainer.run_name={re.sub(r'[^A-Za-z0-9._-]', '-', name)[:64].strip('.') or 'run'}")
    addr = _get(cfg, "ray_address", None)
    if addr not in (None, "") and not RAY_ADDRESS.match(str(addr)):
        out += _err("names_valid", "ray_address", f"ray_address={str(addr)[:80]!r} is not null, 'auto', "
                    "'host:port' or 'ray://host:port'", "e.g. ray_address=auto or ray_address=10.0.0.1:6379")
    elif addr not in (None, "", "auto") and not 0 < int(str(addr).rsplit(":", 1)[1]) < 65536:
        out += _err("names_valid", "ray_address", f"ray_address={addr!r}: the port is outside 1-65535",
                    "e.g. ray_address=10.0.0.1:6379")
    betas = _get(cfg, "backend.betas", None)
    if betas is not None:
        b = list(betas)
        if len(b) != 2 or not all(isinstance(x, (int, float)) and 0 <= x < 1 for x in b):
            out += _err("names_valid", "backend.betas", f"backend.betas={b} must be two numbers in [0, 1) "
                        "(Adam's beta1, beta2)", "try backend.betas=[0.9,0.999]")
    return out
