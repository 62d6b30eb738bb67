#!/usr/bin/env bash
# One device run for the full-depth V4-Flash shapes with dummy weights drawn on the GPU
# (model/cuda/device_random_weights.h): the GPU tests (all, or a gtest filter), then `dsv4 bench latency` on
#   the 43-layer / 32-expert bf16 cut (bench/configs/v4_flash_43layer_32experts.json, issue 8), and
#   V4-Flash itself — 256 MXFP4 experts requantized at load to 2.5 bits/param (issue 7 item 5: one H200).
# Binaries come in $CARRY (built on the CPU machine, stripped); logs go to $OUT; the short table is printed last.
#   bench/run_43layer_device.sh "<case>;<case>..."   each case: name:config:batches:input_len:output_len:extra args
set -uo pipefail
CARRY=${CARRY:-.devcarry/big}
OUT=${OUT:-/tmp/big_out}
TESTS=${TESTS:-*}
mkdir -p "$OUT"
export DSV4_FIXTURES="$PWD/tests/fixtures"
LIBS="$CARRY:/usr/local/cuda/lib64:/usr/local/cuda/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
LD_LIBRARY_PATH="$LIBS" ldd "$CARRY/dsv4_gpu_tests" "$CARRY/dsv4" | grep -iE "not found" > "$OUT/ldd.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
tests_rc=skipped
if [ "$TESTS" != "none" ]; then
  start=$(date +%s)
  LD_LIBRARY_PATH="$LIBS" timeout 280 "$CARRY/dsv4_gpu_tests" --gtest_filter="$TESTS" > "$OUT/gpu_tests.log" 2>&1
  tests_rc="$? in $(( $(date +%s) - start )) s"
fi
IFS=';' read -ra cases <<< "${1:-}"
for case in "${cases[@]}"; do
  IFS=: read -r name config batches input output extra timeout_s <<< "$case"
  start=$(date +%s)
  DSV4_LOAD_PROGRESS=1 LD_LIBRARY_PATH="$LIBS" timeout "${timeout_s:-300}" stdbuf -oL "$CARRY/dsv4" bench latency --model "$config" \
    --load-format dummy --device cuda --input-len "$input" --output-len "$output" --batch-size "$batches" \
    --max-num-batched-tokens 16384 --roofline $extra > "$OUT/latency_$name.log" 2>&1
  echo "latency $name rc=$? in $(( $(date +%s) - start )) s" >> "$OUT/latency_rc.txt"
done
grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|Failure|Expected|Which is|ulp off" "$OUT/gpu_tests.log" 2>/dev/null | head -40
echo "gpu tests rc=$tests_rc: $(grep -E 'tests? ran' "$OUT/gpu_tests.log" 2>/dev/null)"
cat "$OUT/gpu.txt" "$OUT/ldd.txt" "$OUT/latency_rc.txt" 2>/dev/null
for case in "${cases[@]}"; do
  name=${case%%:*}
  echo "== $name"
  grep -iE "error|what" "$OUT/latency_$name.log" | head -3
  grep -E "^load: (globals|layer (1|2|10|43)/)|^Loaded|^bench latency|^Prefill|^Per step|KV cache|weights|roofline" "$OUT/latency_$name.log"
done
