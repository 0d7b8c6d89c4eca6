"""`format=verl` is a shell script: whatever a config or a shared overlay holds, running it runs only the verl
launch, with exactly the configured values (issue 37). Each case reads the script three ways: `bash -n`, shlex
(the words of its commands, comments dropped), and bash itself under `set -u` with a stand-in `python3` that records
its arguments and environment; an injected `touch` would leave a marker file."""
import ast
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from omegaconf import open_dict

from qwen35rl.cli.plan import main as plan
from qwen35rl.config.compose import compose
from qwen35rl.config.verl.exporter import ENTRY, export, render
from tests.config.verl.verl_tree import compose_verl

BIN = Path(sys.executable).parent
MARKER = "PWNED"
"""What an injected command would create in the script's working directory."""
HOSTILE = [
    f"line\ntouch {MARKER}\n",
    f"$(touch {MARKER})",
    f"`touch {MARKER}`",
    f"'; touch {MARKER}; '",
    f'"; touch {MARKER}; "',
    f"a\\b \\ c\\\\ \\'q\\' \\\ntouch {MARKER}",
    "trailing backslash \\",
    "$HOME ${HOME:-x} $UNSET_VARIABLE !! ~ *",
    "tab\tcarriage\rreturn",
    "é ☃ \U0001d518 \u2028 \u00a0",
    "#not a comment",
]
_STANDIN = """#!/bin/sh
printf '%s\\0' "$@" > argv.bin
env -0 > env.bin
"""


