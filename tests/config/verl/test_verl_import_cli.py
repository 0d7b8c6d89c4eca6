"""`qwen35rl-import verl`: where the overlay goes, the command it prints, refusals with exit 2, and that the printed
command plans valid."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from qwen35rl.cli.import_verl import main

SCRIPT = textwrap.dedent("""\
    #!/bin/bash
    set -euo pipefail
    CKPT=${CKPT:-$HOME/ckpt/Qwen3.5-27B}
    GEN_TP=4
    python3 -m verl.trainer.main_ppo \\
        algorithm.adv_estimator=grpo \\
        data.train_files=$HOME/data/geo3k/train.parquet \\
        data.val_files=$HOME/data/geo3k/test.parquet \\
        data.train_batch_size=64 data.max_prompt_length=1024 data.max_response_length=2048 \\
        data.filter_overlong_prompts=True \\
        actor_rollout_ref.model.path=$CKPT \\
        actor_rollout_ref.actor.optim.lr=1e-6 \\
        actor_rollout_ref.actor.ppo_mini_batch_size=16 \\
        actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1 \\
        actor_rollout_ref.actor.fsdp_config.param_offload=True \\
        actor_rollout_ref.actor.fsdp_config.optimizer_offload=True \\
        actor_rollout_ref.actor.fsdp_config.offload_policy=True \\
        actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.01 \\
        actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=5 \\
        actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \\
        actor_rollout_ref.rollout.tensor_model_parallel_size=$GEN_TP \\
        trainer.experiment_name=geo3k_27b trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.total_epochs=15
    """)


@pytest.fixture
def script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("QWEN35RL_CONFIG_PATH", raising=False)
    p = tmp_path / "run_27b.sh"
    p.write_text(SCRIPT)
    return p


def run(capsys, *args):
    rc = main(["verl", *map(str, args)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_default_dir_command_and_plan(script, capsys, tmp_path):
    rc, out, _ = run(capsys, script, "--format", "json")
    r = json.loads(out)
    assert rc == 0 and r["plan"]["valid"], r["plan"]
    conf = tmp_path / "qwen35rl_conf"
    assert r["overlay"] == str(conf / "experiment" / "geo3k_27b.yaml") and os.path.isfile(r["overlay"])
    assert r["command"] == ["qwen35rl-train", "model=qwen3_5_27b", "backend=fsdp", "hw=gpu_1node", "data=geo3k",
                            "+experiment=geo3k_27b"]
    assert r["command_env"] == {"QWEN35RL_CONFIG_PATH": str(conf)}
    assert r["carried"]["actor_rollout_ref.model.path"] == "model.path"
    assert "actor_rollout_ref.actor.optim.lr" in r["defaults"]
    # the printed command is what qwen35rl-plan accepts (a fresh process, as the user would run it)
    env = dict(os.environ, **r["command_env"], OMP_NUM_THREADS="1")
    plan = subprocess.run([sys.executable, "-m", "qwen35rl.cli.plan", *r["command"][1:], "format=json"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert plan.returncode == 0, plan.stderr
    p = json.loads(plan.stdout)
    assert p["rollout"]["tp"] == 4 and p["output_dir"].endswith("/geo3k_27b")


def test_dir_already_on_search_path_needs_no_env(script, capsys, tmp_path, monkeypatch):
    mine = tmp_path / "team_conf"
    mine.mkdir()
    monkeypatch.setenv("QWEN35RL_CONFIG_PATH", str(mine))
    rc, out, _ = run(capsys, script, "--format", "json", "--name", "Mine-1")
    r = json.loads(out)
    assert rc == 0 and r["command_env"] == {} and r["overlay"] == str(mine / "experiment" / "mine_1.yaml")
    rc, out, err = run(capsys, script, "--name", "mine_1")
    assert rc == 2 and "exists" in err and "--force" in err  # nothing is overwritten silently
    rc, out, _ = run(capsys, script, "--name", "mine_1", "--force")
    assert rc == 0 and "plan: VALID" in out and "+experiment=mine_1" in out


@pytest.mark.parametrize("body,needle", [
    ("echo hello\n", "never called python3 -m verl.trainer.main_ppo"),
    ("python3 -m verl.trainer.main_ppo actor_rollout_ref.model.path=/x/SomeOtherModel-7B\n", "--model"),
    ("python3 -m verl.trainer.main_ppo model_engine=torchtitan actor_rollout_ref.model.path=/m/Qwen3.5-27B\n",
     "FSDP2 (backend=fsdp) or Megatron"),
    ("python3 -m verl.trainer.main_ppo 'data.train_files=[a,' actor_rollout_ref.model.path=/m/Qwen3.5-27B\n",
     "not a Hydra override"),
], ids=["no-launch", "unknown-model", "other-engine", "bad-override"])
def test_refusals_exit_2_with_the_fix(tmp_path, capsys, monkeypatch, body, needle):
    monkeypatch.chdir(tmp_path)
    p = tmp_path / "bad.sh"
    p.write_text("#!/bin/bash\n" + body)
    rc, out, err = run(capsys, p, "--out", tmp_path / "o")
    assert rc == 2 and needle in err, err
    assert not (tmp_path / "o" / "experiment").exists()  # nothing half-written


def test_missing_source(capsys, tmp_path):
    rc, _, err = run(capsys, tmp_path / "nope.sh")
    assert rc == 2 and "is not a file" in err


def test_override_list_with_env_file_and_new_hardware(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ovr.txt").write_text(
        "+ python3 -m verl.trainer.main_ppo model_engine=megatron \\\n"
        "algorithm.adv_estimator=grpo\n"
        "actor_rollout_ref.model.path=/models/Qwen3.5-35B-A3B\n"
        "data.train_files=/data/geo3k/train.parquet\n"
        "trainer.nnodes=3\n"
        "trainer.n_gpus_per_node=8\n"
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2\n"
        "actor_rollout_ref.actor.megatron.expert_model_parallel_size=8\n"
        "actor_rollout_ref.rollout.tensor_model_parallel_size=8\n")
    (tmp_path / "launch.env").write_text("export NCCL_IB_HCA=mlx5\nMY_DIR=/x\nHF_TOKEN=hf_secret\n")
    rc, out, _ = run(capsys, tmp_path / "ovr.txt", "--env", tmp_path / "launch.env", "--format", "json",
                     "--out", tmp_path / "c")
    r = json.loads(out)
    assert r["backend"] == "megatron" and r["hw"] == "gpu_3x8" and r["hw_overlay"].endswith("hw/gpu_3x8.yaml")
    assert r["env"]["carried"] == {"NCCL_IB_HCA": "hw.env.NCCL_IB_HCA"}
    why = {x["key"]: x["why"] for x in r["env"]["not_carried"]}
    assert set(why) == {"MY_DIR", "HF_TOKEN"} and "secret" in why["HF_TOKEN"]
    assert "hf_secret" not in out and "hf_secret" not in open(r["overlay"]).read()
    assert r["settings"]["parallelism.tp"] == 2 and r["settings"]["parallelism.ep"] == 8


# --------------------------------------------------------------------------- refused parts and --force
CLI = os.path.join(os.path.dirname(sys.executable), "qwen35rl-import")
REFUSED_PARTS = {  # a part qwen35rl does not run -> a word of its reason
    "actor_rollout_ref.actor.strategy": "megatron_lite",
    "actor_rollout_ref.actor.megatron_lite.tp": "megatron_lite",
    "actor_rollout_ref.actor.policy_loss.loss_mode": "PPO-clip",
    "data.video_key": "video",
}
WITH_REFUSED_PARTS = SCRIPT.replace(
    "trainer.experiment_name=geo3k_27b",
    "trainer.experiment_name=geo3k_27b actor_rollout_ref.actor.strategy=megatron_lite \\\n"
    "    +actor_rollout_ref.actor.megatron_lite.tp=2 actor_rollout_ref.actor.policy_loss.loss_mode=gspo \\\n"
    "    data.video_key=videos")


def console(tmp_path, body, *args):
    src = tmp_path / "launch.sh"
    src.write_text(body)
    return subprocess.run([CLI, "verl", str(src), "--out", str(tmp_path / "conf"), *map(str, args)],
                          capture_output=True, text=True, timeout=180, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})


def test_refused_parts_are_all_named_and_nothing_is_written(tmp_path):
    p = console(tmp_path, WITH_REFUSED_PARTS)
    assert p.returncode == 2, p.stderr
    for key, word in REFUSED_PARTS.items():
        line = next((l for l in p.stderr.splitlines() if l.strip().startswith(key + "=")), "")
        assert word in line, (key, p.stderr)
    assert "--force imports the rest" in p.stderr
    assert not (tmp_path / "conf").exists()
    js = console(tmp_path, WITH_REFUSED_PARTS, "--format", "json")
    out = json.loads(js.stdout)
    assert js.returncode == 2 and {x["key"] for x in out["refused"]} == set(REFUSED_PARTS)


def test_force_imports_the_rest_and_lists_what_it_left_out(tmp_path):
    p = console(tmp_path, WITH_REFUSED_PARTS, "--force", "--format", "json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["plan"]["valid"] and r["backend"] == "fsdp"
    dropped = {x["key"]: x for x in r["dropped"]}
    assert set(dropped) == set(REFUSED_PARTS)
    assert all(x["why"].strip() and x["instead"].strip() for x in dropped.values())
    assert "backend=fsdp" in dropped["actor_rollout_ref.actor.strategy"]["instead"]
    assert "PPO-clip" in dropped["actor_rollout_ref.actor.policy_loss.loss_mode"]["instead"]
    reported = {*r["carried"], *r["defaults"], *r["fixed"], *(x["key"] for x in r["not_carried"])}
    assert not reported & set(REFUSED_PARTS)  # left out, not also reported as something else
    assert r["carried"]["actor_rollout_ref.model.path"] == "model.path"
    overlay = open(r["overlay"]).read()
    assert "# Left out with --force" in overlay and "#   data.video_key=videos: video data" in overlay
    # the same with the text report, over the overlay just written (--force replaces it)
    text = console(tmp_path, WITH_REFUSED_PARTS, "--force")
    assert text.returncode == 0, text.stderr
    assert "LEFT OUT (--force): 4 part(s)" in text.stdout and "4 left out" in text.stdout


def test_force_picks_the_backend_asked_for(tmp_path):
    p = console(tmp_path, WITH_REFUSED_PARTS, "--force", "--backend", "megatron", "--format", "json")
    r = json.loads(p.stdout)
    assert r["backend"] == "megatron" and r["picked"]["backend"] == "--backend"
    why = {x["key"]: x["why"] for x in r["not_carried"]}
    assert "fsdp engine only" in why["actor_rollout_ref.actor.fsdp_config.param_offload"]


@pytest.mark.parametrize("path", ["/models/Qwen3-30B-A3B", "/models/Llama-3.1-8B"])
def test_force_does_not_import_another_model(tmp_path, path):
    body = WITH_REFUSED_PARTS.replace("CKPT=${CKPT:-$HOME/ckpt/Qwen3.5-27B}", f"CKPT={path}")
    p = console(tmp_path, body, "--force")
    assert p.returncode == 2 and "Qwen3.5" in p.stderr, p.stderr
    assert not (tmp_path / "conf").exists()


def test_unset_advantage_estimator_is_verls_gae(tmp_path):
    """verl runs GAE (with a critic) when a script does not name the estimator: refused, not imported as GRPO."""
    body = SCRIPT.replace("algorithm.adv_estimator=grpo \\\n", "")
    p = console(tmp_path, body)
    assert p.returncode == 2 and "algorithm.adv_estimator=gae" in p.stderr and "verl's default" in p.stderr
    forced = json.loads(console(tmp_path, body, "--force", "--format", "json").stdout)
    assert [x["key"] for x in forced["dropped"]] == ["algorithm.adv_estimator"]
    assert "algorithm.adv_estimator" not in forced["settings"] and forced["plan"]["valid"]
