"""The GPU bench as a table of named stages, run by one runner inside one device call.

    python3 bench/gpu/stages.py STAGE...        run the stages (and what they need) in order; results in $OUT
    python3 bench/gpu/stages.py --list          the table
    python3 bench/gpu/stages.py --dry-run STAGE...   print the commands instead of running them

A device call lasts at most 600 s (CALL_S). Each stage runs under its own limit, cut to what is left of the call,
so that the summary (the results packed into $OUT/results-<stages>.tar.gz, the logs, Triton's autotuning results)
always runs. Inside a stage, `$(left N)` is the number of seconds until second N of the call: the jobs of a stage
end at fixed points of the call, wherever the stage starts.

Carry what a stage's install needs (--list names it: .whl, .whl-x, .whl-gdn) and .kcache where it exists: Triton's
autotuning results an earlier call brought back ($OUT/triton-autotune.tar.gz, copied to .kcache/), so that fla's
kernels compile without autotuning again. Installs (no network there): /tmp/site (Hydra, TRL, datasets; Ray from
.whl), /tmp/site-fla (flash-linear-attention alone, for megatron-core), /tmp/site-mcore (megatron-core 0.19.2),
/tmp/site-gdn (fla + TileLang). Which of them a job sees is its PYTHONPATH: without fla, transformers runs its torch
GDN fallback. Every job has a time limit and writes its JSON as it goes, so a job cut short still leaves its
finished steps. fla's Triton kernels compile and autotune on first use per shape (30 s and more): the first step of
a run pays it, steady-state numbers leave it out.

What each stage measured, and the stages retired from this table with the commands that ran them:
bench/results/h200.md and bench/results/megatron_h200.md.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Union

ROOT = Path(__file__).resolve().parents[2]
CALL_S = 600  # the device's limit for one call
SUMMARY_S = 8  # kept back at the end of a call for the summary
LOGS_ROOT = Path("/tmp/logs")
TRITON_CACHE = "/tmp/kcache/triton"
# Triton's autotuning results of earlier calls: the committed ones, then a newer copy carried in as .kcache/
KCACHES = ("bench/gpu/kcache/triton-autotune.tar.gz", ".kcache/triton-autotune.tar.gz")

BASE = f"/tmp/site:{ROOT}"
ENV = {
    # no NVLink multicast (the lent machines do not support it)
    "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
    "PYTHONUNBUFFERED": "1", "RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false",
    # compiled kernels stay while the machine is warm
    "TRITON_CACHE_DIR": TRITON_CACHE, "TILELANG_CACHE_DIR": "/tmp/kcache/tilelang",
    "BASE": BASE,
    "TORCH_PATH": BASE,  # transformers' torch GDN fallback
    "FLA_PATH": f"/tmp/site-gdn:{BASE}",  # fla + TileLang
    "MCORE_PATH": f"/tmp/site-mcore:/tmp/site-fla:{BASE}",  # megatron-core (its GDN module imports fla)
    "MCORE_GDN_PATH": f"/tmp/site-mcore:/tmp/site-gdn:{BASE}",  # megatron-core with fla + TileLang
    "G": "python3 bench/gpu/grpo_h200.py",
}

# Shell functions every snippet can call. T0 (the call's start, epoch seconds), OUT, LOGS, RUNS, NGPU and, after
# stage peak, PEAK come from the runner.
PRELUDE = r"""set -u
left() { echo $(( ${1:-570} - ($(date +%s) - T0) )); }  # seconds until second $1 (default 570) of the call
elapsed() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
env_info() {
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  for p in "$TORCH_PATH" "$FLA_PATH" "$MCORE_PATH"; do
    PYTHONPATH=$p python3 -c 'import importlib.util as u, importlib.metadata as md, torch, transformers, triton
def v(d):
    try: return md.version(d)
    except Exception: return "-"
print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, "triton",
      triton.__version__, *[f"{d} {v(d)}" for d in
                             ("ray", "trl", "hydra-core", "flash-linear-attention", "tilelang", "megatron-core")])' \
      2>&1 | tail -1
  done
}
# the plan's JSON (stdout to $2, stderr to $3) for the overrides a grpo_h200.py run recorded in $1; its exit code
plan_of() {
  PYTHONPATH=$BASE python3 -c "import json, subprocess, sys
o = json.load(open('$1'))['overrides']
sys.exit(subprocess.run([sys.executable, '-m', 'qwen35rl.cli.plan', *o, 'format=json']).returncode)" > "$2" 2> "$3"
}
# $1: target directory, the rest: wheel directories (the log in $LOGS/install.log, shown when it fails)
install_into() {
  SITE=$1 bash bench/gpu/install-wheels.sh "${@:2}" >> "$LOGS/install.log" 2>&1 || { cat "$LOGS/install.log"; exit 1; }
}
"""


@dataclass
class Call:
    """One device call: where its files go and when it ends."""
    out: Path
    t0: float
    deadline: float  # epoch seconds by which the last stage must have ended
    ngpu: int = 0
    stage_end: float = float("inf")  # when the running stage's limit ends
    env: Dict[str, str] = field(default_factory=dict)

    def elapsed(self, msg: str) -> None:
        print(f"[{int(time.time() - self.t0)} s] {msg}", flush=True)


@dataclass
class Stage:
    """name: what the command line calls it. needs: stages run first (once a call) and carried directories (a
    leading dot: .whl, .whl-x, .whl-gdn). command: a bash snippet (run after PRELUDE), an argv list, or a Python
    callable taking the Call and returning an exit code. limit_s: the longest it runs; a call cuts it to what is left.
    records: the bench/results file its numbers go to. doc: what it measures. gpus: the fewest it runs on.
    done: true when a warm machine already has what the stage would make (then it is skipped)."""
    name: str
    needs: Sequence[str]
    command: Union[str, Sequence[str], Callable[[Call], int]]
    limit_s: int
    records: str
    doc: str
    gpus: int = 1
    done: Optional[Callable[[], bool]] = None


def carried(need: str) -> bool:
    return need.startswith(".")


def measure_peak(call: Call) -> int:
    """bf16 matmul TFLOP/s of every GPU at once ($OUT/peak.json); GPU 0's becomes PEAK, which MFU divides by."""
    logs = Path(call.env["LOGS"])
    jobs = [subprocess.Popen(shlex.split(ENV["G"]) + ["peak", "--out", str(logs / f"peak{i}.json")],
                             env={**call.env, "PYTHONPATH": BASE, "CUDA_VISIBLE_DEVICES": str(i)},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(call.ngpu)]
    try:
        for job in jobs:
            job.wait(timeout=max(1.0, call.stage_end - time.time()))
    finally:
        for job in jobs:
            if job.poll() is None:
                job.kill()
    rows = [json.loads((logs / f"peak{i}.json").read_text()) for i in range(call.ngpu)]
    (call.out / "peak.json").write_text(json.dumps(rows) + "\n")
    call.env["PEAK"] = str(round(rows[0]["bf16_matmul_tflops"], 1))
    call.elapsed(f"bf16 matmul peak {call.env['PEAK']} TFLOP/s (GPU 0); {json.dumps(rows)}")
    return 0


def _gdn_installed() -> bool:
    return Path("/tmp/site-gdn/.tilelang.tar.xz.done").is_file() and Path("/tmp/site/trl").is_dir()


STAGES: List[Stage] = [
    # ---- installs and the matmul peak: what the measuring stages need
    Stage("install-base", (".whl", ".whl-x"), r"""
# Ray, Hydra, TRL into /tmp/site; fla alone into /tmp/site-fla; megatron-core into /tmp/site-mcore
rm -rf /tmp/w /tmp/site /tmp/site-fla /tmp/site-mcore && mkdir -p /tmp/w/base /tmp/w/fla /tmp/w/mcore
cp .whl/* /tmp/w/base/ && cp -f .whl-x/* /tmp/w/base/ \
  && mv /tmp/w/base/fla_core-* /tmp/w/base/flash_linear_attention-* /tmp/w/fla/ \
  && mv /tmp/w/base/megatron_core-* /tmp/w/mcore/ || { echo "wheel split failed"; exit 1; }
install_into /tmp/site /tmp/w/base && install_into /tmp/site-fla /tmp/w/fla && install_into /tmp/site-mcore /tmp/w/mcore
PYTHONPATH=$TORCH_PATH python3 -c "import importlib.util as u, sys; sys.exit(u.find_spec('fla') is not None)" \
  || { echo "fla is importable from $TORCH_PATH: the torch-GDN runs would not be"; exit 1; }
""", 180, "-", "Ray, Hydra, TRL, fla and megatron-core, each site apart (fla off the torch-GDN path)"),
    Stage("install-mcore", (".whl",), r"""
# .whl alone (pack_wheels.sh megatron-core==0.19.2), without Ray (its archive stays packed: trainer.launcher=local)
rm -rf /tmp/w /tmp/site /tmp/site-fla /tmp/site-mcore && mkdir -p /tmp/w/base /tmp/w/fla /tmp/w/mcore
cp .whl/*.whl /tmp/w/base/ \
  && mv /tmp/w/base/fla_core-* /tmp/w/base/flash_linear_attention-* /tmp/w/fla/ \
  && mv /tmp/w/base/megatron_core-* /tmp/w/mcore/ || { echo "wheel split failed"; exit 1; }
install_into /tmp/site /tmp/w/base && install_into /tmp/site-fla /tmp/w/fla && install_into /tmp/site-mcore /tmp/w/mcore
""", 180, "-", "Hydra into /tmp/site, fla into /tmp/site-fla, megatron-core into /tmp/site-mcore (no Ray)"),
    Stage("install-gdn", (".whl-gdn", ".whl-x"), r"""
# no Ray and no megatron-core: their wheels and TileLang's do not fit one call's 64 MiB together
rm -rf /tmp/w /tmp/site /tmp/site-gdn && mkdir -p /tmp/w/base
cp .whl-x/* /tmp/w/base/ && rm -f /tmp/w/base/megatron_core-* || { echo "wheel split failed"; exit 1; }
install_into /tmp/site /tmp/w/base && install_into /tmp/site-gdn .whl-gdn
""", 180, "-", "Hydra, TRL into /tmp/site; fla + TileLang into /tmp/site-gdn (kept while the machine is warm)",
          done=_gdn_installed),
    Stage("install-mcore-x", (".whl-x",), r"""
rm -rf /tmp/w/mcore /tmp/site-mcore && mkdir -p /tmp/w/mcore && cp .whl-x/megatron_core-* /tmp/w/mcore/ \
  || { echo "no megatron-core wheel in .whl-x"; exit 1; }
install_into /tmp/site-mcore /tmp/w/mcore
""", 120, "-", "megatron-core alone from .whl-x into /tmp/site-mcore, next to install-gdn's fla + TileLang"),
    Stage("peak", (), measure_peak, 90, "-", measure_peak.__doc__ or ""),

    # ---- one GPU
    Stage("compare-cap", ("install-gdn", "peak"), r"""
# qwen35rl (CLI, no Ray) then TRL on GPU 0 with the same fixed micro batches; qwen35rl gets 58% of the call's
# time left (its first step compiles more), TRL the rest
env_info > "$OUT/env-compare.txt" 2>&1
elapsed "installed: $(tail -2 "$OUT/env-compare.txt" | tr '\n' ' ')"
export PYTHONFAULTHANDLER=1
mkdir -p "$OUT/cap" && cp "$OUT/peak.json" "$OUT/cap/"
budget=$(left 590)
PYTHONPATH=$FLA_PATH CUDA_VISIBLE_DEVICES=0 $G qwen35rl --lengths cap --out "$OUT/cap/q1.json" \
  --run-dir "$RUNS/q1-cap" --steps 3 --peak-tflops "$PEAK" --timeout $(( budget * 58 / 100 )) -- \
  trainer.launcher=local > "$LOGS/q1-cap.log" 2>&1
elapsed "qwen35rl (cap): $(grep -c '\[qwen35rl\] step' "$LOGS/q1-cap.log") steps"
cp "$RUNS/q1-cap/metrics.jsonl" "$OUT/cap/q1-metrics.jsonl" 2>/dev/null
rm -rf "$RUNS/q1-cap"
PYTHONPATH=$FLA_PATH CUDA_VISIBLE_DEVICES=0 timeout -s ABRT "$(left 590)" \
  $G trl --lengths cap --out "$OUT/cap/trl.json" --work-dir "/tmp/trl-cap" --steps 3 > "$LOGS/trl-cap.log" 2>&1
elapsed "TRL (cap): $(grep -c 'trl step' "$LOGS/trl-cap.log") steps"
PYTHONPATH=$BASE python3 bench/gpu/grpo_h200.py report "$OUT/cap" > "$OUT/cap/report.md" 2>&1
grep -A20 "qwen35rl / TRL" "$OUT/cap/report.md"
""", 592, "bench/results/h200.md",
          "the all-at-cap workload, both sides, 3 steps each: qwen35rl through its CLI, then TRL's GRPOTrainer"),
    Stage("qknorm-pair", ("install-gdn", "peak"), r"""
# TOKENS: the token budget of a micro batch (default 24576)
env_info > "$OUT/env-compare.txt" 2>&1
export PYTHONFAULTHANDLER=1
PYTHONPATH=$FLA_PATH timeout -k 15 -s ABRT 150 python3 -m pytest -x -q -p no:cacheprovider --tb=short -k cuda \
  tests/engines/test_gdn_layer.py tests/engines/test_packed_gdn.py tests/engines/test_logprob.py \
  > "$OUT/gpu-tests.log" 2>&1
elapsed "GPU tests (exit $?)"; tail -15 "$OUT/gpu-tests.log" | cut -c1-300
BUDGET=(backend.dynamic_batch_size=true backend.max_tokens_per_device=${TOKENS:-24576} backend.compile_layers=true)
mkdir -p "$OUT/realistic" && cp "$OUT/peak.json" "$OUT/realistic/"
TORCH_LOGS=recompiles PYTHONPATH=$FLA_PATH CUDA_VISIBLE_DEVICES=0 $G qwen35rl --lengths realistic \
  --out "$OUT/realistic/q1.json" --run-dir "$RUNS/q1-realistic" --steps 5 --peak-tflops "$PEAK" --timeout 250 -- \
  trainer.launcher=local "${BUDGET[@]}" > "$LOGS/q1-realistic.log" 2>&1
elapsed "qwen35rl (realistic, ${BUDGET[*]}): $(grep -c '\[qwen35rl\] step' "$LOGS/q1-realistic.log") steps"
cp "$RUNS/q1-realistic/metrics.jsonl" "$OUT/realistic/q1-metrics.jsonl" 2>/dev/null
grep -c "Recompiling function" "$LOGS/q1-realistic.log"
rm -rf "$RUNS/q1-realistic"
PYTHONPATH=$FLA_PATH CUDA_VISIBLE_DEVICES=0 timeout -s ABRT "$(left 570)" $G trl --lengths realistic \
  --out "$OUT/realistic/trl.json" --work-dir /tmp/trl-realistic --steps 3 > "$LOGS/trl-realistic.log" 2>&1
elapsed "TRL (realistic): $(grep -c 'trl step' "$LOGS/trl-realistic.log") steps"
PYTHONPATH=$BASE python3 bench/gpu/grpo_h200.py report "$OUT/realistic" > "$OUT/realistic/report.md" 2>&1
grep -A20 "qwen35rl / TRL" "$OUT/realistic/report.md"
""", 592, "bench/results/h200.md",
          "the CUDA tests of the GDN forward, convolution and log-prob head, then the realistic pair with a token "
          "budget and compiled layers: qwen35rl 5 steps (dynamo's recompiles logged), TRL 3"),
    Stage("qknorm-phases", ("install-gdn", "peak"), r"""
# best right after qknorm-pair, on the warm machine; TOKENS (default 24576), MICRO: the 4B's micro batch (default 8)
env_info > "$OUT/env-phases.txt" 2>&1
export PYTHONFAULTHANDLER=1
mkdir -p "$OUT/phases"
PYTHONPATH=$FLA_PATH CUDA_VISIBLE_DEVICES=0 timeout -s ABRT 200 python3 bench/gpu/train_phases.py \
  --out "$OUT/phases/phases_budget.json" --workloads realistic,cap --variants regions --reps 2 \
  --set backend.dynamic_batch_size=true --set "backend.max_tokens_per_device=${TOKENS:-24576}" --profile regions \
  --profile-rows 16 --peak-tflops "$PEAK" > "$OUT/phases/phases-budget.log" 2>&1
elapsed "0.8B phases with a token budget (exit $?)"
grep "^phases" "$OUT/phases/phases-budget.log"
PYTHONPATH=$FLA_PATH CUDA_VISIBLE_DEVICES=0 timeout -s ABRT "$(left 585)" python3 bench/gpu/train_phases.py \
  --out "$OUT/phases/phases_4b.json" --model qwen3_5_4b --micro "${MICRO:-8}" --workloads cap --variants head \
  --set backend.compile_layers=true --reps 3 --peak-tflops "$PEAK" > "$OUT/phases/phases-4b.log" 2>&1
elapsed "4B phases, compiled layers, micro ${MICRO:-8} (exit $?)"
grep "^phases" "$OUT/phases/phases-4b.log"
""", 592, "bench/results/h200.md",
          "the 0.8B training phases with the token budget and compiled layers (profiled), then the 4B at micro MICRO"),
    Stage("gdn-check", ("install-gdn", "peak"), r"""
# AB: the variants (default regions,fused,qknorm); GDN_4B=0: the 0.8B alone (a shorter call)
env_info > "$OUT/env-phases.txt" 2>&1
export PYTHONFAULTHANDLER=1
PYTHONPATH=$FLA_PATH timeout -k 15 -s ABRT 120 python3 -m pytest -q -p no:cacheprovider --tb=short -k cuda \
  tests/engines/test_gdn_layer.py tests/engines/test_packed_gdn.py tests/engines/test_logprob.py \
  > "$OUT/gpu-tests.log" 2>&1
elapsed "GPU tests (exit $?)"; tail -8 "$OUT/gpu-tests.log" | cut -c1-300
mkdir -p "$OUT/phases"
AB=${AB:-regions,fused,qknorm}  # the default twice (first and last): the drift within the call
PYTHONPATH=$FLA_PATH CUDA_VISIBLE_DEVICES=0 timeout -s ABRT 200 python3 bench/gpu/train_phases.py \
  --out "$OUT/phases/phases_ab.json" --workloads realistic --variants "$AB" --reps 3 \
  --set backend.dynamic_batch_size=true --set "backend.max_tokens_per_device=${TOKENS:-24576}" \
  --peak-tflops "$PEAK" > "$OUT/phases/phases-ab.log" 2>&1
elapsed "0.8B realistic phases, q/k norm and gates A/B (exit $?)"
grep "^phases" "$OUT/phases/phases-ab.log"
if [ "${GDN_4B:-1}" = 1 ]; then
  PYTHONPATH=$FLA_PATH CUDA_VISIBLE_DEVICES=0 timeout -s ABRT "$(left 585)" python3 bench/gpu/train_phases.py \
    --out "$OUT/phases/phases_4b_ab.json" --model qwen3_5_4b --micro 8 --workloads cap \
    --variants "head,${AB#regions,}" \
    --set backend.compile_layers=true --reps 2 --peak-tflops "$PEAK" > "$OUT/phases/phases-4b-ab.log" 2>&1
  elapsed "4B phases, micro 8, A/B (exit $?)"
  grep "^phases" "$OUT/phases/phases-4b-ab.log"
fi
""", 592, "bench/results/h200.md",
          "the CUDA tests of the GDN forward (both fla paths) and convolution, then the GDN q/k norm and gates A/B "
          "(train_phases variants): 0.8B realistic rows with the token budget, then the 4B at micro 8"),
    Stage("megatron-phases", ("install-gdn", "install-mcore-x", "peak"), r"""
# MODEL (default qwen3_5_0_8b), MICRO (16), REPS (3), MEGATRON_UNTIL (400); TESTS=1: first the CUDA tests of the GDN
# forward, convolution and log-prob head; FSDP=0: without the FSDP side
env_info > "$OUT/env-megatron-phases.txt" 2>&1
export PYTHONFAULTHANDLER=1
mkdir -p "$OUT/phases"
# backend=megatron as the FSDP engine runs on one GPU: everything on the device, the plan's version check on 0.19.2
MEGATRON_SET=(--set backend.megatron_core_version=0.19.2 --set backend.param_offload=false
              --set backend.grad_offload=false --set backend.optimizer_offload=false
              --set backend.optimizer_cpu_offload=false)
MODEL=${MODEL:-qwen3_5_0_8b}; MICRO=${MICRO:-16}; tag=${MODEL#qwen3_5_}
if [ "${TESTS:-0}" = 1 ]; then
  PYTHONPATH=$FLA_PATH timeout -k 15 -s ABRT 150 python3 -m pytest -q -p no:cacheprovider --tb=short -k cuda \
    tests/engines/test_gdn_layer.py tests/engines/test_packed_gdn.py tests/engines/test_logprob.py \
    > "$OUT/gpu-tests.log" 2>&1
  elapsed "GPU tests (exit $?)"; tail -6 "$OUT/gpu-tests.log" | cut -c1-300
fi
PYTHONPATH=$MCORE_GDN_PATH CUDA_VISIBLE_DEVICES=0 timeout -s ABRT "$(left "${MEGATRON_UNTIL:-400}")" \
  python3 bench/gpu/train_phases.py --out "$OUT/phases/megatron_$tag.json" --backend megatron --model "$MODEL" \
  --micro "$MICRO" --workloads cap --variants built --reps "${REPS:-3}" --snapshot "${MEGATRON_SET[@]}" \
  --peak-tflops "$PEAK" \
  > "$OUT/phases/megatron-$tag.log" 2>&1
elapsed "Megatron $tag phases, micro $MICRO (exit $?)"
grep "^phases\|^snapshot\|GiB \|before the optimizer" "$OUT/phases/megatron-$tag.log" | head -60
if [ "${FSDP:-1}" = 1 ]; then
  PYTHONPATH=$FLA_PATH CUDA_VISIBLE_DEVICES=0 timeout -s ABRT "$(left 585)" python3 bench/gpu/train_phases.py \
    --out "$OUT/phases/fsdp_$tag.json" --model "$MODEL" --micro "$MICRO" --workloads cap --variants built --reps 3 \
    --peak-tflops "$PEAK" > "$OUT/phases/fsdp-$tag.log" 2>&1
  elapsed "FSDP $tag phases, micro $MICRO (exit $?)"
  grep "^phases" "$OUT/phases/fsdp-$tag.log"
fi
""", 592, "bench/results/megatron_h200.md",
          "train_phases.py with backend=megatron (megatron-core 0.19.2, fla + TileLang, no offload) on the all-at-cap "
          "rows, then one update under the allocator's history (memory_snapshot.py); then the FSDP engine on them"),
    Stage("packing", ("install-gdn",), r"""
# fla compiles each new kernel signature on first use, 100 s and more for a model's forward and backward: the bench
# goes first and the tests, on the same kernels, after it; a job cut by its limit dumps its Python stacks
mkdir -p "$OUT/packing"
export PYTHONFAULTHANDLER=1
PYTHONPATH=$FLA_PATH timeout -s ABRT "$(left 450)" python3 bench/gpu/packing.py --out "$OUT/packing/packing.json" \
  > "$LOGS/packing.log" 2>&1
elapsed "packed against padded (exit $?)"
PYTHONPATH=$FLA_PATH timeout -s ABRT "$(left 560)" python3 -m pytest -v -p no:cacheprovider --durations=0 \
  "tests/engines/test_fsdp_gpu.py::test_packed_equals_padded[bf16-0.05]" \
  tests/engines/test_packed_attention.py::test_varlen_kernel_equals_per_document_sdpa_on_cuda \
  "tests/engines/test_fsdp_gpu.py::test_packed_equals_padded[fp32-0.001]" > "$LOGS/gpu-tests.log" 2>&1
elapsed "GPU tests (exit $?): $(tail -1 "$LOGS/gpu-tests.log")"
""", 570, "bench/results/h200.md",
          "bench/gpu/packing.py (padded, packed, packed filled by tokens; spread response lengths), then the GPU "
          "tests of packing"),
    Stage("profile", ("install-gdn",), r"""
mkdir -p "$OUT/profile"
export PYTHONFAULTHANDLER=1
PYTHONPATH=$FLA_PATH CUDA_VISIBLE_DEVICES=0 timeout -s ABRT "$(left)" $G memory --out "$OUT/profile/memory.json" \
  --profile --decode-bench --decode-tokens 16 > "$LOGS/memory.log" 2>&1
elapsed "memory job with profiles done (exit $?)"
""", 580, "bench/results/h200.md",
          "the memory job with fla + TileLang: kernel profiles of an update, a reference pass and a generation, the "
          "decode benchmark, then the other memory shapes in what is left of the call"),

    # ---- several GPUs (issues 21 and 22)
    Stage("sp-x2", ("install-gdn", "peak"), r"""
# SEQ: tokens a row (default 16384), 4 rows: what SP1 holds without checkpointing in the plan's estimate
env_info > "$OUT/env-sp.txt" 2>&1
mkdir -p "$OUT/sp"
SEQ=${SEQ:-16384}
S="bench/gpu/sp_gap.py run --rows 4"
PYTHONPATH=$FLA_PATH CUDA_VISIBLE_DEVICES=0 timeout -s ABRT "$(left 200)" python3 $S --sp 1 --seq-len "$SEQ" \
  --out "$OUT/sp/sp1.pt" > "$LOGS/sp1.log" 2>&1
elapsed "SP1 (exit $?): $(grep '^sp ' "$LOGS/sp1.log")"
PYTHONPATH=$FLA_PATH timeout -s ABRT "$(left 380)" torchrun --standalone --nproc_per_node=2 $S --sp 2 \
  --seq-len "$SEQ" --out "$OUT/sp/sp2.pt" > "$LOGS/sp2.log" 2>&1
elapsed "SP2 (exit $?): $(grep '^sp ' "$LOGS/sp2.log")"
PYTHONPATH=$BASE python3 bench/gpu/sp_gap.py compare "$OUT/sp/sp1.pt" "$OUT/sp/sp2.pt" --out "$OUT/sp/gap.json"
PYTHONPATH=$FLA_PATH timeout -s ABRT "$(left 575)" torchrun --standalone --nproc_per_node=2 $S --sp 2 \
  --seq-len $((2 * SEQ)) --out "$OUT/sp/sp2_2x.pt" > "$LOGS/sp2_2x.log" 2>&1
elapsed "SP2 at 2x (exit $?): $(grep '^sp ' "$LOGS/sp2_2x.log")"
rm -f "$OUT"/sp/*.pt  # the log-probs are in gap.json's numbers; the rest is in the logs
""", 592, "bench/results/h200.md",
          "Ulysses SP2 against SP1 on the same 4 rows of SEQ tokens (bf16 log-prob gap, pass and update time, peak "
          "memory), then SP2 at twice the length (nvidia-h200-x2)", gpus=2),
    Stage("hsdp-x4", ("install-gdn", "peak"), r"""
mkdir -p "$OUT/hsdp"
for job in "hsdp 2 300" "full 4 540"; do
  read -r name size until <<< "$job"
  PYTHONPATH=$FLA_PATH timeout -s ABRT "$(left "$until")" torchrun --standalone --nproc_per_node=4 \
    bench/gpu/sp_gap.py run --sp 1 --fsdp-size "$size" --rows 16 --seq-len "${SEQ:-4096}" \
    --out "$OUT/hsdp/$name.pt" > "$LOGS/$name.log" 2>&1
  elapsed "$name (exit $?): $(grep '^sp ' "$LOGS/$name.log")"
done
PYTHONPATH=$BASE python3 bench/gpu/sp_gap.py compare "$OUT/hsdp/full.pt" "$OUT/hsdp/hsdp.pt" --out "$OUT/hsdp/gap.json"
rm -f "$OUT"/hsdp/*.pt
""", 592, "bench/results/h200.md",
          "HSDP (fsdp_size 2) against full sharding (fsdp_size 4) on 16 rows: step time, memory, log-prob gap "
          "(nvidia-h200-x4)", gpus=4),
    Stage("split-x2", ("install-base", "peak"), r"""
mkdir -p "$OUT/split"
for job in "s0 0 300" "s1 1 575"; do
  read -r name k until <<< "$job"
  PYTHONPATH=$TORCH_PATH CUDA_VISIBLE_DEVICES=0,1 $G qwen35rl --out "$OUT/split/$name.json" --run-dir "$RUNS/$name" \
    --devices 2 --steps 4 --peak-tflops "$PEAK" --timeout "$(left "$until")" -- placement=split \
    placement.rollout_devices=1 "algorithm.max_staleness=$k" > "$LOGS/split-$name.log" 2>&1
  elapsed "split staleness $k: $(grep -c '\[qwen35rl\] step' "$LOGS/split-$name.log") steps"
  cp "$RUNS/$name/metrics.jsonl" "$OUT/split/$name-metrics.jsonl" 2>/dev/null
  rm -rf "$RUNS/$name"
done
""", 592, "bench/results/h200.md",
          "placement=split (GPU 1 generates, GPU 0 trains), max_staleness 0 then 1, 4 steps each through the CLI "
          "with Ray and torch GDN: step time, tokens/s, weight sync, each pool's timeline (nvidia-h200-x2)", gpus=2),
    Stage("megatron-x2-numerics", ("install-mcore", "peak"), r"""
mkdir -p "$OUT/megatron-x2"
export PYTHONFAULTHANDLER=1
PYTHONPATH=$MCORE_PATH timeout -s ABRT "$(left 280)" torchrun --standalone --nproc_per_node=2 \
  bench/gpu/megatron_numerics.py --steps 3 --models dense_vl --layouts tp2,pp2 --peak-tflops "$PEAK" \
  --out "$OUT/megatron-x2/numerics_dense_vl.json" > "$LOGS/numerics_dense_vl.log" 2>&1
elapsed "dense VL numerics (exit $?)"
PYTHONPATH=$MCORE_PATH timeout -s ABRT "$(left 575)" torchrun --standalone --nproc_per_node=2 \
  bench/gpu/megatron_numerics.py --steps 3 --models moe_vl --layouts ep2,tp2ep2 --rows 4 --peak-tflops "$PEAK" \
  --out "$OUT/megatron-x2/numerics_moe_vl.json" > "$LOGS/numerics_moe_vl.log" 2>&1
elapsed "MoE VL numerics (exit $?)"
""", 592, "bench/results/megatron_h200.md",
          "VL log-probs against transformers' VL model in bf16: dense (0.8B, 4 layers) at TP2 and PP2, MoE "
          "(35B-A3B shapes, 4 layers, 64 experts) at EP2 and TP2 + EP2 (nvidia-h200-x2)", gpus=2),
    Stage("megatron-x2-cli", ("install-base", "peak"), r"""
# geo3k-style images (synthetic drawings); a reward with spread (bench/gpu/hash_reward.py): the random-init policy
# never earns geo3k's math reward, so its advantages, loss and gradient would all be 0
mkdir -p "$OUT/megatron-x2"
PYTHONPATH=$BASE python3 -c "from pathlib import Path; from tests.runtime.geo3k_fixture import write_geo3k
write_geo3k(Path('/tmp/geo3k/train.parquet'), 32); write_geo3k(Path('/tmp/geo3k/test.parquet'), 8, seed=1)" \
  || { echo "geo3k fixture failed"; exit 1; }
for job in "vl_tp2 qwen3_5_0_8b 290 parallelism.tp=2" "vl_ep2 qwen3_5_35b_a3b 575 parallelism.ep=2"; do
  read -r name model until layout <<< "$job"
  PYTHONPATH=$MCORE_PATH CUDA_VISIBLE_DEVICES=0,1 $G qwen35rl --out "$OUT/megatron-x2/$name.json" \
    --run-dir "$RUNS/$name" --model "$model" --backend megatron --data geo3k --devices 2 --steps 3 --prompts 8 \
    --prompt-len 384 --response-len 256 --micro 8 --peak-tflops "$PEAK" --timeout "$(left "$until")" -- \
    model.num_hidden_layers=4 backend.megatron_core_version=0.19.2 \
    +backend.transformer_overrides.deterministic_mode=true \
    rollout.n=4 "data.train_files=[/tmp/geo3k/train.parquet]" \
    "data.val_files=[/tmp/geo3k/test.parquet]" data.reward=bench.gpu.hash_reward:text_hash "$layout" \
    $( [ "$model" = qwen3_5_35b_a3b ] && echo model.num_experts=64 ) > "$LOGS/$name.log" 2>&1
  elapsed "$name: $(grep -c '\[qwen35rl\] step' "$LOGS/$name.log") steps"
  cp "$RUNS/$name/metrics.jsonl" "$OUT/megatron-x2/$name-metrics.jsonl" 2>/dev/null
  rm -rf "$RUNS/$name"
  plan_of "$OUT/megatron-x2/$name.json" "$OUT/megatron-x2/plan-$name.json" "$LOGS/plan-$name.log"
done
""", 592, "bench/results/megatron_h200.md",
          "3 GRPO steps through the CLI (Ray) on geo3k-style images, dense at TP2, MoE at EP2, and the plan's "
          "estimate of each (nvidia-h200-x2)", gpus=2),
]
BY_NAME: Dict[str, Stage] = {s.name: s for s in STAGES}


def order(names: Sequence[str]) -> List[Stage]:
    """The stages named, each after what it needs; every stage once."""
    seen: Dict[str, Stage] = {}

    def visit(name: str) -> None:
        if name in seen:
            return
        for need in BY_NAME[name].needs:
            if not carried(need):
                visit(need)
        seen[name] = BY_NAME[name]

    for name in names:
        visit(name)
    return list(seen.values())


def show(stage: Stage) -> str:
    """The command as it would run: the snippet, the argv, or the callable's name."""
    if isinstance(stage.command, str):
        return stage.command.strip()
    if callable(stage.command):
        return f"(python) {stage.command.__name__}: {stage.command.__doc__}"
    return shlex.join(stage.command)


def table() -> str:
    rows = [("stage", "gpus", "limit", "needs", "records", "what it does")]
    rows += [(s.name, str(s.gpus), f"{s.limit_s} s", " ".join(s.needs) or "-", s.records, s.doc) for s in STAGES]
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:5], widths)) + "  " + r[5] for r in rows)


