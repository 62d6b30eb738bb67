#!/usr/bin/env bash
# One device run for the indexer kernels (docs/kernels/indexer_topk.md): GPU tests, dsv4_kbench's indexer and
# top-k suites, and torch.topk at the same shapes. Binaries and their non-CUDA libraries come in .devcarry/idx
# (built on the CPU machine); logs go to $OUT; the short table is printed last.
#   bench/kbench/run_indexer_device.sh [--quick]
set -uo pipefail
CARRY=${CARRY:-.devcarry/idx}
OUT=${OUT:-/tmp/kbench_out}
mkdir -p "$OUT"
# Our binaries only (python's torch keeps its own libraries): carried libs, then the toolkit's cuBLAS.
TORCH_CUBLAS=$(python3 -c "import nvidia.cublas, os; print(os.path.join(list(nvidia.cublas.__path__)[0], 'lib'))" 2>/dev/null)
LIBS="$CARRY:/usr/local/cuda/lib64:/usr/local/cuda/lib:${TORCH_CUBLAS}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
LD_LIBRARY_PATH="$LIBS" ldd "$CARRY/dsv4_kbench" | grep -i "not found" > "$OUT/ldd.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/gpu.txt" 2>&1
LD_LIBRARY_PATH="$LIBS" "$CARRY/dsv4_gpu_tests" --gtest_filter='CudaIndexerTest*' > "$OUT/gpu_tests.log" 2>&1
tests_rc=$?
LD_LIBRARY_PATH="$LIBS" "$CARRY/dsv4_kbench" --suite indexer_scores --suite top_k "$@" > "$OUT/kbench.log" 2>&1
kbench_rc=$?
PYTHONUNBUFFERED=1 python3 bench/kbench/torch_topk.py "$@" > "$OUT/torch_topk.log" 2>&1
torch_rc=$?
grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|Failure|error" "$OUT/gpu_tests.log" | head -40
echo "gpu tests rc=$tests_rc kbench rc=$kbench_rc torch rc=$torch_rc"
cat "$OUT/gpu.txt" "$OUT/ldd.txt"
sed -n '/^device:/,/^ceilings:/p' "$OUT/kbench.log"
sed -n '/^case /,$p' "$OUT/kbench.log"
cat "$OUT/torch_topk.log"
