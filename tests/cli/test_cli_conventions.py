"""Conventions both commands keep: strict `+keys` (outside the pass-through dicts), Hydra's flags anywhere on the
command line (with and without QWEN35RL_CONFIG_PATH), a `--help` per command, and one run directory for the plan
and the training job. In-process `main([...])` calls, plus a few console-script runs."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from qwen35rl.cli import common
from qwen35rl.cli.plan import main as plan
from qwen35rl.exit_codes import table

BIN = Path(sys.executable).parent
PLAN, TRAIN = str(BIN / "qwen35rl-plan"), str(BIN / "qwen35rl-train")


@pytest.fixture
def overlay(tmp_path, monkeypatch):
    """An overlay directory on QWEN35RL_CONFIG_PATH: experiments (one good, one with a typo, one with a verl key, one
    that moves the run directory) and a cluster of its own."""
    root = tmp_path / "overlay"
    files = {
        "experiment/mine.yaml": "rollout:\n  n: 4\ntrainer:\n  total_steps: 7\n",
        "experiment/typo.yaml": "rollout:\n  nn: 4\n",
        "experiment/verlish.yaml": "actor_rollout_ref:\n  rollout:\n    n: 4\n",
        "experiment/elsewhere.yaml": f"hydra:\n  run:\n    dir: {tmp_path}/from_overlay\n",
        "cluster/lab.yaml": "hw:\n  env:\n    NCCL_SOCKET_IFNAME: ib0\n",
    }
    for name, body in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("# @package _global_\n" + body)
    monkeypatch.setenv("QWEN35RL_CONFIG_PATH", str(root))
    return root


def run(cmd, *args, env=None, cwd=None, timeout=180):
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([cmd, *args], capture_output=True, text=True, env=full_env, cwd=cwd, timeout=timeout)


# ===================================================================================== 1. strict everywhere
@pytest.mark.parametrize("override,key,fragment", [
    ("+some.new_key=1", "some.new_key", "unknown top-level key 'some'"),
    ("++x=1", "'x'", "unknown top-level key 'x'"),
    ("+backend.new_key=1", "backend.new_key", "unknown key 'new_key'"),
    ("+data.dataloader_num_workers=4", "data.dataloader_num_workers", "qwen35rl tokenizes in the driver"),  # verl's key, not carried
    ("+actor_rollout_ref.rollout.n=8", "actor_rollout_ref.rollout.n", "qwen35rl's is rollout.n: try rollout.n=8"),
    ("+rollout.nn=3", "rollout.nn", "did you mean 'n'?"),
    ("++trainer.sed=3", "trainer.sed", "did you mean 'seed'?"),
    ("+trainr.seed=3", "trainr.seed", "did you mean trainer.seed?"),
    ("+backend.transformer_overrides.num_layers=2", "backend.transformer_overrides", "backend=megatron"),
    ("+experiment=mine", "experiment", "no config group 'experiment' on the search path"),
    ("+rollout.n=8", "rollout.n", "set it without the plus: rollout.n=8"),
])
def test_a_new_key_outside_the_pass_through_dicts_is_refused(override, key, fragment, capsys):
    assert plan([override]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    assert err.startswith("qwen35rl: config error at ") and key in err and fragment in err, err
    assert "value:   " + override.partition("=")[2] in err


def test_the_refusal_lists_the_keys_and_the_pass_through_dicts(capsys):
    assert plan(["+data.shufle=false", "format=json"]) == 2
    out, err = capsys.readouterr()
    assert "allowed: name, kind, train_files" in err
    for d in ("rollout.engine_kwargs", "backend.transformer_overrides", "hw.env", "backend.env"):
        assert d in err
    problem = json.loads(out)["problems"][0]
    assert problem["key"] == "data.shufle" and problem["code"] == "unknown_key"


@pytest.mark.parametrize("override,hint", [
    ("actor_rollout_ref.rollout.n=8", "this is verl's key; qwen35rl's is rollout.n: try rollout.n=8"),
    ("actor_rollout_ref.actor.ppo_mini_batch_size=16", "qwen35rl's is algorithm.mini_batch_size"),
    ("trainer.n_gpus_per_node=8", "qwen35rl's is hw.devices_per_node"),
    ("+actor_rollout_ref.rollout.engine_kwargs.vllm.max_num_seqs=8",
     "qwen35rl's is rollout.engine_kwargs.max_num_seqs: try +rollout.engine_kwargs.max_num_seqs=8"),
])
def test_verl_key_names_point_to_the_qwen35rl_key(override, hint, capsys):
    assert plan([override]) == 2
    err = capsys.readouterr().err
    assert hint in err and "Traceback" not in err


def test_additions_inside_the_pass_through_dicts_and_group_additions_stay(overlay, capsys):
    from qwen35rl.config.compose import compose

    cfg = compose(["+hw.env.QWEN35RL_X=1", "+backend.env.QWEN35RL_Y=2", "+rollout.engine_kwargs.enable_lora=true",
                   "+rollout.engine_kwargs.compilation_config.level=3", "+hw.megatron_quirks.use_flash_attn=false"])
    assert cfg.hw.env.QWEN35RL_X == "1" and cfg.backend.env.QWEN35RL_Y == "2"
    assert cfg.rollout.engine_kwargs.enable_lora is True and cfg.rollout.engine_kwargs.compilation_config.level == 3
    meg = compose(["backend=megatron", "+backend.transformer_overrides.deterministic_mode=true"])
    assert meg.backend.transformer_overrides.deterministic_mode is True
    # a group the defaults list has, with or without the plus; an overlay group, with or without it
    assert compose(["+cluster=lab"]) == compose(["cluster=lab"])
    assert compose(["+cluster=lab"]).hw.env.NCCL_SOCKET_IFNAME == "ib0"
    for form in ("+experiment=mine", "experiment=mine", "++experiment=mine"):
        cfg = compose([form])
        assert cfg.rollout.n == 4 and cfg.trainer.total_steps == 7, form
    assert plan(["+experiment=mine", "format=json"]) in (0, 2)  # composes; the plan judges the numbers
    assert json.loads(capsys.readouterr().out)["model"] == "qwen3_5_tiny"


def test_pass_through_names_are_checked_whatever_the_engine(capsys):
    # the default rollout on CPU is hf; a misspelt vLLM argument is still caught
    assert plan(["+rollout.engine_kwargs.enable_lroa=true", "format=json"]) == 2
    problems = json.loads(capsys.readouterr().out)["problems"]
    bad = [p for p in problems if p["code"] == "engine_kwargs_known"]
    assert bad and bad[0]["key"] == "rollout.engine_kwargs.enable_lroa" and "enable_lora" in bad[0]["hint"]
    assert plan(["+rollout.engine_kwargs.enable_lora=true", "format=json"]) == 0
    assert not [p for p in json.loads(capsys.readouterr().out)["problems"] if p["code"] == "engine_kwargs_known"]


def test_overlay_groups_are_checked_and_an_overlay_sets_schema_keys_only(overlay, capsys):
    assert plan(["+experiment=mien"]) == 2
    err = capsys.readouterr().err
    assert "unknown experiment 'mien'" in err and "did you mean 'mine'?" in err
    assert "allowed: elsewhere, mine, typo, verlish" in err
    assert plan(["+experiment=typo"]) == 2
    err = capsys.readouterr().err
    assert "config error at 'rollout.nn'" in err and "did you mean 'n'?" in err
    assert str(overlay / "experiment" / "typo.yaml") in err and "Traceback" not in err
    assert plan(["+experiment=verlish"]) == 2
    err = capsys.readouterr().err
    assert "qwen35rl's is rollout.n" in err and str(overlay / "experiment" / "verlish.yaml") in err


def test_cfg_job_and_sweeps_refuse_a_stray_key_too(capsys):
    assert plan(["--cfg", "job", "+data.shuffle=false"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "data.shuffle" in err
    assert plan(["-m", "+rollout.nn=1,2"]) == 2
    assert "rollout.nn" in capsys.readouterr().err


# ======================================================================================= 2. flags anywhere
def test_flags_are_taken_wherever_they_stand():
    flags, overrides = common.split_argv(["a=1", "-m", "b=2", "--cfg", "job", "--resolve", "c=3", "--info", "d=4",
                                          "--info", "defaults", "-p", "rollout", "--", "-e=5"])
    assert flags == ["-m", "--cfg", "job", "--resolve", "--info", "--info", "defaults", "-p", "rollout"]
    assert overrides == ["a=1", "b=2", "c=3", "d=4", "-e=5"]
    args = common.parse_args(["hw=cpu", "--multirun", "+cluster=example", "--cfg=job"])
    # cluster options merge at the root: the group is chosen by its defaults-list name
    assert args.multirun and args.cfg == "job" and args.overrides == ["hw=cpu", "cluster@_global_=example"]
    assert args.argv == ["--multirun", "--cfg=job", "hw=cpu", "cluster@_global_=example"]


@pytest.mark.parametrize("entry", ["plan", "train"])
def test_cfg_info_and_resolve_after_overrides_with_an_overlay_path(entry, overlay, capsys):
    main = plan if entry == "plan" else __import__("qwen35rl.cli.train", fromlist=["main"]).main
    assert main(["hw=cpu", "+experiment=mine", "--cfg", "job", "--resolve", "--package", "rollout"]) == 0
    out = capsys.readouterr().out
    assert "# @package rollout" in out and "'n': 4" in out and "hydra.searchpath" not in out
    assert main(["hw=cpu", "--info", "searchpath"]) == 0
    assert f"file://{overlay}" in capsys.readouterr().out
    assert main(["hw=cpu", "--hydra-help"]) == 0
    assert "Hydra (1.3" in capsys.readouterr().out


def test_multirun_flag_after_the_overrides_with_an_overlay_path(overlay, tmp_path):
    r = run(PLAN, "hw=cpu", f"hydra.sweep.dir={tmp_path}/sweep", "+experiment=mine", "trainer.seed=1,2",
            "format=json", "-m")
    assert r.returncode in (0, 2) and "unrecognized arguments" not in r.stderr, r.stderr
    plans = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(plans) == 2 and [p["output_dir"] for p in plans] == [f"{tmp_path}/sweep/0", f"{tmp_path}/sweep/1"]


def test_shell_completion(overlay, capsys, monkeypatch):
    r = run(PLAN, "--shell-completion")
    assert r.returncode == 2 and "usage: qwen35rl-plan --shell-completion install=bash" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    r = run(PLAN, "--shell-completion", "install=bash")
    assert r.returncode == 0 and "complete -o nospace -o default -F hydra_bash_completion qwen35rl-plan" in r.stdout
    # the query bash sends while completing: overlay groups and their options, no internal trees
    r = run(PLAN, "-sc", "query=bash", env={"COMP_LINE": "qwen35rl-plan hw=cpu +exp"})
    assert r.returncode == 0 and r.stdout.split() == ["+experiment="], r.stderr
    for line, expected in (("qwen35rl-train +experiment=", {"+experiment=mine", "+experiment=typo"}),
                           ("qwen35rl-train cluster=", {"cluster=lab", "cluster=example"}),
                           ("qwen35rl-train ", {"model=", "hw=", "experiment=", "trainer."})):
        monkeypatch.setenv("COMP_LINE", line)
        assert __import__("qwen35rl.cli.train", fromlist=["main"]).main(["-sc", "query=bash"]) == 0
        words = set(capsys.readouterr().out.split())
        assert expected <= words, (line, words)
        assert not {w for w in words if w.startswith(("model_base", "platform", "schema"))}


# ============================================================================================ 3. --help
def test_help_per_command_through_the_console_scripts(overlay):
    texts = {}
    for cmd, flag in ((PLAN, "--help"), (TRAIN, "-h")):
        r = run(cmd, "hw=cpu", flag, "model=qwen3_5_27b")  # anywhere on the line
        assert r.returncode == 0 and r.stderr == "", r.stderr
        texts[Path(cmd).name] = r.stdout
    for name, text in texts.items():
        assert text.startswith(f"usage: {name} [flags] [overrides]") and "powered by Hydra" not in text
        examples = text.split("Examples:")[1].split("\n\n")[0]
        assert len([ln for ln in examples.splitlines() if ln.startswith(f"  {name}")]) == 3
        groups = text.split("Config groups")[1].split("Every key")[0]
        listed = re.findall(r"^  (\+?[\w/]+)=", groups, re.M)
        assert listed == ["model", "hw", "backend", "rollout", "algorithm", "data", "placement", "parallelism",
                          "cluster", "+experiment"]  # internal trees (model_base, platform, recipe, schema, hydra) hidden
        flat = " ".join(groups.split())
        assert f"example, lab [from {overlay}]" in flat and f"+experiment= elsewhere, mine, typo, verlish [from {overlay}]" in flat
        assert "qwen3_5_tiny_vl_moe (default: qwen3_5_tiny)" in flat and f"then QWEN35RL_CONFIG_PATH: {overlay}" in flat
        assert "qwen35rl/config/schema.py" in text and f"{name} --cfg job" in text and "--hydra-help" in text
        assert "Exit codes (qwen35rl/exit_codes.py):" in text
    assert texts["qwen35rl-plan"] != texts["qwen35rl-train"]
    assert table() in texts["qwen35rl-train"] and "the plan is valid" in texts["qwen35rl-plan"]
    assert "GRPO" in texts["qwen35rl-train"] and "Starts nothing" in texts["qwen35rl-plan"]


_PROBE = """
import contextlib, io, json, sys
from qwen35rl.cli.train import main
out = []
for argv in json.loads(sys.argv[1]):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        rc = main(argv)
    out.append({"rc": rc, "text": buf.getvalue()})
