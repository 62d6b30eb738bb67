#include <cuda_fp8.h>

#include "ops/cuda/fp8_quantize.h"
#include "ops/cuda/fp8_simulation.cuh"
#include "ops/cuda/launch.cuh"

namespace dsv4::ops::cuda {
namespace {

constexpr int kWarps = 8;  // rows per CTA: warp w quantizes row blockIdx.y · 8 + w

template <bool kBf16, bool kVector>
__global__ void __launch_bounds__(kWarps * 32)
    quantize_e4m3_rows_kernel(const Fp8QuantizeParams p, const void* __restrict__ x,
                              uint8_t* __restrict__ codes, float* __restrict__ scales) {
  wait_for_prior_grid();
  allow_dependents();
  const int lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.y) * kWarps + threadIdx.x / 32;
  if (row >= p.rows) return;
  const int64_t block = blockIdx.x;
  const int64_t c0 = block * kFp8Block + lane * 4;
  const bool full = c0 + 4 <= p.cols;
  float v[4];
  if (kVector && full) {
    if constexpr (kBf16) {
      const uint2 w =
          *reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(x) + row * p.x_stride + c0);
      v[0] = __uint_as_float(w.x << 16);
      v[1] = __uint_as_float(w.x & 0xffff0000u);
      v[2] = __uint_as_float(w.y << 16);
      v[3] = __uint_as_float(w.y & 0xffff0000u);
    } else {
      const float4 f = *reinterpret_cast<const float4*>(static_cast<const float*>(x) + row * p.x_stride + c0);
      v[0] = f.x;
      v[1] = f.y;
      v[2] = f.z;
      v[3] = f.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[i] = 0.0f;
      if (c0 + i < p.cols) {
        if constexpr (kBf16)
          v[i] = __uint_as_float(
              static_cast<uint32_t>(static_cast<const uint16_t*>(x)[row * p.x_stride + c0 + i]) << 16);
        else
          v[i] = static_cast<const float*>(x)[row * p.x_stride + c0 + i];
      }
    }
  }
  // amax over the block (fmaxf skips NaN, as std::max(amax, NaN) keeps amax); lanes past the end hold 0.
  float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2)
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  const float scale = e4m3_block_scale(amax);  // ue8m0_scale(amax, 448, 1e-4)
  if (lane == 0) scales[block * p.scale_stride + row] = scale;
  uint8_t* out = codes + row * p.code_stride + c0;
  if (kVector && full) {
    *reinterpret_cast<uint32_t*>(out) = e4m3_scaled_code(v[0], scale) | e4m3_scaled_code(v[1], scale) << 8 |
                                        e4m3_scaled_code(v[2], scale) << 16 | e4m3_scaled_code(v[3], scale) << 24;
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (c0 + i < p.cols) out[i] = static_cast<uint8_t>(e4m3_scaled_code(v[i], scale));
  }
}

// One warp per (row, block of BLOCK columns): lane l holds columns l, l + 32, … of the block.
template <int BLOCK, bool kBf16>
__global__ void __launch_bounds__(kWarps * 32) simulate_e4m3_kernel(const Fp8SimulateParams p, void* __restrict__ x) {
  wait_for_prior_grid();
  allow_dependents();
  constexpr int kPerLane = BLOCK / 32;
  const int lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.y) * kWarps + threadIdx.x / 32;
  if (row >= p.rows) return;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * BLOCK;
  float v[kPerLane];
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int64_t c = c0 + lane + 32 * i;
    v[i] = 0.0f;
    if (c < p.cols) {
      if constexpr (kBf16)
        v[i] = __uint_as_float(static_cast<uint32_t>(static_cast<const uint16_t*>(x)[row * p.stride + c]) << 16);
      else
        v[i] = static_cast<const float*>(x)[row * p.stride + c];
    }
    amax = fmaxf(amax, fabsf(v[i]));  // fmaxf skips NaN, as the CPU's std::max
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  const float scale = e4m3_block_scale(amax);
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int64_t c = c0 + lane + 32 * i;
    if (c >= p.cols) continue;
    const float value = e4m3_simulate(v[i], scale);
    if constexpr (kBf16)
      static_cast<uint16_t*>(x)[row * p.stride + c] = static_cast<uint16_t>(__float_as_uint(value) >> 16);  // exact
    else
      static_cast<float*>(x)[row * p.stride + c] = value;
  }
}

}  // namespace

