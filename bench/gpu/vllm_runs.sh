#!/usr/bin/env bash
# GRPO with the vLLM rollout on one GPU, through qwen35rl-train: the runs of bench/results/vllm_gpu.md.
# vLLM 0.26.0 (it pins the machine's torch 2.11) comes in back-to-back device calls (the machine stays warm 30 s
# between calls, and /tmp with it):
#   bash bench/gpu/vllm_runs.sh stage     (carry .vllm-a)      -> "staged 1/2 parts"
#   bash bench/gpu/vllm_runs.sh stage     (carry .vllm-b)      -> "staged 2/2 parts"
#   bash bench/gpu/vllm_runs.sh gdn       (carry .whl-gdn)     fla + TileLang into /tmp/site-gdn
#   bash bench/gpu/vllm_runs.sh install   (carry .vllm-deps .whl-x, and .kcache-vllm if an earlier session brought
#        one back) installs vLLM, Hydra, megatron-core, TRL and writes the data
#   bash bench/gpu/vllm_runs.sh warmup    a 2-step run that compiles the kernels (a cold vLLM start took 194 s on an
#        H100) and brings the caches back as $OUT/kcache-vllm.tar.gz (unpack into .kcache-vllm/, carry it next time)
# Stages run one after another in one call (`install megatron`); each run gets what is left of the call's 10 min,
# and a run cut off by the limit continues from its checkpoint when its stage is called again.
#   bash bench/gpu/vllm_runs.sh text      run A: 0.8B architecture, FSDP + vLLM colocated, GSM8K-shaped text, 50 steps
#   bash bench/gpu/vllm_runs.sh images    run B: the same on Geometry3K-shaped images
#   bash bench/gpu/vllm_runs.sh textl     runs A / B on the byte-sized vocabulary with a reward the policy can learn
#   bash bench/gpu/vllm_runs.sh imagesl   (LEARN, as run C)
#   bash bench/gpu/vllm_runs.sh megatron  run C: Megatron TP1 + vLLM on the images, byte-sized vocabulary (LEARN)
#   bash bench/gpu/vllm_runs.sh warm4b    run D's kernels compiled (2 steps, killed), so that `4b` fits one call
#   bash bench/gpu/vllm_runs.sh 4b        run D: 4B architecture, FSDP + vLLM, text
#   bash bench/gpu/vllm_runs.sh 4bmax follow   run D at the largest micro batch the plan accepts on the card (B4
#        prompts, default 32: 256 responses in one micro batch on an H100), started in its own process session so
#        that it outlives the call; `follow` (again in each next back-to-back call) brings its files back and ends
#        it once it has logged its steps (before its final checkpoint, 48 GB of host states)
#   bash bench/gpu/vllm_runs.sh caches    the compiled kernels of this machine's runs into $OUT/kcache/ (parts of 15 MiB),
#        for the next session's `install` to carry in as .kcache-vllm/
#   bash bench/gpu/vllm_runs.sh peers     bare vLLM generate and TRL's GRPOTrainer (vLLM colocate) on run A's workload
#   bash bench/gpu/vllm_runs.sh trl       TRL's half of peers alone (TRL_EXTRA: overrides of the shared workload, e.g.
#        TRL_EXTRA=model.vocab_size=320 for run A's learnable variant `textl`: both sides on the same vocabulary;
#        results in $OUT/peers/trl-x.json)
# Each run's card memory comes from the device (hw.memory_gb), never a constant. Kernel caches live in
# /tmp/kcache (trainer.kernel_cache_dir) for the whole warm machine: the first engine start compiles, later ones
# reuse. Results: $OUT/<run>/ (metrics.jsonl, plan.json, the log's tail) and one summary line per run.
set -u
[ $# -gt 0 ] || { echo "usage: vllm_runs.sh STAGE... (stage gdn install warmup text images textl imagesl megatron warm4b 4b 4bmax follow caches peers trl)"; exit 2; }
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false RAY_AUTH_MODE=disabled
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-/tmp/out}
LOGS=/tmp/logs/vllm
KCACHE=/tmp/kcache
RUNS=/tmp/runs
mkdir -p "$OUT" "$LOGS" "$KCACHE" "$RUNS"
export PYTHONPATH=/tmp/site:/tmp/site-gdn:$PWD
t0=$(date +%s)
elapsed() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
left() { echo $(( ${1:-585} - ($(date +%s) - t0) )); }

card() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch; p = torch.cuda.get_device_properties(0); print(int(p.total_memory / 1e9))"
}

# $1: run name, $2: time limit (s), then Hydra overrides. The plan of the same overrides goes beside the metrics.
# A run stopped at the call's time limit (SIGINT: the step in flight finishes and checkpoints) continues from its
# checkpoint when the same stage runs again on the warm machine (trainer.resume=auto); FRESH=1 starts it over.
q_run() {
  local name=$1 limit=$2; shift 2
  local dir="$RUNS/$name"
  [ "${FRESH:-0}" = 1 ] && rm -rf "$dir"
  [ "$limit" -lt 120 ] && { elapsed "run $name: only $limit s left in this call, not started"; return; }
  mkdir -p "$OUT/$name"
  python3 -m qwen35rl.cli.plan "$@" format=json > "$OUT/$name/plan.json" 2> "$LOGS/$name-plan.log"
  elapsed "plan $name: exit $? ($(python3 -c "import json; p = json.load(open('$OUT/$name/plan.json')); m = p['memory_gib']; print('valid', p['valid'], 'train', round(m['train_peak'], 1), 'rollout', round(m['rollout_peak'], 1), 'usable', round(m['capacity'], 1), p.get('vllm'))" 2>&1 | tail -1))"
  # metrics and the log's tail copied as they grow: a call cut off at its limit still brings them back
  # and which process holds how much of the device (the driver, the workers), with the step reached
  ( while sleep 10; do cp "$dir/metrics.jsonl" "$OUT/$name/" 2>/dev/null
      tail -c 20000 "$LOGS/$name.log" > "$OUT/$name/log-tail.txt"
      echo "$(date +%T) steps=$(wc -l 2>/dev/null < "$dir/metrics.jsonl") $(nvidia-smi --query-compute-apps=pid,used_memory \
        --format=csv,noheader 2>&1 | while IFS=, read -r pid mem; do echo -n "$pid:$(ps -o comm= -p "$pid" 2>/dev/null):$mem;"; done)" \
        >> "$OUT/$name/gpu-procs.txt"; done ) &
  local copier=$!
  timeout -s INT -k 90 "$limit" python3 -m qwen35rl.cli.train "hydra.run.dir=$dir" trainer.stop_timeout_s=75 "$@" \
    >> "$LOGS/$name.log" 2>&1
  local rc=$?
  kill $copier 2>/dev/null
  cp "$dir/metrics.jsonl" "$OUT/$name/" 2>/dev/null
  tail -c 20000 "$LOGS/$name.log" > "$OUT/$name/log-tail.txt"
  grep -h "engine started\|kernel caches\|resum\|out of memory\|Error\|error:" "$LOGS/$name.log" | cut -c1-400 | tail -8
  # this launch's start-up, line by line up to its first step (where the minutes before it go)
  awk -v from="$(grep -n "libraries imported" "$LOGS/$name.log" | tail -1 | cut -d: -f1)" \
    'NR >= from && !/it\/s\]|^Autotuning kernel|with config/ {print substr($0, 1, 300)} NR >= from && /first step in/ {exit}' \
    "$LOGS/$name.log" > "$OUT/$name/log-start.txt"
  elapsed "run $name: exit $rc, $(wc -l 2>/dev/null < "$dir/metrics.jsonl" || echo 0) steps logged"
  python3 bench/gpu/vllm_summary.py "$OUT/$name" | tee "$OUT/$name/summary.txt"
}

data() {
  python3 bench/gpu/learnable.py write_gsm8k_like /tmp/data/gsm8k/train.jsonl 2048 \
    && python3 bench/gpu/learnable.py write_gsm8k_like /tmp/data/gsm8k/test.jsonl 32 1 \
    && python3 -c "from pathlib import Path; from tests.runtime.geo3k_fixture import write_geo3k
write_geo3k(Path('/tmp/data/geo3k/train.parquet'), 1024); write_geo3k(Path('/tmp/data/geo3k/test.parquet'), 16, seed=1)" \
    || { echo "data fixtures failed"; exit 1; }
}

