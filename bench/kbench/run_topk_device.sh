#!/usr/bin/env bash
# One device run for top-k (docs/kernels/indexer_topk.md), most important first (each step logs under $OUT, so a
# cut-off run still returns what it finished): the top-k GPU tests of the carried build, dsv4_kbench --suite top_k
# of two builds side by side (.devcarry/old and .devcarry/new: carry both), torch.topk at the same shapes, the
# the cluster path at every shape with its pre-filter (DSV4_TOPK_PATH=cluster DSV4_TOPK_PREFILTER=1), ncu's full
# set on the 256K × 1 call, the whole-model GPU tests that run the top-k (FILTER), bench latency of the 4-layer
# cut, then 16-CTA clusters.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
TORCH_CUBLAS=$(python3 -c "import nvidia.cublas, os; print(os.path.join(list(nvidia.cublas.__path__)[0], 'lib'))" 2>/dev/null)
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${TORCH_CUBLAS}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
NEW=.devcarry/new OLD=.devcarry/old
table() { sed -n '/^case /,$p' "$1" | cut -c1-70; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout 60 $NEW/dsv4_gpu_tests --gtest_filter='CudaIndexer*TopK*' > "$OUT/topk_tests.log" 2>&1; echo "top-k tests rc=$?"
grep -E "^\[  (PASSED|FAILED) |Failure|Expected|Which" "$OUT/topk_tests.log" | head -12
timeout 90 $OLD/dsv4_kbench --suite top_k > "$OUT/old.log" 2>&1; echo "old rc=$?"
timeout 90 $NEW/dsv4_kbench --suite top_k > "$OUT/new.log" 2>&1; echo "new rc=$?"
paste -d'|' <(table "$OUT/old.log") <(table "$OUT/new.log")
DSV4_TOPK_PATH=sampled timeout 90 $NEW/dsv4_kbench --suite top_k > "$OUT/sampled.log" 2>&1
echo "sampled path everywhere rc=$?"; table "$OUT/sampled.log"
DSV4_TOPK_PATH=sampled DSV4_TOPK_CLUSTER=16 timeout 90 $NEW/dsv4_kbench --suite top_k --case "top_k 512 256K b1" \
  --case "top_k 1024 256K b1" --case "top_k 512 32K b1" > "$OUT/sampled16.log" 2>&1
echo "sampled path, 16-CTA clusters rc=$?"; table "$OUT/sampled16.log"
DSV4_TOPK_PREFILTER=1 DSV4_TOPK_PATH=cluster timeout 90 $NEW/dsv4_kbench --suite top_k > "$OUT/prefilter.log" 2>&1
echo "cluster path everywhere, pre-filter on rc=$?"; table "$OUT/prefilter.log"
# Where the cluster path's time goes at 256K × 1 (without and with the pre-filter): ncu's full set on one call.
ncu_path() { echo "${1%%+*}"; }
for variant in sampled cluster cluster+prefilter; do
  DSV4_TOPK_PATH=$(ncu_path $variant) DSV4_TOPK_PREFILTER=$([[ $variant == *prefilter ]] && echo 1 || echo 0) timeout 120 ncu --set full --kernel-name regex:top_k_ --launch-skip 2 \
    --launch-count 1 $NEW/dsv4_kbench --suite top_k --quick --case "top_k 512 256K b1" \
    > "$OUT/ncu_256k_b1_$variant.txt" 2>&1; echo "ncu $variant rc=$?"
  grep -E "Duration|Memory Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Stall|Warp Cycles Per Issued" \
    "$OUT/ncu_256k_b1_$variant.txt" | head -8
done
timeout 90 python3 bench/kbench/torch_topk.py > "$OUT/torch.log" 2>&1; echo "torch rc=$?"; tail -26 "$OUT/torch.log"
timeout 150 $NEW/dsv4_gpu_tests --gtest_filter="${FILTER:-CudaModel.Fp32MatchesCpuOnTheTinyModel:CudaModel.Bf16GreedyTop1*:CudaModel.EngineGreedy*}" \
  > "$OUT/model_tests.log" 2>&1; echo "model tests rc=$?"
grep -E "^\[  (PASSED|FAILED) |Failure|Expected|Which|greedy top-1" "$OUT/model_tests.log" | head -12
timeout 80 $NEW/dsv4 bench latency --model bench/configs/v4_flash_4layer.json --load-format dummy --device cuda \
  --input-len 1024 --output-len 64 --batch-size 1,8 > "$OUT/latency.log" 2>&1; echo "latency rc=$?"
grep -E "ms|tok" "$OUT/latency.log" | tail -6
DSV4_TOPK_CLUSTER=16 timeout 60 $NEW/dsv4_kbench --suite top_k > "$OUT/new16.log" 2>&1; echo "new16 rc=$?"; table "$OUT/new16.log"
DSV4_TOPK_CLUSTER=16 DSV4_TOPK_PREFILTER=1 timeout 60 $NEW/dsv4_kbench --suite top_k > "$OUT/new16_prefilter.log" 2>&1
echo "new16 + pre-filter rc=$?"; table "$OUT/new16_prefilter.log"
