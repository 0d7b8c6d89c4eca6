"""bench/gpu/stages.py: the GPU bench's table holds together, and the runner refuses, lists, prints and runs stages
as a device call needs (no GPU here: the runner's own flow runs on stand-in stages)."""
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from bench.gpu import stages

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu" / "stages.py"


def cli(*args, **kw):
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, **kw)


def test_names_are_unique_and_needs_are_in_the_table():
    names = [s.name for s in stages.STAGES]
    assert len(names) == len(set(names))
    for s in stages.STAGES:
        for need in s.needs:
            assert stages.carried(need) or need in stages.BY_NAME, (s.name, need)
            # a need runs before the stage that needs it: listed above it
            if not stages.carried(need):
                assert names.index(need) < names.index(s.name), (s.name, need)


def test_limits_fit_in_a_call():
    for s in stages.STAGES:
        assert 0 < s.limit_s <= stages.CALL_S - stages.SUMMARY_S, s.name


def test_measuring_stages_name_their_records():
    for s in stages.STAGES:
        if s.records != "-":
            assert (ROOT / s.records).is_file(), (s.name, s.records)
    assert all(s.records != "-" for s in stages.STAGES if not s.name.startswith(("install-", "peak")))


def test_unknown_stage_is_refused_with_the_known_ones():
    r = cli("compare-cap", "no-such-stage")
    assert r.returncode == 2
    assert "no-such-stage" in r.stderr
    for s in stages.STAGES:
        assert s.name in r.stderr
    assert r.stdout == ""  # nothing ran


def test_list_names_every_stage():
    r = cli("--list")
    assert r.returncode == 0
    listed = [line.split()[0] for line in r.stdout.splitlines()[1:]]
    assert listed == [s.name for s in stages.STAGES]


def test_order_runs_needs_first_and_once():
    got = [s.name for s in stages.order(["qknorm-pair", "qknorm-phases", "megatron-phases"])]
    assert got == ["install-gdn", "peak", "qknorm-pair", "qknorm-phases", "install-mcore-x", "megatron-phases"]


# What bench/gpu/run_all.sh ran for these stages (`git show 115a2c5:bench/gpu/run_all.sh`), the commands behind
# the records of 2026-12-04 and 2026-12-04b
DRY_RUNS = {
    "qknorm-pair": [
        "ENV",
        "BUDGET=(backend.dynamic_batch_size=true backend.max_tokens_per_device=${TOKENS:-24576} "
        "backend.compile_layers=true)",
        "TORCH_LOGS=recompiles PYTHONPATH=$FLA_PATH CUDA_VISIBLE_DEVICES=0 $G qwen35rl --lengths realistic",
        '--run-dir "$RUNS/q1-realistic" --steps 5 --peak-tflops "$PEAK" --timeout 250 --',
        'trainer.launcher=local "${BUDGET[@]}"',
        'timeout -s ABRT "$(left 570)" $G trl --lengths realistic',
        "timeout -k 15 -s ABRT 150 python3 -m pytest -x -q -p no:cacheprovider --tb=short -k cuda",
    ],
    "megatron-phases": [
        "ENV",
        "MEGATRON_SET=(--set backend.megatron_core_version=0.19.2 --set backend.param_offload=false",
        "--set backend.grad_offload=false --set backend.optimizer_offload=false",
        "--set backend.optimizer_cpu_offload=false)",
        'timeout -s ABRT "$(left "${MEGATRON_UNTIL:-400}")"',
        '--micro "$MICRO" --workloads cap --variants built --reps "${REPS:-3}" --snapshot "${MEGATRON_SET[@]}"',
        "MODEL=${MODEL:-qwen3_5_0_8b}; MICRO=${MICRO:-16}; tag=${MODEL#qwen3_5_}",
        'cp .whl-x/megatron_core-* /tmp/w/mcore/',
    ],
    "compare-cap": [
        "ENV",
        '--timeout $(( budget * 58 / 100 )) --',
        "budget=$(left 590)",
        '$G trl --lengths cap --out "$OUT/cap/trl.json" --work-dir "/tmp/trl-cap" --steps 3',
    ],
}
ENV_LINE = ("NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 "
            "RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false TRITON_CACHE_DIR=/tmp/kcache/triton "
            "TILELANG_CACHE_DIR=/tmp/kcache/tilelang")


