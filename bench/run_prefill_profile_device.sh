#!/usr/bin/env bash
# One device run: where a prefill of the 4-layer V4-Flash cut goes, kernel by kernel (ncu kernel durations summed
# per kernel name, tools/reference/ncu_summary.py), beside the end-to-end bench latency figures of the same binary.
#   CARRY=.devcarry/new bench/run_prefill_profile_device.sh [input_len, default 4096]
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/device_env.sh"
LEN=${1:-4096}
timeout 200 "$CARRY/dsv4" bench latency "${MODEL[@]}" --input-len 1024 --output-len 64 --batch-size 1,8 \
  > "$OUT/latency_decode.log" 2>&1; echo "decode bench rc=$?"
timeout 120 "$CARRY/dsv4" bench latency "${MODEL[@]}" --input-len "$LEN" --output-len 2 --batch-size 1 \
  > "$OUT/latency_prefill.log" 2>&1; echo "prefill bench rc=$?"
DSV4_CUDA_GRAPHS=0 timeout 300 ncu --metrics gpu__time_duration.sum --csv --print-units base --cache-control none \
  --clock-control none "$CARRY/dsv4" bench latency "${MODEL[@]}" --input-len "$LEN" --output-len 1 --batch-size 1 \
  --num-iters-warmup 0 --num-iters 1 > "$OUT/ncu_prefill.csv" 2> "$OUT/ncu_prefill.err"; echo "ncu rc=$?"
grep -E "ms|tok" "$OUT/latency_decode.log" | tail -8
grep -E "ms|tok" "$OUT/latency_prefill.log" | tail -5
python3 tools/reference/ncu_summary.py "$OUT/ncu_prefill.csv" 30
