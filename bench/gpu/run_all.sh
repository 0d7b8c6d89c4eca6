#!/usr/bin/env bash
# The H200 proof on a 2-GPU machine (nvidia-h200-x2), one stage per device call; results in $OUT.
# bench/results/h200.md and megatron_h200.md have what each stage gave and how long it took.
#
#   bash bench/gpu/run_all.sh torch     (carry .whl .whl-x; ~8.5 min; ran 2026-11-30)
#       transformers' torch GDN code on both sides: GPU 0 qwen35rl GRPO through its CLI, GPU 1 at the same time
#       TRL's GRPOTrainer on the same workload; then the Megatron engine's numerics against transformers
#   bash bench/gpu/run_all.sh fla       (carry .whl-gdn .whl-x; no Ray: qwen35rl runs trainer.launcher=local; ~9.5 min;
#                                        ran 2026-11-30b on a 1-GPU machine, where its jobs run one after another)
#       the same pair with flash-linear-attention + TileLang on both sides; then the memory calibration with fla
#       (GPU 0) next to the qwen35rl run without fla but with trainer.launcher=local (GPU 1: the launcher's own
#       effect against stage torch)
#   bash bench/gpu/run_all.sh megatron  (carry .whl .whl-x; ~9 min; ran 2026-11-30b: only the MoE run got its steps)
#       GRPO with backend=megatron through the CLI: dense at PP2 and TP2, MoE at TP2 + EP2
#   bash bench/gpu/run_all.sh megatron-dense  (carry .whl .whl-x; ~6 min; ran 2026-11-30b)
#       the dense Megatron GRPO runs with 8 prompts x 4, so that the first step (compilation) fits
#   bash bench/gpu/run_all.sh packing         (carry .whl-gdn .whl-x .kcache; ~9 min; one GPU is enough)
#       fla + TileLang: bench/gpu/packing.py (padded, packed, and packed micro batches filled by tokens, with spread
#       response lengths), then the GPU tests of packing
#   bash bench/gpu/run_all.sh profile         (carry .whl-gdn .whl-x .kcache; ~9 min; one GPU is enough)
#       fla + TileLang: the memory job with kernel profiles of an update, a reference pass and a generation, and the
#       decode benchmark, on its first shape; then the other memory shapes in what is left of the call
#   bash bench/gpu/run_all.sh phases          (carry .whl-gdn .whl-x .kcache; ~9.5 min; one GPU)
#       fla + TileLang: bench/gpu/train_phases.py (the FSDP engine's reference pass and update, kernel change by
#       kernel change, all-at-cap and realistic lengths, kernel profiles), then the decode benchmark
#   bash bench/gpu/run_all.sh conv-cap          (carry .whl-gdn .whl-x; ~9.5 min; one GPU)
#       the GPU tests of the short convolution (compiled against eager) and of packing, then compare-cap
#   bash bench/gpu/run_all.sh conv-profile      (carry .whl-gdn .whl-x; ~8 min; one GPU)
#       the CUDA tests of short_conv, bench/gpu/conv_bench.py (the convolution alone), kernel profiles of the
#       training phases with the convolution eager and compiled, then the decode benchmark
#   bash bench/gpu/run_all.sh final-cap         (carry .whl-gdn .whl-x; LIMIT=seconds of the call, default 430)
#       conv_bench.py, then qwen35rl (175 s, three steps) and TRL on the all-at-cap workload; the matmul peak of an
#       earlier call (PEAK)
#   bash bench/gpu/run_all.sh decode-cap        (carry .whl-gdn .whl-x .kcache; ~9.5 min; one GPU)
#       the all-at-cap pair with rollout.compile_decode=true (qwen35rl 235 s, then TRL), then the 0.8B phases with
#       the norms and MLPs compiled (train_phases.py --variants head,regions) on both workloads
#   bash bench/gpu/run_all.sh budget            (carry .whl-gdn .whl-x .kcache; ~9.5 min; one GPU; TOKENS=24576)
#       the realistic pair with micro batches filled to TOKENS tokens and the compiled layers (qwen35rl 230 s, then
#       TRL), then the 0.8B phases with that budget, compiled layers off and on, and the host-side profile
#   bash bench/gpu/run_all.sh budget-4b         (the same carry; ~8 min; MICRO=8)
#       the 4B phases with backend.compile_layers=true at micro MICRO, profiled (kernels and host time)
#   bash bench/gpu/run_all.sh qknorm-pair       (carry .whl-gdn .whl-x .kcache; ~8 min; one GPU; TOKENS=24576;
#                                                ran 2026-12-04)
#       the CUDA tests of the GDN training forward (q/k normalised by the convolution), then the realistic pair of
#       stage budget with 5 qwen35rl steps, dynamo's recompiles logged
#   bash bench/gpu/run_all.sh qknorm-phases     (the same carry, right after qknorm-pair; ~5.5 min; MICRO=8; ran
#                                                2026-12-04)
#       the 0.8B phases with the token budget and compiled layers (profiled), then the 4B at micro MICRO
#   bash bench/gpu/run_all.sh gdn-check         (the same carry; ~9.5 min; one GPU)
#       the CUDA tests of the GDN forward (both fla paths) and convolution, then the GDN q/k norm and gates A/B in
#       one call (train_phases variants regions,flanorm,fused,qknorm): 0.8B realistic rows with the token budget,
#       then the 4B at micro 8 with compiled layers
#   bash bench/gpu/run_all.sh megatron-phases   (carry .whl-gdn .whl-x .kcache; ~9 min; one GPU; MODEL, MICRO; TESTS=1
#                                                first the CUDA tests; FSDP=0 without the FSDP side; ran 2026-12-04)
#       bench/gpu/train_phases.py with backend=megatron (megatron-core 0.19.2 from .whl-x, fla + TileLang, no
#       offload) on the all-at-cap rows: reference pass and update, then one update under the allocator's history
#       (what holds the memory at its peak); then the FSDP engine on the same rows
#   bash bench/gpu/run_all.sh compare-cap       (carry .whl-gdn .whl-x; ~9.5 min; one GPU)
#   bash bench/gpu/run_all.sh compare-realistic (the same carry, back to back with compare-cap: its caches are warm)
#       one workload per call: qwen35rl through its CLI (no Ray, fixed micro batches of 16 as TRL's) then TRL's
#       GRPOTrainer, 3 steps each, the call's time split between them; compare-realistic then measures the 4B
#       architecture's training phases (bench/gpu/train_phases.py, micro 4, the default engine) in what is left
#   bash bench/gpu/run_all.sh megatron-tp1      (carry .whl alone, and bench/gpu/kcache; one GPU; no Ray)
#       GRPO with backend=megatron at TP1 on the comparison's all-at-cap workload (0.8B, all layers, fla, micro 16, no
#       offload: everything stays on the GPU as with FSDP):
#       the update MFU next to the FSDP engine's, and the plan's estimate of the same config
#   bash bench/gpu/run_all.sh phases-4b       (carry .whl-gdn .whl-x; ~9 min; one GPU)
#       the all-at-cap CLI run of compare-cap alone, with its peak memory per phase (perf/max_memory_allocated_gb/*)
#       against the plan's estimate, then the 4B architecture's reference pass and update with kernel profiles
#   Multi-GPU stages (not run yet: only nvidia-h200 was lent so far):
#   bash bench/gpu/run_all.sh sp-x2           (nvidia-h200-x2; carry .whl-gdn .whl-x; ~9 min)
#       bench/gpu/sp_gap.py: Ulysses SP2 against SP1 on the same 4 rows of $SEQ tokens (default 16384): log-prob gap
#       in bf16, log-prob pass and update time, peak memory; then SP2 at twice the length
#   bash bench/gpu/run_all.sh hsdp-x4         (nvidia-h200-x4; carry .whl-gdn .whl-x; ~9 min)
#       HSDP (fsdp_size 2) against full sharding (fsdp_size 4) on 16 rows: step time, memory, log-prob gap
#   bash bench/gpu/run_all.sh split-x2        (nvidia-h200-x2; carry .whl .whl-x; ~9 min; Ray, torch GDN)
#       placement=split placement.rollout_devices=1, algorithm.max_staleness 0 then 1, 4 steps each through the
#       CLI: step time, tokens/s, timing_s/sync_weights and each pool's busy timeline (timeline.jsonl)
#   bash bench/gpu/run_all.sh megatron-x2-numerics (nvidia-h200-x2; carry .whl; ~9 min)
#       VL log-probs against transformers' VL model in bf16: dense (0.8B, 4 layers) at TP2 and PP2, MoE (35B-A3B
#       shapes, 4 layers, 64 experts) at EP2 and TP2 + EP2 (megatron-core's torch GDN recurrence, deterministic)
#   bash bench/gpu/run_all.sh megatron-x2-cli (nvidia-h200-x2; carry .whl .whl-x, Ray; ~9 min)
#       3 GRPO steps through the CLI on geo3k-style images: dense at TP2, MoE at EP2; the plan's estimate of each
#   bash bench/gpu/run_all.sh alloc-4b        (carry .whl-gdn .whl-x; ~8 min; one GPU)
#       the 4B phases at micro 4 (108.6 of 110.6 GiB) with the default allocator against expandable segments, then
#       with checkpointing at micro 8; allocator retries per phase
#   bash bench/gpu/run_all.sh megatron-tp1-fla (carry .whl; right after phases-4b, whose /tmp/site-gdn it uses)
#       megatron-tp1 with fla + TileLang, so that the GDN backward runs on fla's kernels: 0.8B, then 4B at micro 2
#   bash bench/gpu/run_all.sh profile-head    (carry .whl-gdn .whl-x; LIMIT=seconds caps the call; one GPU)
#       kernel profiles of the reference pass and the update with the compiled head on the all-at-cap rows
#   bash bench/gpu/run_all.sh decode-only     (carry .whl-gdn .whl-x; ~2.5 min; ran 2026-12-02b)
#       the decode benchmark alone: eager, CUDA graph, transformers generate, compiled + graph last
#   bash bench/gpu/run_all.sh moe-numerics    (carry .whl .whl-x; ~8 min)
#       the MoE model's log-probs against transformers at EP2 and TP1, with the whole call's time
#   bash bench/gpu/run_all.sh scale     (carry .whl .whl-x; ~5 min; ran 2026-11-30 with the Megatron jobs)
#       qwen35rl on both GPUs (FSDP over NCCL), twice the prompts
#   bash bench/gpu/run_all.sh megatron-vl     (carry .whl alone; ~9 min; one GPU is enough; no Ray)
#       Qwen3.5-VL on the Megatron engine: its log-probs at TP1 against transformers' VL model (bf16 and fp32) on a
#       batch with one image per row, GRPO steps on it, export names; then one GRPO run on geo3k-style image data
#       through the CLI (trainer.launcher=local) and the plan's estimate of the same config (ran 2026-12-01: the
#       numerics finished, the CLI run failed in the engine, see megatron_h200.md)
#   bash bench/gpu/run_all.sh megatron-vl-cli (carry .whl alone, and .kcache; ~5 min; one GPU)
#   bash bench/gpu/run_all.sh megatron-nofla  (carry .whl alone; one GPU; megatron-core without fla: the engine's
#       own fallback to megatron-core's torch GDN recurrence, no overrides)
#       that CLI run alone, three steps (2026-12-01, first call: step 1 finished through a stop-gap for the vision
#       inputs' device, step 2 failed in the engine's host offload; both fixed in the engine since)
#
# Carry .kcache as well where it exists: Triton's autotuning results that an earlier call brought back
# ($OUT/triton-autotune.tar.gz, copied to .kcache/), so that fla's kernels compile without autotuning again.
# Installs (no network there): /tmp/site (Ray, Hydra, TRL, datasets), /tmp/site-fla (flash-linear-attention
# alone, for megatron-core), /tmp/site-mcore (megatron-core 0.19.2), /tmp/site-gdn (fla + TileLang). Which of them
# a job sees is its PYTHONPATH: without fla, transformers runs its torch GDN fallback.
# The hf rollout's decode step runs as a CUDA graph (rollout.cuda_graph, on by default). Every job has a time limit;
# JSON results are written as they come, so a job cut short still leaves its finished steps. fla's Triton kernels
# compile and autotune on first use per shape (30 s and more): the first step of a run pays it, steady-state
# numbers leave it out.
set -u
stage=${1:?usage: run_all.sh megatron-phases|gdn-check|qknorm-pair|qknorm-phases|budget|budget-4b|decode-cap|final-cap|conv-cap|conv-profile|sp-x2|hsdp-x4|split-x2|megatron-x2-numerics|megatron-x2-cli|alloc-4b|phases-4b|megatron-tp1-fla|megatron-tp1|profile-head|compare-cap|compare-realistic|decode-only|phases|torch|fla|megatron|megatron-dense|moe-numerics|packing|profile|scale|megatron-vl|megatron-vl-cli|megatron-nofla}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast
export PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false
export TRITON_CACHE_DIR=/tmp/kcache/triton TILELANG_CACHE_DIR=/tmp/kcache/tilelang  # kept while the machine is warm
OUT=${OUT:-/tmp/out}
LOGS=/tmp/logs/$stage
mkdir -p "$OUT" "$LOGS" /tmp/kcache
# Triton's autotuning results of earlier calls: the committed ones (bench/gpu/kcache/), then a newer local copy
for cache in bench/gpu/kcache/triton-autotune.tar.gz .kcache/triton-autotune.tar.gz; do
  [ -f "$cache" ] && mkdir -p "$TRITON_CACHE_DIR" && tar xzf "$cache" -C "$TRITON_CACHE_DIR"
