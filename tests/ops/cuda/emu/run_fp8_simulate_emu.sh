#!/usr/bin/env bash
# Runs the CudaFp8Simulation.* tests on the host, without a GPU: src/ops/cuda/fp8_quantize.cu is compiled as C++
# against the CUDA emulation (emu.h: 256 threads per CTA with real barriers and warp shuffles; a 2-D grid launched
# row by row through the launch_dependent shim below), under ASan + UBSan, against ops::cpu::quantize_e4m3_blocks
# bit for bit. Usage: tests/ops/cuda/emu/run_fp8_simulate_emu.sh [gtest args]
set -euo pipefail
root=$(cd "$(dirname "$0")/../../../.." && pwd)
emu="$root/tests/ops/cuda/emu"
out=${TMPDIR:-/tmp}/dsv4_fp8_simulate_emu
mkdir -p "$out"
cat > "$out/launch_shim.h" <<'SHIM'
#pragma once
#include "emu.h"
using std::isnan;
struct uint2 { unsigned x, y; };
struct float4 { float x, y, z, w; };
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
namespace dsv4::ops::cuda {
inline void wait_for_prior_grid() {}
inline void allow_dependents() {}
// Row by row of the grid: emu_launch runs blockIdx.x = 0 … grid.x − 1 with 256 threads each.
template <typename... Params, typename... Args>
cudaError_t launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t, cudaStream_t, Args... args) {
  if (block.x != 256) return cudaErrorInvalidValue;
  gridDim.y = grid.y;
  for (unsigned y = 0; y < grid.y; ++y) {
    blockIdx.y = y;
    emu_launch(static_cast<int>(grid.x), [&] { kernel(args...); });
  }
  return cudaSuccess;
}
}  // namespace dsv4::ops::cuda
SHIM
sed -e 's|#include <cuda_fp8.h>|#include "launch_shim.h"\n#include "cache/kv_entry_format.h"|' \
    -e 's|#include "ops/cuda/launch.cuh"||' \
    "$root/src/ops/cuda/fp8_quantize.cu" > "$out/fp8_quantize_emu.cpp"
s="$root/src"
g++ -std=c++20 -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=undefined -pthread \
  -I"$out" -I"$emu/include" -I"$emu" -I"$s" -I"$root/tests/ops/cuda" \
  "$emu/emu.cpp" "$out/fp8_quantize_emu.cpp" "$root/tests/ops/cuda/fp8_simulate_test.cpp" "$s/ops/cpu/quantize.cpp" \
  "$s/core/dtype.cpp" -lgtest -lgtest_main -o "$out/emu_tests"
"$out/emu_tests" "$@"
