"""`qwen35rl-plan --help` and `qwen35rl-train --help`: what the command does, examples, the config groups a user
picks from (the overlay directories of QWEN35RL_CONFIG_PATH included, internal trees left out), the flags, where
the schema lives and the exit codes. Hydra's own help stays behind `--hydra-help`."""
from __future__ import annotations

import textwrap
from typing import Dict, List, Optional

from qwen35rl.exit_codes import MEANINGS, ExitCode, table

WIDTH = 100

ABOUT = {
    "plan": ("qwen35rl-plan [flags] [overrides]",
             "Compose the run config and check it before anything starts: layouts, batch arithmetic, per-device "
             "memory, version quirks, paths and packages. Prints the plan of the run (text, or format=json: one "
             "JSON object on stdout; format=verl: the same run as a verl launch). Starts nothing and imports no "
             "torch, Ray or vLLM, so it runs on a login node."),
    "train": ("qwen35rl-train [flags] [overrides]",
              "Compose and check the run config as qwen35rl-plan does (a refused config exits 2 before Ray starts), "
              "then start or join Ray (or the local launcher), build the workers and post-train the policy with "
              "GRPO. Metrics, TensorBoard events, checkpoints and the Hugging Face export go to the run directory, "
              "hydra.run.dir (by default ${trainer.output_root}/${trainer.run_name}, the 'output' line of the plan); "
              "the same command again resumes there. With no overrides it trains the tiny Qwen3.5 on this CPU."),
}

EXAMPLES = {
    "plan": [
        ("qwen35rl-plan model=qwen3_5_35b_a3b hw=gpu_1node backend=megatron",
         "the plan of a reference run, as text"),
        ("qwen35rl-plan model=qwen3_5_397b_a17b hw=a3_16node backend=megatron data=geo3k format=json",
         "the same facts as one JSON object"),
        ("qwen35rl-plan -m model=qwen3_5_27b hw=gpu_1node parallelism.tp=1,2,4",
         "a sweep: one plan per layout, and a summary table"),
    ],
    "train": [
        ("qwen35rl-train", "the tiny Qwen3.5 with GRPO on two CPU workers (a few minutes)"),
        ("qwen35rl-train model=qwen3_5_35b_a3b hw=gpu_1node backend=megatron model.path=/ckpt/Qwen3.5-35B-A3B "
         "data=geo3k", "a reference run on one 8-GPU node"),
        ("qwen35rl-train -m trainer.seed=1,2,3 trainer.total_steps=20", "three runs, one per seed"),
    ],
}

GROUPS_ABOUT = {
    "model": "architecture facts, checkpoint (model.path), init, tokenizer",
    "hw": "device kind, nodes, devices per node, memory, worker env, platform quirks",
    "backend": "training engine",
    "rollout": "generation engine (default: vLLM on accelerators, transformers on CPU)",
    "algorithm": "advantage, loss, KL",
    "data": "prompts, lengths, reward",
    "placement": "colocated (generation and training take turns on every device) or split (the rollout on "
                 "devices of its own, placement.rollout_devices)",
    "parallelism": "a tested layout is picked from backend/model@hw; auto searches every valid layout",
    "cluster": "a per-cluster overlay (paths, Ray address, network env)",
    "experiment": "an experiment overlay (e.g. written by qwen35rl-import verl); add it with +experiment=NAME",
}
HIDDEN_GROUPS = {"model_base", "platform", "recipe", "schema", "hydra"}
"""Trees other configs include (recipe: picked from backend/model automatically), not groups to choose."""

FLAGS = [
    ("-m, --multirun", "one job per value of each swept key (key=a,b,c)"),
    ("--cfg job|hydra|all", "print the composed config instead of running (secrets show REDACTED); with "
                            "--resolve, interpolations resolved; --package PKG prints one part"),
    ("--info [what]", "Hydra's view of the composition: all, config, defaults, defaults-tree, plugins, searchpath"),
    ("-sc, --shell-completion", "install=bash prints the completion script: eval \"$(CMD -sc install=bash)\""),
    ("--hydra-help", "Hydra's own help"),
    ("-h, --help", "this help"),
]

OVERRIDES = [
    ("group=option", "choose a config of a group (below)"),
    ("key=value", "set a key of the schema, e.g. rollout.n=8 trainer.total_steps=100"),
    ("+group=option", "add an overlay group that the defaults do not have, e.g. +experiment=NAME"),
    ("+key=value", "add an entry to a pass-through dict: rollout.engine_kwargs, backend.transformer_overrides, "
                   "hw.env, backend.env, hw.megatron_quirks (any other new key is refused)"),
    ("~key", "delete a key"),
    ("hydra.run.dir=DIR", "write the run to DIR instead of ${trainer.output_root}/${trainer.run_name}"),
]


