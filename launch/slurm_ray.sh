#!/usr/bin/env bash
# Start a Ray cluster over a Slurm allocation, then run qwen35rl-train on it from the head node.
#
#   sbatch --nodes=16 launch/slurm_ray.sh model=qwen3_5_397b_a17b hw=gpu_16node backend=megatron
#
# Every argument goes to qwen35rl-train. hw.nodes must match the allocation (checked below). The run directory
# (trainer.output_root) must be on a file system every node sees: checkpoints are written by all ranks.
# Environment knobs: RAY_PORT (6379), NUM_DEVICES (devices per node; default: GPUs Slurm gives the job),
# RAY_AUTH_MODE (token with a token in a shared ~/.ray/auth_token on multi-user clusters; see launch/README.md),
# VENV (a virtual environment to activate on every node).
#SBATCH --job-name=qwen35rl
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --exclusive
#SBATCH --output=qwen35rl-%j.log
set -euo pipefail

RAY_PORT=${RAY_PORT:-6379}
NUM_DEVICES=${NUM_DEVICES:-${SLURM_GPUS_ON_NODE:-8}}
ACTIVATE=${VENV:+source "$VENV/bin/activate" &&}

mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
head_node=${nodes[0]}
head_ip=$(srun --nodes=1 --ntasks=1 -w "$head_node" hostname --ip-address | awk '{print $1}')
echo "[qwen35rl] Ray head on $head_node ($head_ip:$RAY_PORT), ${#nodes[@]} node(s) x $NUM_DEVICES device(s)"

# --block keeps each `ray start` in the foreground of its srun step, so Slurm tears Ray down with the job.
srun --nodes=1 --ntasks=1 -w "$head_node" bash -c "$ACTIVATE ray start --head --node-ip-address=$head_ip \
    --port=$RAY_PORT --num-gpus=$NUM_DEVICES --disable-usage-stats --block" &
sleep 15
for node in "${nodes[@]:1}"; do
  srun --nodes=1 --ntasks=1 -w "$node" bash -c "$ACTIVATE ray start --address=$head_ip:$RAY_PORT \
      --num-gpus=$NUM_DEVICES --disable-usage-stats --block" &
done

# Wait until every node has joined before the run asks for its placement groups.
${VENV:+source "$VENV/bin/activate"}
python -m qwen35rl.runtime.wait_for_nodes "${#nodes[@]}" "$head_ip:$RAY_PORT" 600

export RAY_ADDRESS="$head_ip:$RAY_PORT"
qwen35rl-train ray_address="$RAY_ADDRESS" hw.nodes="${#nodes[@]}" hw.devices_per_node="$NUM_DEVICES" "$@"
