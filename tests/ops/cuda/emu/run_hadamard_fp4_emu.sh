#!/usr/bin/env bash
# Runs the CudaHadamardFp4.* tests on the host, without a GPU: src/ops/cuda/hadamard_fp4.cu is compiled as C++ against
# the small CUDA emulation of run_compressor_emu.sh (emu.h: 256 threads per CTA with real barriers and warp
# shuffles — doubles shuffle exactly — CTAs one after another; include/cuda_runtime.h: cudaMalloc = malloc), under
# ASan + UBSan. It checks the kernel's butterflies, lanes and FP4 blocks bit for bit against the CPU recipe with
# glibc's rintf / ldexpf / ilogbf in place of CUDA's (the same IEEE operations).
# Usage: tests/ops/cuda/emu/run_hadamard_fp4_emu.sh [gtest args]
set -euo pipefail
root=$(cd "$(dirname "$0")/../../../.." && pwd)
emu="$root/tests/ops/cuda/emu"
out=${TMPDIR:-/tmp}/dsv4_hadamard_fp4_emu
mkdir -p "$out"
sed -e '1i #include "emu.h"' \
    -e 's|#include "ops/cuda/launch.cuh"|namespace dsv4::ops::cuda { inline void wait_for_prior_grid() {} inline void allow_dependents() {} }|' \
    -e 's|launch_dependent(hadamard_fp4_kernel<\([0-9]\)>, blocks, kWarpsPerBlock \* 32, 0, stream, p, x);|emu_launch(static_cast<int>(blocks), [\&] { hadamard_fp4_kernel<\1>(p, x); }); (void)stream;|' \
    "$root/src/ops/cuda/hadamard_fp4.cu" > "$out/hadamard_fp4_emu.cpp"
grep -q emu_launch "$out/hadamard_fp4_emu.cpp" || { echo "the launch was not rewritten"; exit 1; }
s="$root/src"
g++ -std=c++20 -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=undefined -pthread \
  -I"$emu/include" -I"$emu" -I"$s" -I"$root/tests/ops/cuda" \
  "$emu/emu.cpp" "$out/hadamard_fp4_emu.cpp" "$root/tests/ops/cuda/hadamard_fp4_test.cpp" "$s/ops/cpu/quantize.cpp" \
  "$s/core/dtype.cpp" -lgtest -lgtest_main -o "$out/emu_tests"
"$out/emu_tests" "$@"