def _defaults() -> Dict[str, Optional[str]]:
    """The option conf/config.yaml picks for each group (None: no option unless chosen)."""
    from omegaconf import OmegaConf

    from qwen35rl.config.paths import config_dir

    out: Dict[str, Optional[str]] = {}
    for entry in OmegaConf.to_container(OmegaConf.load(config_dir() / "config.yaml")).get("defaults", []):
        if isinstance(entry, dict):
            for key, value in entry.items():
                words = str(key).split()
                if words[0] != "override":
                    name = words[-1].split("@")[0]
                    out.setdefault(name, None if value is None or "${" in str(value) else str(value))
    return out


def _wrap(text: str, indent: int, first: str = "") -> List[str]:
    lead = " " * indent
    return textwrap.wrap(text, WIDTH, initial_indent=first or lead, subsequent_indent=lead,
                         break_on_hyphens=False, break_long_words=False)


def _table(rows, indent: int = 2, col: int = 26) -> List[str]:
    lines: List[str] = []
    for left, right in rows:
        if len(left) < col - 1:
            lines += _wrap(right, indent + col, first=f"{' ' * indent}{left:<{col}}")
        else:
            lines += [f"{' ' * indent}{left}"] + _wrap(right, indent + col)
    return lines


def group_lines() -> List[str]:
    """The groups a user picks from, with their options, across the search path."""
    from qwen35rl.config.compose import available_options, group_sources, search_dirs, search_groups
    from qwen35rl.config.paths import config_dir

    defaults = _defaults()
    packaged = config_dir().resolve()
    order = list(GROUPS_ABOUT)
    groups = sorted((g for g in search_groups() if g not in HIDDEN_GROUPS),
                    key=lambda g: (order.index(g) if g in order else len(order), g))
    lines = []
    overlays = search_dirs()[1:]
    lines.append("Config groups (conf/ of the package" + (", then QWEN35RL_CONFIG_PATH: "
                                                         + ", ".join(str(d) for d in overlays) if overlays else
                                                         "; QWEN35RL_CONFIG_PATH=dir1:dir2 adds overlay directories")
                 + ")")
    for g in groups:
        options = available_options(g)
        default = defaults.get(g)
        about = GROUPS_ABOUT.get(g, "")
        from_overlay = [str(d) for d in group_sources(g) if d.resolve() != packaged]
        where = f" [from {', '.join(from_overlay)}]" if from_overlay else ""
        head = f"{'+' if g not in defaults else ''}{g}="
        text = ", ".join(options) or "(no options)"
        if default:
            text += f" (default: {default})"
        lines += _wrap(f"{text}{where}" + (f": {about}" if about else ""), 18, first=f"  {head:<16}")
    return lines


def exit_code_lines(command: str) -> List[str]:
    if command == "train":
        return table().splitlines()
    meaning = {ExitCode.OK: "the plan is valid (with -m: at least one job is)",
               ExitCode.ERROR: MEANINGS[ExitCode.ERROR],
               ExitCode.CONFIG: "the config is refused or the plan is invalid (the problems are printed)",
               ExitCode.STDOUT_CLOSED: MEANINGS[ExitCode.STDOUT_CLOSED]}
    return [f"  {int(c):>3}  {m}" for c, m in meaning.items()]


def render(command: str) -> str:
    usage, about = ABOUT[command]
    cmd = f"qwen35rl-{command}"
    lines = [f"usage: {usage}", ""]
    lines += textwrap.wrap(about, WIDTH, break_on_hyphens=False)
    lines += ["", "Examples:"]
    for example, what in EXAMPLES[command]:
        lines += [f"  {example}"] + _wrap(what, 6, first="      # ")
    lines += ["", "Overrides (as many as needed, in any order):"] + _table(OVERRIDES)
    lines += [""] + group_lines()
    lines += [""] + textwrap.wrap("Every key, its type, range and meaning: qwen35rl/config/schema.py. "
                                  f"`{cmd} --cfg job [overrides]` prints the composed config.", WIDTH)
    lines += ["", "Flags (Hydra's; anywhere on the command line):"]
    lines += _table([(f, t.replace("CMD", cmd)) for f, t in FLAGS])
    lines += ["", "Exit codes (qwen35rl/exit_codes.py):"] + exit_code_lines(command)
    return "\n".join(lines)
