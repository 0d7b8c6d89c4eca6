"""trainer.launcher=local: a single-device run with its worker in the driver's process and no Ray. The worker group
interface (calls, failures named like a Ray worker's, environment), the local preflight, and `qwen35rl-train` end to
end in an interpreter where ray cannot be imported: metrics, checkpoint, resume equal to an uninterrupted run."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import json
import logging
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from qwen35rl.config.compose import compose
from qwen35rl.config.problems import WARNING
from qwen35rl.config.resolved import resolve_run
from qwen35rl.runtime import driver
from qwen35rl.runtime.cluster import EXIT_WORKER_FAILURE, ClusterError, LocalWorkerGroup, WorkerFailure
from qwen35rl.runtime.platform import resolve_platform
from qwen35rl.runtime.preflight import PreflightError, run_local_preflight
from qwen35rl.runtime.tracking import read_metrics
from qwen35rl.runtime.worker import PolicyWorker
from tests.load import scaled

LOCAL = ["trainer.launcher=local", "hw.devices_per_node=1"]
SMALL = ["data.train_batch_size=4", "rollout.n=4", "algorithm.mini_batch_size=2",
         "backend.micro_batch_size_per_device=4", "trainer.test_freq=-1"]
# every step's metrics (grpo.md names), as the Ray end-to-end test asks for them
STEP_METRICS = ["critic/score/mean", "critic/rewards/mean", "critic/advantages/mean", "response_length/mean",
                "actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/lr", "timing_s/gen",
                "timing_s/old_log_prob", "timing_s/update_actor", "timing_s/step", "perf/throughput",
                "perf/mfu/actor", "perf/max_memory_allocated_gb"]


# ---------------------------------------------------------------------------------------------- worker group
class Recorder:
    """A worker that records how it was built and called."""

    def __init__(self, cfg, *, layout, rank, world_size, local_rank, fail_init=False, tag=None):
        if fail_init:
            raise ValueError("no such checkpoint")
        self.cfg, self.layout, self.placed, self.tag = cfg, layout, (rank, world_size, local_rank), tag
        self.calls, self.rendezvous, self.closed = [], None, False

    def init_distributed(self, addr, port):
        self.rendezvous = (addr, port)

    def echo(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return args, kwargs

    def fail(self, how):
        if how == "oom":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        raise RuntimeError("NaN in the engine")

    def shutdown(self):
        self.closed = True


def _group(*overrides, **kwargs):
    run = resolve_run(compose([*LOCAL, *overrides]))
    return LocalWorkerGroup.create(run, resolve_platform(run.cfg), Recorder, 1, **kwargs)


def test_one_in_process_worker_with_the_group_interface():
    wg = _group(tag="x")
    w = wg.worker
    assert wg.world == 1 and w.placed == (0, 1, 0) and w.tag == "x"
    assert w.cfg.trainer.launcher == "local" and w.layout.world == 1  # the run's typed config and layout, as is
    addr, port = w.rendezvous
    assert addr == "127.0.0.1" and port > 0
    assert wg.where == [{"hostname": socket.gethostname(), "ip": "127.0.0.1", "pid": os.getpid()}]
    assert wg.start("echo", [(3, 4)], {"k": 5}).wait() == [((3, 4), {"k": 5})]
    assert wg.start("echo", [(6,)], ranks=[0]).wait() == [((6,), {})]
    with pytest.raises(ValueError, match="2 shares for 1 workers"):
        wg.start("echo", [(1,), (2,)])
    with pytest.raises(IndexError, match=r"ranks \[1\] of a world of 1"):
        wg.start("echo", [(1,)], ranks=[1])
    wg.shutdown()
    assert w.closed


@pytest.mark.parametrize("how, cause", [
    ("raise", "RuntimeError: NaN in the engine"),
    ("oom", "out of device memory (OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB)"),
])
def test_a_raising_method_is_a_worker_failure_named_like_a_ray_one(how, cause):
    wg = _group()
    with pytest.raises(WorkerFailure) as e:
        wg.start("fail", [(how,)])
    where = wg.where[0]
    assert e.value.rank == 0 and e.value.method == "fail"
    assert str(e.value) == (f"worker rank 0 on node 127.0.0.1 ({where['hostname']}), pid {os.getpid()}, failed in "
                            f"fail: {cause}")
    assert "Traceback" in e.value.detail and "in fail" in e.value.detail


def test_a_worker_that_fails_to_start_is_named():
    with pytest.raises(WorkerFailure) as e:
        _group(fail_init=True)
    assert e.value.method == "start-up" and "failed to start (ValueError: no such checkpoint)" in str(e.value)


def test_more_than_one_device_is_refused():
    run = resolve_run(compose(["hw.devices_per_node=2"]))
    with pytest.raises(ClusterError, match="trainer.launcher=ray"):
        LocalWorkerGroup.create(run, resolve_platform(run.cfg), Recorder, 2)


def test_worker_env_is_applied_but_the_users_values_stay(monkeypatch):
    monkeypatch.setenv("QWEN35RL_TEST_MINE", "user")
    monkeypatch.delenv("QWEN35RL_TEST_NEW", raising=False)
    _group("+hw.env.QWEN35RL_TEST_MINE=config", "+hw.env.QWEN35RL_TEST_NEW=config")
    assert os.environ["QWEN35RL_TEST_MINE"] == "user" and os.environ["QWEN35RL_TEST_NEW"] == "config"


# ------------------------------------------------------------------------------------------------- preflight
def test_local_preflight_checks_this_process_like_a_node(caplog):
    cfg = compose([*LOCAL, "hw.memory_gb=100000"])  # more than any host: the CPU memory warning
    with caplog.at_level(logging.WARNING, logger="qwen35rl.runtime.preflight"):
        report = run_local_preflight(resolve_run(cfg), resolve_platform(cfg))
    assert report["launcher"] == "local" and report["probes"][0]["packages"]["torch"] == torch.__version__
    assert [(w["code"], w["severity"]) for w in report["warnings"]] == [("host_memory_short", WARNING)]
    assert "host_memory_short" in caplog.text


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA device")
def test_local_preflight_without_the_device_fails_before_any_worker():
    cfg = compose(["hw=gpu_1x", "rollout=hf", "trainer.launcher=local"])
    with pytest.raises(PreflightError) as e:
        run_local_preflight(resolve_run(cfg), resolve_platform(cfg))
    assert [p.code for p in e.value.problems] == ["local_device_missing"]
    assert "hw.device=cuda" in str(e.value) and "hw=cpu" in str(e.value)


# ----------------------------------------------------------------------------------------------- the driver
def test_worker_failure_in_a_run_exits_4_naming_rank_and_method(tmp_path, monkeypatch, caplog):
    def no_ray(*a, **k):
        raise AssertionError("trainer.launcher=local entered a Ray session")

    def broken_generate(self, prompt_ids, params):
        raise RuntimeError("sampler exploded")

    monkeypatch.setattr(driver, "ray_session", no_ray)
    monkeypatch.setattr(PolicyWorker, "generate", broken_generate)
    cfg = compose([*LOCAL, *SMALL, "trainer.total_steps=1"])
    with caplog.at_level(logging.ERROR, logger="qwen35rl.runtime.driver"):
        assert driver.run_training(cfg, tmp_path) == EXIT_WORKER_FAILURE
    assert "worker rank 0 on node 127.0.0.1" in caplog.text and f"pid {os.getpid()}" in caplog.text
    assert "failed in generate: RuntimeError: sampler exploded" in caplog.text
    assert not torch.distributed.is_initialized()  # the worker left its process group on the way out
    # one block (what, where, fix); the traceback goes to the log file only (the qwen35rl.file logger)
    [block] = [r.getMessage() for r in caplog.records if r.name == "qwen35rl.runtime.driver"]
    assert block.startswith("a worker failed: the run stopped (exit code 4)\n  what:  worker rank 0 on node")
    assert "\n  where: training step 1 of 1\n  fix:   no known fix" in block and "in broken_generate" not in block
    [full] = [r.getMessage() for r in caplog.records if r.name == "qwen35rl.file" and r.levelno == logging.ERROR]
    assert full.startswith("a worker failed: the full error") and "in broken_generate" in full


def test_an_unexpected_error_after_launch_is_one_block_and_exit_1(tmp_path, monkeypatch, caplog):
    def broken_step(self):
        raise KeyError("critic/score/mean")

    monkeypatch.setattr(driver.GRPOTrainer, "train_step", broken_step)
    cfg = compose([*LOCAL, *SMALL, "trainer.total_steps=2", "trainer.save_freq=1"])
    with caplog.at_level(logging.ERROR):
        assert driver.run_training(cfg, tmp_path) == 1
    [block] = [r.getMessage() for r in caplog.records if r.name == "qwen35rl.runtime.driver"]
    assert block.startswith("an unexpected error: the run stopped (exit code 1)\n  what:  KeyError: 'critic/score/mean'")
    assert "\n  where: training step 1 of 2, at tests/runtime/test_local_launcher.py:" in block
    assert block.split("\n")[2].endswith(" in broken_step")
    [full] = [r.getMessage() for r in caplog.records if r.name == "qwen35rl.file"]
    assert "Traceback (most recent call last)" in full and 'raise KeyError("critic/score/mean")' in full


# ----------------------------------------------------------------------------------------------- end to end
NO_RAY = ("import sys; sys.modules['ray'] = None  # any `import ray` fails, as where Ray is not installed\n"
          "from qwen35rl.cli.train import main; sys.exit(main(sys.argv[1:]))")


def train(run_dir, *overrides):
    return subprocess.run([sys.executable, "-c", NO_RAY, f"hydra.run.dir={run_dir}", *LOCAL, *SMALL, *overrides],
                          capture_output=True, text=True, timeout=scaled(300), env=dict(os.environ))


def _ok(proc):
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_train_without_ray(tmp_path):
    run = tmp_path / "run"
    proc = train(run, "trainer.total_steps=2", "trainer.save_freq=1")
    _ok(proc)
    for phase in ("config + plan checked", "data ready", "preflight passed", "workers up", "engines built",
                  "first step"):
        assert f"[qwen35rl] {phase}" in proc.stderr, phase
    assert "Ray up" not in proc.stderr and "[qwen35rl] done: step 2 of 2" in proc.stderr
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        missing = [k for k in STEP_METRICS if k not in r]
        assert not missing, missing
        assert r["rollout/logprob_diff_max"] < 1e-3  # the rollout samples from the synced policy
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_1", "step_2"]
    step_2 = run / "checkpoints" / "step_2"
    assert json.loads((step_2 / "meta.json").read_text())["step"] == 2
    assert [p.name for p in (step_2 / "rng").iterdir()] == ["rank_0.pt"]
    assert (run / "final" / "model.safetensors").is_file()
    cluster = json.loads((run / "provenance" / "start-001" / "cluster.json").read_text())
    assert cluster["launcher"] == "local" and cluster["probes"][0]["address"] == "127.0.0.1"


def test_resume_continues_like_an_uninterrupted_run(tmp_path):
    """In this process (the driver path is the same; no interpreter start-ups): 3 steps straight, against 2 steps
    and the same command with 3 resuming from the step-2 checkpoint."""
    def run(run_dir, steps):
        cfg = compose([*LOCAL, *SMALL, f"trainer.total_steps={steps}", "trainer.save_freq=1"])
        assert driver.run_training(cfg, run_dir) == 0

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(straight, 3)
    run(resumed, 2)
    run(resumed, 3)
    assert json.loads((resumed / "provenance" / "start-002" / "run.json").read_text())["start_step"] == 2
    rows_a, rows_b = read_metrics(straight / "metrics.jsonl"), read_metrics(resumed / "metrics.jsonl")
    assert [r["step"] for r in rows_b] == [1, 2, 3]
    for key in ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/grad_norm"):
        assert rows_b[2][key] == rows_a[2][key], key
    a, b = load_file(straight / "final" / "model.safetensors"), load_file(resumed / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((resumed / "checkpoints" / "step_3" / "meta.json").read_text())["provenance"] == "start-002"


def test_a_reward_that_always_fails_ends_the_run_with_exit_5_and_its_error(tmp_path, caplog):
    from qwen35rl.exit_codes import EXIT_REWARD_FAILURE

    cfg = compose([*LOCAL, *SMALL, "trainer.total_steps=3", "data.reward_failure_window=1",
                   "data.reward=tests.rewards.reward_helpers:always_raises"])
    with caplog.at_level(logging.ERROR, logger="qwen35rl.runtime.driver"):
        assert driver.run_training(cfg, tmp_path) == EXIT_REWARD_FAILURE
    assert "failed on 16 of 16 responses (100%) over step 1, more than" in caplog.text
    assert "ConnectionError: reward server at 10.0.0.9:8000 refused the connection" in caplog.text
    [block] = [r.getMessage() for r in caplog.records if r.name == "qwen35rl.runtime.driver"]
    assert block.startswith("the reward function failed too often: the run stopped (exit code 5)\n  what:  ")
    assert "\n  where: training step 1 of 3\n  fix:   fix the reward function" in block
    assert "last complete checkpoint: " not in block  # none yet
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1]


def test_a_reward_that_does_not_load_is_refused_before_any_worker(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(driver, "launcher", lambda *a, **k: pytest.fail("launched"))
    cfg = compose([*LOCAL, *SMALL, "data.reward=tests.rewards.reward_helpers:no_such_reward"])
    with caplog.at_level(logging.ERROR):
        assert driver.run_training(cfg, tmp_path) == 2
    assert "[reward_not_loadable] data.reward: data.reward='tests.rewards.reward_helpers:no_such_reward': cannot " \
           "import it" in caplog.text and "no_such_reward" in caplog.text


def test_a_full_disk_while_checkpointing_is_said_in_one_block_and_exits_6(tmp_path, caplog, monkeypatch):
    """DCP's shard write of the second checkpoint fails with ENOSPC inside the worker; curves.png then fails too.
    One block (what, free space, last complete checkpoint), exit 6, the clean-up's failure only a warning."""
    import errno

    from qwen35rl.exit_codes import EXIT_DISK_FULL
    from qwen35rl.runtime import checkpoint as ckpt
    from qwen35rl.runtime import tracking

    real_save = ckpt.save_engine_state

    def save_engine_state(path, engine):
        if "step_2" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path / "model" / "__0_0.distcp"))
        real_save(path, engine)

    def no_png(rows, out):
        raise RuntimeError("savefig: [Errno 28] No space left on device")

    monkeypatch.setattr(ckpt, "save_engine_state", save_engine_state)
    monkeypatch.setattr(tracking, "plot_curves", no_png)
    cfg = compose([*LOCAL, *SMALL, "trainer.total_steps=3", "trainer.save_freq=1"])
    with caplog.at_level(logging.WARNING):
        assert driver.run_training(cfg, tmp_path) == EXIT_DISK_FULL
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, errors
    block = errors[0]
    assert block.startswith("no space left on device: the run stopped (exit code 6)")
    assert "could not write:          checkpoint step_2: " in block and "__0_0.distcp (worker rank 0" in block
    assert "free of" in block
    assert f"last complete checkpoint: {tmp_path / 'checkpoints' / 'step_1'} (step 1)" in block
    assert "no curves.png: RuntimeError" in caplog.text
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_1"]  # the half save is gone
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]