@pytest.mark.parametrize("name", sorted(DRY_RUNS))
def test_dry_run_prints_the_commands_run_all_ran(name):
    r = cli("--dry-run", name)
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())  # continuation lines and indents folded
    for expected in DRY_RUNS[name]:
        assert " ".join((ENV_LINE if expected == "ENV" else expected).split()) in text, expected
    assert [line.split()[1] for line in r.stdout.splitlines() if line.startswith("== ")] == [
        s.name for s in stages.order([name])]


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """Stand-in stages, logs and caches under tmp_path: the runner's flow without a GPU."""
    monkeypatch.setattr(stages, "LOGS_ROOT", tmp_path / "logs")
    monkeypatch.setattr(stages, "TRITON_CACHE", str(tmp_path / "triton"))
    monkeypatch.setattr(stages, "KCACHES", ())
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    table = [
        stages.Stage("setup", (), "echo setup > \"$LOGS/setup.log\"", 30, "-", "stand-in install"),
        stages.Stage("measure", ("setup",), 'mkdir -p "$OUT/m"; echo "{\\"left\\": $(left 100)}" > "$OUT/m/r.json"\n'
                     'echo "| row |" > "$LOGS/m.log"; exit 3', 30, "-", "stand-in measurement"),
        stages.Stage("slow", (), "sleep 30", 30, "-", "cut by the call's end"),
        stages.Stage("needs-carry", (".no-such-dir",), "true", 30, "-", "a carried directory missing"),
    ]
    monkeypatch.setattr(stages, "STAGES", table)
    monkeypatch.setattr(stages, "BY_NAME", {s.name: s for s in table})
    return tmp_path


def test_runner_runs_needs_packs_results_and_passes_the_exit_code(sandbox, capsys):
    rc = stages.main(["measure"])
    assert rc == 3  # the measuring stage's exit code becomes the call's
    out = sandbox / "out"
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == ["logs-measure.tar.gz", "results-measure.tar.gz"]
    with tarfile.open(out / "results-measure.tar.gz") as tar:
        left = json.load(tar.extractfile("m/r.json"))["left"]
    assert 90 <= left <= 100  # second 100 of the call, counted from the call's start
    with tarfile.open(out / "logs-measure.tar.gz") as tar:
        assert {"setup/setup.log", "measure/m.log"} <= set(tar.getnames())
    printed = capsys.readouterr().out
    assert "stage setup" in printed.splitlines()[0] and "| row |" in printed


def test_runner_cuts_a_stage_at_the_calls_end(sandbox, capsys):
    rc = stages.main(["--call-s", str(stages.SUMMARY_S + 2), "slow"])
    assert rc == 124
    assert "past its limit" in capsys.readouterr().out


def test_runner_names_a_missing_carried_directory(sandbox, capsys):
    assert stages.main(["needs-carry"]) == 1
    assert ".no-such-dir" in capsys.readouterr().out


def test_peak_measures_every_gpu_and_hands_gpu_0s_on(tmp_path, monkeypatch):
    fake = tmp_path / "fake_peak.py"  # stands in for grpo_h200.py: `peak --out FILE`
    fake.write_text("import json, os, sys\n"
                    "rate = 700.04 + int(os.environ['CUDA_VISIBLE_DEVICES'])\n"
                    "json.dump({'bf16_matmul_tflops': rate}, open(sys.argv[3], 'w'))\n")
    monkeypatch.setitem(stages.ENV, "G", f"{sys.executable} {fake}")
    (tmp_path / "logs").mkdir()
    call = stages.Call(out=tmp_path, t0=0.0, deadline=float("inf"), ngpu=2, env={"LOGS": str(tmp_path / "logs")})
    assert stages.measure_peak(call) == 0
    assert [r["bf16_matmul_tflops"] for r in json.loads((tmp_path / "peak.json").read_text())] == [700.04, 701.04]
    assert call.env["PEAK"] == "700.0"
