#!/usr/bin/env bash
# Issue 9 item 5: throughput scaling 1 -> 2 -> 4 GPUs of the 4-layer V4-Flash cut (dummy weights, bf16), one process
# per GPU (--data-parallel-backend mp), plain data parallelism and expert parallelism, each twice, on a machine
# with at least 4 GPUs (nvidia-h100-x4 / nvidia-h200-x4). Prints one line per run; logs under $OUT.
#   CARRY=.devcarry/new bench/run_dp_scaling_device.sh
set -uo pipefail
CARRY=${CARRY:-.devcarry/new}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
gpus=$(nvidia-smi -L | wc -l)
echo "$gpus GPU(s): $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
MODEL=(--model bench/configs/v4_flash_4layer.json --load-format dummy --device cuda)
run() {  # $1: label, rest: flags
  local label=$1; shift
  timeout 240 "$CARRY/dsv4" bench throughput "${MODEL[@]}" --input-len 1024 --output-len 128 --num-prompts 256 \
    --data-parallel-backend mp "$@" --output-json "$OUT/$label.json" >"$OUT/$label.log" 2>&1
  echo "$label rc=$? $(grep -E 'Throughput|requests/s' "$OUT/$label.log" | tail -1)"
}
for repeat in 1 2; do
  for ranks in 1 2 4; do
    [ "$ranks" -le "$gpus" ] || continue
    run "dp${ranks}_r${repeat}" --data-parallel-size "$ranks"
    [ "$ranks" -gt 1 ] && run "ep${ranks}_r${repeat}" --data-parallel-size "$ranks" --enable-expert-parallel
  done
done