done
BASE=/tmp/site:$PWD
TORCH_PATH=$BASE                                   # transformers' torch GDN fallback
FLA_PATH=/tmp/site-gdn:$BASE                       # fla + TileLang
MCORE_PATH=/tmp/site-mcore:/tmp/site-fla:$BASE     # megatron-core (its GDN module imports fla)
G="python3 bench/gpu/grpo_h200.py"
t0=$(date +%s)
NGPU=$(nvidia-smi -L | wc -l)
left() { echo $(( ${1:-570} - ($(date +%s) - t0) )); }  # seconds left of a call's budget (default 570)
elapsed() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
env_info() {
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  for p in "$TORCH_PATH" "$FLA_PATH" "$MCORE_PATH"; do
    PYTHONPATH=$p python3 -c 'import importlib.util as u, importlib.metadata as md, torch, transformers, triton
def v(d):
    try: return md.version(d)
    except Exception: return "-"
print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, "triton",
      triton.__version__, *[f"{d} {v(d)}" for d in ("ray", "trl", "hydra-core", "flash-linear-attention", "tilelang", "megatron-core")])' 2>&1 | tail -1
  done
}
# a RAM-backed run directory keeps the end-of-run checkpoint (fp32 weights + Adam, 12 GB) off the disk's clock
RUNS=/tmp/runs
[ "$(df --output=avail -B1G /dev/shm 2>/dev/null | tail -1)" -gt 60 ] 2>/dev/null && RUNS=/dev/shm/runs
mkdir -p "$RUNS"
peaks() {
  local i
  for ((i = 0; i < NGPU; i++)); do
    PYTHONPATH=$BASE CUDA_VISIBLE_DEVICES=$i $G peak --out "$LOGS/peak$i.json" > /dev/null 2>&1 &
  done
  wait
  python3 -c "import json; print(json.dumps([json.load(open('$LOGS/peak%d.json' % i)) for i in range($NGPU)]))" > "$OUT/peak.json"
  PEAK=$(python3 -c "import json; print(round(json.load(open('$LOGS/peak0.json'))['bf16_matmul_tflops'], 1))")
  elapsed "bf16 matmul peak $PEAK TFLOP/s (GPU 0); $(cat "$OUT/peak.json")"
}
# qwen35rl (GPU 0) next to TRL (GPU 1) on the same workload, or one after the other on GPU 0 of a 1-GPU machine;
# $1: label (torch | fla), $2: PYTHONPATH, the rest: more qwen35rl overrides
pair() {
  local label=$1 path=$2; shift 2
  # qwen35rl's first step compiles fla's kernels (143 s on 2026-11-30b; TRL's took 44 s): 3 steps need ~230 s
  local trl_gpu=1 q_limit=250 trl_limit=220
  [ "$NGPU" -ge 2 ] || { trl_gpu=0; trl_limit=170; }
  mkdir -p "$OUT/$label"
  cp "$OUT/peak.json" "$OUT/$label/peak.json"
  q_job() {
    PYTHONPATH=$path CUDA_VISIBLE_DEVICES=0 $G qwen35rl --out "$OUT/$label/q1.json" --run-dir "$RUNS/q1-$label" \
      --steps 3 --peak-tflops "$PEAK" --timeout $q_limit -- "$@" > "$LOGS/q1-$label.log" 2>&1
    elapsed "qwen35rl 1 GPU ($label) done: $(grep -c '\[qwen35rl\] step' "$LOGS/q1-$label.log") steps"
    rm -rf "$RUNS/q1-$label"
  }
  trl_job() {
    PYTHONPATH=$path CUDA_VISIBLE_DEVICES=$trl_gpu timeout $trl_limit $G trl --out "$OUT/$label/trl.json" \
      --work-dir "/tmp/trl-$label" --steps 3 > "$LOGS/trl-$label.log" 2>&1
    elapsed "TRL ($label) done: $(grep -c 'trl step' "$LOGS/trl-$label.log") steps"
  }
  if [ "$NGPU" -ge 2 ]; then q_job "$@" & trl_job & wait; else q_job "$@"; trl_job; fi
}
# GRPO with backend=megatron through the CLI; $1: name, $2: model, $3: time limit (s), then options of grpo_h200.py
# qwen35rl, `--`, and the overrides
megatron_grpo() {
  local name=$1 model=$2 limit=$3 opts=(); shift 3
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do opts+=("$1"); shift; done
  [ $# -gt 0 ] && shift
  PYTHONPATH=$MCORE_PATH CUDA_VISIBLE_DEVICES=0,1 $G qwen35rl --out "$OUT/megatron/$name.json" --run-dir "$RUNS/$name" \
    --model "$model" --backend megatron --devices 2 --steps 3 --response-len 256 --micro 8 --peak-tflops "$PEAK" \
    --timeout "$limit" "${opts[@]}" -- model.num_hidden_layers=4 backend.megatron_core_version=0.19.2 \
    +backend.transformer_overrides.deterministic_mode=true "$@" \
    > "$LOGS/$name.log" 2>&1
  elapsed "megatron GRPO $name done: $(grep -c '\[qwen35rl\] step' "$LOGS/$name.log") steps"
  rm -rf "$RUNS/$name"
}
# the plan's JSON (stdout to $2, stderr to $3) for the overrides a grpo_h200.py run recorded in $1; its exit code
plan_of() {
  PYTHONPATH=$BASE python3 -c "import json, subprocess, sys
o = json.load(open('$1'))['overrides']
sys.exit(subprocess.run([sys.executable, '-m', 'qwen35rl.cli.plan', *o, 'format=json']).returncode)" > "$2" 2> "$3"
}
# GRPO on geo3k-style images (a parquet of synthetic drawings, written here) through the CLI with backend=megatron on
# one GPU, no Ray, then the plan's estimate for the same overrides (as the run recorded them); $1: the module that
# runs the CLI (bench.gpu.vl_device_shim: with the engine's device stop-gap), $2: time limit (s), $3: steps. A reward with spread
# (bench/gpu/hash_reward.py): the random-init policy never earns geo3k's math reward, so its advantages, loss and
# gradient would all be 0
vl_cli() {
  local entry=$1 limit=$2 steps=$3
  mkdir -p "$OUT/megatron-vl"
  PYTHONPATH=$BASE python3 -c "from pathlib import Path; from tests.runtime.geo3k_fixture import write_geo3k
write_geo3k(Path('/tmp/geo3k/train.parquet'), 32); write_geo3k(Path('/tmp/geo3k/test.parquet'), 8, seed=1)" \
    || { echo "geo3k fixture failed"; exit 1; }
  PYTHONPATH=$MCORE_PATH CUDA_VISIBLE_DEVICES=0 $G qwen35rl --entry "$entry" --out "$OUT/megatron-vl/grpo_vl.json" \
    --run-dir "$RUNS/grpo_vl" --model qwen3_5_0_8b --backend megatron --data geo3k --devices 1 --steps "$steps" --prompts 8 \
    --prompt-len 384 --response-len 256 --micro 8 --peak-tflops "$PEAK" --timeout "$limit" -- model.num_hidden_layers=4 \
    backend.megatron_core_version=0.19.2 +backend.transformer_overrides.deterministic_mode=true rollout.n=4 \
    trainer.launcher=local "data.train_files=[/tmp/geo3k/train.parquet]" "data.val_files=[/tmp/geo3k/test.parquet]" \
    data.reward=bench.gpu.hash_reward:text_hash > "$LOGS/grpo_vl.log" 2>&1
  elapsed "megatron VL GRPO (CLI, $entry) done: $(grep -c '\[qwen35rl\] step' "$LOGS/grpo_vl.log") steps"
  rm -rf "$RUNS/grpo_vl"
  plan_of "$OUT/megatron-vl/grpo_vl.json" "$OUT/megatron-vl/plan_vl.json" "$LOGS/plan_vl.log"
  elapsed "plan of the CLI run (exit $?)"
}
# one workload ($1: cap | realistic) of the comparison: qwen35rl (CLI, no Ray) then TRL on GPU 0, with the same fixed
# micro batches; the time left of the call is split $2 percent to qwen35rl (its first step compiles more), the rest
# to TRL, leaving $3 seconds for what follows
compare_one() {
  local wl=$1 q_share=$2 after=$3
  mkdir -p "$OUT/$wl" && cp "$OUT/peak.json" "$OUT/$wl/"
  local budget=$(( $(left 590) - after ))
  PYTHONPATH=$FLA_PATH CUDA_VISIBLE_DEVICES=0 $G qwen35rl --lengths "$wl" --out "$OUT/$wl/q1.json" \
    --run-dir "$RUNS/q1-$wl" --steps 3 --peak-tflops "$PEAK" --timeout $(( budget * q_share / 100 )) -- \
    trainer.launcher=local > "$LOGS/q1-$wl.log" 2>&1
  elapsed "qwen35rl ($wl): $(grep -c '\[qwen35rl\] step' "$LOGS/q1-$wl.log") steps"
  cp "$RUNS/q1-$wl/metrics.jsonl" "$OUT/$wl/q1-metrics.jsonl" 2>/dev/null
  rm -rf "$RUNS/q1-$wl"
  PYTHONPATH=$FLA_PATH CUDA_VISIBLE_DEVICES=0 timeout -s ABRT "$(( $(left 590) - after ))" \
    $G trl --lengths "$wl" --out "$OUT/$wl/trl.json" --work-dir "/tmp/trl-$wl" --steps 3 > "$LOGS/trl-$wl.log" 2>&1
  elapsed "TRL ($wl): $(grep -c 'trl step' "$LOGS/trl-$wl.log") steps"
  PYTHONPATH=$BASE python3 bench/gpu/grpo_h200.py report "$OUT/$wl" > "$OUT/$wl/report.md" 2>&1
  grep -A20 "qwen35rl / TRL" "$OUT/$wl/report.md"
}
# $1: target directory, the rest: wheel directories (the log in $LOGS/install.log, shown when it fails)
install_into() {
  SITE=$1 bash bench/gpu/install-wheels.sh "${@:2}" >> "$LOGS/install.log" 2>&1 || { cat "$LOGS/install.log"; exit 1; }
}
# .whl + .whl-x: Ray, Hydra, TRL into /tmp/site; fla alone into /tmp/site-fla; megatron-core into /tmp/site-mcore
install_base() {
  rm -rf /tmp/w /tmp/site /tmp/site-fla /tmp/site-mcore && mkdir -p /tmp/w/base /tmp/w/fla /tmp/w/mcore
  cp .whl/* /tmp/w/base/ && cp -f .whl-x/* /tmp/w/base/ \
    && mv /tmp/w/base/fla_core-* /tmp/w/base/flash_linear_attention-* /tmp/w/fla/ \
    && mv /tmp/w/base/megatron_core-* /tmp/w/mcore/ || { echo "wheel split failed"; exit 1; }
  install_into /tmp/site /tmp/w/base && install_into /tmp/site-fla /tmp/w/fla && install_into /tmp/site-mcore /tmp/w/mcore
  PYTHONPATH=$TORCH_PATH python3 -c "import importlib.util as u, sys; sys.exit(u.find_spec('fla') is not None)" \
    || { echo "fla is importable from $TORCH_PATH: the torch-GDN runs would not be"; exit 1; }
}
# .whl alone (pack-wheels.sh megatron-core==0.19.2), without Ray (its archive stays packed: trainer.launcher=local):
# Hydra into /tmp/site, fla alone into /tmp/site-fla, megatron-core into /tmp/site-mcore
install_mcore() {
  rm -rf /tmp/w /tmp/site /tmp/site-fla /tmp/site-mcore && mkdir -p /tmp/w/base /tmp/w/fla /tmp/w/mcore
  cp .whl/*.whl /tmp/w/base/ \
    && mv /tmp/w/base/fla_core-* /tmp/w/base/flash_linear_attention-* /tmp/w/fla/ \
    && mv /tmp/w/base/megatron_core-* /tmp/w/mcore/ || { echo "wheel split failed"; exit 1; }
  install_into /tmp/site /tmp/w/base && install_into /tmp/site-fla /tmp/w/fla && install_into /tmp/site-mcore /tmp/w/mcore
}
# megatron-core alone from .whl-x into /tmp/site-mcore, next to install_gdn's fla + TileLang (MCORE_GDN_PATH)
install_mcore_x() {
  rm -rf /tmp/w/mcore /tmp/site-mcore && mkdir -p /tmp/w/mcore && cp .whl-x/megatron_core-* /tmp/w/mcore/ \
    || { echo "no megatron-core wheel in .whl-x"; exit 1; }
  install_into /tmp/site-mcore /tmp/w/mcore
}
MCORE_GDN_PATH=/tmp/site-mcore:/tmp/site-gdn:$BASE  # megatron-core with fla + TileLang
# backend=megatron as the FSDP engine runs on one GPU: everything on the device, the plan's version check on 0.19.2
MEGATRON_SET=(--set backend.megatron_core_version=0.19.2 --set backend.param_offload=false
              --set backend.grad_offload=false --set backend.optimizer_offload=false
              --set backend.optimizer_cpu_offload=false)
# .whl-gdn + .whl-x without megatron-core: Hydra, TRL into /tmp/site; fla + TileLang into /tmp/site-gdn (no Ray: its
# wheels and TileLang's do not fit one call's 64 MiB together)
install_gdn() {
  rm -rf /tmp/w /tmp/site /tmp/site-gdn && mkdir -p /tmp/w/base
  cp .whl-x/* /tmp/w/base/ && rm -f /tmp/w/base/megatron_core-* || { echo "wheel split failed"; exit 1; }
  install_into /tmp/site /tmp/w/base && install_into /tmp/site-gdn .whl-gdn
}
summary() {
  tar czf "$OUT/logs-$stage.tar.gz" -C /tmp/logs "$stage"
  # a call brings back only a dozen files or so: the results travel as one archive (unpack it into the results dir)
  (cd "$OUT" && find . -type f \( -name '*.json' -o -name '*.jsonl' -o -name '*.md' -o -name '*.txt' -o -name '*.log' \) \
    | tar czf "results-$stage.tar.gz" -T - --remove-files)
  # Triton's autotuning results (1 KB JSON files, no binaries): kept in .kcache/ and carried in, they spare the next
  # machine the autotuning of fla's kernels, most of a first step's compile time
  (cd "$TRITON_CACHE_DIR" 2>/dev/null && find . -name '*.autotune.json' | tar czf "$OUT/triton-autotune.tar.gz" -T -)
  grep -h "\[qwen35rl\] step\|trl step {\|^memory \|^decode bench\|^| \|Error\|error:" "$LOGS"/*.log | cut -c1-300 | tail -60
}

case "$stage" in
torch)
  mkdir -p /tmp/w/base /tmp/w/fla /tmp/w/mcore
  install_base
  env_info > "$OUT/env-torch.txt" 2>&1
  elapsed "installed: $(tail -3 "$OUT/env-torch.txt" | tr '\n' ' ')"
  peaks
  pair torch "$TORCH_PATH"
  PYTHONPATH=$MCORE_PATH timeout 290 torchrun --standalone --nproc_per_node=2 bench/gpu/megatron_numerics.py --steps 3 \
    --peak-tflops "$PEAK" --out "$OUT/megatron/numerics.json" > "$LOGS/numerics.log" 2>&1
  elapsed "megatron numerics done (exit $?)"
  ;;
fla)
  install_gdn
  env_info > "$OUT/env-fla.txt" 2>&1
  elapsed "installed: $(tail -3 "$OUT/env-fla.txt" | tr '\n' ' ')"
  peaks
  pair fla "$FLA_PATH" trainer.launcher=local
  mkdir -p "$OUT/torch-local"
  if [ "$NGPU" -ge 2 ]; then
    (
      PYTHONPATH=$FLA_PATH CUDA_VISIBLE_DEVICES=0 timeout "$(left)" $G memory --out "$OUT/fla/memory.json" --profile --decode-bench \
        --decode-tokens 16 > "$LOGS/memory.log" 2>&1
      elapsed "memory calibration (fla) done"
    ) &
    (
      PYTHONPATH=$TORCH_PATH CUDA_VISIBLE_DEVICES=1 $G qwen35rl --out "$OUT/torch-local/q1.json" \
        --run-dir "$RUNS/q1-torch-local" --steps 3 --peak-tflops "$PEAK" --timeout "$(left)" -- trainer.launcher=local \
        > "$LOGS/q1-torch-local.log" 2>&1
      elapsed "qwen35rl torch GDN, launcher local: $(grep -c '\[qwen35rl\] step' "$LOGS/q1-torch-local.log") steps"
    ) &
    wait
  else  # one GPU: the memory calibration in what is left of the call (the MoE numerics: stage moe-numerics)
    PYTHONPATH=$FLA_PATH CUDA_VISIBLE_DEVICES=0 timeout "$(left)" $G memory --out "$OUT/fla/memory.json" \
      --profile --decode-bench --decode-tokens 16 > "$LOGS/memory.log" 2>&1
    elapsed "memory calibration (fla) done (exit $?)"
  fi
  ;;
megatron)
  install_base
  peaks
  mkdir -p "$OUT/megatron"
  # the first job pays fla's Triton compilation for the hf rollout (~45 s); the dense jobs share its cache
  megatron_grpo dense_pp2 qwen3_5_0_8b 170 -- parallelism.pp=2
  megatron_grpo dense_tp2 qwen3_5_0_8b 120 -- parallelism.tp=2
  megatron_grpo moe_tp2_ep2 qwen3_5_35b_a3b "$(left 580)" -- model.num_experts=64 parallelism.tp=2 parallelism.ep=2 \
    parallelism.etp=1 rollout.n=4
  ;;
megatron-dense)  # the dense layouts again, sized so that the first step (compilation included) fits its limit
  install_base
  peaks
  mkdir -p "$OUT/megatron"
  megatron_grpo dense_pp2 qwen3_5_0_8b 220 --prompts 8 -- parallelism.pp=2 rollout.n=4
  megatron_grpo dense_tp2 qwen3_5_0_8b "$(left 470)" --prompts 8 -- parallelism.tp=2 rollout.n=4
  ;;
packing)  # packed against padded on the 0.8B shapes, then the GPU tests of packing (fla compiles each new kernel
  # signature on first use, 100 s and more for a model's forward and backward: the bench goes first and the tests,
  # on the same kernels, after it); a job cut by its limit dumps its Python stacks (faulthandler on SIGABRT)
  install_gdn
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
  ;;
profile)  # where the time of the training phases and of a decode step goes, with fla + TileLang
  install_gdn
  mkdir -p "$OUT/profile"
  export PYTHONFAULTHANDLER=1
  PYTHONPATH=$FLA_PATH CUDA_VISIBLE_DEVICES=0 timeout -s ABRT "$(left)" $G memory --out "$OUT/profile/memory.json" \
    --profile --decode-bench --decode-tokens 16 > "$LOGS/memory.log" 2>&1
  elapsed "memory job with profiles done (exit $?)"
  ;;
phases)  # where the FSDP engine's training phases spend their time, kernel change by kernel change (fla + TileLang)
  install_gdn
  env_info > "$OUT/env-phases.txt" 2>&1
  elapsed "installed: $(tail -2 "$OUT/env-phases.txt" | tr '\n' ' ')"
  peaks
  mkdir -p "$OUT/phases"
  export PYTHONFAULTHANDLER=1
  # the new kernels against the torch math first (fla's convolution, the compiled bf16 head)
  PYTHONPATH=$FLA_PATH timeout -k 15 -s ABRT 120 python3 -m pytest -q -p no:cacheprovider -k "cuda" \
    tests/engines/test_packed_gdn.py tests/engines/test_logprob.py > "$LOGS/gpu-tests.log" 2>&1
  elapsed "GPU tests (exit $?): $(tail -1 "$LOGS/gpu-tests.log")"
  PYTHONPATH=$FLA_PATH CUDA_VISIBLE_DEVICES=0 timeout -s ABRT "$(left 575)" python3 bench/gpu/train_phases.py \
    --out "$OUT/phases/phases_0_8b.json" --peak-tflops "$PEAK" --profile torch,regions --plain --padded \
    --decode-tokens 32 > "$LOGS/phases.log" 2>&1
  elapsed "training phases (exit $?)"
  grep "^phases\|^decode bench [a-z]" "$LOGS/phases.log"
  ;;
conv-cap)  # short_conv on the GPU: its CUDA tests and packed = padded, then compare-cap with it (the default now)
  [ -f /tmp/site-gdn/.tilelang.tar.xz.done ] && [ -d /tmp/site/trl ] || install_gdn
  env_info > "$OUT/env-compare.txt" 2>&1
  elapsed "installed: $(tail -2 "$OUT/env-compare.txt" | tr '\n' ' ')"
  peaks
  export PYTHONFAULTHANDLER=1
  PYTHONPATH=$FLA_PATH timeout -s ABRT 90 python3 -m pytest -q -p no:cacheprovider --durations=5 \
    tests/engines/test_packed_gdn.py tests/engines/test_fsdp_gpu.py > "$LOGS/gpu-tests.log" 2>&1
  elapsed "GPU tests (exit $?): $(tail -1 "$LOGS/gpu-tests.log")"
  compare_one cap 45 0
  ;;
conv-profile)  # the CUDA tests of short_conv in full, the convolution alone, kernel profiles of the phases; decode
  [ -f /tmp/site-gdn/.tilelang.tar.xz.done ] && [ -d /tmp/site/trl ] || install_gdn
  env_info > "$OUT/env-conv.txt" 2>&1
  peaks
  export PYTHONFAULTHANDLER=1
  mkdir -p "$OUT/phases"
  PYTHONPATH=$FLA_PATH timeout -s ABRT 60 python3 -m pytest -x -q -p no:cacheprovider --tb=short -k cuda \
    tests/engines/test_packed_gdn.py > "$LOGS/gpu-tests.log" 2>&1
  elapsed "GPU tests (exit $?)"; tail -25 "$LOGS/gpu-tests.log" | cut -c1-300
  PYTHONPATH=$FLA_PATH timeout -s ABRT 90 python3 bench/gpu/conv_bench.py --out "$OUT/phases/conv.json" \
    > "$LOGS/conv.log" 2>&1
  elapsed "convolution alone (exit $?)"; grep "^conv bench" "$LOGS/conv.log"
  TORCH_LOGS=recompiles PYTHONPATH=$FLA_PATH CUDA_VISIBLE_DEVICES=0 timeout -s ABRT "$(left 400)" \
    python3 bench/gpu/train_phases.py --out "$OUT/phases/phases_conv.json" --workloads cap --variants torch,conv,head \
    --profile torch,head --profile-rows 16 --reps 2 --peak-tflops "$PEAK" > "$LOGS/phases.log" 2>&1
  elapsed "training phases (exit $?)"; grep "^phases\|ecompil" "$LOGS/phases.log" | cut -c1-250 | head -20
  PYTHONPATH=$FLA_PATH CUDA_VISIBLE_DEVICES=0 timeout -s ABRT "$(left 585)" python3 bench/gpu/train_phases.py \
    --out "$OUT/phases/decode.json" --variants "" --decode-tokens 32 > "$LOGS/decode.log" 2>&1
  elapsed "decode (exit $?)"; grep "^decode bench" "$LOGS/decode.log"
  ;;
final-cap)  # a short call: the convolution alone (speed, compiled against eager), then compare-cap's pair
  [ -f /tmp/site-gdn/.tilelang.tar.xz.done ] && [ -d /tmp/site/trl ] || install_gdn
  env_info > "$OUT/env-compare.txt" 2>&1
  PEAK=${PEAK:-786.7}; echo "[{\"bf16_matmul_tflops\": $PEAK, \"measured\": \"an earlier call\"}]" > "$OUT/peak.json"
  export PYTHONFAULTHANDLER=1
  mkdir -p "$OUT/cap" && cp "$OUT/peak.json" "$OUT/cap/"
  PYTHONPATH=$FLA_PATH timeout -s ABRT 45 python3 bench/gpu/conv_bench.py --out "$OUT/cap/conv.json" > "$LOGS/conv.log" 2>&1
  elapsed "convolution alone (exit $?)"; grep "^conv bench" "$LOGS/conv.log"
  PYTHONPATH=$FLA_PATH CUDA_VISIBLE_DEVICES=0 $G qwen35rl --lengths cap --out "$OUT/cap/q1.json" \
    --run-dir "$RUNS/q1-cap" --steps 3 --peak-tflops "$PEAK" --timeout 175 -- trainer.launcher=local \
    > "$LOGS/q1-cap.log" 2>&1
  elapsed "qwen35rl (cap): $(grep -c '\[qwen35rl\] step' "$LOGS/q1-cap.log") steps"
  cp "$RUNS/q1-cap/metrics.jsonl" "$OUT/cap/q1-metrics.jsonl" 2>/dev/null
  PYTHONPATH=$FLA_PATH CUDA_VISIBLE_DEVICES=0 timeout -s ABRT "$(left "${LIMIT:-430}")" \
    $G trl --lengths cap --out "$OUT/cap/trl.json" --work-dir /tmp/trl-cap --steps 3 > "$LOGS/trl-cap.log" 2>&1
  elapsed "TRL (cap): $(grep -c 'trl step' "$LOGS/trl-cap.log") steps"
  PYTHONPATH=$BASE python3 bench/gpu/grpo_h200.py report "$OUT/cap" > "$OUT/cap/report.md" 2>&1
  grep -A20 "qwen35rl / TRL" "$OUT/cap/report.md"
  ;;
decode-cap)  # the all-at-cap pair with the compiled decode step, then the 0.8B phases with norms and MLPs compiled
  [ -f /tmp/site-gdn/.tilelang.tar.xz.done ] && [ -d /tmp/site/trl ] || install_gdn
  env_info > "$OUT/env-compare.txt" 2>&1
  peaks
  export PYTHONFAULTHANDLER=1
  mkdir -p "$OUT/cap" "$OUT/phases" && cp "$OUT/peak.json" "$OUT/cap/"
  PYTHONPATH=$FLA_PATH CUDA_VISIBLE_DEVICES=0 $G qwen35rl --lengths cap --out "$OUT/cap/q1.json" \
    --run-dir "$RUNS/q1-cap" --steps 3 --peak-tflops "$PEAK" --timeout 235 -- trainer.launcher=local \
    rollout.compile_decode=true > "$LOGS/q1-cap.log" 2>&1
  elapsed "qwen35rl (cap, compiled decode): $(grep -c '\[qwen35rl\] step' "$LOGS/q1-cap.log") steps"
  cp "$RUNS/q1-cap/metrics.jsonl" "$OUT/cap/q1-metrics.jsonl" 2>/dev/null
  rm -rf "$RUNS/q1-cap"
  PYTHONPATH=$FLA_PATH CUDA_VISIBLE_DEVICES=0 timeout -s ABRT "$(left ${TRL_UNTIL:-440})" \
    $G trl --lengths cap --out "$OUT/cap/trl.json" --work-dir /tmp/trl-cap --steps 3 > "$LOGS/trl-cap.log" 2>&1
  elapsed "TRL (cap): $(grep -c 'trl step' "$LOGS/trl-cap.log") steps"
  PYTHONPATH=$BASE python3 bench/gpu/grpo_h200.py report "$OUT/cap" > "$OUT/cap/report.md" 2>&1
  grep -A20 "qwen35rl / TRL" "$OUT/cap/report.md"
  [ -z "${PAIR_ONLY:-}" ] && PYTHONPATH=$FLA_PATH CUDA_VISIBLE_DEVICES=0 timeout -s ABRT "$(left 585)" \
    python3 bench/gpu/train_phases.py --out "$OUT/phases/phases_regions.json" --workloads cap,realistic \
    --variants head,regions --reps 3 --peak-tflops "$PEAK" > "$OUT/phases/phases-regions.log" 2>&1
  elapsed "0.8B phases, regions (exit $?)"
  grep "^phases" "$OUT/phases/phases-regions.log"
  ;;
budget)  # fuller micro batches: the realistic pair with a token budget, then the 0.8B phases with it, host-side profile
  [ -f /tmp/site-gdn/.tilelang.tar.xz.done ] && [ -d /tmp/site/trl ] || install_gdn
  env_info > "$OUT/env-compare.txt" 2>&1
  peaks
  export PYTHONFAULTHANDLER=1
  BUDGET=(backend.dynamic_batch_size=true backend.max_tokens_per_device=${TOKENS:-24576} backend.compile_layers=true)
  mkdir -p "$OUT/realistic" "$OUT/phases" && cp "$OUT/peak.json" "$OUT/realistic/"
  PYTHONPATH=$FLA_PATH CUDA_VISIBLE_DEVICES=0 $G qwen35rl --lengths realistic --out "$OUT/realistic/q1.json" \
    --run-dir "$RUNS/q1-realistic" --steps 3 --peak-tflops "$PEAK" --timeout 230 -- trainer.launcher=local \
    "${BUDGET[@]}" > "$LOGS/q1-realistic.log" 2>&1
  elapsed "qwen35rl (realistic, ${BUDGET[*]}): $(grep -c '\[qwen35rl\] step' "$LOGS/q1-realistic.log") steps"
  cp "$RUNS/q1-realistic/metrics.jsonl" "$OUT/realistic/q1-metrics.jsonl" 2>/dev/null
  rm -rf "$RUNS/q1-realistic"
  plan_of "$OUT/realistic/q1.json" "$OUT/realistic/plan.json" "$LOGS/plan_realistic.log"
  PYTHONPATH=$FLA_PATH CUDA_VISIBLE_DEVICES=0 timeout -s ABRT "$(left 440)" $G trl --lengths realistic \
    --out "$OUT/realistic/trl.json" --work-dir /tmp/trl-realistic --steps 3 > "$LOGS/trl-realistic.log" 2>&1
  elapsed "TRL (realistic): $(grep -c 'trl step' "$LOGS/trl-realistic.log") steps"
  PYTHONPATH=$BASE python3 bench/gpu/grpo_h200.py report "$OUT/realistic" > "$OUT/realistic/report.md" 2>&1
  grep -A20 "qwen35rl / TRL" "$OUT/realistic/report.md"
  PYTHONPATH=$FLA_PATH CUDA_VISIBLE_DEVICES=0 timeout -s ABRT "$(left 585)" python3 bench/gpu/train_phases.py \
    --out "$OUT/phases/phases_budget.json" --workloads realistic,cap --variants head,regions --reps 2 \
    --set backend.dynamic_batch_size=true --set "backend.max_tokens_per_device=${TOKENS:-24576}" --profile head \
    --profile-rows 16 --peak-tflops "$PEAK" > "$OUT/phases/phases-budget.log" 2>&1
  elapsed "0.8B phases with a token budget (exit $?)"
  grep "^phases" "$OUT/phases/phases-budget.log"
  ;;
qknorm-pair)  # q/k normalised in the GDN convolution: its CUDA tests, then the realistic budget pair, 5 steps
  [ -f /tmp/site-gdn/.tilelang.tar.xz.done ] && [ -d /tmp/site/trl ] || install_gdn
  env_info > "$OUT/env-compare.txt" 2>&1
  peaks
  export PYTHONFAULTHANDLER=1
  PYTHONPATH=$FLA_PATH timeout -k 15 -s ABRT 150 python3 -m pytest -x -q -p no:cacheprovider --tb=short -k cuda \
    tests/engines/test_gdn_layer.py tests/engines/test_packed_gdn.py tests/engines/test_logprob.py > "$OUT/gpu-tests.log" 2>&1
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
  ;;
qknorm-phases)  # right after qknorm-pair (warm): the 0.8B phases with a token budget, then the 4B at micro MICRO
  [ -f /tmp/site-gdn/.tilelang.tar.xz.done ] && [ -d /tmp/site/trl ] || install_gdn
  env_info > "$OUT/env-phases.txt" 2>&1
  peaks
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
  ;;
gdn-check)  # the GDN forward's CUDA tests, then its q/k norm and gates A/B on the 0.8B (token budget) and the 4B
  [ -f /tmp/site-gdn/.tilelang.tar.xz.done ] && [ -d /tmp/site/trl ] || install_gdn
  env_info > "$OUT/env-phases.txt" 2>&1
  peaks
  export PYTHONFAULTHANDLER=1
  PYTHONPATH=$FLA_PATH timeout -k 15 -s ABRT 120 python3 -m pytest -q -p no:cacheprovider --tb=short -k cuda \
    tests/engines/test_gdn_layer.py tests/engines/test_packed_gdn.py tests/engines/test_logprob.py > "$OUT/gpu-tests.log" 2>&1
  elapsed "GPU tests (exit $?)"; tail -8 "$OUT/gpu-tests.log" | cut -c1-300
  mkdir -p "$OUT/phases"
  AB=${AB:-regions,fused,qknorm}  # the default twice (first and last): the drift within the call
  PYTHONPATH=$FLA_PATH CUDA_VISIBLE_DEVICES=0 timeout -s ABRT 200 python3 bench/gpu/train_phases.py \
    --out "$OUT/phases/phases_ab.json" --workloads realistic --variants "$AB" --reps 3 \
    --set backend.dynamic_batch_size=true --set "backend.max_tokens_per_device=${TOKENS:-24576}" \
    --peak-tflops "$PEAK" > "$OUT/phases/phases-ab.log" 2>&1
  elapsed "0.8B realistic phases, q/k norm and gates A/B (exit $?)"
  grep "^phases" "$OUT/phases/phases-ab.log"
  if [ "${GDN_4B:-1}" = 1 ]; then  # GDN_4B=0: the 0.8B alone (a shorter call)
    PYTHONPATH=$FLA_PATH CUDA_VISIBLE_DEVICES=0 timeout -s ABRT "$(left 585)" python3 bench/gpu/train_phases.py \
      --out "$OUT/phases/phases_4b_ab.json" --model qwen3_5_4b --micro 8 --workloads cap --variants "head,${AB#regions,}" \
      --set backend.compile_layers=true --reps 2 --peak-tflops "$PEAK" > "$OUT/phases/phases-4b-ab.log" 2>&1
    elapsed "4B phases, micro 8, A/B (exit $?)"
    grep "^phases" "$OUT/phases/phases-4b-ab.log"
  fi
  ;;
megatron-phases)  # the Megatron engine's phases (fla + TileLang, chunked head) against FSDP's on the same rows (1 GPU)
  [ -f /tmp/site-gdn/.tilelang.tar.xz.done ] && [ -d /tmp/site/trl ] || install_gdn
  install_mcore_x
  env_info > "$OUT/env-megatron-phases.txt" 2>&1
  peaks
  export PYTHONFAULTHANDLER=1
  mkdir -p "$OUT/phases"
  MODEL=${MODEL:-qwen3_5_0_8b}; MICRO=${MICRO:-16}; tag=${MODEL#qwen3_5_}
  if [ "${TESTS:-0}" = 1 ]; then  # TESTS=1: first the CUDA tests of the GDN forward, convolution and log-prob head
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
  if [ "${FSDP:-1}" = 1 ]; then  # FSDP=0: the Megatron engine alone
    PYTHONPATH=$FLA_PATH CUDA_VISIBLE_DEVICES=0 timeout -s ABRT "$(left 585)" python3 bench/gpu/train_phases.py \
      --out "$OUT/phases/fsdp_$tag.json" --model "$MODEL" --micro "$MICRO" --workloads cap --variants built --reps 3 \
      --peak-tflops "$PEAK" > "$OUT/phases/fsdp-$tag.log" 2>&1
    elapsed "FSDP $tag phases, micro $MICRO (exit $?)"
    grep "^phases" "$OUT/phases/fsdp-$tag.log"
  fi
  ;;
budget-4b)  # the 4B phases with the compiled layers' smaller peak: micro 8 instead of 4, host-side profile (1 GPU)
  [ -f /tmp/site-gdn/.tilelang.tar.xz.done ] && [ -d /tmp/site/trl ] || install_gdn
  env_info > "$OUT/env-phases.txt" 2>&1
  peaks
  export PYTHONFAULTHANDLER=1
  mkdir -p "$OUT/phases"
  PYTHONPATH=$FLA_PATH CUDA_VISIBLE_DEVICES=0 timeout -s ABRT "$(left 585)" python3 bench/gpu/train_phases.py \
    --out "$OUT/phases/phases_4b.json" --model qwen3_5_4b --micro "${MICRO:-8}" --workloads cap --variants head \
    --set backend.compile_layers=true --profile head --profile-rows "${MICRO:-8}" --reps 3 --peak-tflops "$PEAK" \
    > "$OUT/phases/phases-4b.log" 2>&1
  elapsed "4B phases, compiled layers, micro ${MICRO:-8} (exit $?)"
  grep "^phases" "$OUT/phases/phases-4b.log"
  ;;
compare-cap)  # the all-at-cap workload, both sides, one call
  [ -f /tmp/site-gdn/.tilelang.tar.xz.done ] && [ -d /tmp/site/trl ] || install_gdn
  env_info > "$OUT/env-compare.txt" 2>&1
  elapsed "installed: $(tail -2 "$OUT/env-compare.txt" | tr '\n' ' ')"
  peaks
  export PYTHONFAULTHANDLER=1
  compare_one cap 58 0
  ;;
compare-realistic)  # the realistic lengths, both sides, one call; then the 4B architecture's training phases
  [ -f /tmp/site-gdn/.tilelang.tar.xz.done ] && [ -d /tmp/site/trl ] || install_gdn
  env_info > "$OUT/env-compare.txt" 2>&1
  peaks
  export PYTHONFAULTHANDLER=1
  compare_one realistic 50 250
  mkdir -p "$OUT/phases"
  PYTHONPATH=$FLA_PATH CUDA_VISIBLE_DEVICES=0 timeout -s ABRT "$(left 585)" python3 bench/gpu/train_phases.py \
    --out "$OUT/phases/phases_4b.json" --model qwen3_5_4b --micro 4 --variants head --reps 3 \
    --peak-tflops "$PEAK" > "$LOGS/phases-4b.log" 2>&1
  elapsed "4B training phases (exit $?)"
  grep "^phases" "$LOGS/phases-4b.log"
  ;;
phases-4b)  # the CLI's all-at-cap run with its memory per phase, then the 4B architecture's phases profiled (1 GPU)
  [ -f /tmp/site-gdn/.tilelang.tar.xz.done ] && [ -d /tmp/site/trl ] || install_gdn
  env_info > "$OUT/env-phases-4b.txt" 2>&1
  elapsed "installed: $(tail -2 "$OUT/env-phases-4b.txt" | tr '\n' ' ')"
  peaks
  export PYTHONFAULTHANDLER=1
  mkdir -p "$OUT/cap-memory" "$OUT/phases"
  PYTHONPATH=$FLA_PATH CUDA_VISIBLE_DEVICES=0 $G qwen35rl --lengths cap --out "$OUT/cap-memory/q1.json" \
    --run-dir "$RUNS/q1-cap" --steps 3 --peak-tflops "$PEAK" --timeout "$(left 260)" -- trainer.launcher=local \
    > "$LOGS/q1-cap.log" 2>&1
  elapsed "qwen35rl (cap): $(grep -c '\[qwen35rl\] step' "$LOGS/q1-cap.log") steps"
  cp "$RUNS/q1-cap/metrics.jsonl" "$OUT/cap-memory/q1-metrics.jsonl" 2>/dev/null
  rm -rf "$RUNS/q1-cap"
  plan_of "$OUT/cap-memory/q1.json" "$OUT/cap-memory/plan.json" "$LOGS/plan_cap.log"
  grep -o '"perf/max_memory_allocated_gb[^,]*' "$OUT/cap-memory/q1-metrics.jsonl" | tail -6
  PYTHONPATH=$FLA_PATH CUDA_VISIBLE_DEVICES=0 timeout -s ABRT "$(left 575)" python3 bench/gpu/train_phases.py \
    --out "$OUT/phases/phases_4b.json" --model qwen3_5_4b --micro 4 --workloads cap --variants head --profile head \
    --profile-rows 32 --reps 2 --peak-tflops "$PEAK" > "$OUT/phases/phases-4b.log" 2>&1
  elapsed "4B phases profiled (exit $?)"
  grep "^phases" "$OUT/phases/phases-4b.log"
  ;;
sp-x2)  # issue 22: Ulysses SP2 against SP1 on the same rows (fla + TileLang, NCCL), then SP2 at twice the length
  [ "$NGPU" -ge 2 ] || { echo "sp-x2 needs 2 GPUs (nvidia-h200-x2)"; exit 2; }
  [ -f /tmp/site-gdn/.tilelang.tar.xz.done ] && [ -d /tmp/site/trl ] || install_gdn
  env_info > "$OUT/env-sp.txt" 2>&1
  peaks
  mkdir -p "$OUT/sp"
  SEQ=${SEQ:-16384}  # 4 rows of it: what SP1 holds without checkpointing in the plan's estimate; SP2 then takes 2x
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
  ;;
hsdp-x4)  # issue 22: HSDP (fsdp_size 2) against full sharding over 4 GPUs, same rows (fla + TileLang, NCCL)
  [ "$NGPU" -ge 4 ] || { echo "hsdp-x4 needs 4 GPUs (nvidia-h200-x4)"; exit 2; }
  [ -f /tmp/site-gdn/.tilelang.tar.xz.done ] && [ -d /tmp/site/trl ] || install_gdn
  peaks
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
  ;;
split-x2)  # issue 22: placement=split, GPU 1 generating and GPU 0 training, staleness 0 against 1 (Ray, torch GDN)
  [ "$NGPU" -ge 2 ] || { echo "split-x2 needs 2 GPUs (nvidia-h200-x2)"; exit 2; }
  install_base
  peaks
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
  ;;
megatron-x2-numerics)  # issue 21: VL log-probs against transformers' VL model, dense at TP2 / PP2, MoE at EP2 / TP2+EP2
  [ "$NGPU" -ge 2 ] || { echo "megatron-x2-numerics needs 2 GPUs (nvidia-h200-x2)"; exit 2; }
  install_mcore
  peaks
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
  ;;
megatron-x2-cli)  # issue 21: 3 GRPO steps through the CLI on geo3k-style images, dense at TP2, MoE at EP2 (Ray)
  [ "$NGPU" -ge 2 ] || { echo "megatron-x2-cli needs 2 GPUs (nvidia-h200-x2)"; exit 2; }
  install_base  # Ray: two worker processes
  peaks
  mkdir -p "$OUT/megatron-x2"
  PYTHONPATH=$BASE python3 -c "from pathlib import Path; from tests.runtime.geo3k_fixture import write_geo3k
write_geo3k(Path('/tmp/geo3k/train.parquet'), 32); write_geo3k(Path('/tmp/geo3k/test.parquet'), 8, seed=1)" \
    || { echo "geo3k fixture failed"; exit 1; }
  for job in "vl_tp2 qwen3_5_0_8b 290 parallelism.tp=2" "vl_ep2 qwen3_5_35b_a3b 575 parallelism.ep=2"; do
    read -r name model until layout <<< "$job"
    PYTHONPATH=$MCORE_PATH CUDA_VISIBLE_DEVICES=0,1 $G qwen35rl --out "$OUT/megatron-x2/$name.json" \
      --run-dir "$RUNS/$name" --model "$model" --backend megatron --data geo3k --devices 2 --steps 3 --prompts 8 \
      --prompt-len 384 --response-len 256 --micro 8 --peak-tflops "$PEAK" --timeout "$(left "$until")" -- \
      model.num_hidden_layers=4 backend.megatron_core_version=0.19.2 +backend.transformer_overrides.deterministic_mode=true \
      rollout.n=4 "data.train_files=[/tmp/geo3k/train.parquet]" \
      "data.val_files=[/tmp/geo3k/test.parquet]" data.reward=bench.gpu.hash_reward:text_hash "$layout" \
      $( [ "$model" = qwen3_5_35b_a3b ] && echo model.num_experts=64 ) > "$LOGS/$name.log" 2>&1
    elapsed "$name: $(grep -c '\[qwen35rl\] step' "$LOGS/$name.log") steps"
    cp "$RUNS/$name/metrics.jsonl" "$OUT/megatron-x2/$name-metrics.jsonl" 2>/dev/null
    rm -rf "$RUNS/$name"
    plan_of "$OUT/megatron-x2/$name.json" "$OUT/megatron-x2/plan-$name.json" "$LOGS/plan-$name.log"
  done
  ;;
alloc-4b)  # the 4B phases at the memory edge: the default caching allocator, expandable segments, checkpointing (1 GPU)
  [ -f /tmp/site-gdn/.tilelang.tar.xz.done ] && [ -d /tmp/site/trl ] || install_gdn
  elapsed "installed"
  mkdir -p "$OUT/phases"
  export PYTHONFAULTHANDLER=1
  for job in "default 4 - ${T1:-250}" "expandable 4 - ${T2:-420}" "expandable-ckpt 8 --ckpt ${T3:-575}"; do
    read -r name micro ckpt until <<< "$job"
    conf=""; [ "${name#expandable}" != "$name" ] && conf=expandable_segments:True
    PYTORCH_CUDA_ALLOC_CONF=$conf PYTHONPATH=$FLA_PATH CUDA_VISIBLE_DEVICES=0 timeout -s ABRT "$(left "$until")" \
      python3 bench/gpu/train_phases.py --out "$OUT/phases/alloc_4b_$name.json" --model qwen3_5_4b --micro "$micro" \
      $( [ "$ckpt" = - ] || echo "$ckpt" ) --workloads cap --variants head --reps 2 --peak-tflops "${PEAK:-786.6}" \
      > "$OUT/phases/alloc-4b-$name.log" 2>&1
    elapsed "4B $name (exit $?): $(grep "^phases" "$OUT/phases/alloc-4b-$name.log")"
  done
  ;;
megatron-tp1-fla)  # megatron-tp1 with fla + TileLang (GDN backward on fla's kernels): 0.8B, then 4B at micro 2 (1 GPU)
  # TileLang's wheels and megatron-core's do not fit one call: /tmp/site-gdn stays from a fla stage called just before
  [ -f /tmp/site-gdn/.tilelang.tar.xz.done ] || { echo "no /tmp/site-gdn: call phases-4b (or another fla stage) right before"; exit 1; }
  install_mcore
  peaks
  export PYTHONFAULTHANDLER=1
  NO_OFFLOAD=(backend.param_offload=false backend.grad_offload=false backend.optimizer_offload=false
              backend.optimizer_cpu_offload=false)
  mkdir -p "$OUT/megatron-tp1-fla"
  for job in "0.8b qwen3_5_0_8b 16 330" "4b qwen3_5_4b 2 570"; do
    read -r name model micro until <<< "$job"
    PYTHONPATH=$MCORE_GDN_PATH CUDA_VISIBLE_DEVICES=0 $G qwen35rl --out "$OUT/megatron-tp1-fla/$name.json" \
      --run-dir "$RUNS/mtp1-$name" --model "$model" --micro "$micro" --backend megatron --steps 3 --peak-tflops "$PEAK" \
      --timeout "$(left "$until")" -- backend.megatron_core_version=0.19.2 trainer.launcher=local "${NO_OFFLOAD[@]}" \
      > "$LOGS/mtp1-$name.log" 2>&1
    elapsed "megatron TP1 fla ($name): $(grep -c '\[qwen35rl\] step' "$LOGS/mtp1-$name.log") steps"
    cp "$RUNS/mtp1-$name/metrics.jsonl" "$OUT/megatron-tp1-fla/$name-metrics.jsonl" 2>/dev/null
    rm -rf "$RUNS/mtp1-$name"
    plan_of "$OUT/megatron-tp1-fla/$name.json" "$OUT/megatron-tp1-fla/plan-$name.json" "$LOGS/plan-$name.log"
    grep -m3 "GDN\|gdn\|Error" "$LOGS/mtp1-$name.log" | cut -c1-300
  done
  ;;
profile-head)  # the engine's reference pass and update with the compiled head, all at cap, profiled (~4 min, 1 GPU)
  [ -f /tmp/site-gdn/.tilelang.tar.xz.done ] && [ -d /tmp/site/trl ] || install_gdn
  elapsed "installed"
  mkdir -p "$OUT/phases"
  export PYTHONFAULTHANDLER=1
  PYTHONPATH=$FLA_PATH CUDA_VISIBLE_DEVICES=0 timeout -s ABRT "$(left "${LIMIT:-570}")" python3 bench/gpu/train_phases.py \
    --out "$OUT/phases/phases_head.json" --workloads cap --variants head --profile head --reps 2 \
    --peak-tflops "${PEAK:-786.6}" > "$OUT/phases/phases-head.log" 2>&1
  elapsed "profiled phases (exit $?)"
  grep "^phases" "$OUT/phases/phases-head.log"
  ;;
decode-only)  # the decode benchmark alone (eager, CUDA graph, transformers generate, compiled + graph last)
  [ -f /tmp/site-gdn/.tilelang.tar.xz.done ] && [ -d /tmp/site/trl ] || install_gdn
  mkdir -p "$OUT/decode"
  PYTHONPATH=$FLA_PATH CUDA_VISIBLE_DEVICES=0 timeout -s ABRT "$(left 150)" python3 bench/gpu/train_phases.py \
    --out "$OUT/decode/decode.json" --variants "" --decode-tokens 32 > "$OUT/decode/decode.log" 2>&1
  elapsed "decode bench (exit $?)"
  grep "^decode bench [a-z]" "$OUT/decode/decode.log"
  ;;
moe-numerics)  # the MoE model's log-probs against transformers at EP2 and TP1 (DP2), alone in a call
  install_base
  peaks
  mkdir -p "$OUT/megatron"
  PYTHONPATH=$MCORE_PATH timeout "$(left)" torchrun --standalone --nproc_per_node=2 bench/gpu/megatron_numerics.py \
    --steps 3 --models moe --layouts ep2,tp1 --rows 4 --peak-tflops "$PEAK" --out "$OUT/megatron/numerics_moe.json" \
    > "$LOGS/numerics_moe.log" 2>&1
  elapsed "megatron numerics (MoE) done (exit $?)"
  ;;
scale)
  install_base
  peaks
  mkdir -p "$OUT/torch"
  PYTHONPATH=$TORCH_PATH CUDA_VISIBLE_DEVICES=0,1 $G qwen35rl --out "$OUT/torch/q2.json" --run-dir "$RUNS/q2" --devices 2 \
    --prompts 32 --steps 3 --peak-tflops "$PEAK" --timeout 220 > "$LOGS/q2.log" 2>&1
  elapsed "qwen35rl 2 GPUs done: $(grep -c '\[qwen35rl\] step' "$LOGS/q2.log") steps"
  rm -rf "$RUNS/q2"
  ;;
megatron-vl)  # Qwen3.5-VL on the Megatron engine (1 GPU): numerics against transformers' VL model, then the CLI on images
  install_mcore
  env_info > "$OUT/env-megatron-vl.txt" 2>&1
  elapsed "installed: $(tail -1 "$OUT/env-megatron-vl.txt")"
  peaks
  mkdir -p "$OUT/megatron-vl"
  export PYTHONFAULTHANDLER=1
  # the 0.8B architecture (4 text layers) with its real vision tower; 8 rows, one 384x256 noise image each (a 16 x 24
  # patch grid, 96 image tokens), prompts of 128-256 tokens, responses of 384-768; 3 GRPO steps on the fixed batch
  # (one process without torchrun, so that the limit's SIGABRT reaches it and faulthandler dumps its stacks)
  PYTHONPATH=$MCORE_PATH CUDA_VISIBLE_DEVICES=0 RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29517 \
    timeout -s ABRT -k 10 280 python3 bench/gpu/megatron_numerics.py --steps 3 --models dense_vl --layouts tp1 --peak-tflops "$PEAK" \
    --out "$OUT/megatron-vl/numerics_vl.json" > "$LOGS/numerics_vl.log" 2>&1
  elapsed "megatron VL numerics done (exit $?)"
  vl_cli qwen35rl.cli.train "$(left 555)" 2
  ;;
megatron-vl-cli)  # the CLI run of stage megatron-vl alone, three steps
  install_mcore
  peaks
  vl_cli qwen35rl.cli.train "$(left 540)" 3
  ;;
megatron-tp1)  # the Megatron engine at TP1 on the FSDP comparison's workload (all layers, fla + megatron-core)
  install_mcore
  peaks
  mkdir -p "$OUT/megatron-tp1"
  export PYTHONFAULTHANDLER=1
  PYTHONPATH=$MCORE_PATH CUDA_VISIBLE_DEVICES=0 $G qwen35rl --out "$OUT/megatron-tp1/grpo.json" --run-dir "$RUNS/mtp1" \
    --backend megatron --steps 3 --peak-tflops "$PEAK" --timeout "$(left 560)" -- backend.megatron_core_version=0.19.2 \
    trainer.launcher=local backend.param_offload=false backend.grad_offload=false backend.optimizer_offload=false \
    backend.optimizer_cpu_offload=false > "$LOGS/mtp1.log" 2>&1
  elapsed "megatron TP1: $(grep -c '\[qwen35rl\] step' "$LOGS/mtp1.log") steps"
  cp "$RUNS/mtp1/metrics.jsonl" "$OUT/megatron-tp1/" 2>/dev/null
  rm -rf "$RUNS/mtp1"
  plan_of "$OUT/megatron-tp1/grpo.json" "$OUT/megatron-tp1/plan.json" "$LOGS/plan_mtp1.log"
  ;;
megatron-nofla)  # GRPO through the CLI with megatron-core but no flash-linear-attention on the path, no overrides
  install_mcore
  peaks
  mkdir -p "$OUT/megatron-nofla"
  PYTHONPATH=/tmp/site-mcore:$BASE CUDA_VISIBLE_DEVICES=0 $G qwen35rl --out "$OUT/megatron-nofla/grpo.json" \
    --run-dir "$RUNS/nofla" --model qwen3_5_0_8b --backend megatron --devices 1 --steps 3 --prompts 8 \
    --response-len 128 --micro 8 --peak-tflops "$PEAK" --timeout "$(left 500)" -- model.num_hidden_layers=4 \
    backend.megatron_core_version=0.19.2 rollout.n=4 trainer.launcher=local \
    data.reward=bench.gpu.hash_reward:text_hash > "$LOGS/nofla.log" 2>&1
  elapsed "megatron without fla done: $(grep -c '\[qwen35rl\] step' "$LOGS/nofla.log") steps"
  grep -m3 "flash-linear-attention is not installed\|Error" "$LOGS/nofla.log"
  cp "$LOGS/nofla.log" "$OUT/megatron-nofla/"
  ;;
*) echo "unknown stage $stage"; exit 2 ;;
esac
summary
elapsed "all done"
