#!/usr/bin/env bash
# The unit tests and CLI checks under AddressSanitizer + UndefinedBehaviorSanitizer (no CUDA: the sanitizers
# instrument host code only), then each libFuzzer target for a bounded time.
# Usage: scripts/sanitize.sh [fuzz seconds per target, default 60]
set -euo pipefail
cd "$(dirname "$0")/.."
fuzz_seconds=${1:-60}
./scripts/setup.sh
# OpenBLAS threads are invisible to ASan and slow under it; one thread keeps the run fast and deterministic.
export OPENBLAS_NUM_THREADS=1
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDSV4_SANITIZE=ON -DDSV4_CUDA=OFF \
  -DDSV4_BUILD_BENCH=OFF >/dev/null
cmake --build build-asan
ctest --test-dir build-asan --output-on-failure -j "$(nproc)"

CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDSV4_FUZZ=ON \
  -DDSV4_CUDA=OFF -DDSV4_BUILD_TESTS=OFF -DDSV4_BUILD_BENCH=OFF >/dev/null
cmake --build build-fuzz
for corpus in fuzz/corpus/*/; do
  target=$(basename "$corpus")_fuzz
  scratch=$(mktemp -d)
  cp -r "$corpus"/. "$scratch"
  echo "fuzzing $target for ${fuzz_seconds}s"
  "build-fuzz/fuzz/$target" -max_total_time="$fuzz_seconds" -print_final_stats=1 "$scratch" 2>&1 | tail -n 12
  rm -rf "$scratch"
done