print(json.dumps({"runs": out, "ray": sorted(m for m in sys.modules if m.split('.')[0] == 'ray')}))
"""


def test_train_help_cfg_and_info_start_no_ray(tmp_path):
    argvs = [["--help"], ["hw=cpu", "-h"], ["hw=cpu", "--cfg", "job"], ["--info", "defaults", "hw=cpu"],
             ["+data.shuffle=false"]]
    env = {**os.environ, "RAY_TMPDIR": str(tmp_path / "ray")}
    r = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(argvs)], capture_output=True, text=True,
                       timeout=180, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert [x["rc"] for x in res["runs"]] == [0, 0, 0, 0, 2]
    assert res["runs"][0]["text"].startswith("usage: qwen35rl-train") and "model:" in res["runs"][2]["text"]
    assert "data.shuffle" in res["runs"][4]["text"]
    assert res["ray"] == [] and not (tmp_path / "ray").exists() and not (tmp_path / "runs").exists()


# ============================================================================ 4. one run directory truth
_RUN_DIRS = """
import contextlib, io, json, sys
from hydra.core.hydra_config import HydraConfig
from qwen35rl.cli import train as train_cli
from qwen35rl.cli.plan import main as plan

seen = []


def job(cfg):  # the training job, as far as its run directory: what `_train_job` hands to the training
    seen.append(HydraConfig.get().runtime.output_dir)
    train_cli._exit_codes.append(0)


