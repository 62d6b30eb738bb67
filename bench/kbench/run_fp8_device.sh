#!/usr/bin/env bash
# One device run for the FP8 dense GEMMs (docs/kernels/fp8_gemm.md): the FP8 and GEMM GPU tests, then dsv4_kbench's
# fp8_gemm suite. Binaries and their non-CUDA libraries come in .devcarry/fp8 (built on the CPU machine, stripped);
# logs go to $OUT; the short table is printed last.
#   bench/kbench/run_fp8_device.sh [--quick]
set -uo pipefail
CARRY=${CARRY:-.devcarry/fp8}
OUT=${OUT:-/tmp/kbench_out}
mkdir -p "$OUT"
TORCH_CUBLAS=$(python3 -c "import nvidia.cublas, os; print(os.path.join(list(nvidia.cublas.__path__)[0], 'lib'))" 2>/dev/null)
LIBS="$CARRY:/usr/local/cuda/lib64:/usr/local/cuda/lib:${TORCH_CUBLAS}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
LD_LIBRARY_PATH="$LIBS" ldd "$CARRY/dsv4_kbench" "$CARRY/dsv4_gpu_tests" | grep -iE "not found|cublas" > "$OUT/ldd.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > "$OUT/gpu.txt" 2>&1
LD_LIBRARY_PATH="$LIBS" timeout 300 "$CARRY/dsv4_gpu_tests" --gtest_filter='CudaFp8*:CudaGemm*:CudaSkinnyGemm*' \
  > "$OUT/gpu_tests.log" 2>&1
tests_rc=$?
LD_LIBRARY_PATH="$LIBS" timeout 240 "$CARRY/dsv4_kbench" --suite fp8_gemm "$@" > "$OUT/kbench.log" 2>&1
kbench_rc=$?
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader >> "$OUT/gpu.txt" 2>&1
grep -E "^\[fp8\]" "$OUT/gpu_tests.log" | sed -E 's/rel_l2 vs recipe/rec/; s/vs double/dbl/; s/max rel/mx/' | cut -c1-150
grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|Failure|error:|Expected|Which is" "$OUT/gpu_tests.log" | head -40
echo "gpu tests rc=$tests_rc kbench rc=$kbench_rc"
cat "$OUT/gpu.txt" "$OUT/ldd.txt"
grep -E "refused" "$OUT/kbench.log" | head -20
sed -n '/^device:/,/^ceilings:/p' "$OUT/kbench.log"
sed -n '/^case /,$p' "$OUT/kbench.log"
