"""`qwen35rl-train` end to end on CPU through Ray (2 worker processes, FSDP over gloo, transformers rollout):
the run directory it leaves, and kill -9 + resume ending bitwise equal to an uninterrupted run."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.processes import cmdline, kill_after_checkpoint, session_pids, workers_of
from qwen35rl.runtime.tracking import read_metrics
from tests.load import scaled

pytestmark = pytest.mark.slow

_SCRIPT = Path(sys.executable).parent / "qwen35rl-train"
TRAIN = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "qwen35rl.cli.train"]
SMALL = ["hw.devices_per_node=2", "data.train_batch_size=4", "rollout.n=4", "algorithm.mini_batch_size=2",
         "backend.micro_batch_size_per_device=4", "data.val_size=8", "data.val_batch_size=8"]
# the metric names of grpo.md every step must carry
STEP_METRICS = ["critic/score/mean", "critic/rewards/mean", "critic/advantages/mean", "response_length/mean",
                "response_length/clip_ratio", "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/pg_clipfrac",
                "actor/ppo_kl", "actor/grad_norm", "actor/lr", "timing_s/gen", "timing_s/old_log_prob",
                "timing_s/update_actor", "timing_s/step", "perf/throughput", "perf/mfu/actor",
                "perf/max_memory_allocated_gb"]


def train(run_dir, *overrides, timeout=600, env=None):
    return subprocess.run([*TRAIN, f"hydra.run.dir={run_dir}", *SMALL, *overrides], capture_output=True, text=True,
                          timeout=scaled(timeout), env=env or dict(os.environ))


def without_torch_and_ray(tmp_path):
    """An environment whose Python cannot import torch or ray (a sitecustomize makes both imports fail): what a
    command run in it does, it does without them."""
    block = tmp_path / "no_torch_no_ray"
    block.mkdir(exist_ok=True)
    (block / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None\nsys.modules['ray'] = None\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(block), os.environ.get("PYTHONPATH")]))}


def _ok(proc):
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_train_end_to_end(tmp_path):
    run = tmp_path / "run"
    proc = train(run, "trainer.total_steps=3", "trainer.save_freq=2", "trainer.test_freq=3",
                 "algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=0.01")
    _ok(proc)
    assert "[qwen35rl] step 3/3" in proc.stderr

    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        missing = [k for k in STEP_METRICS + ["timing_s/ref"] if k not in r]
        assert not missing, missing
        assert 0.0 <= r["critic/score/mean"] <= 1.0 and r["actor/skipped_steps"] == 0
        # the rollout engine samples from the synced policy: its log-probs are the trainer's
        assert r["rollout/logprob_diff_max"] < 1e-3 and r["rollout/logprob_diff_mean"] < 1e-4
        assert r["rollout/cuda_graph"] == 0.0  # on by default, never on a CPU
        # generation's parts, on the slowest worker: within the generation the driver timed
        parts = [r[f"timing_s/gen_{p}"] for p in ("wake", "generate", "sleep")]
        assert r["timing_s/gen_generate"] > 0 and all(p >= 0 for p in parts) and sum(parts) <= r["timing_s/gen"]
    assert "val/score/mean" in rows[2] and "val/score/mean" not in rows[0]

    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_2", "step_3"]
    for step in (2, 3):
        d = ckpts / f"step_{step}"
        assert json.loads((d / "meta.json").read_text())["step"] == step
        assert (d / "trainer_state.pt").is_file()
        assert sorted(p.name for p in (d / "rng").iterdir()) == ["rank_0.pt", "rank_1.pt"]
        assert list((d / "model").glob("*.distcp")) and (d / "model" / ".metadata").is_file()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(run / "final")
    tok = AutoTokenizer.from_pretrained(run / "final")
    ids = torch.tensor([tok.encode("7 3 9")])
    assert model(ids).logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert (run / "curves.png").stat().st_size > 0
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    start = run / "provenance" / "start-001"
    assert {p.name for p in start.iterdir()} >= {"config.yaml", "run.json", "cluster.json"}
    assert json.loads((start / "cluster.json").read_text())["probes"][0]["packages"]["torch"] == torch.__version__
    assert json.loads((ckpts / "step_3" / "meta.json").read_text())["provenance"] == "start-001"

    # a line per start-up phase, in order, each with its time, before the first step's line
    err = proc.stderr
    phases = ["config + plan checked", "libraries imported", "data ready", "preflight passed", "workers up",
              "engines built", "first step"]
    at = [err.find(f"[qwen35rl] {p} in ") for p in phases]
    assert -1 not in at and at == sorted(at) and at[-1] < err.index("[qwen35rl] step 1/3"), err[:3000]
    # trainer.launcher=auto on this host's CPUs: local worker processes, no Ray
    assert "Ray up" not in err and "workers up in " in err and "2 worker process(es) on 1 node(s)" in err
    assert re.search(r"\[qwen35rl\] workers up in \d+\.\d s: 2 worker process\(es\) on 1 node\(s\)", err)
    # and where the engines' time went, part by part, on rank 0
    assert re.search(r"engines built in [\d.]+ s: .* on each worker \(rank 0: fsdp train engine \d+\.\d s, .*"
                     r"hf rollout engine \d+\.\d s\)", err), err[:3000]
    # the end: steps, time, tokens/s, reward first -> last, validation, where everything is
    summary = err[err.index("[qwen35rl] done: step 3 of 3"):]
    assert re.search(r"time: +\d:\d\d:\d\d wall time for 3 step\(s\) in this launch; [\d.]+ s per step, [\d,]+ "
                     r"tokens/s", summary), summary
    first, last = rows[0]["critic/score/mean"], rows[-1]["critic/score/mean"]
    assert f"reward:      critic/score/mean {first:.3g} at step 1 -> {last:.3g} at step 3" in summary
    assert f"validation:  val/score/mean {rows[2]['val/score/mean']:.3g} at step 3" in summary
    for label, path in (("metrics", run / "metrics.jsonl"), ("curves", run / "curves.png"),
                        ("samples", run / "generations.jsonl"), ("checkpoint", ckpts / "step_3"),
                        ("export", run / "final"), ("log", run / "train.log")):
        assert re.search(rf"^\[qwen35rl\]   {label}: +{re.escape(str(path))}/?( |$)", summary, re.M), (label, summary)
    # the CPU's GPU-kernel fallback warnings: not on the console, noted once in train.log, which has the steps too
    assert "falling back to its reference PyTorch implementation" not in err
    log = (run / "train.log").read_text()
    assert log.count("reference PyTorch code") == 1
    assert "step 3/3 | " in log and "first step in " in log and "done: step 3 of 3" in log
    # validation samples: the first 4 validation prompts with their greedy responses and scores
    samples = [json.loads(line) for line in (run / "generations.jsonl").read_text().splitlines()]
    assert [(s["step"], s["index"]) for s in samples] == [(3, 0), (3, 1), (3, 2), (3, 3)]
    for s in samples:
        # copy_digit: "7 3 9" -> 9
        assert s["answer"].isdigit() and s["prompt"].endswith(s["answer"]) and isinstance(s["response"], str)
        assert 0.0 <= s["score"] <= 1.0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    text = events.Tensors("val/generations/text_summary")[0]  # add_text's tag
    assert text.step == 3 and samples[0]["prompt"] in text.tensor_proto.string_val[0].decode()


def test_moe_model_trains(tmp_path):
    run = tmp_path / "moe"
    _ok(train(run, "model=qwen3_5_tiny_moe", "hw.devices_per_node=1", "trainer.total_steps=2",
              "trainer.test_freq=-1", "trainer.save_freq=-1"))
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2]
    assert (run / "final" / "model.safetensors").is_file()


def _kill_after_checkpoint(run_dir, step, *overrides):
    kill_after_checkpoint([*TRAIN, f"hydra.run.dir={run_dir}", *SMALL, *overrides], run_dir, step)


def test_kill_and_resume_is_bitwise_identical(tmp_path):
    args = ["trainer.total_steps=6", "trainer.save_freq=3", "trainer.test_freq=3", "trainer.max_keep_checkpoints=10"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _ok(train(straight, *args))

    _kill_after_checkpoint(resumed, 3, *args)
    done = sorted(p.name for p in (resumed / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert done == ["step_3"], f"killed too late: {done}"
    proc = train(resumed, *args)           # the same command again: resume=auto picks step_3 up
    _ok(proc)
    assert "resuming from" in proc.stderr and "[qwen35rl] checkpoint restored in " in proc.stderr
    starts = sorted(p.name for p in (resumed / "provenance").iterdir())
    assert starts == ["start-001", "start-002"]                      # the resume kept the first start's record
    assert json.loads((resumed / "provenance" / "start-002" / "run.json").read_text())["start_step"] == 3

    a, b = load_file(straight / "final" / "model.safetensors"), load_file(resumed / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    differing = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differing, f"parameters differ after resume: {differing[:5]}"

    rows_a, rows_b = read_metrics(straight / "metrics.jsonl"), read_metrics(resumed / "metrics.jsonl")
    assert [r["step"] for r in rows_b] == [1, 2, 3, 4, 5, 6]          # each step logged once
    for ra, rb in zip(rows_a, rows_b):
        for key in ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/grad_norm"):
            assert ra[key] == rb[key], (ra["step"], key)

    # once more: already complete, said without starting Ray, or even importing torch
    blocked = without_torch_and_ray(tmp_path)
    done = train(resumed, *args, "hw.devices_per_node=1", env=blocked)   # another device count is no other run
    _ok(done)
    assert "[qwen35rl] already complete (step 6 of 6)" in done.stderr
    assert f"export:      {resumed / 'final'}/ (Hugging Face format)" in done.stderr
    # another experiment in this directory is refused with the diff and the ways out, before anything starts
    other = train(resumed, *args, "algorithm.ppo_epochs=2", "trainer.total_steps=8", env=blocked)
    assert other.returncode == 2, other.stderr[-3000:]
    assert "[resume_config_changed] trainer.resume:" in other.stderr
    assert "    algorithm.ppo_epochs: 1 -> 2" in other.stderr and "    trainer.total_steps: 6 -> 8" in other.stderr
    assert "trainer.resume=never" in other.stderr and "trainer.resume=force" in other.stderr


def stop_bound():
    """(trainer.stop_timeout_s override, seconds to wait for the run to exit) for a test of a stop that finishes its
    step and checkpoints: on a loaded 2-core box a step and its checkpoint took longer than the default 10 s, the
    step was abandoned and the test saw a half-written checkpoint."""
    bound = scaled(300)
    return f"trainer.stop_timeout_s={bound * 2 / 3:.0f}", bound


def test_ctrl_c_finishes_the_step_checkpoints_and_exits(tmp_path):
    """Ctrl-C in a terminal signals the whole foreground process group (driver and local Ray alike)."""
    run = tmp_path / "run"
    stop_timeout, bound = stop_bound()
    proc = subprocess.Popen([*TRAIN, f"hydra.run.dir={run}", *SMALL, "trainer.total_steps=100", "trainer.test_freq=-1",
                             stop_timeout],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ))
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + scaled(600)
    while not (metrics.exists() and metrics.read_text().strip()):
        assert proc.poll() is None and time.monotonic() < deadline, "no step logged"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=bound)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err[-3000:]
    last = read_metrics(metrics)[-1]["step"]
    assert last < 100
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == [f"step_{last}"], names          # the interrupted step's checkpoint, nothing half-written
    assert not (run / "final").exists()
    assert f"[qwen35rl] stopped at step {last} of 100 (exit code 130); the same command resumes" in err


# ------------------------------------------------------------------------------------------------- failures
def _start_and_wait_for_a_step(run_dir, err_path, *overrides):
    """A long run in its own session (stderr to a file: a full pipe would block it), once step 1 is logged."""
    proc = subprocess.Popen([*TRAIN, f"hydra.run.dir={run_dir}", *SMALL, "trainer.total_steps=100",
                             "trainer.test_freq=-1", *overrides], stdout=subprocess.DEVNULL,
                            stderr=open(err_path, "w"), start_new_session=True, env=dict(os.environ))
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + scaled(600)
    while not (metrics.exists() and metrics.read_text().strip()):
        assert proc.poll() is None, err_path.read_text()[-3000:]
        assert time.monotonic() < deadline, "no step logged"
        time.sleep(0.05)
    return proc


def _assert_nothing_left(sid, grace_s=15):
    deadline = time.monotonic() + scaled(grace_s)
    while (left := session_pids(sid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = {pid: cmdline(pid) for pid in session_pids(sid)}
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"processes left behind: {left}"


@pytest.mark.parametrize("launcher", ["ray", "local"])
def test_killed_worker_stops_the_run_naming_it(tmp_path, launcher):
    from qwen35rl.runtime.cluster import EXIT_WORKER_FAILURE

    run, err = tmp_path / "run", tmp_path / "stderr.txt"
    proc = _start_and_wait_for_a_step(run, err, f"trainer.launcher={launcher}")
    try:
        workers = workers_of(proc.pid)
        assert len(workers) == 2, {p: cmdline(p) for p in session_pids(proc.pid)}
        victim = max(workers)
        os.kill(victim, signal.SIGKILL)                  # mid-step: a step takes a few seconds, logging none
        try:
            proc.wait(timeout=scaled(60))                # stops (a bound on a hang, not a measurement)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the run did not stop within {scaled(60):.0f} s of its worker's death")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = err.read_text()
    assert proc.returncode == EXIT_WORKER_FAILURE, text[-3000:]
    assert re.search(rf"worker rank [01] on node \S+ \(\S+\), pid {victim}, failed in \w+: its process died", text), \
        text[-3000:]
    # one block: what, where, the fix; Ray's own error text in full only in train.log
    block = text[text.index("[qwen35rl] error: a worker failed: the run stopped (exit code 4)"):]
    assert re.search(r"\n  where: (training step \d+ of 100|the checkpoint of step \d+)\n", block), block
    assert "\n  fix:   the worker's own log says why" in block
    assert f"\n  the full traceback: {run / 'train.log'}" in block
    assert "a worker failed: the full error" in (run / "train.log").read_text()
    assert "a worker failed: the full error" not in text
    _assert_nothing_left(proc.pid)


def test_sigterm_to_the_driver_checkpoints_and_exits(tmp_path):
    """How a scheduler preempts (kill <pid>, a container's stop): the step finishes, a checkpoint is written and
    the run exits 128 + SIGTERM; the same command resumes from it."""
    run, err = tmp_path / "run", tmp_path / "stderr.txt"
    stop_timeout, bound = stop_bound()
    proc = _start_and_wait_for_a_step(run, err, stop_timeout)
    try:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=bound)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err.read_text()[-3000:]
    assert "SIGTERM received" in err.read_text()
    last = read_metrics(run / "metrics.jsonl")[-1]["step"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [f"step_{last}"]
    assert json.loads((run / "checkpoints" / f"step_{last}" / "meta.json").read_text())["step"] == last
    assert not (run / "final").exists()
    _assert_nothing_left(proc.pid)


def test_dapo_end_to_end(tmp_path):
    """algorithm=dapo: no reference (no KL), clip higher, dynamic sampling (groups of two samples often score the
    same and are dropped, more prompts are drawn, within the bound on rounds), overlong shaping (responses over
    max_response_length - buffer_len are penalised). Micro batches by tokens (backend.dynamic_batch_size): within 40
    tokens a rank's two rows of a mini batch take one or two micro batches, and the two ranks agree on the count."""
    run = tmp_path / "dapo"
    max_rounds, batch = 3, 4
    _ok(train(run, "algorithm=dapo", "rollout.n=2", "backend.dynamic_batch_size=true", "backend.max_tokens_per_device=40",
              f"algorithm.dynamic_sampling.max_rounds={max_rounds}",
              "algorithm.overlong_shaping.buffer_len=4", "trainer.total_steps=3", "trainer.test_freq=-1",
              "trainer.save_freq=-1", "trainer.export_hf=false"))
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        rounds, dropped, filled = (r[f"dynamic_sampling/{k}"] for k in ("rounds", "groups_dropped", "groups_filled"))
        assert 1 <= rounds <= 1 + max_rounds and rounds == int(rounds)
        kept = rounds * batch - dropped                      # groups with signal among all those generated
        if filled:
            assert rounds == 1 + max_rounds and kept == batch - filled
        else:
            assert kept >= batch
        assert r["actor/kl_loss"] == 0 and "timing_s/ref" not in r
        # overlong shaping: a response longer than 8 - 4 tokens loses reward
        if r["response_length/max"] > 4:
            assert r["critic/rewards/mean"] < r["critic/score/mean"]
        else:
            assert r["critic/rewards/mean"] == pytest.approx(r["critic/score/mean"])
    assert sum(r["dynamic_sampling/groups_dropped"] for r in rows) > 0  # the filter did something
    cfg = yaml_config(run)
    assert cfg["algorithm"]["clip_ratio_high"] == 0.28 and cfg["algorithm"]["loss_agg_mode"] == "token-mean"


def yaml_config(run):
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(run / "provenance" / "start-001" / "config.yaml"))
