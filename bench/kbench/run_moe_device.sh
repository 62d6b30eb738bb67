#!/usr/bin/env bash
# One device run for the routed experts (ops/cuda/moe_experts.h, bf16 and MXFP4 weights): the MoE and CudaModel GPU
# tests, dsv4_kbench's moe suite, then end to end `dsv4 bench latency` on the 4-layer V4-Flash cut as the release
# stores it (bench/configs/v4_flash_4layer_fp8.json: FP8 projections, MXFP4 routed experts) with the experts decoded
# in the kernel (DSV4_LOW_BIT_EXPERTS=1, the default) and decoded to bf16 at upload (=0), side by side. Binaries come
# in .devcarry/moe (built on the CPU machine, stripped); logs go to $OUT; the short tables are printed last.
#   bench/kbench/run_moe_device.sh [--quick]
set -uo pipefail
CARRY=${CARRY:-.devcarry/moe}
OUT=${OUT:-/tmp/kbench_out}
mkdir -p "$OUT"
export DSV4_FIXTURES="$PWD/tests/fixtures"
LIBS="$CARRY:/usr/local/cuda/lib64:/usr/local/cuda/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
LD_LIBRARY_PATH="$LIBS" ldd "$CARRY/dsv4_kbench" "$CARRY/dsv4_gpu_tests" "$CARRY/dsv4" | grep -iE "not found" > "$OUT/ldd.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > "$OUT/gpu.txt" 2>&1
LD_LIBRARY_PATH="$LIBS" timeout 200 "$CARRY/dsv4_gpu_tests" --gtest_filter='CudaMoeExperts*:CudaModel.*:MoeKernelLayout*' \
  > "$OUT/gpu_tests.log" 2>&1
tests_rc=$?
LD_LIBRARY_PATH="$LIBS" timeout 150 "$CARRY/dsv4_kbench" --suite moe "$@" > "$OUT/kbench.log" 2>&1
kbench_rc=$?
# Variants: MXFP4 in the kernel (the default); decoded to bf16 at upload, every step on the grouped kernel; decoded
# to bf16 with steps of >= 256 tokens on per-expert cuBLASLt GEMMs (moe_host_grouped, the earlier default).
# Then the experts requantized at load (--expert-bits 3.5 / 2.5), decoded in the kernel.
variants=("mxfp4:DSV4_LOW_BIT_EXPERTS=1" "bf16_kernel:DSV4_LOW_BIT_EXPERTS=0"
          "bf16_host_grouped:DSV4_LOW_BIT_EXPERTS=0 DSV4_HOST_GROUPED_MOE_MIN_TOKENS=256"
          "q3_kernel:DSV4_LOW_BIT_EXPERTS=1:--expert-bits 3.5" "q2_kernel:DSV4_LOW_BIT_EXPERTS=1:--expert-bits 2.5")
for variant in "${variants[@]}"; do
  IFS=: read -r name environment arguments <<< "$variant"
  env $environment LD_LIBRARY_PATH="$LIBS" timeout 100 "$CARRY/dsv4" bench latency \
    --model bench/configs/v4_flash_4layer_fp8.json --load-format dummy --device cuda --input-len 1024 \
    --output-len 64 --batch-size 1,8 --num-iters 3 $arguments > "$OUT/latency_$name.log" 2>&1
  echo "latency $name rc=$?" >> "$OUT/latency_rc.txt"
done
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader >> "$OUT/gpu.txt" 2>&1
grep -E "device weight bytes|steps within|rel L2 to the bf16" "$OUT/gpu_tests.log" | head -20
grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|Failure|error:|Expected|Which is" "$OUT/gpu_tests.log" | head -40
echo "gpu tests rc=$tests_rc kbench rc=$kbench_rc"
cat "$OUT/gpu.txt" "$OUT/ldd.txt" "$OUT/latency_rc.txt"
sed -n '/^device:/,/^ceilings:/p' "$OUT/kbench.log"
sed -n '/^case /,$p' "$OUT/kbench.log"
for variant in "${variants[@]}"; do
  name=${variant%%:*}
  echo "== $name"
  grep -iE "error" "$OUT/latency_$name.log" | head -3
  grep -E "^bench latency|^Prefill" "$OUT/latency_$name.log"
done
