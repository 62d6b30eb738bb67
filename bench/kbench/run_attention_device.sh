#!/usr/bin/env bash
# One device run for the sparse attention kernels (docs/kernels/attention.md), most important first (each step
# logs under $OUT, so a cut-off run still returns what it finished): the attention GPU tests (both kernels), then
# dsv4_kbench --suite attention with the warpgroup-MMA kernel and with DSV4_ATTENTION_KERNEL=mma, joined case by
# case, then the 4-layer V4-Flash cut end to end with each kernel (4K prefill twice each, 1K-context decode at
# batch 1 and 8), and with PROFILE=1 ncu's per-layer attention times of a 4K prefill. Carry the build in
# .devcarry/new (dsv4, dsv4_gpu_tests, dsv4_kbench).   bench/kbench/run_attention_device.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
NEW=.devcarry/new
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 120 $NEW/dsv4_gpu_tests --gtest_filter='CudaSparseAttention*' > "$OUT/attention_tests.log" 2>&1
echo "attention tests rc=$?"
grep -E "^\[  (PASSED|FAILED) |Failure|Expected|Which is" "$OUT/attention_tests.log" | head -12
rows() { sed -n '/^case /,$p' "$1" | tail -n +2 | awk '{printf "%s %s %s %s %s|%s\n", $1, $2, $3, $4, $5, $6}' | sort; }
for kernel in wgmma mma; do
  DSV4_ATTENTION_KERNEL=$kernel timeout 120 $NEW/dsv4_kbench --suite attention > "$OUT/kbench_$kernel.log" 2>&1
  echo "kbench $kernel rc=$?"
done
echo "case|wgmma us|mma us"
join -t'|' <(rows "$OUT/kbench_wgmma.log") <(rows "$OUT/kbench_mma.log")
MODEL=(--model bench/configs/v4_flash_4layer.json --load-format dummy --device cuda --num-iters 3)
for kernel in wgmma mma wgmma mma; do
  DSV4_ATTENTION_KERNEL=$kernel timeout 60 $NEW/dsv4 bench latency "${MODEL[@]}" --input-len 4096 --output-len 2 \
    --batch-size 1 2>&1 | grep -E "Prefill|rror" | sed "s/^/4K prefill, $kernel: /"
done
for kernel in wgmma mma; do
  DSV4_ATTENTION_KERNEL=$kernel timeout 90 $NEW/dsv4 bench latency "${MODEL[@]}" --input-len 1024 --output-len 64 \
    --batch-size 1,8 2>&1 | grep -E "Decode|rror" | sed "s/^/1K decode, $kernel: /"
done
if [ "${PROFILE:-0}" = 1 ]; then
  for kernel in wgmma mma; do
    DSV4_ATTENTION_KERNEL=$kernel DSV4_CUDA_GRAPHS=0 timeout 150 ncu --metrics gpu__time_duration.sum --csv \
      --print-units base -k regex:"sparse_attention" $NEW/dsv4 bench latency "${MODEL[@]}" --input-len 4096 \
      --output-len 1 --batch-size 1 --num-iters-warmup 0 --num-iters 1 > "$OUT/ncu_prefill_$kernel.csv" 2>&1
    echo "per-layer attention of a 4K prefill, $kernel (us):" $(grep '"gpu__time_duration.sum"' "$OUT/ncu_prefill_$kernel.csv" \
      | head -4 | awk -F'","' '{gsub(/[",]/, "", $NF); printf "%.0f ", $NF / 1000}')
  done
fi
gzip -f "$OUT"/*.log "$OUT"/*.csv 2>/dev/null
