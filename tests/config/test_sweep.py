"""The sweep summary callback: fake job returns, and a real `qwen35rl-plan -m` sweep."""
import csv
import os
import subprocess
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf

from qwen35rl.config.compose import compose
from qwen35rl.config.sweep import SweepSummary, varying_overrides


def plan(valid, train=30.0, cap=71.5, rollout=44.7, problems=(), cost=None, layout=None):
    out = {"valid": valid, "problems": list(problems),
           "memory_gib": {"train_peak": train, "capacity": cap, "rollout_peak": rollout, "fits": True}}
    if layout is not None:
        out["train"], out["rollout"] = layout
    if cost is not None:
        out["cost"] = cost
    return out


def job(num, overrides, value, status=JobStatus.COMPLETED, cfg=None):
    return JobReturn(overrides=overrides, cfg=cfg, hydra_cfg=OmegaConf.create({"hydra": {"job": {"num": num}}}),
                     status=status, _return_value=value)


def test_summary_from_fake_jobs(tmp_path, capsys):
    err = {"code": "tp_divides_attention_heads", "severity": "error", "key": "parallelism.tp",
           "message": "TP3 does not divide the 16 attention heads", "hint": "try parallelism.tp=4"}
    warn = {"code": "vllm_not_installed", "severity": "warning", "key": "rollout.engine", "message": "w", "hint": ""}
    cb = SweepSummary()
    cb.on_multirun_start(OmegaConf.create({}))
    base = ["model=qwen3_5_35b_a3b", "backend=megatron"]
    # Jobs arrive out of order; one carries its score, one is scored from its config, one failed, one is invalid.
    cfg = compose(base + ["hw=gpu_1node", "parallelism.tp=2"])
    cb.on_job_end(None, job(1, base + ["parallelism.tp=2"], plan(True, problems=[warn]), cfg=cfg))
    cb.on_job_end(None, job(0, base + ["parallelism.tp=1"], plan(True, train=40.0, cost={"score": 12.5}, layout=(
        {"tp": 1, "pp": 1, "cp": 1, "ep": 8, "etp": 1, "dp": 8, "vpp": None}, {"tp": 8, "dp": 1, "ep": 1}))))
    cb.on_job_end(None, job(3, base + ["parallelism.tp=8"], ValueError("boom"), status=JobStatus.FAILED))
    err2 = {**err, "code": "tp_fits_kv_heads", "message": "TP3 x"}
    # an invalid plan's cost is no score
    cb.on_job_end(None, job(2, base + ["parallelism.tp=3"], plan(False, problems=[warn, err, err2], cost={"score": 9},
                                                                 layout=({"tp": 3, "dp": 2}, {"tp": 8, "dp": 1, "ep": 1}))))
    cb.on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / "sweep")}}}))

    md = (tmp_path / "sweep" / "summary.md").read_text()
    rows = list(csv.DictReader(open(tmp_path / "sweep" / "summary.csv")))
    assert [r["job"] for r in rows] == ["0", "1", "2", "3"]
    assert [r["valid"] for r in rows] == ["True", "True", "False", "False"]
    assert rows[0]["score"] == "12.5" and float(rows[1]["score"]) > 0 and rows[2]["score"] == ""
    assert rows[2]["first_error"].startswith("[tp_divides_attention_heads] parallelism.tp: TP3")
    # every error of a job, not only the first (warnings are no errors)
    assert rows[2]["errors"].splitlines() == ["[tp_divides_attention_heads] parallelism.tp: TP3 does not divide the "
                                              "16 attention heads", "[tp_fits_kv_heads] parallelism.tp: TP3 x"]
    assert "job failed: ValueError: boom" in rows[3]["first_error"]
    # each job's own layout: from its plan, else from its config; nothing known for a job with neither
    assert rows[0]["layout"] == "TP1 PP1 CP1 EP8 ETP1 DP8 | rollout TP8 DP1 EP1"
    assert rows[1]["layout"] == "TP2 PP1 CP1 EP8 ETP1 DP4 | rollout TP8 DP1 EP1" and rows[3]["layout"] == ""
    assert rows[0]["score_unit"] == "s/step" and rows[2]["score_unit"] == ""
    assert rows[0]["train_peak_gib"] == "40.0" and rows[0]["capacity_gib"] == "71.5"
    assert "2 of 4 jobs valid" in md and "| 0 | parallelism.tp=1 | yes | TP1 PP1" in md and "40.0 / 71.5" in md
    assert "16 attention heads<br>[tp_fits_kv_heads] parallelism.tp: TP3 x |" in md
    assert "model=" not in md  # only the swept overrides are shown
    assert "| 2 | parallelism.tp=3 | NO | TP3 DP2 \\| rollout TP8 DP1 EP1 | [tp_divides_attention_heads]" in \
        capsys.readouterr().err


def test_varying_overrides():
    from qwen35rl.config.sweep import SweepRow

    rows = [SweepRow(i, ["a=1", f"b={i}"], True, [], None, None, None, None) for i in range(2)]
    assert varying_overrides(rows) == [["b=0"], ["b=1"]]
    assert varying_overrides(rows[:1]) == [["a=1", "b=0"]]


def test_real_plan_multirun_writes_the_summary(tmp_path):
    r = subprocess.run([sys.executable, "-m", "qwen35rl.cli.plan", "-m", "model=qwen3_5_35b_a3b", "hw=gpu_1node",
                        "backend=megatron", "parallelism.tp=1,2,3", f"trainer.output_root={tmp_path}"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    summaries = list((tmp_path / "sweeps").glob("*/summary.csv"))
    assert len(summaries) == 1
    rows = list(csv.DictReader(open(summaries[0])))
    assert [r_["valid"] for r_ in rows] == ["True", "True", "False"]
    assert "world_size_matches_devices" in rows[2]["first_error"]
    assert [e.split("]")[0] for e in rows[2]["errors"].splitlines()] == [
        "[world_size_matches_devices", "[tp_divides_attention_heads", "[tp_fits_kv_heads", "[tp_cp_divide_gdn_heads"]
    assert all(float(r_["score"]) > 0 for r_ in rows[:2]) and rows[2]["score"] == ""
    assert [r_["layout"].split(" | ")[0] for r_ in rows] == [f"TP{tp} PP1 CP1 EP8 ETP1 DP{8 // tp}" for tp in (1, 2, 3)]
    assert "sweep summary (2/3 valid)" in r.stderr and "| 2 | parallelism.tp=3 | NO | TP3 PP1" in r.stderr
    # each job prints its own layout: the tested one, or the tested one and what the job changed
    labels = [ln.split("[layout: ")[1].rstrip("]") for ln in r.stdout.splitlines() if "[layout: " in ln]
    tested = "megatron/qwen3_5_35b_a3b@gpu_1node"
    assert labels == [f"{tested} + tp=1", tested, f"{tested} + tp=3"]
    # the sweep directory holds the summary and Hydra's multirun.yaml, no empty job log or job directory
    sweep = summaries[0].parent
    assert sorted(p.name for p in sweep.iterdir()) == ["multirun.yaml", "summary.csv", "summary.md"]


def test_an_empty_job_directory_is_removed_and_one_with_files_kept(tmp_path):
    from qwen35rl.config.sweep import remove_if_empty

    (tmp_path / "empty").mkdir()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "train.log").write_text("x")
    remove_if_empty(str(tmp_path / "empty"))
    remove_if_empty(str(tmp_path / "full"))
    remove_if_empty(None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]