def test_a_full_disk_writing_metrics_is_said_plainly_and_earlier_rows_stay(tmp_path, caplog, monkeypatch):
    import errno

    from qwen35rl.runtime import tracking

    real_append = tracking._append
    calls = []

    def append(fd, data):
        calls.append(data)
        if len(calls) == 2:  # half the row reaches the disk, then it is full
            real_append(fd, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        real_append(fd, data)

    monkeypatch.setattr(tracking, "_append", append)
    cfg = compose([*LOCAL, *SMALL, "trainer.total_steps=3", "trainer.save_freq=1"])
    assert driver.run_training(cfg, tmp_path) == 6
    assert f"could not write:          {tmp_path / 'metrics.jsonl'}" in caplog.text
    assert "last complete checkpoint: " in caplog.text and "step_1 (step 1)" in caplog.text
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1]  # the half row was cut off
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_one_exit_code_table_for_the_help_and_every_module():
    from qwen35rl import exit_codes
    from qwen35rl.cli import train as train_cli
    from qwen35rl.config.problems import EXIT_CONFIG
    from qwen35rl.runtime.preflight import EXIT_PREFLIGHT

    assert exit_codes.table() in train_cli.__doc__
    assert (EXIT_CONFIG, EXIT_PREFLIGHT, EXIT_WORKER_FAILURE) == (2, 3, 4)
    assert [int(c) for c in exit_codes.MEANINGS] == [0, 1, 2, 3, 4, 5, 6, 130, 141, 143]