def run_stage(stage: Stage, call: Call) -> int:
    logs = LOGS_ROOT / stage.name
    logs.mkdir(parents=True, exist_ok=True)
    call.env["LOGS"] = str(logs)
    if stage.done is not None and stage.done():
        call.elapsed(f"{stage.name}: already there")
        return 0
    missing = [n for n in stage.needs if carried(n) and not (ROOT / n).is_dir()]
    if missing:
        print(f"stage {stage.name} needs {' '.join(missing)}: carry it with the call", flush=True)
        return 1
    limit = min(stage.limit_s, call.deadline - time.time())
    if limit <= 0:
        print(f"stage {stage.name}: no time left in the call", flush=True)
        return 124
    call.stage_end = time.time() + limit
    if callable(stage.command):
        try:
            return stage.command(call)
        except Exception as e:  # a missing result file, a job past the call's end
            print(f"stage {stage.name}: {type(e).__name__}: {e}", flush=True)
            return 1
    argv = ["bash", "-c", PRELUDE + stage.command] if isinstance(stage.command, str) else list(stage.command)
    # its own process group, so that a stage past its limit goes with the jobs it started (those under `timeout`
    # are groups of their own and end by their own limits, which lie within the call)
    proc = subprocess.Popen(argv, cwd=ROOT, env=call.env, start_new_session=True)
    try:
        return proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        call.elapsed(f"{stage.name}: past its limit of {int(limit)} s, stopped")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return 124


