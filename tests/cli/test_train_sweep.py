"""`qwen35rl-train -m`: an invalid job of a sweep is skipped before it starts anything, valid ones train, and the
sweep directory gets the summary."""
import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.load import scaled

SMALL = ["hw.devices_per_node=1", "data.train_batch_size=4", "algorithm.mini_batch_size=4",
         "backend.micro_batch_size_per_device=8", "trainer.total_steps=1", "trainer.test_freq=-1",
         "trainer.export_hf=false"]


def train(*args, timeout=600):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    return subprocess.run([sys.executable, "-m", "qwen35rl.cli.train", *args], capture_output=True, text=True,
                          timeout=scaled(timeout), env=env)


def test_all_invalid_sweep_starts_nothing(tmp_path):
    r = train("-m", "rollout.n=0,1", f"trainer.output_root={tmp_path}", *SMALL)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "rollout_n_at_least_2" in r.stderr
    assert "Started a local Ray instance" not in r.stderr and "[qwen35rl] step" not in r.stderr
    summary = next(tmp_path.glob("sweeps/*/summary.csv"))
    rows = list(csv.DictReader(summary.open()))
    assert [row["valid"] for row in rows] == ["False", "False"]
    # n=0 is out of the field's range (value_in_range stops the other rules); n=1 is in range but too few for GRPO
    assert [row["first_error"].split("]")[0] + "]" for row in rows] == ["[value_in_range]", "[rollout_n_at_least_2]"]


@pytest.mark.slow
def test_sweep_trains_the_valid_job_and_skips_the_invalid_one(tmp_path):
    r = train("-m", "rollout.n=1,4", f"trainer.output_root={tmp_path}", *SMALL)
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stderr.count("[qwen35rl] step 1/1") == 1
    sweep = next(tmp_path.glob("sweeps/*"))
    assert not (sweep / "0" / "metrics.jsonl").exists()
    assert (sweep / "1" / "metrics.jsonl").is_file()
    assert (sweep / "summary.md").is_file()