def test_a_truncated_shard_of_the_newest_checkpoint_resumes_from_the_older_one(tmp_path, caplog):
    """A real run's checkpoints (DCP shards): the newest one's shard cut in half is named in one line and moved
    aside (kept as it is); the run resumes from the one before and finishes."""
    from qwen35rl.runtime.checkpoint import verify as ckpt_verify

    def run(steps):
        cfg = compose([*LOCAL, *SMALL, f"trainer.total_steps={steps}", "trainer.save_freq=1",
                       "trainer.max_keep_checkpoints=0"])
        return driver.run_training(cfg, tmp_path)

    assert run(2) == 0
    step_2 = tmp_path / "checkpoints" / "step_2"
    shard = max((step_2 / "model").glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    cut = shard.stat().st_size
    with caplog.at_level(logging.WARNING):
        assert run(3) == 0
    damaged = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(damaged) == 1, damaged
    (aside,) = (tmp_path / "checkpoints").glob("step_2.incomplete-*")
    assert damaged[0].startswith(f"checkpoint {step_2} skipped: model/{shard.name} is {cut} bytes, ")
    assert damaged[0].endswith(f"when saved (truncated or overwritten); moved aside to {aside} (kept, not deleted)")
    assert ckpt_verify(step_2) is None  # step 2 was trained again, beside the damaged one
    assert (aside / "model" / shard.name).stat().st_size == cut
    assert json.loads((tmp_path / "provenance" / "start-002" / "run.json").read_text())["start_step"] == 1
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
