#!/usr/bin/env bash
# The H200 proof on a 2-GPU machine (nvidia-h200-x2) in back-to-back device calls; results in $OUT.
# See bench/results/h200.md for what each stage gave so far and how long it takes.
#
#   bash bench/gpu/run_all.sh main    (carry .whl; ~8 min)
#       GPU 0: qwen35rl GRPO through its CLI (1 GPU); GPU 1 at the same time: TRL's GRPOTrainer on the same
#       workload, then the memory calibration (estimate vs measured peaks of the colocated worker)
#   bash bench/gpu/run_all.sh multi   (machine still warm, so /tmp/site is there; ~4 min)
#       qwen35rl on both GPUs (FSDP over NCCL), twice the prompts (same work per GPU as the 1-GPU run)
#   bash bench/gpu/run_all.sh gdn     (carry .whl-gdn .whl-cfg) then main with GDN=fla
#       flash-linear-attention + TileLang instead of transformers' torch GDN code; their Triton kernels are
#       compiled and autotuned on first use (the smoke case of this stage had not finished its first prefill
#       after 150 s on a fresh machine)
#
# QWEN35RL_DECODE_CUDA_GRAPH=1 captures the hf rollout's decode step as a CUDA graph (off by default). Every job
# has a time limit; JSON results are written as they come, so a job cut short still leaves its finished steps.
set -u
stage=${1:?usage: run_all.sh main|multi|gdn}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast
export PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false
export QWEN35RL_DECODE_CUDA_GRAPH=${QWEN35RL_DECODE_CUDA_GRAPH:-0}
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
OUT=${OUT:-/tmp/out}
LOGS=/tmp/logs
mkdir -p "$OUT" "$LOGS"
G="python3 bench/gpu/grpo_h200.py"
t0=$(date +%s)
elapsed() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
env_info() {
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import importlib.util as u, torch, transformers, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, "triton", triton.__version__, *[f"{m} {u.find_spec(m) is not None}" for m in ("ray", "trl", "hydra", "fla", "tilelang")])'
  echo "QWEN35RL_DECODE_CUDA_GRAPH=$QWEN35RL_DECODE_CUDA_GRAPH GDN=${GDN:-torch}"
}
# a RAM-backed run directory keeps the end-of-run checkpoint (fp32 weights + Adam, 12 GB) off the disk's clock
RUNS=/tmp/runs
[ "$(df --output=avail -B1G /dev/shm 2>/dev/null | tail -1)" -gt 60 ] 2>/dev/null && RUNS=/dev/shm/runs
mkdir -p "$RUNS"
peaks() {
  CUDA_VISIBLE_DEVICES=0 $G peak --out "$LOGS/peak0.json" > /dev/null 2>&1 &
  CUDA_VISIBLE_DEVICES=1 $G peak --out "$LOGS/peak1.json" > /dev/null 2>&1 &
  wait
  python3 -c "import json; print(json.dumps([json.load(open('$LOGS/peak%d.json' % i)) for i in (0, 1)]))" > "$OUT/peak.json"
  PEAK=$(python3 -c "import json; print(round(json.load(open('$LOGS/peak0.json'))['bf16_matmul_tflops'], 1))")
  elapsed "bf16 matmul peak $PEAK TFLOP/s (GPU 0); $(cat "$OUT/peak.json")"
}
summary() {
  tar czf "$OUT/logs.tar.gz" -C /tmp logs
  grep -h "\[qwen35rl\] step\|^trl step\|^memory \|^decode bench\|Error\|error:" "$LOGS"/*.log | cut -c1-300 | tail -40
}

case "$stage" in
gdn)
  bash bench/gpu/install-wheels.sh .whl-gdn .whl-cfg > "$LOGS/install-gdn.log" 2>&1 || { cat "$LOGS/install-gdn.log"; exit 1; }
  env_info > "$OUT/env.txt" 2>&1
  CUDA_VISIBLE_DEVICES=0 timeout 400 $G memory --out "$OUT/smoke.json" --smoke --decode-bench > "$LOGS/smoke.log" 2>&1
  elapsed "smoke done"
  summary
  ;;
main)
  if [ "${GDN:-torch}" = torch ]; then  # transformers' torch GDN code on both sides: no kernel compilation
    mkdir -p /tmp/whl-nofla && cp .whl/* /tmp/whl-nofla/ && rm -f /tmp/whl-nofla/fla_core-* /tmp/whl-nofla/flash_linear_attention-*
    bash bench/gpu/install-wheels.sh /tmp/whl-nofla > "$LOGS/install.log" 2>&1 || { cat "$LOGS/install.log"; exit 1; }
  else
    bash bench/gpu/install-wheels.sh .whl > "$LOGS/install.log" 2>&1 || { cat "$LOGS/install.log"; exit 1; }
  fi
  env_info > "$OUT/env.txt" 2>&1
  elapsed "installed: $(cat "$OUT/env.txt" | tail -2 | tr '\n' ' ')"
  peaks
  (
    CUDA_VISIBLE_DEVICES=0 $G qwen35rl --out "$OUT/q1.json" --run-dir "$RUNS/q1" --steps 4 --peak-tflops "$PEAK" \
      --timeout 420 > "$LOGS/q1.log" 2>&1
    elapsed "qwen35rl 1 GPU done: $(grep -c '\[qwen35rl\] step' "$LOGS/q1.log") steps"
  ) &
  (
    CUDA_VISIBLE_DEVICES=1 timeout 220 $G trl --out "$OUT/trl.json" --work-dir /tmp/trl --steps 3 > "$LOGS/trl.log" 2>&1
    elapsed "TRL done"
    CUDA_VISIBLE_DEVICES=1 timeout 230 $G memory --out "$OUT/memory.json" --profile --decode-bench --decode-tokens 16 \
      > "$LOGS/memory.log" 2>&1
    elapsed "memory calibration done"
  ) &
  wait
  rm -rf "$RUNS"
  summary
  ;;
multi)
  env_info > "$OUT/env.txt" 2>&1
  peaks
  CUDA_VISIBLE_DEVICES=0,1 $G qwen35rl --out "$OUT/q2.json" --run-dir "$RUNS/q2" --devices 2 --prompts 32 --steps 3 \
    --peak-tflops "$PEAK" --timeout 300 > "$LOGS/q2.log" 2>&1
  elapsed "qwen35rl 2 GPUs done: $(grep -c '\[qwen35rl\] step' "$LOGS/q2.log") steps"
  rm -rf "$RUNS"
  summary
  ;;
*) echo "unknown stage $stage"; exit 2 ;;
esac
elapsed "all done"
