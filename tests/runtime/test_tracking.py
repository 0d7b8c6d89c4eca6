"""Tracking: metrics.jsonl rows, resume truncation, console line, TensorBoard events, missing opt-in trackers,
and the curves PNG."""
import io
import json
import os
import sys

import pytest
from omegaconf import OmegaConf

from qwen35rl.runtime import tracking


def _cfg(trackers):
    return OmegaConf.create({"trainer": {"trackers": trackers, "project_name": "p", "run_name": "r"}})


def test_jsonl_rows_and_resume_truncation(tmp_path):
    t = tracking.Tracking(_cfg(["jsonl"]), tmp_path, total_steps=5)
    for step in (1, 2, 3):
        t.log(step, {"critic/score/mean": step / 10, "actor/pg_loss": float("nan")})
    t.close()
    rows = tracking.read_metrics(tmp_path / tracking.METRICS_FILE)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["critic/score/mean"] == 0.1 and rows[0]["actor/pg_loss"] is None   # strict JSON, no NaN
    # resumed from the step-2 checkpoint: the interrupted run's step 3 is dropped, the new one appended
    t = tracking.Tracking(_cfg(["jsonl"]), tmp_path, total_steps=5, start_step=2)
    t.log(3, {"critic/score/mean": 0.33})
    t.close()
    rows = tracking.read_metrics(tmp_path / tracking.METRICS_FILE)
    assert [(r["step"], r["critic/score/mean"]) for r in rows] == [(1, 0.1), (2, 0.2), (3, 0.33)]


def test_console_line_has_step_eta_reward(tmp_path):
    out = io.StringIO()
    t = tracking.Tracking(_cfg(["console"]), tmp_path, total_steps=10, console_stream=out)
    t.log(1, {"critic/score/mean": 0.25, "timing_s/step": 1.5})
    line = out.getvalue()
    assert "step 1/10" in line and "reward 0.25" in line and "<" in line


def test_tensorboard_writes_events(tmp_path):
    t = tracking.Tracking(_cfg(["tensorboard"]), tmp_path, total_steps=2)
    t.log(1, {"critic/score/mean": 0.5})
    t.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_unknown_and_missing_trackers(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="unknown"):
        tracking.Tracking(_cfg(["neptune"]), tmp_path, total_steps=1)
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail whether or not it is installed
    with pytest.raises(tracking.TrackerMissing, match=r"qwen35rl\[trackers\]"):
        tracking.Tracking(_cfg(["wandb"]), tmp_path, total_steps=1)


def test_curves_png(tmp_path):
    rows = [{"step": s, "critic/rewards/mean": s / 10, "response_length/mean": 5 + s} for s in range(1, 6)]
    out = tracking.plot_curves(rows, tmp_path / tracking.CURVES_FILE)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_wandb_and_mlflow_receive_each_step(tmp_path, monkeypatch):
    """Opt-in trackers, with stand-in modules recording what they are given."""
    import types

    calls = []
    run = types.SimpleNamespace(log=lambda m, step: calls.append(("wandb", step, m)),
                                finish=lambda: calls.append(("wandb", "finish")))
    wandb = types.SimpleNamespace(init=lambda **kw: calls.append(("wandb.init", kw["id"], kw["resume"])) or run)
    mlflow = types.SimpleNamespace(
        set_tracking_uri=lambda uri: calls.append(("mlflow.uri", uri)),
        set_experiment=lambda name: None, start_run=lambda run_name: None,
        log_metrics=lambda m, step: calls.append(("mlflow", step, m)), end_run=lambda: calls.append(("mlflow", "end")))
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setitem(sys.modules, "mlflow", mlflow)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    t = tracking.Tracking(_cfg(["wandb", "mlflow"]), tmp_path, total_steps=3)
    t.log(2, {"critic/score/mean": 0.5, "actor/pg_loss": float("nan")})
    t.close()
    init = next(c for c in calls if c[0] == "wandb.init")
    assert init[2] == "allow"                                           # a resumed run continues the W&B run
    logged = [c[2] for c in calls if c[0] == "wandb" and c[1] == 2]
    assert len(logged) == 1 and logged[0]["critic/score/mean"] == 0.5
    assert [c for c in calls if c[0] == "mlflow" and c[1] == 2] == [("mlflow", 2, {"critic/score/mean": 0.5})]
    assert next(c for c in calls if c[0] == "mlflow.uri")[1].endswith("/mlruns")
    assert ("wandb", "finish") in calls and ("mlflow", "end") in calls
    # the same run dir gives the same W&B run id
    again = []
    wandb.init = lambda **kw: again.append(kw["id"]) or run
    tracking.Tracking(_cfg(["wandb"]), tmp_path, total_steps=3)
    assert again == [init[1]]


def test_a_failed_write_leaves_earlier_rows_and_the_previous_curves_intact(tmp_path, monkeypatch, caplog):
    import errno

    t = tracking.Tracking(_cfg(["jsonl"]), tmp_path, total_steps=5)
    t.log(1, {"critic/score/mean": 0.1})
    real_append = tracking._append

    def full(fd, data):
        real_append(fd, data[:7])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tracking, "_append", full)
    with pytest.raises(OSError) as e:
        t.log(2, {"critic/score/mean": 0.2})
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / tracking.METRICS_FILE)
    t.close()
    assert (tmp_path / tracking.METRICS_FILE).read_text() == '{"step": 1, "critic/score/mean": 0.1}\n'

    png = tracking.plot_curves_safely(tmp_path)
    good = png.read_bytes()
    assert good[:4] == b"\x89PNG"

    def no_space(fd):  # the file is created and written, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    assert tracking.plot_curves_safely(tmp_path) is None  # logged, not raised
    assert "no curves.png: OSError: [Errno 28] No space left on device" in caplog.text
    assert png.read_bytes() == good and sorted(p.name for p in tmp_path.iterdir()) == ["curves.png", "metrics.jsonl"]


def test_a_row_cut_off_by_a_crash_is_skipped(tmp_path):
    (tmp_path / tracking.METRICS_FILE).write_text('{"step": 1, "a": 1}\n{"step": 2, "a"')
    assert tracking.read_metrics(tmp_path / tracking.METRICS_FILE) == [{"step": 1, "a": 1}]