def run_script(text: str, tmp: Path):
    """Run `text` with bash -u in `tmp` (python3 is the recording stand-in): (argv it got, its environment)."""
    bindir = tmp / "bin"
    bindir.mkdir(parents=True)
    (bindir / "python3").write_text(_STANDIN)
    (bindir / "python3").chmod(0o755)
    (tmp / "launch.sh").write_text(text)
    checked = subprocess.run(["bash", "-n", "launch.sh"], cwd=tmp, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "HOME": str(tmp), "LANG": "C.UTF-8"}
    done = subprocess.run(["bash", "-u", "launch.sh"], cwd=tmp, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert not (tmp / MARKER).exists(), "a value ran as a command"
    assert sorted(p.name for p in tmp.iterdir()) == ["argv.bin", "bin", "env.bin", "launch.sh"]
    argv = (tmp / "argv.bin").read_bytes().decode().split("\0")[:-1]
    environ = dict(item.split("=", 1) for item in (tmp / "env.bin").read_bytes().decode().split("\0")[:-1])
    return argv, environ


def words(text: str):
    """The words of the script's commands as a POSIX shell splits them (`#` comments dropped); a `\\`-newline line
    continuation reads as a lone newline word in shlex, and no exported word is one."""
    return [w for w in shlex.split(text, comments=True) if w != "\n"]


def expected_words(exported):
    out = []
    for k, v in sorted(exported["env"].items()):
        out += ["export", f"{k}={v}"]
    return out + ENTRY + exported["argv"]


def literal(value):
    """`value` as an OmegaConf string that resolves to it (its `${` escaped; no backslash precedes one here)."""
    return value.replace("${", "\\${")


def hostile_config():
    cfg = compose(["model=qwen3_5_0_8b", "backend=megatron", "hw=gpu_1node", "data=geo3k"])
    with open_dict(cfg):
        for i, value in enumerate(HOSTILE):
            cfg.hw.env[f"HOSTILE_{i}"] = literal(value)
        cfg.backend.env["BACKEND_HOSTILE"] = HOSTILE[0]
        cfg.hw.name = HOSTILE[0]
        cfg.trainer.run_name = "".join(HOSTILE[:5])  # verl's trainer.experiment_name
        cfg.data.system_prompt = literal("\n".join(HOSTILE))
        cfg.trainer.output_root = HOSTILE[1]
        cfg.trainer.checkpoint_dir = literal(HOSTILE[7])  # verl's trainer.default_local_dir
        cfg.hw.ray_runtime_env.py_executable = literal(HOSTILE[3])  # verl's ray_kwargs.ray_init.runtime_env
        cfg.data.train_files = [literal(v) for v in HOSTILE[:3]]
        cfg.data.val_files = [literal(v) for v in HOSTILE[5:8]]
    return cfg


def test_hostile_values_round_trip_exactly(tmp_path):
    cfg = hostile_config()
    exported = export(cfg)
    text = render(exported)
    assert words(text) == expected_words(exported)
    argv, environ = run_script(text, tmp_path)
    assert argv == ["-m", "verl.trainer.main_ppo", *exported["argv"]]
    for i, value in enumerate(HOSTILE):
        assert environ[f"HOSTILE_{i}"] == value
    assert environ["BACKEND_HOSTILE"] == HOSTILE[0]
    # verl composes the overrides it was given back to the configured values
    verl = compose_verl([a for a in argv[2:] if not a.startswith("model_engine=")] + ["model_engine=megatron"])
    assert verl["trainer"]["experiment_name"] == "".join(HOSTILE[:5])
    assert verl["trainer"]["default_local_dir"] == HOSTILE[7]
    assert verl["ray_kwargs"]["ray_init"]["runtime_env"]["py_executable"] == HOSTILE[3]
    assert verl["data"]["train_files"] == HOSTILE[:3] and verl["data"]["val_files"] == HOSTILE[5:8]


def test_comment_lines_stay_comments():
    """Settings verl has no key for are listed one per `#` line; a value that is not printable on one line is shown
    as a Python literal that reads back to it."""
    text = render(export(hostile_config()))
    comments = text.split("# qwen35rl settings verl has no key for:\n", 1)[1]
    assert all(line.startswith("#") for line in comments.split("\n"))
    shown = {}
    for line in comments.split("\n"):
        key, eq, value = line.lstrip("# ").partition("=")
        if eq:
            shown[key] = value
    prompt = shown["data.system_prompt"]
    assert prompt.endswith("  (Python literal)")
    assert ast.literal_eval(prompt[:-len("  (Python literal)")]) == "\n".join(HOSTILE)
    assert ast.literal_eval(shown["hw.name"].removesuffix("  (Python literal)")) == HOSTILE[0]
    assert shown["trainer.output_root"] == "'$(touch PWNED)'"  # printable: Hydra's own quoting


OVERLAY = {  # a team's shared cluster overlay, as issue 37 found them
    "cluster/hostile.yaml": f"""
        ray_address: auto
        hw:
          name: "cluster\\ntouch {MARKER}"
          env:
            NCCL_SOCKET_IFNAME: "eth0\\ntouch {MARKER}"
            HF_HOME: "/shared/$(touch {MARKER})/`touch {MARKER}`/'q' \\"d\\"/C:\\\\hf\\\\"
            GREETING: "é ☃ \\\\n is not a line break"
        data:
          system_prompt: "You are helpful.\\n# end\\ntouch {MARKER}\\n"
        trainer:
          output_root: "/shared/runs\\ntouch {MARKER}"
    """,
    "cluster/badname.yaml": f"""
        hw:
          env:
            "NCCL_DEBUG;touch {MARKER};X": WARN
            "LINE\\nBREAK": x
    """,
}


@pytest.fixture
def overlay(tmp_path, monkeypatch):
    root = tmp_path / "overlay"
    for name, body in OVERLAY.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("# @package _global_\n" + textwrap.dedent(body))
    monkeypatch.setenv("QWEN35RL_CONFIG_PATH", str(root))
    return root


def test_a_hostile_cluster_overlay_through_the_console_script(overlay, tmp_path):
    run = subprocess.run([str(BIN / "qwen35rl-plan"), "cluster=hostile", "format=verl"], capture_output=True,
                         text=True, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=180)
    assert run.returncode == 0, run.stderr
    argv, environ = run_script(run.stdout, tmp_path / "run")
    assert environ["NCCL_SOCKET_IFNAME"] == f"eth0\ntouch {MARKER}"
    assert environ["HF_HOME"] == f"/shared/$(touch {MARKER})/`touch {MARKER}`/'q' \"d\"/C:\\hf\\"
    assert environ["GREETING"] == "é ☃ \\n is not a line break"
    # the run name ends with the hardware's name (the overlay's hostile one), quoted as one word
    assert [a for a in argv if a.startswith("trainer.experiment_name='qwen3_5_tiny-")
            and a.endswith(f"-cluster\ntouch {MARKER}'")], argv
    assert words(run.stdout)[-len(argv):] == argv


def test_an_environment_name_that_is_no_shell_identifier_is_refused(overlay, tmp_path):
    run = subprocess.run([str(BIN / "qwen35rl-plan"), "cluster=badname", "format=verl"], capture_output=True,
                         text=True, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=180)
    assert run.returncode == 2 and run.stdout == ""
    assert f"error: [env_name_not_shell_identifier] hw.env: the variable name 'NCCL_DEBUG;touch {MARKER};X' is " \
           "not a shell identifier" in run.stderr
    assert "the variable name 'LINE\\nBREAK'" in run.stderr
    assert "hint: rename or remove it where it is set" in run.stderr and "Traceback" not in run.stderr
    assert not (tmp_path / MARKER).exists()


@pytest.mark.parametrize("override", ["+hw.env.MY-VAR=1", "+backend.env.X-Y=1"])
def test_refusals_in_process_and_the_other_formats(override, capsys):
    assert plan([override, "format=verl"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "[env_name_not_shell_identifier]" in out.err
    assert plan([override, "format=json"]) == 0  # data, not a script: the JSON plan carries the name as it is
    assert "[env_name_not_shell_identifier]" not in capsys.readouterr().err


def test_render_refuses_what_it_cannot_write():
    for env in ({"A;B": "x"}, {"A": "x\0y"}):
        with pytest.raises(ValueError):
            render({"argv": [], "env": env, "not_exported": []})


def test_sweep_exports_are_refused_per_job(overlay, tmp_path, capsys):
    assert plan(["-m", "cluster=hostile,badname", "format=verl", f"hydra.sweep.dir={tmp_path}/sweep"]) == 0
    out = capsys.readouterr()
    assert out.out.count("python3 -m verl.trainer.main_ppo") == 1 and "[env_name_not_shell_identifier]" in out.err
    assert "NO" in (tmp_path / "sweep" / "summary.md").read_text()
