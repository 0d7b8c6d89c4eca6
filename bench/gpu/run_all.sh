#!/usr/bin/env bash
# The H200 proof in two back-to-back device calls on a 2-GPU machine (nvidia-h200-x2); results in $OUT.
#
#   stage 1 (carry .whl-gdn .whl-cfg):  bash bench/gpu/run_all.sh gdn
#       installs flash-linear-attention + TileLang (+ hydra/omegaconf), records the environment and runs the short
#       smoke case of the colocated worker (decode graph, log-probs, updates) with a decode benchmark and a profile
#   stage 2 (carry .whl, machine still warm): bash bench/gpu/run_all.sh main
#       GPU 0: qwen35rl GRPO through its CLI, then the memory calibration; GPU 1 at the same time: TRL's
#       GRPOTrainer on the same workload; then qwen35rl on both GPUs (FSDP over NCCL)
#
# Every job has a time limit so that the call ends inside the device's 10 minutes; JSON results are written as
# they come, so a job cut short still leaves its finished steps.
set -u
stage=${1:?usage: run_all.sh gdn|main}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast
export PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
OUT=${OUT:-/tmp/out}
LOGS=/tmp/logs
mkdir -p "$OUT" "$LOGS"
G="python3 bench/gpu/grpo_h200.py"
t0=$(date +%s)
elapsed() { echo "[$(( $(date +%s) - t0 )) s] $*"; }

if [ "$stage" = gdn ]; then
  bash bench/gpu/install-wheels.sh .whl-gdn .whl-cfg > "$LOGS/install-gdn.log" 2>&1 || { cat "$LOGS/install-gdn.log"; exit 1; }
  elapsed "installed"
  {
    date -u; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    df -h /tmp /dev/shm; nproc
    python3 -c 'import torch, transformers, triton, fla, tilelang; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, "triton", triton.__version__, "fla", fla.__version__, "tilelang", tilelang.__version__)'
  } > "$OUT/env.txt" 2>&1
  cat "$OUT/env.txt"
  CUDA_VISIBLE_DEVICES=0 timeout 150 $G memory --out "$OUT/smoke.json" --smoke --decode-bench \
    2>&1 | grep -v "Warning\|warnings.warn" | tee "$OUT/smoke.log" | tail -40
  elapsed "smoke done"
  exit 0
fi

[ "$stage" = main ] || { echo "unknown stage $stage"; exit 2; }
# GDN=torch (default): transformers' torch GDN code on both sides (the fla + TileLang stack of stage gdn compiled
# its kernels for over 150 s in the smoke run, longer than this call can wait); GDN=fla: install fla first (stage gdn)
if [ "${GDN:-torch}" = torch ]; then
  mkdir -p /tmp/whl-nofla && cp .whl/* /tmp/whl-nofla/ && rm -f /tmp/whl-nofla/fla_core-* /tmp/whl-nofla/flash_linear_attention-*
  bash bench/gpu/install-wheels.sh /tmp/whl-nofla > "$LOGS/install.log" 2>&1 || { cat "$LOGS/install.log"; exit 1; }
else
  bash bench/gpu/install-wheels.sh .whl > "$LOGS/install.log" 2>&1 || { cat "$LOGS/install.log"; exit 1; }
fi
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import importlib.util as u, torch, transformers, triton, ray, trl, hydra; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, "triton", triton.__version__, "ray", ray.__version__, "trl", trl.__version__, "hydra", hydra.__version__, "fla", u.find_spec("fla") is not None)'
} > "$OUT/env.txt" 2>&1
elapsed "installed: $(tail -1 "$OUT/env.txt")"
# a RAM-backed run directory keeps the end-of-run checkpoint (fp32 weights + Adam, 12 GB) off the disk's clock
RUNS=/tmp/runs
[ "$(df --output=avail -B1G /dev/shm 2>/dev/null | tail -1)" -gt 60 ] 2>/dev/null && RUNS=/dev/shm/runs
mkdir -p "$RUNS"

CUDA_VISIBLE_DEVICES=0 $G peak --out "$LOGS/peak0.json" > /dev/null 2>&1 &
CUDA_VISIBLE_DEVICES=1 $G peak --out "$LOGS/peak1.json" > /dev/null 2>&1 &
wait
PEAK=$(python3 -c "import json; print(round(json.load(open('$LOGS/peak0.json'))['bf16_matmul_tflops'], 1))")
python3 -c "import json; print(json.dumps([json.load(open('$LOGS/peak%d.json' % i)) for i in (0, 1)]))" > "$OUT/peak.json"
elapsed "bf16 matmul peak $PEAK TFLOP/s (GPU 0); $(cat "$OUT/peak.json")"

(
  CUDA_VISIBLE_DEVICES=0 $G qwen35rl --out "$OUT/q1.json" --run-dir "$RUNS/q1" --steps 3 --peak-tflops "$PEAK" \
    --timeout 140 > "$LOGS/q1.log" 2>&1
  elapsed "qwen35rl 1 GPU done: $(grep -c '\[qwen35rl\] step' "$LOGS/q1.log") steps"
  rm -rf "$RUNS/q1/checkpoints"
  CUDA_VISIBLE_DEVICES=0 timeout 75 $G memory --out "$OUT/memory.json" --profile --decode-bench --decode-tokens 16 \
    > "$LOGS/memory.log" 2>&1
  elapsed "memory calibration done"
) &
(
  CUDA_VISIBLE_DEVICES=1 timeout 190 $G trl --out "$OUT/trl.json" --work-dir /tmp/trl --steps 2 > "$LOGS/trl.log" 2>&1
  elapsed "TRL done"
) &
wait
tar czf "$OUT/logs.tar.gz" -C /tmp logs

CUDA_VISIBLE_DEVICES=0,1 $G qwen35rl --out "$OUT/q2.json" --run-dir "$RUNS/q2" --devices 2 --prompts 32 --steps 2 \
  --peak-tflops "$PEAK" --timeout 95 > "$LOGS/q2.log" 2>&1
elapsed "qwen35rl 2 GPUs done: $(grep -c '\[qwen35rl\] step' "$LOGS/q2.log") steps"
tar czf "$OUT/logs.tar.gz" -C /tmp logs
rm -rf "$RUNS"
grep -h "\[qwen35rl\] step\|^trl step\|^memory \|Error\|error:" "$LOGS"/q1.log "$LOGS"/trl.log "$LOGS"/memory.log "$LOGS"/q2.log \
  | cut -c1-300 | tail -30
elapsed "all done"