RESULT_SUFFIXES = {".json", ".jsonl", ".md", ".txt", ".log"}
SUMMARY_LINE = re.compile(r"\[qwen35rl\] step|trl step \{|^memory |^decode bench|^\| |Error|error:")


def summarize(call: Call, stages: Sequence[Stage], tag: str) -> None:
    """A call brings back only a dozen files or so: the results travel as one archive (unpack it into the results
    dir), the logs as another. Triton's autotuning results (1 KB JSON files, no binaries), kept in .kcache/ and
    carried in, spare the next machine the autotuning of fla's kernels, most of a first step's compile time."""
    dirs = [LOGS_ROOT / s.name for s in stages if (LOGS_ROOT / s.name).is_dir()]
    with tarfile.open(call.out / f"logs-{tag}.tar.gz", "w:gz") as tar:
        for d in dirs:
            tar.add(d, arcname=d.name)
    results = sorted(p for p in call.out.rglob("*") if p.is_file() and p.suffix in RESULT_SUFFIXES)
    with tarfile.open(call.out / f"results-{tag}.tar.gz", "w:gz") as tar:
        for p in results:
            tar.add(p, arcname=str(p.relative_to(call.out)))
    for p in results:
        p.unlink()
    tuned = sorted(Path(TRITON_CACHE).rglob("*.autotune.json")) if Path(TRITON_CACHE).is_dir() else []
    if tuned:
        with tarfile.open(call.out / "triton-autotune.tar.gz", "w:gz") as tar:
            for p in tuned:
                tar.add(p, arcname=str(p.relative_to(TRITON_CACHE)))
    lines = [line.rstrip("\n")[:300] for d in dirs for log in sorted(d.glob("*.log"))
             for line in log.read_text(errors="replace").splitlines() if SUMMARY_LINE.search(line)]
    print("\n".join(lines[-60:]), flush=True)


