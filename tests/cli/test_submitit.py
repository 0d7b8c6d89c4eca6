"""Sweeps as jobs of a scheduler: `qwen35rl-train -m hydra/launcher=submitit_local|submitit_slurm`.

- two tiny training jobs through submitit's local executor, end to end through the console script;
- a Slurm sweep against stand-in `sbatch` / `sacct` commands: each job's batch script sized from its own config;
- the Ray bring-up inside a multi-node Slurm job (qwen35rl/runtime/slurm.py) with a fake environment and recorded
  process runners: node lists, the srun commands slurm_ray.sh would run, ray_address.
"""
import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from qwen35rl.config.compose import compose
from qwen35rl.runtime import slurm
from tests.load import scaled

BIN = Path(sys.executable).parent
TINY = ["trainer.launcher=local", "hw.devices_per_node=1", "data.train_batch_size=2", "rollout.n=2",
        "algorithm.mini_batch_size=2", "backend.micro_batch_size_per_device=4", "trainer.test_freq=-1",
        "trainer.total_steps=1", "trainer.export_hf=false"]


def train(*args, env=None, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled", **(env or {})}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([str(BIN / "qwen35rl-train"), *args], capture_output=True, text=True, env=env,
                          timeout=scaled(timeout))


def summary_rows(sweep: Path):
    return list(csv.DictReader((sweep / "summary.csv").open()))


# ---------------------------------------------------------------------------------------------- local executor
@pytest.mark.slow
def test_two_tiny_jobs_through_the_local_executor(tmp_path):
    r = train("-m", "hydra/launcher=submitit_local", "trainer.seed=1,2", *TINY, f"trainer.output_root={tmp_path}")
    assert r.returncode == 0, r.stderr[-4000:]
    sweep = next(tmp_path.glob("sweeps/*"))
    logs = sorted(sweep.glob(".submitit/*/*_0_log.err"))
    assert len(logs) == 2, sorted(p.name for p in sweep.rglob("*"))
    # each job ran in its own process, with its own seed, and trained its step into its own run directory
    for job, seed in (("0", 1), ("1", 2)):
        rows = [json.loads(line) for line in (sweep / job / "metrics.jsonl").read_text().splitlines()]
        assert [row["step"] for row in rows] == [1]
        assert OmegaConf.load(sweep / job / "provenance" / "start-001" / "config.yaml").trainer.seed == seed
    assert all(re.search(r"step 1/1 \|", log.read_text()) for log in logs)  # each job's output is in its log
    # the submitting process says where each job went, and gets every job back (summary, exit code)
    assert len(re.findall(r"#\d : .* -> job \d+ \(nodes=1, timeout_min=1440; log .*_0_log\.err\)", r.stderr)) == 2
    rows = summary_rows(sweep)
    assert [(row["job"], row["valid"]) for row in rows] == [("0", "True"), ("1", "True")]


# ---------------------------------------------------------------------------------------------- Slurm, stand-ins
FAKE_SBATCH = """#!{python}
# records the batch script and answers like sbatch; nothing runs the jobs: their result files are written here, as
# submitit writes them for a job that returned (16 nodes) or raised (the others)
import os, pickle, re, sys
from pathlib import Path
record = Path(os.environ["QWEN35RL_FAKE_SLURM"])
n = len(list(record.glob("job*.sh"))) + 1
script = Path(sys.argv[1]).read_text()
(record / f"job{{n}}.sh").write_text(script)
job = 4200 + n
if "--partition=nope" in script:
    sys.exit("sbatch: error: invalid partition specified: nope")
out = re.search(r"#SBATCH --output=(\\S+)", script).group(1)
array = re.search(r"#SBATCH --array=0-(\\d+)", script)
for task in range(int(array.group(1)) + 1 if array else 1):
    result = out.replace("%A", str(job)).replace("%a", str(task)).replace("%j", str(job))
    result = Path(result.replace("_log.out", "_result.pkl"))
    result.parent.mkdir(parents=True, exist_ok=True)
    if "--nodes=16" in script:  # task 0 of a multi-node job returns as a training job does; tasks 1-15 never do
        from hydra.core.utils import JobReturn, JobStatus
        done = JobReturn(status=JobStatus.COMPLETED, _return_value={{"valid": True, "problems": [], "exit_code": 0}})
        result.write_bytes(pickle.dumps(("success", done)))
    else:
        result.write_bytes(pickle.dumps(("error", "RuntimeError: the stand-in sbatch ran nothing")))
print(f"Submitted batch job {{job}}")
"""
FAKE_SACCT = """#!/bin/sh
# every job asked about has failed (nothing ran it)
echo "JobID|State|NodeList"
while [ $# -gt 0 ]; do
  if [ "$1" = "-j" ]; then echo "$2|FAILED|n1"; echo "${2}_0|FAILED|n1"; echo "${2}_1|FAILED|n1"; shift; fi
  shift
done
"""