job.__module__ = "qwen35rl.cli.train"
train_cli._train_job = job
out = []
for argv in json.loads(sys.argv[1]):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = plan([*argv, "format=json"])
    planned = [json.loads(line)["output_dir"] for line in buf.getvalue().splitlines() if line.startswith("{")]
    seen.clear()
    with contextlib.redirect_stdout(io.StringIO()):
        code = train_cli.main(argv)
    out.append({"plan_rc": rc, "planned": planned, "train_rc": code, "trained": list(seen)})
print(json.dumps(out))
"""


def test_the_plan_reports_the_directory_training_writes_to(overlay, tmp_path):
    cases = [
        [],
        [f"hydra.run.dir={tmp_path}/explicit"],
        [f"trainer.output_root={tmp_path}/root", "trainer.run_name=named"],
        ["hydra.run.dir=${trainer.output_root}/${hydra.job.name}/${trainer.seed}", f"trainer.output_root={tmp_path}/r"],
        ["+experiment=elsewhere"],
        [f"hydra.sweep.dir={tmp_path}/sweep", "trainer.seed=1,2", "-m"],  # the flag last, for both commands
    ]
    r = subprocess.run([sys.executable, "-c", _RUN_DIRS, json.dumps(cases)], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path, env={**os.environ, "RAY_TMPDIR": str(tmp_path / "ray")})
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(r.stdout.strip().splitlines()[-1])
    expected = [[f"{tmp_path}/runs/qwen3_5_tiny-synthetic-grpo-fsdp2-cpu"], [f"{tmp_path}/explicit"],
                [f"{tmp_path}/root/named"],
                [f"{tmp_path}/r/train/1"], [f"{tmp_path}/from_overlay"], [f"{tmp_path}/sweep/0", f"{tmp_path}/sweep/1"]]
    real = lambda paths: [str((tmp_path / p).resolve()) for p in paths]  # noqa: E731 - relative to the cwd
    for case, res, want in zip(cases, results, expected):
        assert res["plan_rc"] == 0 and res["train_rc"] == 0, (case, res)
        assert real(res["planned"]) == real(want) == real(res["trained"]), (case, res)
    # as the config says it, relative to the cwd
    assert results[0]["planned"] == ["runs/qwen3_5_tiny-synthetic-grpo-fsdp2-cpu"]


def test_plan_text_shows_the_run_directory(tmp_path, capsys):
    assert plan([f"hydra.run.dir={tmp_path}/x"]) == 0
    assert f"  output     {tmp_path}/x" in capsys.readouterr().out


def test_a_hydra_key_that_cannot_be_overridden_names_hydras_config():
    from qwen35rl.config.compose import ConfigError, compose

    with pytest.raises(ConfigError) as e:
        compose(["hydra.launcher.no_such_key={a: 1}"])
    assert e.value.key == "hydra.launcher.no_such_key" and "Hydra's own config" in e.value.message
    assert "+hydra.launcher.no_such_key.<name>=<value>" in e.value.hint