MEM() { python3 -c "import torch; print(int(torch.cuda.get_device_properties(0).total_memory / 1e9))"; }
# The workload every run shares: random-init weights, byte tokenizer, the decoded-length reward
# (bench/gpu/learnable.py), 50 steps, no Ray (one GPU), kernel caches kept on the machine, the trainer's own old
# log-probs (so that the vLLM / trainer log-prob gap is logged).
common() {
  echo model.init=random model.tokenizer=byte hw=gpu_1x "hw.memory_gb=$(MEM)" rollout=vllm \
    trainer.total_steps=${STEPS:-50} trainer.launcher=local trainer.export_hf=false trainer.test_freq=-1 \
    trainer.resume=auto "trainer.trackers=[console,jsonl]" "trainer.kernel_cache_dir=$KCACHE" \
    data.reward=bench.gpu.learnable:decoded_length backend.lr=2e-5 backend.lr_warmup_steps=0 trainer.seed=1 \
    backend.use_rollout_log_probs=false
}
TEXT=(data=gsm8k "data.train_files=[/tmp/data/gsm8k/train.jsonl]" "data.val_files=[/tmp/data/gsm8k/test.jsonl]")
IMAGES=(data=geo3k "data.train_files=[/tmp/data/geo3k/train.parquet]" "data.val_files=[/tmp/data/geo3k/test.parquet]")
SMALL=(data.train_batch_size=8 algorithm.mini_batch_size=8 rollout.n=8 data.max_prompt_length=256
       data.max_response_length=128 backend.micro_batch_size_per_device=16)
# A byte-sized vocabulary (the byte tokenizer's 256 bytes + specials) so that a random-init policy samples text and
# the digit-share reward has spread within a group: a task the policy can learn in 50 steps (over the 248k
# vocabulary a random policy rarely samples a byte token and the reward stays flat).
LEARN=(model.vocab_size=320 data.reward=bench.gpu.learnable:digit_share backend.lr=1e-4)
MEGATRON=(backend=megatron backend.megatron_core_version=0.19.2 backend.param_offload=false
          backend.grad_offload=false backend.optimizer_offload=false backend.optimizer_cpu_offload=false)

# run D: the 4B policy's fp32 weights, gradients and Adam states (64 GB) live on the host (FSDP2 CPU offload), beside
# vLLM's pool of 0.4 of the card
D4=(data.train_batch_size=${B4:-8} "algorithm.mini_batch_size=${B4:-8}" rollout.n=8 data.max_prompt_length=256
    data.max_response_length=128 backend.micro_batch_size_per_device=auto backend.optimizer_offload=true
    rollout.gpu_memory_utilization=0.4)

trl_peer() {
  timeout "$(left 580)" python3 bench/gpu/peers.py trl-vllm "${W[@]}" --micro 16 --steps ${TRL_STEPS:-8} \
    --work-dir /tmp/peers/trl${TRL_EXTRA:+-x} --out "$OUT/peers/trl${TRL_EXTRA:+-x}.json" ${TRL_EXTRA:-} 2>&1 | tail -12
  elapsed "TRL (vLLM colocate) done"
}

for stage in "$@"; do
case "$stage" in
stage)
  bash bench/gpu/install-vllm.sh ;;
gdn)
  rm -rf /tmp/site-gdn && SITE=/tmp/site-gdn bash bench/gpu/install-wheels.sh .whl-gdn 2>&1 | tail -2 ;;
install)
  card
  bash bench/gpu/install-vllm.sh 2>&1 | tail -3 || exit 1
  SITE=/tmp/site bash bench/gpu/install-wheels.sh .whl-x 2>&1 | tail -1
  python3 -c "import vllm, hydra, fla, tilelang, megatron.core, trl; print('imports ok: vllm', vllm.__version__)" 2>&1 | tail -1
  [ -f /tmp/data/geo3k/test.parquet ] || data
  [ -f .kcache-vllm/kcache-vllm.tar.gz ] || { ls .kcache-vllm/kcache-vllm.tar.gz.part-? > /dev/null 2>&1 \
    && cat .kcache-vllm/kcache-vllm.tar.gz.part-? > .kcache-vllm/kcache-vllm.tar.gz; }
  [ -f .kcache-vllm/kcache-vllm.tar.gz ] && tar xzf .kcache-vllm/kcache-vllm.tar.gz -C "$KCACHE" && echo "kernel caches carried in"
  ;;
