#!/usr/bin/env bash
# One device run of the whole test set (docs/testing.md "On the GPU machine"): dsv4_gpu_tests (every GPU test)
# and dsv4_tests (the CPU suite, on the device machine's cores), from binaries built on the CPU machine and carried
# in $CARRY with the repository's tests/fixtures. Logs go to $OUT; the short summary is printed last.
#   CARRY=.devcarry/tests tests/run_device_tests.sh [extra gtest args for dsv4_gpu_tests]
set -uo pipefail
CARRY=${CARRY:-.devcarry/tests}
OUT=${OUT:-/tmp/device_tests}
mkdir -p "$OUT"
export DSV4_FIXTURES="$PWD/tests/fixtures"
LIBS="$CARRY:/usr/local/cuda/lib64:/usr/local/cuda/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
for binary in dsv4_gpu_tests dsv4_tests; do
  LD_LIBRARY_PATH="$LIBS" ldd "$CARRY/$binary" | grep -i "not found" >> "$OUT/ldd.txt"
done
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/gpu.txt" 2>&1
start=$(date +%s)
LD_LIBRARY_PATH="$LIBS" "$CARRY/dsv4_gpu_tests" "$@" > "$OUT/gpu_tests.log" 2>&1
gpu_rc=$?
gpu_s=$(( $(date +%s) - start ))
start=$(date +%s)
# The tokenizer tests need the npm tokenizer.json, which is not carried: filtered out here, run by CI.
LD_LIBRARY_PATH="$LIBS" "$CARRY/dsv4_tests" --gtest_filter='-Tokenizer*:*Detokenizer*:ChatEncoding*:StopStrings*' \
  > "$OUT/cpu_tests.log" 2>&1
cpu_rc=$?
cpu_s=$(( $(date +%s) - start ))
grep -E "^\[  FAILED|Failure" "$OUT/gpu_tests.log" "$OUT/cpu_tests.log" | head -40
grep -E "relative L2|worst|agree" "$OUT/gpu_tests.log" | head -40
cat "$OUT/gpu.txt" "$OUT/ldd.txt"
echo "dsv4_gpu_tests rc=$gpu_rc ${gpu_s}s: $(grep -E '^\[  (PASSED|FAILED)  \]|tests? ran' "$OUT/gpu_tests.log" | tr '\n' ' ')"
echo "dsv4_tests     rc=$cpu_rc ${cpu_s}s: $(grep -E '^\[  (PASSED|FAILED)  \]|tests? ran' "$OUT/cpu_tests.log" | tr '\n' ' ')"