def start_call(t0: float, call_s: int) -> Call:
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    Path(TRITON_CACHE).mkdir(parents=True, exist_ok=True)
    for cache in KCACHES:
        if (ROOT / cache).is_file():
            subprocess.run(["tar", "xzf", str(ROOT / cache), "-C", TRITON_CACHE], check=False)
    # a RAM-backed run directory keeps the end-of-run checkpoint (fp32 weights + Adam, 12 GB) off the disk's clock
    runs = "/tmp/runs"
    if Path("/dev/shm").is_dir() and shutil.disk_usage("/dev/shm").free // 2**30 > 60:
        runs = "/dev/shm/runs"
    Path(runs).mkdir(parents=True, exist_ok=True)
    try:
        gpus = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.count("\n")
    except FileNotFoundError:
        gpus = 0
    env = {**os.environ, **ENV, "OUT": str(out), "RUNS": runs, "NGPU": str(gpus), "T0": str(int(t0))}
    return Call(out=out, t0=t0, deadline=t0 + call_s - SUMMARY_S, ngpu=gpus, env=env)


def main(argv: Optional[Sequence[str]] = None) -> int:
    t0 = time.time()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stages", nargs="*", metavar="STAGE")
    p.add_argument("--list", action="store_true", help="print the table of stages")
    p.add_argument("--dry-run", action="store_true", help="print what would run, run nothing")
    p.add_argument("--call-s", type=int, default=CALL_S, help=f"seconds of the device call (default {CALL_S})")
    args = p.parse_args(argv)
    if args.list:
        print(table())
        return 0
    unknown = [n for n in args.stages if n not in BY_NAME]
    if unknown or not args.stages:
        what = f"unknown stage {', '.join(unknown)}" if unknown else "no stage named"
        print(f"stages.py: {what}; known stages: {' '.join(BY_NAME)}", file=sys.stderr)
        return 2
    stages = order(args.stages)
    if args.dry_run:
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in ENV.items()))
        for s in stages:
            print(f"== {s.name} (limit {s.limit_s} s; needs {' '.join(s.needs) or '-'}; {s.gpus} GPU)")
            print(show(s))
        return 0
    call = start_call(t0, args.call_s)
    for s in stages:  # a multi-GPU stage on a smaller machine stops before installing anything
        if s.gpus > 1 and call.ngpu < s.gpus:
            print(f"{s.name} needs {s.gpus} GPUs (nvidia-h200-x{s.gpus})", flush=True)
            return 2
    # a stage that others need (an install, the peak) stops the call when it fails; a measuring stage's exit code
    # (often its last grep's) only becomes the call's
    needed = {n for s in stages for n in s.needs}
    worst = 0
    for s in stages:
        call.elapsed(f"stage {s.name}")
        rc = run_stage(s, call)
        worst = worst or rc
        if rc != 0 and s.name in needed:
            call.elapsed(f"stage {s.name} failed (exit {rc}); the stages that need it do not run")
            break
    summarize(call, stages, "+".join(args.stages))
    call.elapsed("all done")
    return worst


if __name__ == "__main__":
    sys.exit(main())
