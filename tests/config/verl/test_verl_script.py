"""Evaluating verl launch scripts under stand-ins, and reading override lists and env files."""
import os
import textwrap
from pathlib import Path

import pytest

from qwen35rl.config.verl.script import (Launch, ScriptError, evaluate_script, load_source, read_env_file,
                                         read_override_list)

LAUNCH = "python3 -m verl.trainer.main_ppo"


def script(tmp_path: Path, body: str, name: str = "run.sh") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body).lstrip())
    return path


def run(tmp_path: Path, body: str, **kwargs) -> Launch:
    return evaluate_script(script(tmp_path, body), **kwargs)


def running(pid: int) -> bool:
    """A process that exists and is not a zombie (an unreaped zombie has finished)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:].split()[0] != "Z"


# --- device branches and probes ---------------------------------------------------------------------------------

def test_case_device_branches_differ_for_gpu_and_npu(tmp_path):
    path = script(tmp_path, f"""
        case $DEVICE in
          gpu) ENGINE=vllm ;;
          npu) ENGINE=vllm_ascend ;;
        esac
        {LAUNCH} actor_rollout_ref.rollout.name=$ENGINE
    """)
    assert evaluate_script(path, device="gpu").argv == ["actor_rollout_ref.rollout.name=vllm"]
    assert evaluate_script(path, device="npu").argv == ["actor_rollout_ref.rollout.name=vllm_ascend"]


def test_torch_npu_probe_picks_the_device(tmp_path):
    path = script(tmp_path, f"""
        if python3 -c "import torch; import torch_npu" 2>/dev/null; then D=npu; else D=cuda; fi
        {LAUNCH} trainer.device=$D
    """)
    assert evaluate_script(path, device="gpu").argv == ["trainer.device=cuda"]
    assert evaluate_script(path, device="npu").argv == ["trainer.device=npu"]


def test_device_count_probe_reaches_an_override(tmp_path):
    path = script(tmp_path, f"""
        N=$(python3 -c "import torch; print(torch.cuda.device_count())")
        {LAUNCH} trainer.n_gpus_per_node=$N
    """)
    assert evaluate_script(path).argv == ["trainer.n_gpus_per_node=8"]
    assert evaluate_script(path, devices_per_node=4).argv == ["trainer.n_gpus_per_node=4"]


def test_npu_device_count_and_npu_smi(tmp_path):
    launch = run(tmp_path, f"""
        N=$(python3 -c "import torch, torch_npu; print(torch.npu.device_count())")
        T=$(npu-smi info -l | grep "Total Count" | awk -F: '{{print $2}}' | tr -d ' ')
        {LAUNCH} trainer.n_gpus_per_node=$N t=$T
    """, device="npu")
    assert launch.argv == ["trainer.n_gpus_per_node=16", "t=16"]


def test_nvidia_smi_counts_and_queries(tmp_path):
    launch = run(tmp_path, f"""
        set -euo pipefail
        L=$(nvidia-smi -L | wc -l)
        Q=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -n1)
        {LAUNCH} l=$L "q=$Q"
    """, devices_per_node=2)
    assert launch.argv == ["l=2", "q=NVIDIA H100 80GB HBM3, 81559 MiB"]


def test_nvidia_smi_only_on_gpu(tmp_path):
    path = script(tmp_path, f"""
        if command -v nvidia-smi >/dev/null; then D=gpu; else D=other; fi
        {LAUNCH} d=$D
    """)
    assert evaluate_script(path, device="gpu").argv == ["d=gpu"]
    assert evaluate_script(path, device="npu").argv == ["d=other"]


def test_unknown_device_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="gpu"):
        evaluate_script(script(tmp_path, f"{LAUNCH} a=1\n"), device="tpu")


# --- shell forms ------------------------------------------------------------------------------------------------

def test_default_expansion_with_and_without_env(tmp_path):
    path = script(tmp_path, f"""
        set -u
        MODEL=${{MODEL_PATH:-Qwen/Qwen3.5-2B}}
        {LAUNCH} actor_rollout_ref.model.path=$MODEL
    """)
    assert evaluate_script(path).argv == ["actor_rollout_ref.model.path=Qwen/Qwen3.5-2B"]
    launch = evaluate_script(path, env={"MODEL_PATH": "/data/m"})
    assert launch.argv == ["actor_rollout_ref.model.path=/data/m"]
    assert launch.env == {"MODEL_PATH": "/data/m"}


def test_callers_environment_does_not_leak(tmp_path, monkeypatch):
    monkeypatch.setenv("QWEN35RL_LEAK_PROBE", "leaked")
    launch = run(tmp_path, f"{LAUNCH} x=${{QWEN35RL_LEAK_PROBE:-clean}}\n")
    assert launch.argv == ["x=clean"]
    assert "QWEN35RL_LEAK_PROBE" not in launch.calls[0].env


def test_array_values_with_spaces_and_plus_keys_stay_verbatim(tmp_path):
    launch = run(tmp_path, f"""
        set -euo pipefail
        ARGS=(
          "data.train_files=['a.parquet', 'b.parquet']"
          +actor_rollout_ref.model.override_config.attention_dropout=0.0
          ++trainer.val_before_train=False
          '~trainer.logger'
        )
        {LAUNCH} "${{ARGS[@]}}" trainer.total_epochs=1
    """)
    assert launch.argv == ["data.train_files=['a.parquet', 'b.parquet']",
                           "+actor_rollout_ref.model.override_config.attention_dropout=0.0",
                           "++trainer.val_before_train=False", "~trainer.logger", "trainer.total_epochs=1"]


def test_exports_prefixes_and_unset_make_the_launch_env(tmp_path):
    launch = run(tmp_path, f"""
        export NCCL_X=1
        export VLLM_USE_V1=1
        unset LANG
        VLLM_ATTENTION_BACKEND=XFORMERS {LAUNCH} a=1
    """)
    assert launch.env == {"NCCL_X": "1", "VLLM_USE_V1": "1", "VLLM_ATTENTION_BACKEND": "XFORMERS"}
    assert launch.unset == ["LANG"]
    assert launch.entry == LAUNCH
    assert launch.calls[0].env["NCCL_X"] == "1"


def test_path_kept_only_when_the_script_changed_it(tmp_path):
    launch = run(tmp_path, f"""
        export PATH=/opt/tools/bin:$PATH
        {LAUNCH} a=1
    """)
    assert launch.env == {"PATH": "/opt/tools/bin:/usr/local/bin:/usr/bin:/bin"}


def test_home_and_work_dir_map_back_to_the_callers(tmp_path, monkeypatch):
    caller = tmp_path / "caller"
    caller.mkdir()
    monkeypatch.chdir(caller)
    launch = run(tmp_path, f"""
        export CKPT=$HOME/ckpt
        {LAUNCH} actor_rollout_ref.model.path=$HOME/models/x data.train_files=$(pwd)/data/train.parquet
    """)
    home = os.path.expanduser("~")
    assert launch.argv == [f"actor_rollout_ref.model.path={home}/models/x",
                           f"data.train_files={caller}/data/train.parquet"]
    assert launch.env == {"CKPT": f"{home}/ckpt"}
    assert launch.cwd == str(caller)


def test_cd_to_the_scripts_folder(tmp_path):
    folder = tmp_path / "examples"
    folder.mkdir()
    launch = evaluate_script(script(folder, f"""
        cd "$(dirname "$0")"
        {LAUNCH} data.train_files=$(pwd)/train.parquet
    """))
    assert launch.argv == [f"data.train_files={folder}/train.parquet"]
    assert launch.cwd == str(folder)


def test_config_flags_stay_in_argv(tmp_path):
    launch = run(tmp_path, f"""
        {LAUNCH} --config-path=config --config-name=ppo_megatron_trainer \\
            algorithm.adv_estimator=grpo
    """)
    assert launch.argv == ["--config-path=config", "--config-name=ppo_megatron_trainer",
                           "algorithm.adv_estimator=grpo"]


def test_heredoc_probe_and_entry_script_path(tmp_path):
    launch = run(tmp_path, """
        N=$(python3 - <<'EOF'
        import torch
        print(torch.cuda.device_count())
        EOF
        )
        python3 -u /opt/verl/verl/trainer/main_ppo.py trainer.n_gpus_per_node=$N
    """, devices_per_node=2)
    assert launch.argv == ["trainer.n_gpus_per_node=2"]
    assert launch.entry == "python3 /opt/verl/verl/trainer/main_ppo.py"


# --- wrappers ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("command, entry, env", [
    ("uv run --with vllm python3 -m verl.trainer.main_ppo x=1",
     "uv run ... python3 -m verl.trainer.main_ppo", {}),
    ("""ray job submit --address=http://127.0.0.1:8265 --runtime-env-json '{"env_vars": {"A": "1"}}' """
     "--no-wait -- python3 -m verl.trainer.main_ppo x=1",
     "ray job submit ... -- python3 -m verl.trainer.main_ppo", {"A": "1"}),
    ("torchrun --nproc_per_node=8 --nnodes 1 -m verl.trainer.main_ppo x=1",
     "torchrun ... -m verl.trainer.main_ppo", {}),
])
def test_wrappers_yield_the_launch(tmp_path, command, entry, env):
    launch = run(tmp_path, "ray start --head\n" + command + "\n")
    assert launch.argv == ["x=1"]
    assert launch.entry == entry
    assert launch.env == env


