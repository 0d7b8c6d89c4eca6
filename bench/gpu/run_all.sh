#!/usr/bin/env bash
# The H200 proof on a 2-GPU machine (nvidia-h200-x2) in three back-to-back device calls; results in $OUT.
# bench/results/h200.md has what each stage gave and how long it took.
#
#   bash bench/gpu/run_all.sh torch   (carry .whl .whl-x; ~8 min)
#       transformers' torch GDN code on both sides: GPU 0 qwen35rl GRPO through its CLI, GPU 1 at the same time
#       TRL's GRPOTrainer on the same workload; then the Megatron engine's numerics against transformers on both
#       GPUs (TP1 / TP2 / PP2 / EP2, megatron-core's torch GDN recurrence)
#   bash bench/gpu/run_all.sh fla     (carry .whl-gdn; machine still warm, so /tmp/site* are there; ~8 min)
#       GRPO with backend=megatron through the CLI (MoE at TP2 + EP2, dense at PP2); then the same pair as stage
#       torch with flash-linear-attention + TileLang for the GDN layers on both sides
#   bash bench/gpu/run_all.sh scale   (no carry, still warm; ~7 min)
#       qwen35rl on both GPUs (FSDP over NCCL, fla), twice the prompts; then the memory calibration with fla
#
# Installs (no network there): /tmp/site (Ray, Hydra, TRL, datasets), /tmp/site-fla (flash-linear-attention
# alone, for megatron-core), /tmp/site-mcore (megatron-core 0.19.2), /tmp/site-gdn (fla + TileLang). Which of them
# a job sees is its PYTHONPATH: without fla, transformers runs its torch GDN fallback.
# The hf rollout's decode step runs as a CUDA graph (rollout.cuda_graph, on by default). Every job has a time limit;
# JSON results are written as they come, so a job cut short still leaves its finished steps.
set -u
stage=${1:?usage: run_all.sh torch|fla|scale}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast
export PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false
export TRITON_CACHE_DIR=/tmp/kcache/triton TILELANG_CACHE_DIR=/tmp/kcache/tilelang  # kept while the machine is warm
OUT=${OUT:-/tmp/out}
LOGS=/tmp/logs/$stage
mkdir -p "$OUT" "$LOGS" /tmp/kcache
BASE=/tmp/site:$PWD
TORCH_PATH=$BASE                                   # transformers' torch GDN fallback
FLA_PATH=/tmp/site-gdn:$BASE                       # fla + TileLang
MCORE_PATH=/tmp/site-mcore:/tmp/site-fla:$BASE     # megatron-core (its GDN module imports fla)
G="python3 bench/gpu/grpo_h200.py"
t0=$(date +%s)
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
  PYTHONPATH=$BASE CUDA_VISIBLE_DEVICES=0 $G peak --out "$LOGS/peak0.json" > /dev/null 2>&1 &
  PYTHONPATH=$BASE CUDA_VISIBLE_DEVICES=1 $G peak --out "$LOGS/peak1.json" > /dev/null 2>&1 &
  wait
  python3 -c "import json; print(json.dumps([json.load(open('$LOGS/peak%d.json' % i)) for i in (0, 1)]))" > "$OUT/peak.json"
  PEAK=$(python3 -c "import json; print(round(json.load(open('$LOGS/peak0.json'))['bf16_matmul_tflops'], 1))")
  elapsed "bf16 matmul peak $PEAK TFLOP/s (GPU 0); $(cat "$OUT/peak.json")"
}
# qwen35rl (GPU 0) next to TRL (GPU 1) on the same workload; $1: label (torch | fla), $2: PYTHONPATH
pair() {
  local label=$1 path=$2
  mkdir -p "$OUT/$label"
  cp "$OUT/peak.json" "$OUT/$label/peak.json"
  (
    PYTHONPATH=$path CUDA_VISIBLE_DEVICES=0 $G qwen35rl --out "$OUT/$label/q1.json" --run-dir "$RUNS/q1-$label" \
      --steps 3 --peak-tflops "$PEAK" --timeout 220 > "$LOGS/q1-$label.log" 2>&1
    elapsed "qwen35rl 1 GPU ($label) done: $(grep -c '\[qwen35rl\] step' "$LOGS/q1-$label.log") steps"
    rm -rf "$RUNS/q1-$label"
  ) &
  (
    PYTHONPATH=$path CUDA_VISIBLE_DEVICES=1 timeout 220 $G trl --out "$OUT/$label/trl.json" --work-dir "/tmp/trl-$label" \
      --steps 3 > "$LOGS/trl-$label.log" 2>&1
    elapsed "TRL ($label) done: $(grep -c '^trl step' "$LOGS/trl-$label.log") steps"
  ) &
  wait
}
# GRPO with backend=megatron through the CLI; $1: name, $2: model, the rest: overrides
megatron_grpo() {
  local name=$1 model=$2; shift 2
  PYTHONPATH=$MCORE_PATH CUDA_VISIBLE_DEVICES=0,1 $G qwen35rl --out "$OUT/megatron/$name.json" --run-dir "$RUNS/$name" \
    --model "$model" --backend megatron --devices 2 --steps 3 --response-len 256 --micro 8 --peak-tflops "$PEAK" --timeout 150 \
    -- model.num_hidden_layers=4 +backend.transformer_overrides.deterministic_mode=true "$@" > "$LOGS/$name.log" 2>&1
  elapsed "megatron GRPO $name done: $(grep -c '\[qwen35rl\] step' "$LOGS/$name.log") steps"
  rm -rf "$RUNS/$name"
}
# .whl + .whl-x: Ray, Hydra, TRL into /tmp/site; fla alone into /tmp/site-fla; megatron-core into /tmp/site-mcore
install_base() {
  rm -rf /tmp/w /tmp/site /tmp/site-fla /tmp/site-mcore && mkdir -p /tmp/w/base /tmp/w/fla /tmp/w/mcore
  cp .whl/* /tmp/w/base/ && cp -f .whl-x/* /tmp/w/base/ \
    && mv /tmp/w/base/fla_core-* /tmp/w/base/flash_linear_attention-* /tmp/w/fla/ \
    && mv /tmp/w/base/megatron_core-* /tmp/w/mcore/ || { echo "wheel split failed"; exit 1; }
  { bash bench/gpu/install-wheels.sh /tmp/w/base && SITE=/tmp/site-fla bash bench/gpu/install-wheels.sh /tmp/w/fla \
    && SITE=/tmp/site-mcore bash bench/gpu/install-wheels.sh /tmp/w/mcore; } > "$LOGS/install.log" 2>&1 \
    || { cat "$LOGS/install.log"; exit 1; }
  PYTHONPATH=$TORCH_PATH python3 -c "import importlib.util as u, sys; sys.exit(u.find_spec('fla') is not None)" \
    || { echo "fla is importable from $TORCH_PATH: the torch-GDN runs would not be"; exit 1; }
}
summary() {
  tar czf "$OUT/logs-$stage.tar.gz" -C /tmp/logs "$stage"
  grep -h "\[qwen35rl\] step\|^trl step\|^memory \|^decode bench\|^| \|Error\|error:" "$LOGS"/*.log | cut -c1-300 | tail -60
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
  SITE=/tmp/site-gdn bash bench/gpu/install-wheels.sh .whl-gdn > "$LOGS/install.log" 2>&1 || { cat "$LOGS/install.log"; exit 1; }
  env_info > "$OUT/env-fla.txt" 2>&1
  elapsed "installed: $(tail -3 "$OUT/env-fla.txt" | tr '\n' ' ')"
  peaks
  mkdir -p "$OUT/megatron"
  megatron_grpo moe_tp2_ep2 qwen3_5_35b_a3b model.num_experts=64 parallelism.tp=2 parallelism.ep=2 parallelism.etp=1
  megatron_grpo dense_pp2 qwen3_5_0_8b parallelism.pp=2
  pair fla "$FLA_PATH"
  ;;
scale)
  [ -d .whl ] && install_base
  peaks
  mkdir -p "$OUT/megatron" "$OUT/torch"
  megatron_grpo moe_tp2_ep2 qwen3_5_35b_a3b model.num_experts=64 parallelism.tp=2 parallelism.ep=2 parallelism.etp=1
  PYTHONPATH=$TORCH_PATH CUDA_VISIBLE_DEVICES=0,1 $G qwen35rl --out "$OUT/torch/q2.json" --run-dir "$RUNS/q2" --devices 2 \
    --prompts 32 --steps 3 --peak-tflops "$PEAK" --timeout 220 > "$LOGS/q2.log" 2>&1
  elapsed "qwen35rl 2 GPUs done: $(grep -c '\[qwen35rl\] step' "$LOGS/q2.log") steps"
  rm -rf "$RUNS/q2"
  # the MoE half of the numerics (stage torch ran out of time after the dense layouts)
  PYTHONPATH=$MCORE_PATH timeout 150 torchrun --standalone --nproc_per_node=2 bench/gpu/megatron_numerics.py --steps 3 \
    --models moe --layouts ep2,tp2 --rows 4 --peak-tflops "$PEAK" --out "$OUT/megatron/numerics_moe.json" \
    > "$LOGS/numerics_moe.log" 2>&1
  elapsed "megatron numerics (MoE) done (exit $?)"
  megatron_grpo dense_pp2 qwen3_5_0_8b parallelism.pp=2
  ;;
*) echo "unknown stage $stage"; exit 2 ;;
esac
summary
elapsed "all done"
