"""Credentials stay out of plan output and provenance (qwen35rl.config.redact holds the rule)."""
import errno
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

from qwen35rl.config import redact
from qwen35rl.config.compose import compose
from qwen35rl.runtime import provenance

SECRET, ENV_SECRET = "abc123secret", "envsecret999"
_PLAN = Path(sys.executable).parent / "qwen35rl-plan"
PLAN = [str(_PLAN)] if _PLAN.exists() else [sys.executable, "-m", "qwen35rl.cli.plan"]


def test_the_rule():
    for name in ("WANDB_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "MLFLOW_TRACKING_PASSWORD",
                 "AWS_SECRET_ACCESS_KEY", "MY_SERVICE_KEY", "hw.env.WANDB_API_KEY", "api_key", "token", "password",
                 "ssh_private_key", "client_secret"):
        assert redact.is_secret_name(name), name
    for name in ("NCCL_DEBUG", "OMP_NUM_THREADS", "prompt_key", "answer_key", "image_key", "pad_token",
                 "max_num_batched_tokens", "data.prompt_key"):
        assert not redact.is_secret_name(name), name
    out = redact.redact({"WANDB_API_KEY": SECRET, "NCCL_DEBUG": "INFO", "data": {"prompt_key": "prompt"},
                         "uri": "https://me:hunter22@mlflow.example/x", "list": [{"token": "t0k3n"}]})
    assert out == {"WANDB_API_KEY": "REDACTED", "NCCL_DEBUG": "INFO", "data": {"prompt_key": "prompt"},
                   "uri": "https://me:REDACTED@mlflow.example/x", "list": [{"token": "REDACTED"}]}
    values = redact.secret_values({"a": {"HF_TOKEN": SECRET}}, environ={"WANDB_API_KEY": ENV_SECRET, "HOME": "/h"})
    assert values == {SECRET, ENV_SECRET}
    assert redact.scrub(f"x {SECRET} y {ENV_SECRET} /h", values) == "x REDACTED y REDACTED /h"


def _plan(*args):
    env = dict(os.environ, WANDB_API_KEY=ENV_SECRET, OMP_NUM_THREADS="1")
    return subprocess.run([*PLAN, f"+hw.env.WANDB_API_KEY={SECRET}", "hw.env.OMP_NUM_THREADS=1", *args],
                          capture_output=True, text=True, timeout=300, env=env)


def test_plan_output_redacts_the_worker_env():
    text = _plan()
    assert text.returncode == 0, text.stderr[-2000:]
    assert "WANDB_API_KEY=REDACTED" in text.stdout and "OMP_NUM_THREADS=1" in text.stdout
    as_json = _plan("format=json")
    assert as_json.returncode == 0, as_json.stderr[-2000:]
    env = json.loads(as_json.stdout.strip().splitlines()[-1])["worker_env"]
    assert env["WANDB_API_KEY"] == "REDACTED" and env["OMP_NUM_THREADS"] == "1"
    for proc in (text, as_json):
        assert SECRET not in proc.stdout + proc.stderr and ENV_SECRET not in proc.stdout + proc.stderr


def test_provenance_redacts_config_command_and_cluster(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", ENV_SECRET)
    monkeypatch.setattr(provenance, "code_root", lambda: tmp_path)       # not a git tree: no diff
    cfg = compose([f"+hw.env.WANDB_API_KEY={SECRET}", "+hw.env.MLFLOW_URI=https://u:pw4567@host/"])
    start = provenance.record_start(tmp_path / "run", cfg, argv=["qwen35rl-train", f"+hw.env.WANDB_API_KEY={SECRET}"])
    provenance.record_cluster(start, {"probes": [{"env": {"HF_TOKEN": SECRET, "NCCL_DEBUG": "INFO"},
                                                  "note": f"saw {ENV_SECRET}"}]})
    texts = {p.name: p.read_text() for p in start.iterdir()}
    assert set(texts) == {"config.yaml", "run.json", "cluster.json"}   # no temp file left
    for name, text in texts.items():
        assert SECRET not in text and ENV_SECRET not in text and "pw4567" not in text, name
    assert "WANDB_API_KEY: REDACTED" in texts["config.yaml"] and "u:REDACTED@host" in texts["config.yaml"]
    assert "prompt_key" in texts["config.yaml"] and "NCCL_DEBUG" in texts["cluster.json"]
    assert json.loads(texts["run.json"])["command"] == ["qwen35rl-train", "+hw.env.WANDB_API_KEY=REDACTED"]


def test_a_full_disk_logs_one_line_and_the_run_goes_on(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(provenance, "code_root", lambda: tmp_path)
    real_open = open

    def full(path, *a, **k):
        if ".tmp-" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr("builtins.open", full)
    with caplog.at_level(logging.ERROR, logger="qwen35rl.runtime.provenance"):
        start = provenance.record_start(tmp_path / "run", compose([]), argv=["x"])
        provenance.record_cluster(start, {"probes": []})
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all("disk is full" in ln and "continues" in ln for ln in lines), lines
    assert sorted(p.name for p in start.iterdir()) == []                 # nothing half-written


def test_atomic_write_keeps_the_old_content_when_writing_fails(tmp_path, monkeypatch):
    path = tmp_path / "run.json"
    provenance.write_atomic(path, "old\n")

    class Boom(Exception):
        pass

    def fail(*a, **k):
        raise Boom()

    monkeypatch.setattr(provenance.os, "replace", fail)
    try:
        provenance.write_atomic(path, "new\n")
    except Boom:
        pass
    assert path.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["run.json"]


def test_redact_yaml_shows_secret_keys_redacted():
    text = "hw:\n  env:\n    WANDB_API_KEY: abc123secret\n    HF_TOKEN: null\n    OMP_NUM_THREADS: '1'\n" \
           "data:\n  prompt_key: prompt\n  uri: https://me:hunter22@host/x\nnote: abc123secret\n"
    out = redact.redact_yaml(text, {SECRET})
    assert "WANDB_API_KEY: REDACTED" in out and "HF_TOKEN: null" in out and "OMP_NUM_THREADS: '1'" in out
    assert "prompt_key: prompt" in out and "me:REDACTED@host" in out and SECRET not in out


def test_config_error_scrubs_secret_values():
    from qwen35rl.config.compose import ConfigError

    err = ConfigError("hw.env.WANDB_API_KEY", "unknown key 'WANDB_API_KEY'", value="x",
                      hint="+hw.env.WANDB_API_KEY=x")
    text = err.render()
    assert "value:   REDACTED" in text and "+hw.env.WANDB_API_KEY=REDACTED" in text
    err = ConfigError("hw.nodez", "unknown key", value="4", hint=f"mentions {SECRET}")
    err.overrides = [f"+hw.env.WANDB_API_KEY={SECRET}", "hw.nodez=4"]
    assert SECRET not in err.render() and SECRET not in json.dumps(err.to_problem_dict())
    assert "value:   4" in err.render()