def test_install_and_download_do_nothing(tmp_path):
    launch = run(tmp_path, f"""
        set -e
        pip install -e .
        python3 -m pip install vllm
        hf download Qwen/Qwen3.5-2B --local-dir $HOME/models/q
        {LAUNCH} actor_rollout_ref.model.path=$HOME/models/q
    """)
    # Under set -e every stand-in succeeded; the download went nowhere (HOME was a temporary folder).
    assert [c.tool for c in launch.calls] == ["pip", "python3", "hf", "python3"]
    assert launch.argv == [f"actor_rollout_ref.model.path={os.path.expanduser('~')}/models/q"]


def test_background_launch_is_recorded(tmp_path):
    launch = run(tmp_path, f"nohup {LAUNCH} a=1 > train.log 2>&1 &\necho started\n")
    assert launch.argv == ["a=1"]


def test_failure_after_the_launch_is_fine(tmp_path):
    launch = run(tmp_path, f"{LAUNCH} a=1\nfalse\n")
    assert launch.argv == ["a=1"]
    assert launch.status == 1


# --- errors -----------------------------------------------------------------------------------------------------

def test_no_launch_names_the_calls_stderr_and_the_override_list_hint(tmp_path):
    with pytest.raises(ScriptError) as err:
        run(tmp_path, """
            python3 -c "import torch"
            echo "something broke" >&2
            exit 3
        """)
    message = str(err.value)
    assert "exit status 3" in message and "never called python3 -m verl.trainer.main_ppo" in message
    assert "python3 -c 'import torch'" in message
    assert "something broke" in message
    assert "one override per line" in message