cudaError_t simulate_e4m3_blocks(const Fp8SimulateParams& params, void* x, cudaStream_t stream) {
  Fp8SimulateParams p = params;
  if (p.stride == 0) p.stride = p.cols;
  if (p.rows < 0 || p.cols < 0 || p.stride < p.cols || (p.block != 32 && p.block != 64 && p.block != 128))
    return cudaErrorInvalidValue;
  if (p.rows == 0 || p.cols == 0) return cudaSuccess;
  const int64_t row_groups = (p.rows + kWarps - 1) / kWarps;
  if (row_groups > 65535) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>((p.cols + p.block - 1) / p.block), static_cast<unsigned>(row_groups));
  const dim3 block(kWarps * 32);
  auto launch = [&](auto kernel) { return launch_dependent(kernel, grid, block, 0, stream, p, x); };
  switch (p.block) {
    case 32: return p.bf16 ? launch(simulate_e4m3_kernel<32, true>) : launch(simulate_e4m3_kernel<32, false>);
    case 64: return p.bf16 ? launch(simulate_e4m3_kernel<64, true>) : launch(simulate_e4m3_kernel<64, false>);
    default: return p.bf16 ? launch(simulate_e4m3_kernel<128, true>) : launch(simulate_e4m3_kernel<128, false>);
  }
}

cudaError_t quantize_e4m3_rows(const Fp8QuantizeParams& params, const void* x, uint8_t* codes, float* scales,
                               cudaStream_t stream) {
  Fp8QuantizeParams p = params;
  if (p.x_stride == 0) p.x_stride = p.cols;
  if (p.code_stride == 0) p.code_stride = p.cols;
  if (p.scale_stride == 0) p.scale_stride = p.rows;
  if (p.rows < 0 || p.cols < 0 || p.x_stride < p.cols || p.code_stride < p.cols || p.scale_stride < p.rows)
    return cudaErrorInvalidValue;
  if (p.rows == 0 || p.cols == 0) return cudaSuccess;
  const int64_t row_groups = (p.rows + kWarps - 1) / kWarps;
  if (row_groups > 65535) return cudaErrorInvalidValue;
  auto aligned = [](const void* ptr, uintptr_t bytes) {
    return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
  };
  // Vector loads (16 B of fp32 / 8 B of bf16) and 4-byte code stores need every lane's 4 columns aligned.
  const bool vector =
      p.x_stride % 4 == 0 && p.code_stride % 4 == 0 && aligned(codes, 4) && aligned(x, p.bf16_input ? 8 : 16);
  const dim3 grid(static_cast<unsigned>((p.cols + kFp8Block - 1) / kFp8Block),
                  static_cast<unsigned>(row_groups));
  const dim3 block(kWarps * 32);
  if (p.bf16_input)
    return vector ? launch_dependent(quantize_e4m3_rows_kernel<true, true>, grid, block, 0, stream, p, x,
                                     codes, scales)
                  : launch_dependent(quantize_e4m3_rows_kernel<true, false>, grid, block, 0, stream, p, x,
                                     codes, scales);
  return vector ? launch_dependent(quantize_e4m3_rows_kernel<false, true>, grid, block, 0, stream, p, x,
                                   codes, scales)
                : launch_dependent(quantize_e4m3_rows_kernel<false, false>, grid, block, 0, stream, p, x,
                                   codes, scales);
}

}  // namespace dsv4::ops::cuda