def fake_slurm(tmp_path):
    """A PATH with stand-ins for Slurm's commands, and the folder where `sbatch` keeps the scripts it got."""
    fake, bin_dir = tmp_path / "fake_slurm", tmp_path / "bin"
    fake.mkdir()
    bin_dir.mkdir()
    for name, text in (("sbatch", FAKE_SBATCH.format(python=sys.executable)), ("sacct", FAKE_SACCT),
                       ("scancel", "#!/bin/sh\n"), ("srun", "#!/bin/sh\nexit 1\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return fake, {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "QWEN35RL_FAKE_SLURM": str(fake)}


def test_a_slurm_sweep_submits_each_job_sized_from_its_own_config(tmp_path):
    fake, env = fake_slurm(tmp_path)
    r = train("-m", "hydra/launcher=submitit_slurm", "hw=gpu_1node,gpu_16node", "trainer.seed=1,2",
              "hydra.launcher.partition=gpu", "hydra.launcher.account=proj42", f"trainer.output_root={tmp_path}",
              env=env, timeout=120)
    scripts = {p.name: p.read_text() for p in sorted(fake.glob("job*.sh"))}
    # two sizes, two job arrays of two jobs each
    assert sorted(scripts) == ["job1.sh", "job2.sh"], r.stderr[-3000:]
    by_nodes = {re.search(r"--nodes=(\d+)", s).group(1): s for s in scripts.values()}
    assert sorted(by_nodes) == ["1", "16"]
    for nodes, script in by_nodes.items():
        flags = dict(re.findall(r"#SBATCH --([\w-]+)(?:=(\S+))?", script))
        assert flags["gpus-per-node"] == "8" and flags["ntasks-per-node"] == "1" and flags["cpus-per-task"] == "64"
        assert flags["partition"] == "gpu" and flags["account"] == "proj42" and flags["time"] == "1440"
        assert flags["array"] == "0-1%2" and flags["job-name"] == "qwen35rl"
        command = script.split("# command", 1)[1]
        # one node: submitit's srun step; 16 nodes: the job function runs once, in the batch step, and starts Ray
        # over the allocation with its own srun steps
        assert ("srun" in command) == (nodes == "1"), command
        assert "-m submitit.core._submit" in command
    # the 16-node jobs returned (their task 0: the only one that runs the function), the one-node jobs raised: each
    # of those is said once and is a failed row of the summary; the sweep succeeds as one job of it did
    assert r.returncode == 0, r.stderr[-3000:]
    failed = re.findall(r"qwen35rl: sweep job #(\d) \((hw=\w+).*\n  error: \[sweep_job_failed\] hydra.launcher: "
                        r"job \d+_\d failed: it ended without a result \(state FAILED\): RuntimeError: the stand-in "
                        r"sbatch ran nothing\n  hint: its log: .*_0_log\.err", r.stderr)
    assert sorted(failed) == [("0", "hw=gpu_1node"), ("1", "hw=gpu_1node")], r.stderr[-3000:]
    rows = summary_rows(next(tmp_path.glob("sweeps/*")))
    assert len(rows) == 4 and sum("sweep_job_failed" in json.dumps(row) for row in rows) == 2


def test_a_submission_that_sbatch_refuses_is_one_block_per_job_not_a_traceback(tmp_path):
    fake, env = fake_slurm(tmp_path)
    r = train("-m", "hydra/launcher=submitit_slurm", "hydra.launcher.partition=nope", "trainer.seed=1,2",
              f"trainer.output_root={tmp_path}", env=env, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    blocks = re.findall(r"qwen35rl: sweep job #\d .*\n  error: \[sweep_job_failed\] hydra.launcher: the job was not "
                        r"submitted: sbatch: error: invalid partition specified: nope\n  hint: check hydra.launcher",
                        r.stderr)
    assert len(blocks) == 2, r.stderr[-3000:]
    assert len(summary_rows(next(tmp_path.glob("sweeps/*")))) == 2


def test_the_launcher_names_are_qwen35rls_with_defaults_from_the_config():
    from hydra_plugins.qwen35rl_submitit.launcher import QwenSlurmConf

    cfg = compose(["hw=gpu_16node"])
    root = OmegaConf.create({"hw": OmegaConf.to_container(cfg.hw), "hydra": {
        "launcher": OmegaConf.structured(QwenSlurmConf), "sweep": {"dir": "/sweeps/x"}, "job": {"name": "train"}}})
    params = slurm.job_parameters(OmegaConf.to_container(root.hydra.launcher, resolve=True), cfg)
    assert (params["nodes"], params["gpus_per_node"], params["cpus_per_task"], params["tasks_per_node"]) == \
        (16, 8, 64, 1)
    assert params["timeout_min"] == 1440 and "_target_" not in params
    cpu = compose([])  # a CPU target asks for no GPUs
    assert slurm.job_parameters({"gpus_per_node": "auto", "cpus_per_task": 3}, cpu) == \
        {"gpus_per_node": None, "cpus_per_task": 3}


# ---------------------------------------------------------------------------------------------- Ray bring-up
@pytest.mark.parametrize("nodelist, hosts", [
    ("gpu001", ["gpu001"]),
    ("gpu[001-003,007]", ["gpu001", "gpu002", "gpu003", "gpu007"]),
    ("a[8-10],login-b,c", ["a8", "a9", "a10", "login-b", "c"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
])
def test_node_lists_expand_as_scontrol_does(nodelist, hosts):
    assert slurm.parse_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["gpu[1-3", "gpu1-3]", "gpu[3-1]", "gpu[a-b]"])
def test_a_malformed_node_list_is_refused(bad):
    with pytest.raises(ValueError):
        slurm.parse_nodelist(bad)


class Recorder:
    """Stands in for subprocess.run / Popen and the join wait: records every command, runs none."""

    def __init__(self):
        self.ran, self.started, self.waited, self.slept = [], [], [], []

    def run(self, cmd, **kwargs):
        self.ran.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout="10.1.2.3 fe80::1\n", stderr="")

    def popen(self, cmd):
        self.started.append(cmd)
        return subprocess.Popen(["true"])

    def wait(self, count, address, timeout_s):
        self.waited.append((count, address))

    def runners(self, env):
        return dict(env=env, run=self.run, popen=self.popen, wait=self.wait, sleep=self.slept.append)


def slurm_env(nodelist, nnodes, **extra):
    return {"SLURM_JOB_ID": "777", "SLURM_JOB_NODELIST": nodelist, "SLURM_NNODES": str(nnodes), **extra}


def test_a_multi_node_job_starts_ray_as_slurm_ray_sh_does(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = compose(["hw=gpu_16node", "hw.nodes=3"])
    rec = Recorder()
    out = slurm.ray_for_allocation(cfg, **rec.runners(slurm_env("gpu[001-002,004]", 3, SLURM_CPUS_PER_TASK="64")))
    assert out.ray_address == "10.1.2.3:6379" and os.environ.pop("RAY_ADDRESS") == "10.1.2.3:6379"
    # the head's address, asked on the head node
    assert rec.ran == [["srun", "--nodes=1", "--ntasks=1", "-w", "gpu001", "hostname", "--ip-address"]]
    ray = slurm._ray_executable()
    step = ["srun", "--nodes=1", "--ntasks=1", "--cpus-per-task=64", "-w"]
    assert rec.started == [
        [*step, "gpu001", ray, "start", "--head", "--node-ip-address=10.1.2.3", "--port=6379", "--num-gpus=8",
         "--disable-usage-stats", "--block"],
        [*step, "gpu002", ray, "start", "--address=10.1.2.3:6379", "--num-gpus=8", "--disable-usage-stats",
         "--block"],
        [*step, "gpu004", ray, "start", "--address=10.1.2.3:6379", "--num-gpus=8", "--disable-usage-stats",
         "--block"]]
    assert rec.slept == [slurm.HEAD_START_S] and rec.waited == [(3, "10.1.2.3:6379")]


def test_ascend_nodes_advertise_their_dies_and_the_port_comes_from_ray_port():
    cfg = compose(["hw=a3_4node", "hw.nodes=2"])
    rec = Recorder()
    done = slurm.bring_up(cfg, **rec.runners(slurm_env("npu[1-2]", 2, RAY_PORT="6380")))
    assert done.address == "10.1.2.3:6380"
    assert all('--resources={"NPU": 16}' in cmd for cmd in rec.started) and "--cpus-per-task" not in rec.started[0]


@pytest.mark.parametrize("overrides, env", [
    (["hw=gpu_16node", "hw.nodes=1"], slurm_env("gpu001", 1)),                               # one node
    (["hw=gpu_16node", "hw.nodes=2"], {}),                                                   # not in Slurm
    (["hw=gpu_16node", "hw.nodes=2"], slurm_env("g[1-2]", 2, SUBMITIT_EXECUTOR="local")),   # local executor
    (["hw=gpu_16node", "hw.nodes=2", "ray_address=10.0.0.9:6379"], slurm_env("g[1-2]", 2)),  # a named cluster
    (["hw=gpu_16node", "hw.nodes=2"], slurm_env("g[1-2]", 2, RAY_ADDRESS="auto")),
    (["hw=gpu_16node", "hw.nodes=2"], slurm_env("g[1-2]", 2, SLURM_PROCID="1")),             # not task 0
    (["trainer.launcher=local", "hw.devices_per_node=1"], slurm_env("g[1-2]", 2)),           # no Ray at all
])
def test_otherwise_the_job_just_runs(overrides, env):
    cfg = compose(overrides)
    before = cfg.ray_address
    rec = Recorder()
    assert slurm.ray_for_allocation(cfg, **rec.runners(env)).ray_address == before
    assert rec.ran == rec.started == rec.waited == []


def test_an_allocation_that_does_not_match_hw_nodes_is_refused_before_srun():
    cfg = compose(["hw=gpu_16node"])
    rec = Recorder()
    with pytest.raises(slurm.SlurmAllocationError, match=r"2 node\(s\) \(g1, g2\) but the run asks for hw.nodes=16"):
        slurm.bring_up(cfg, **rec.runners(slurm_env("g[1-2]", 2)))
    with pytest.raises(slurm.SlurmAllocationError, match="names 2 node"):
        slurm.allocation(slurm_env("g[1-2]", 3))
    assert rec.ran == rec.started == []


class FakeJob:
    """A submitted job as submitit hands it back: its task 0 returns `outcome` or raises it."""

    def __init__(self, outcome):
        self.outcome, self.job_id, self.state = outcome, "99_3", "TIMEOUT"
        self.paths = type("Paths", (), {"stderr": Path("/sweep/.submitit/99_3/99_3_0_log.err")})()

    def task(self, index):
        assert index == 0
        return self

    def result(self):
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome


def test_a_job_that_raised_or_died_comes_back_as_a_failed_row_with_its_reason(capsys):
    from hydra.core.utils import JobReturn, JobStatus
    from hydra_plugins.qwen35rl_submitit.launcher import SlurmLauncher
    from submitit.core.utils import UncompletedJobError

    def back(outcome):
        job = {"num": 3, "overrides": ["hw.nodes=2"], "cfg": None, "job": FakeJob(outcome)}
        ret = SlurmLauncher.result(job)
        assert ret.status == JobStatus.COMPLETED and ret.return_value["exit_code"] == 1
        assert slurm.exit_code_of(ret) == 1
        return ret.return_value["problems"][0]

    raised = JobReturn(status=JobStatus.FAILED, _return_value=slurm.SlurmAllocationError("2 node(s) but 16"))
    assert back(raised)["message"] == "job 99_3 failed: SlurmAllocationError: 2 node(s) but 16"
    died = UncompletedJobError("Job 99_3 (task: 0) with path /x\nhas not produced any output (state: TIMEOUT)\n"
                               "Error stream produced:\n" + "-" * 40 + "\nstep 7/10\n"
                               "slurmstepd: error: *** JOB 99 CANCELLED DUE TO TIME LIMIT ***\n")
    problem = back(died)
    assert problem["message"] == ("job 99_3 failed: it ended without a result (state TIMEOUT): slurmstepd: error: "
                                  "*** JOB 99 CANCELLED DUE TO TIME LIMIT ***")
    assert problem["hint"] == "its log: /sweep/.submitit/99_3/99_3_0_log.err"
    assert capsys.readouterr().err.count("qwen35rl: sweep job #3 (hw.nodes=2)\n  error: [sweep_job_failed]") == 2
    fine = JobReturn(status=JobStatus.COMPLETED, _return_value={"valid": True, "exit_code": 143})
    assert SlurmLauncher.result({"num": 0, "overrides": [], "cfg": None, "job": FakeJob(fine)}) is fine
    assert slurm.exit_code_of(fine) == 143
    assert slurm.exit_code_of(JobReturn(status=JobStatus.COMPLETED, _return_value={"valid": False})) == 2


def test_without_the_slurm_extra_the_launchers_say_what_to_install(tmp_path):
    hide = ("import sys\n"
            "for m in ('', '.config', '.submitit_launcher'):\n"
            "    sys.modules['hydra_plugins.hydra_submitit_launcher' + m] = None  # as if not installed\n"
            "from qwen35rl.cli.train import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    r = subprocess.run([sys.executable, "-c", hide, "-m", "hydra/launcher=submitit_slurm", "trainer.seed=1,2",
                        f"trainer.output_root={tmp_path}"], capture_output=True, text=True, timeout=scaled(120),
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "pip install 'qwen35rl[slurm]'" in r.stderr
    assert not list(tmp_path.glob("sweeps/*/0"))
