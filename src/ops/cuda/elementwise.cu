#include "ops/cuda/elementwise.h"

#include <algorithm>

#include "ops/cuda/bf16.cuh"
#include "ops/cuda/launch.cuh"

namespace dsv4::ops::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ uint16_t to_bf16(float value) { return f32_to_bf16_bits(value); }
__device__ __forceinline__ float from_bf16(uint16_t bits) { return bf16_bits_to_f32(bits); }

unsigned blocks_for(int64_t n) {
  return static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, int64_t{1} << 20));
}

__global__ void f32_to_bf16_kernel(const float* __restrict__ in, uint16_t* __restrict__ out, int64_t n) {
  wait_for_prior_grid();
  allow_dependents();
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < n; i += int64_t{gridDim.x} * kThreads)
    out[i] = to_bf16(in[i]);
}
__global__ void bf16_to_f32_kernel(const uint16_t* __restrict__ in, float* __restrict__ out, int64_t n) {
  wait_for_prior_grid();
  allow_dependents();
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < n; i += int64_t{gridDim.x} * kThreads)
    out[i] = from_bf16(in[i]);
}
__global__ void round_to_bf16_kernel(float* x, int64_t n) {
  wait_for_prior_grid();
  allow_dependents();
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < n; i += int64_t{gridDim.x} * kThreads)
    x[i] = from_bf16(to_bf16(x[i]));
}
__global__ void add_kernel(float* y, const float* x, int64_t n) {
  wait_for_prior_grid();
  allow_dependents();
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < n; i += int64_t{gridDim.x} * kThreads)
    y[i] = __fadd_rn(y[i], x[i]);
}
__global__ void scale_kernel(float* y, float s, int64_t n) {
  wait_for_prior_grid();
  allow_dependents();
  for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < n; i += int64_t{gridDim.x} * kThreads)
    y[i] = __fmul_rn(y[i], s);
}

// grid (count, column blocks): one row per blockIdx.x, float4 when every row start is 16-byte aligned.
template <bool kVec4>
__global__ void gather_rows_kernel(const float* __restrict__ in, const int32_t* __restrict__ rows,
                                   float* __restrict__ out, int64_t row_elems) {
  wait_for_prior_grid();
  allow_dependents();
  const int64_t i = blockIdx.x;
  const float* src = in + static_cast<int64_t>(rows[i]) * row_elems;
  float* dst = out + i * row_elems;
  const int64_t stride = int64_t{gridDim.y} * kThreads;
  if constexpr (kVec4) {
    const int64_t n4 = row_elems / 4;
    for (int64_t c = blockIdx.y * int64_t{kThreads} + threadIdx.x; c < n4; c += stride)
      reinterpret_cast<float4*>(dst)[c] = reinterpret_cast<const float4*>(src)[c];
  } else {
    for (int64_t c = blockIdx.y * int64_t{kThreads} + threadIdx.x; c < row_elems; c += stride) dst[c] = src[c];
  }
}

}  // namespace

cudaError_t f32_to_bf16(const float* in, uint16_t* out, int64_t n, cudaStream_t stream) {
  if (n < 0) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  launch_dependent(f32_to_bf16_kernel, blocks_for(n), kThreads, 0, stream, in, out, n);
  return cudaGetLastError();
}

cudaError_t bf16_to_f32(const uint16_t* in, float* out, int64_t n, cudaStream_t stream) {
  if (n < 0) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  launch_dependent(bf16_to_f32_kernel, blocks_for(n), kThreads, 0, stream, in, out, n);
  return cudaGetLastError();
}

cudaError_t round_to_bf16(float* x, int64_t n, cudaStream_t stream) {
  if (n < 0) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  launch_dependent(round_to_bf16_kernel, blocks_for(n), kThreads, 0, stream, x, n);
  return cudaGetLastError();
}

cudaError_t add_inplace(float* y, const float* x, int64_t n, cudaStream_t stream) {
  if (n < 0) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  launch_dependent(add_kernel, blocks_for(n), kThreads, 0, stream, y, x, n);
  return cudaGetLastError();
}

cudaError_t scale_inplace(float* y, float s, int64_t n, cudaStream_t stream) {
  if (n < 0) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  launch_dependent(scale_kernel, blocks_for(n), kThreads, 0, stream, y, s, n);
  return cudaGetLastError();
}

cudaError_t gather_rows(const GatherRowsParams& p, const float* in, const int32_t* rows, float* out,
                        cudaStream_t stream) {
  if (p.count < 0 || p.row_elems < 0 || p.count > 0x7fffffff) return cudaErrorInvalidValue;
  if (p.count == 0 || p.row_elems == 0) return cudaSuccess;
  const bool vec4 = p.row_elems % 4 == 0 && reinterpret_cast<uintptr_t>(in) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(out) % 16 == 0;
  const int64_t per_row = vec4 ? p.row_elems / 4 : p.row_elems;
  const dim3 grid(static_cast<unsigned>(p.count),
                  static_cast<unsigned>(std::min<int64_t>((per_row + kThreads - 1) / kThreads, 65535)));
  if (vec4)
    launch_dependent(gather_rows_kernel<true>, grid, kThreads, 0, stream, in, rows, out, p.row_elems);
  else
    launch_dependent(gather_rows_kernel<false>, grid, kThreads, 0, stream, in, rows, out, p.row_elems);
  return cudaGetLastError();
}

}  // namespace dsv4::ops::cuda