warmup)
  STEPS=2 FRESH=1 q_run warmup "$(left 540)" model=qwen3_5_0_8b backend=fsdp $(common) "${TEXT[@]}" "${SMALL[@]}"
  # what the next machine needs to start warm: Triton's compiled kernels and autotuning results, vLLM's compile
  # cache (Inductor's and TileLang's are rebuilt from these quickly)
  (cd "$KCACHE" && tar czf "$OUT/kcache-vllm.tar.gz" triton vllm 2>/dev/null); ls -la "$OUT/kcache-vllm.tar.gz"
  ;;
text)
  card
  q_run text-0.8b "$(left 480)" model=qwen3_5_0_8b backend=fsdp $(common) "${TEXT[@]}" "${SMALL[@]}"
  ;;
images)
  card
  q_run images-0.8b-fsdp "$(left 480)" model=qwen3_5_0_8b backend=fsdp $(common) "${IMAGES[@]}" "${SMALL[@]}"
  ;;
textl|imagesl)
  # runs A and B on the byte-sized vocabulary with the digit-share reward (LEARN): a task the policy can learn
  card
  if [ "$stage" = textl ]; then name=text-0.8b-fsdp-learn; set_=("${TEXT[@]}"); else name=images-0.8b-fsdp-learn; set_=("${IMAGES[@]}"); fi
  # LIMIT: seconds of the call the run may use (default 540); EXTRA: more overrides (e.g. rollout.enforce_eager=true);
  # NAME: the run's name instead (a variant of the same run beside the first, e.g. its warm start with STEPS=3)
  name=${NAME:-$name}
  q_run "$name" "$(left ${LIMIT:-540})" model=qwen3_5_0_8b backend=fsdp $(common) "${set_[@]}" "${SMALL[@]}" "${LEARN[@]}" \
    ${EXTRA:-}
  ;;
megatron)
  card
  q_run images-0.8b-megatron "$(left 480)" model=qwen3_5_0_8b "${MEGATRON[@]}" $(common) "${IMAGES[@]}" "${SMALL[@]}" \
    "${LEARN[@]}" rollout.gpu_memory_utilization=0.5
  ;;
warm4b)
  # run D's kernels compiled (vLLM's torch.compile, Triton autotuning of the 4B shapes) into /tmp/kcache, so that
  # the `4b` call's 10 minutes go to its 50 steps: two steps, then the process is killed (a 4B checkpoint with
  # host Adam states takes minutes to write and the next run starts fresh anyway)
  card
  FRESH=1 q_run warm-4b "$(left 560)" model=qwen3_5_4b backend=fsdp $(common) "${TEXT[@]}" "${D4[@]}" &
  qpid=$!
  while kill -0 $qpid 2>/dev/null && [ "$(cat "$RUNS/warm-4b/metrics.jsonl" 2>/dev/null | wc -l)" -lt 2 ]; do sleep 2; done
  pkill -9 -f "hydra.run.dir=$RUNS/warm-4b"; wait $qpid
  ;;
4b)
  # one mini batch per step: one host optimizer step, and the update's own pass is the old log-probs (no separate
  # pass); it logs the vLLM / trainer gap (rollout/logprob_diff_*) itself. The call's whole limit: the 50th step is
  # logged before the final checkpoint (48 GB of host states) would be written, which the limit may cut short
  card
  q_run text-4b-fsdp "$(left ${LIMIT:-585})" model=qwen3_5_4b backend=fsdp $(common) "${TEXT[@]}" "${D4[@]}"
  ;;
