#!/usr/bin/env bash
# One device run: where a decode step of the 4-layer V4-Flash cut goes (issue 8), most important first, each step
# logging under $OUT so a cut-off run still returns what it finished:
#   1. `dsv4 bench latency` at batch 1 and 8 (CUDA graphs: the headline figures);
#   2. one decode step as it runs in the graph (CUPTI's kernel records, DSV4_KERNEL_TRACE), then kernel by kernel: ncu
#      kernel durations of two eager runs that differ by 8 decode steps, subtracted per kernel name and divided
#      by 8 (tools/reference/ncu_summary.py --minus);
#   3. why the decode GEMV streams the 64 MiB projections below the copy rate (72 % on the H200, 83 % on the H100,
#      docs/PERF.md): ncu's DRAM throughput, occupancy and stall reasons for skinny_gemm on wq_b and wo_b, one row.
#   CARRY=.devcarry/new bench/run_decode_profile_device.sh [batch, default 1]
# Carry a build in $CARRY (dsv4, dsv4_kbench).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/device_env.sh"
BATCH=${1:-1}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout 200 "$CARRY/dsv4" bench latency "${MODEL[@]}" --input-len 1024 --output-len 64 --batch-size 1,8 \
  > "$OUT/latency_decode.log" 2>&1; echo "decode bench rc=$?"
grep -E "bench latency on|Decode" "$OUT/latency_decode.log"
# 2a. The step as it runs in the graph (PDL overlap and side streams included): the kernels CUPTI recorded
#     (DSV4_KERNEL_TRACE, ops/cuda/kernel_trace.h; the lent machines' nsys cannot import its own reports), each
#     step's wall time split over its kernels (tools/reference/kernel_step_timeline.py).
CUPTI=$(ls /usr/local/cuda/extras/CUPTI/lib64/libcupti.so* /usr/local/cuda/lib64/libcupti.so* 2>/dev/null | head -1)
[ -z "$CUPTI" ] && CUPTI=$(timeout 30 find / -xdev -name 'libcupti.so*' 2>/dev/null | head -1)
for b in "$BATCH" 8; do
  DSV4_CUPTI_LIBRARY="$CUPTI" DSV4_KERNEL_TRACE="$OUT/trace_b$b.csv" timeout 120 "$CARRY/dsv4" bench latency "${MODEL[@]}" \
    --input-len 1024 --output-len 24 --batch-size "$b" --num-iters-warmup 0 --num-iters 1 > "$OUT/trace_b$b.log" 2>&1
  echo "kernel trace batch $b rc=$? ($(tail -1 "$OUT/trace_b$b.log"))"
  python3 tools/reference/kernel_step_timeline.py "$OUT/trace_b$b.csv" 45 --steps 8
done
for steps in 2 10; do
  DSV4_CUDA_GRAPHS=0 timeout 240 ncu --metrics gpu__time_duration.sum --csv --print-units base --cache-control none \
    --clock-control none "$CARRY/dsv4" bench latency "${MODEL[@]}" --input-len 1024 --output-len "$steps" \
    --batch-size "$BATCH" --num-iters-warmup 0 --num-iters 1 > "$OUT/ncu_decode_$steps.csv" 2> "$OUT/ncu_decode_$steps.err"
  echo "ncu output-len $steps rc=$?"
done
python3 tools/reference/ncu_summary.py "$OUT/ncu_decode_10.csv" 60 --minus "$OUT/ncu_decode_2.csv" --steps 8
METRICS='dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active,lts__t_sector_hit_rate.pct,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio'
for c in "bf16 wq_b 1024->32768 r1" "bf16 wo_b 8192->4096 r1"; do
  f="$OUT/ncu_skinny_$(echo "$c" | tr ' >' '__').txt"
  timeout 90 ncu --metrics "$METRICS" --kernel-name regex:skinny_gemm --launch-skip 3 --launch-count 1 \
    "$CARRY/dsv4_kbench" --suite fp8_gemm --quick --case "$c" > "$f" 2>&1
  echo "ncu $c rc=$?"
  grep -E "duration|dram__|warps_active|hit_rate|stalled" "$f" | awk '{v=$NF; gsub(",","",v); if (v+0 >= 0.3 || /duration|dram|active|hit/) print}' | cut -c1-120
done
