#!/usr/bin/env bash
# Bring up Ray on Ascend NPU nodes (A2: 8 devices per node, A3: 16 dies per node), then run qwen35rl-train.
#
# On the head node:     launch/ascend_ray.sh head   [qwen35rl-train overrides...]
# On every other node:  HEAD_IP=<head ip> launch/ascend_ray.sh worker
# The head starts the run once NNODES nodes have joined, e.g.
#   NNODES=16 NPUS_PER_NODE=16 launch/ascend_ray.sh head model=qwen3_5_397b_a17b hw=a3_16node backend=megatron
#
# Ray does not count Ascend devices by itself in every version: each node advertises them as the custom
# resource NPU (hw.ray_resource), one placement-group bundle per die. The environment below is what CANN,
# HCCL and vllm-ascend need on every node; the run also hands hw.env to each worker through Ray's runtime env.
# Knobs: NPUS_PER_NODE (16), NNODES (1), RAY_PORT (6379), ASCEND_TOOLKIT (/usr/local/Ascend/ascend-toolkit),
# HCCL_CONNECT_TIMEOUT (1500; 5400 for 122B / 397B), NODE_IP (this node's address for HCCL and Ray).
set -euo pipefail

role=${1:?usage: ascend_ray.sh head|worker [qwen35rl-train overrides...]}
shift
NPUS_PER_NODE=${NPUS_PER_NODE:-16}
NNODES=${NNODES:-1}
RAY_PORT=${RAY_PORT:-6379}
NODE_IP=${NODE_IP:-$(hostname -I | awk '{print $1}')}

# CANN toolkit (and NNAL/ATB when installed) must be sourced before torch_npu imports.
source "${ASCEND_TOOLKIT:-/usr/local/Ascend/ascend-toolkit}/set_env.sh"
[ -f /usr/local/Ascend/nnal/atb/set_env.sh ] && source /usr/local/Ascend/nnal/atb/set_env.sh

export HCCL_CONNECT_TIMEOUT=${HCCL_CONNECT_TIMEOUT:-1500}
export HCCL_IF_IP=$NODE_IP
export HCCL_HOST_SOCKET_PORT_RANGE=60000-60050
export HCCL_NPU_SOCKET_PORT_RANGE=61000-61050
export RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES=1   # every die stays visible; the runtime picks its own
export RAY_DEDUP_LOGS=0
export NDEVICES_PER_NODE=$NPUS_PER_NODE

case "$role" in
  head)
    ray start --head --node-ip-address="$NODE_IP" --port="$RAY_PORT" \
        --resources="{\"NPU\": $NPUS_PER_NODE}" --disable-usage-stats
    python -m qwen35rl.runtime.wait_for_nodes "$NNODES" auto 900
    qwen35rl-train ray_address=auto hw.nodes="$NNODES" hw.devices_per_node="$NPUS_PER_NODE" "$@"
    ;;
  worker)
    : "${HEAD_IP:?set HEAD_IP to the address of the head node}"
    ray start --address="$HEAD_IP:$RAY_PORT" --node-ip-address="$NODE_IP" \
        --resources="{\"NPU\": $NPUS_PER_NODE}" --disable-usage-stats --block
    ;;
  *)
    echo "unknown role '$role': expected head or worker" >&2
    exit 2
    ;;
esac
