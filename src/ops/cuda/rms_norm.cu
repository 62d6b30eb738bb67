#include "ops/cuda/rms_norm.h"

#include "ops/cuda/bf16.cuh"
#include "ops/cuda/launch.cuh"

namespace dsv4::ops::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void rms_norm_kernel(const float* __restrict__ x, const float* __restrict__ weight, float* y, int64_t dim,
                                float eps, uint16_t* y_bf16) {
  wait_for_prior_grid();
  allow_dependents();
  const int64_t row = blockIdx.x;
  const float* in = x + row * dim;
  float* out = y + row * dim;
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < dim; i += kThreads) sum += in[i] * in[i];
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  __shared__ float warp_sums[kThreads / 32];
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = sum;
  __syncthreads();
  if (threadIdx.x < 32) {
    float total = threadIdx.x < kThreads / 32 ? warp_sums[threadIdx.x] : 0.0f;
    for (int offset = 16; offset > 0; offset /= 2) total += __shfl_xor_sync(0xffffffffu, total, offset);
    if (threadIdx.x == 0) warp_sums[0] = total;
  }
  __syncthreads();
  const float scale = rsqrtf(warp_sums[0] / static_cast<float>(dim) + eps);
  for (int64_t i = threadIdx.x; i < dim; i += kThreads) {
    const float value = (weight ? weight[i] : 1.0f) * (in[i] * scale);
    out[i] = value;
    if (y_bf16) y_bf16[row * dim + i] = f32_to_bf16_bits(value);
  }
}

}  // namespace

cudaError_t rms_norm(const RmsNormParams& p, const float* x, const float* weight, float* y, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  launch_dependent(rms_norm_kernel, static_cast<unsigned>(p.rows), kThreads, 0, stream, x, weight, y, p.dim,
                   p.eps, nullptr);
  return cudaGetLastError();
}

cudaError_t rms_norm_with_bf16(const RmsNormParams& p, const float* x, const float* weight, float* y,
                               uint16_t* y_bf16, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  launch_dependent(rms_norm_kernel, static_cast<unsigned>(p.rows), kThreads, 0, stream, x, weight, y, p.dim,
                   p.eps, y_bf16);
  return cudaGetLastError();
}

}  // namespace dsv4::ops::cuda
