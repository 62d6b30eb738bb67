#!/usr/bin/env bash
# Runs the CudaCompressor.* tests on the host, without a GPU: src/ops/cuda/compressor.cu is compiled as C++ against
# a small CUDA emulation (emu.h: a persistent pool of 256 threads per CTA with real barriers and warp shuffles,
# CTAs one after another; include/cuda_runtime.h: cudaMalloc = malloc), under ASan + UBSan. It checks the kernel's
# indexing, phases and formats (CTAs do not overlap here, so cross-CTA races are not exercised) with glibc's expf
# instead of CUDA's. Usage: tests/ops/cuda/emu/run_compressor_emu.sh [gtest args]
set -euo pipefail
root=$(cd "$(dirname "$0")/../../../.." && pwd)
emu="$root/tests/ops/cuda/emu"
out=${TMPDIR:-/tmp}/dsv4_compressor_emu
mkdir -p "$out"
sed -e 's|#include <cuda_bf16.h>|#include "emu.h"|' -e 's|#include <cuda_fp8.h>||' \
    -e 's|extern __shared__ int prefix\[\];|static int prefix[12001];|' \
    -e 's|__shared__ double|static double|; s|__shared__ float|static float|; s|__shared__ int|static int|' \
    -e 's|#include "ops/cuda/launch.cuh"|namespace dsv4::ops::cuda { inline void wait_for_prior_grid() {} inline void allow_dependents() {} }|' \
    -e 's|launch_dependent(compressor_step_kernel<true>, blocks, kThreads, shared, stream, k);|emu_launch(blocks, [\&] { compressor_step_kernel<true>(k); }); (void)shared; (void)stream;|' \
    -e 's|launch_dependent(compressor_step_kernel<false>, blocks, kThreads, shared, stream, k);|emu_launch(blocks, [\&] { compressor_step_kernel<false>(k); });|' \
    "$root/src/ops/cuda/compressor.cu" > "$out/compressor_emu.cpp"
s="$root/src"
g++ -std=c++20 -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=undefined -pthread \
  -I"$emu/include" -I"$emu" -I"$s" -I"$root/tests/ops/cuda" \
  "$emu/emu.cpp" "$out/compressor_emu.cpp" "$root/tests/ops/cuda/compressor_test.cpp" \
  "$root/tests/ops/cuda/compressor_index_fp8_test.cpp" "$s/ops/cpu/compressor.cpp" "$s/ops/cpu/norm.cpp" \
  "$s/ops/cpu/rope.cpp" "$s/ops/cpu/quantize.cpp" "$s/core/dtype.cpp" "$s/cache/index_key_format.cpp" -lgtest -lgtest_main -o "$out/emu_tests"
"$out/emu_tests" "$@"
