#!/usr/bin/env bash
# One device run for top-k (docs/kernels/indexer_topk.md): the GPU tests of the carried build (FILTER), then
# dsv4_kbench --suite top_k of two builds side by side (.devcarry/old, .devcarry/new: carry both) and torch.topk.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
TORCH_CUBLAS=$(python3 -c "import nvidia.cublas, os; print(os.path.join(list(nvidia.cublas.__path__)[0], 'lib'))" 2>/dev/null)
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${TORCH_CUBLAS}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout 240 .devcarry/new/dsv4_gpu_tests --gtest_filter="${FILTER:-CudaIndexer*:CudaModel*}" > "$OUT/gpu_tests.log" 2>&1; echo "gpu tests rc=$?"
grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|Failure|error|Expected|Which" "$OUT/gpu_tests.log" | head -30
timeout 120 .devcarry/old/dsv4_kbench --suite top_k > "$OUT/old.log" 2>&1; echo "old rc=$?"
timeout 120 .devcarry/new/dsv4_kbench --suite top_k > "$OUT/new.log" 2>&1; echo "new rc=$?"
timeout 120 python3 bench/kbench/torch_topk.py > "$OUT/torch.log" 2>&1; echo "torch rc=$?"
paste -d'|' <(sed -n '/^case /,$p' "$OUT/old.log" | cut -c1-60) <(sed -n '/^case /,$p' "$OUT/new.log" | cut -c1-60)
cat "$OUT/torch.log" | tail -30
DSV4_TOPK_CLUSTER=16 timeout 120 .devcarry/new/dsv4_kbench --suite top_k > "$OUT/new16.log" 2>&1; echo "new16 rc=$?"; sed -n "/^case /,\$p" "$OUT/new16.log" | cut -c1-60