4bmax)
  # started in a new process session: the device keeps it running while the machine stays warm between calls
  card
  mkdir -p /tmp/det
  B4=${B4:-32} OUT=/tmp/det setsid nohup bash bench/gpu/vllm_runs.sh _4bmax > "$LOGS/4bmax.out" 2>&1 < /dev/null &
  elapsed "run D at B4=${B4:-32} prompts started in its own session (pid $!)"
  ;;
_4bmax)
  # no KL term (no reference pass) so that 50 steps of 256 responses fit the session's device time
  q_run text-4b-max "${DLIMIT:-1700}" model=qwen3_5_4b backend=fsdp $(common) "${TEXT[@]}" "${D4[@]}" \
    algorithm.use_kl_loss=false
  ;;
follow)
  # the detached run's files into $OUT every 5 s; ends at the call's limit, when the run ends, or once it has logged
  # STEPS steps (then it is killed: its final checkpoint would take minutes and is not needed)
  name=${FOLLOW:-text-4b-max}
  while :; do
    mkdir -p "$OUT/$name"; cp /tmp/det/$name/* "$OUT/$name/" 2>/dev/null
    n=$(cat "$RUNS/$name/metrics.jsonl" 2>/dev/null | wc -l)
    if [ "$n" -ge "${STEPS:-50}" ]; then
      pkill -9 -f "hydra.run.dir=$RUNS/$name"; elapsed "run $name: $n steps logged, stopped"; break
    fi
    pgrep -f "vllm_runs.sh _" > /dev/null || { elapsed "run $name: not running ($n steps)"; break; }
    [ "$(left 590)" -lt 12 ] && { elapsed "run $name: still running, $n steps logged"; break; }
    sleep 5
  done
  cp "$RUNS/$name/metrics.jsonl" "$OUT/$name/" 2>/dev/null
  tail -c 20000 "$LOGS/$name.log" > "$OUT/$name/log-tail.txt"
  grep -h "engine started\|engines built\|first step\|out of memory\|Error\|error:" "$LOGS/$name.log" | cut -c1-300 | tail -8
  python3 bench/gpu/vllm_summary.py "$OUT/$name" | tee "$OUT/$name/summary.txt"
  ;;
caches)
  # the compiled kernels of this machine's runs (Triton, TileLang, Inductor, vLLM's compile cache), for the next
  # machine to start warm: $OUT/kcache/kcache-vllm.tar.gz.part-?, at most 3 parts of 15 MiB (the files that come
  # back are limited); join them into .kcache-vllm/kcache-vllm.tar.gz and carry that with `install`
  mkdir -p "$OUT/kcache"
  (cd "$KCACHE" && nice -n 19 tar czf /tmp/kcache-vllm.tar.gz $(ls -d triton tilelang inductor vllm 2>/dev/null))
  size=$(stat -c %s /tmp/kcache-vllm.tar.gz)
  if [ "$size" -le $((45 * 1048576)) ]; then split -b 15M -a 1 /tmp/kcache-vllm.tar.gz "$OUT/kcache/kcache-vllm.tar.gz.part-"
  else echo "kernel caches: $size bytes, more than the 45 MiB that may come back"; fi
  du -sh "$KCACHE"/* 2>/dev/null; elapsed "kernel caches packed: $size bytes"
  ;;
peers)
  # run A's workload: 8 prompts x 8, prompts of 256 tokens, responses of 128; vLLM at the same memory share
  card
  W=(--model qwen3_5_0_8b --prompts 8 --n 8 --prompt-len 256 --response-len 128 --gpu-memory-utilization 0.6)
  python3 bench/gpu/peers.py bare-vllm "${W[@]}" --model-dir /tmp/peers/ckpt08 --write-model \
    --out "$OUT/peers/bare.json" --timeout "$(( $(left 585) / 3 ))" 2>&1 | tail -12
  elapsed "bare vLLM against qwen35rl's engine done"
  trl_peer
  ;;
trl)
  # the TRL half of `peers` alone
  card
  W=(--model qwen3_5_0_8b --prompts 8 --n 8 --prompt-len 256 --response-len 128 --gpu-memory-utilization 0.6)
  trl_peer
  ;;
*) echo "unknown stage $stage"; exit 2 ;;
esac
done
elapsed "done"
