#!/usr/bin/env bash
# This machine's part of a GRPO job that spans several machines: run the same command on every
# node, changing only --node_rank (0 on the machine whose address is --master_addr). Each node
# starts --workers_per_node workers with msrun; together they form one job of nodes x workers
# ranks, laid out by the training flags after `--` (which must multiply to that many ranks), e.g.
#
#   bash scripts/launch_node.sh --nodes 2 --node_rank 0 --master_addr 10.0.0.1 --workers_per_node 8 \
#       -- --config model_configs/qwen_grpo/grpo_qwen2_5_7b_8p.yaml --train_dp 2
#
# Every node needs the repository, the environment mindrlhf is installed in (activated: msrun must
# be on PATH), the model and the data at the same paths. Rank 0 writes the outputs.
set -euo pipefail
nodes="" node_rank="" master_addr="" workers=1 port=8118 log_dir=""
usage="usage: bash scripts/launch_node.sh --nodes N --node_rank R --master_addr ADDR [--workers_per_node W] [--master_port P] [--log_dir DIR] -- TRAINING_FLAGS"
while [ $# -gt 0 ]; do
  case "$1" in
    --nodes) nodes="${2:-}"; shift 2 ;;
    --node_rank) node_rank="${2:-}"; shift 2 ;;
    --master_addr) master_addr="${2:-}"; shift 2 ;;
    --workers_per_node) workers="${2:-}"; shift 2 ;;
    --master_port) port="${2:-}"; shift 2 ;;
    --log_dir) log_dir="${2:-}"; shift 2 ;;
    --) shift; break ;;
    -h|--help) echo "$usage"; exit 0 ;;
    *) echo "error: unknown option $1: launcher options come before --, the training flags after it" >&2
       echo "$usage" >&2; exit 2 ;;
  esac
done
for name in nodes node_rank workers port; do
  value="${!name}"
  if ! [[ "$value" =~ ^[0-9]+$ ]]; then
    echo "error: --${name/workers/workers_per_node} '${value}' must be a whole number" >&2; echo "$usage" >&2; exit 2
  fi
done
if [ -z "$master_addr" ] || [ "$nodes" -lt 1 ] || [ "$workers" -lt 1 ]; then
  echo "error: --nodes and --workers_per_node must be >= 1 and --master_addr is required" >&2; echo "$usage" >&2; exit 2
fi
if [ "$node_rank" -ge "$nodes" ]; then
  echo "error: --node_rank $node_rank must be below --nodes $nodes (nodes count from 0)" >&2; exit 2
fi
command -v msrun >/dev/null || {
  echo "error: msrun not found; activate the environment mindrlhf is installed in (e.g. source .venv/bin/activate)" >&2
  exit 2
}
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
exec msrun --worker_num=$((nodes * workers)) --local_worker_num="$workers" --node_rank="$node_rank" \
  --master_addr="$master_addr" --master_port="$port" --join=True \
  --log_dir="${log_dir:-output/msrun_logs/node_$node_rank}" \
  "$repo/examples/grpo/qwen_grpo_tutorial/grpo_one_stage.py" --use_parallel true "$@"