def test_unbound_variable_points_at_env(tmp_path):
    with pytest.raises(ScriptError, match="--env"):
        run(tmp_path, f"set -u\n{LAUNCH} model=$MODEL_PATH\n")


def test_two_different_launches_are_refused_identical_ones_are_not(tmp_path):
    with pytest.raises(ScriptError, match=r"2 times.*'a=1' vs 'a=2'"):
        run(tmp_path, f"{LAUNCH} a=1\n{LAUNCH} a=2\n")
    assert run(tmp_path, f"{LAUNCH} a=1\n{LAUNCH} a=1\n", ).argv == ["a=1"]


def test_timeout_stops_the_script_and_its_children(tmp_path):
    pidfile = tmp_path / "pids"
    path = script(tmp_path, """
        sleep 100 &
        echo "$$ $!" > "$PIDFILE"
        wait
    """)
    with pytest.raises(ScriptError, match="did not finish within 2 s"):
        evaluate_script(path, env={"PIDFILE": str(pidfile)}, timeout_s=2)
    pids = [int(p) for p in pidfile.read_text().split()]
    assert len(pids) == 2 and not any(running(p) for p in pids)


def test_script_writes_land_in_the_temporary_work_dir(tmp_path, monkeypatch):
    caller = tmp_path / "caller"
    caller.mkdir()
    monkeypatch.chdir(caller)
    launch = run(tmp_path, f"touch marker\nmkdir -p logs\n{LAUNCH} a=1\n")
    assert launch.argv == ["a=1"]
    assert list(caller.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["caller", "run.sh"]


# --- override lists, env files, load_source ---------------------------------------------------------------------

def test_override_list_from_bash_x(tmp_path):
    path = tmp_path / "trace.txt"
    path.write_text("+ export VLLM_USE_V1=1\n++ nvidia-smi -L\n"
                    "+ python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo "
                    "'data.train_files=[a.parquet, b.parquet]' +trainer.x=1\n")
    assert read_override_list(path) == ["algorithm.adv_estimator=grpo", "data.train_files=[a.parquet, b.parquet]",
                                        "+trainer.x=1"]


def test_override_list_one_per_line(tmp_path):
    path = tmp_path / "overrides.txt"
    path.write_text(textwrap.dedent("""\
        # copied from the example
        python3 -m verl.trainer.main_ppo \\
            --config-name=ppo_megatron_trainer \\
            algorithm.adv_estimator=grpo \\

            data.train_files=['a.parquet', 'b.parquet'] \\
            'trainer.project_name=my run'
            ++trainer.val_before_train=False
            "$@"
    """))
    assert read_override_list(path) == ["--config-name=ppo_megatron_trainer", "algorithm.adv_estimator=grpo",
                                        "data.train_files=['a.parquet', 'b.parquet']", "trainer.project_name=my run",
                                        "++trainer.val_before_train=False"]


def test_override_list_errors(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing\n\n")
    with pytest.raises(ScriptError, match="no overrides"):
        read_override_list(empty)
    with pytest.raises(ScriptError, match="cannot read"):
        read_override_list(tmp_path / "missing.txt")
    other = tmp_path / "other.txt"
    other.write_text("python3 train.py a=1\n")
    with pytest.raises(ScriptError, match=r"other.txt:1: .*not verl.trainer"):
        read_override_list(other)


def test_read_env_file(tmp_path):
    good = tmp_path / "good.env"
    good.write_text("# cluster\nexport NCCL_DEBUG=WARN\n\nMODEL='/data/my model'\nB=\"a \\\"q\\\"\"  # note\n"
                    "C=plain # comment\nEMPTY=\n")
    assert read_env_file(good) == {"NCCL_DEBUG": "WARN", "MODEL": "/data/my model", "B": 'a "q"', "C": "plain",
                                   "EMPTY": ""}
    for bad_line in ("NO_EQUALS", "1BAD=x", "Q='open"):
        bad = tmp_path / "bad.env"
        bad.write_text(f"OK=1\n{bad_line}\n")
        with pytest.raises(ScriptError, match=r"bad.env:2: .*KEY=VALUE"):
            read_env_file(bad)


def test_load_source_tells_scripts_from_override_lists(tmp_path):
    sh = script(tmp_path, f"{LAUNCH} a=$((1 + 1))\n")
    assert load_source(sh).argv == ["a=2"]
    no_suffix = script(tmp_path, f"B=3\n{LAUNCH} b=$B\n", name="launch")
    assert load_source(no_suffix).argv == ["b=3"]
    listing = tmp_path / "overrides.txt"
    listing.write_text(f"{LAUNCH}\na=1\nb=[x, y]\n")
    launch = load_source(listing, env={"K": "v"})
    assert (launch.argv, launch.env, launch.calls) == (["a=1", "b=[x, y]"], {"K": "v"}, [])
