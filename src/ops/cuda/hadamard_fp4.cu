#include "ops/cuda/hadamard_fp4.h"

#include "ops/cuda/bf16.cuh"
#include "ops/cuda/fp4_simulation.cuh"
#include "ops/cuda/launch.cuh"

namespace dsv4::ops::cuda {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr unsigned kFull = 0xffffffffu;

// One warp per row; lane l holds elements l·V … l·V + V − 1 (V = dim / 32). Butterfly stage `half` pairs element
// i with i ^ half: within a lane while half < V, across lanes (lane ^ half / V) above.
template <int V>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) hadamard_fp4_kernel(HadamardFp4Params p, float* x) {
  wait_for_prior_grid();
  allow_dependents();
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (row >= p.rows) return;  // the whole warp leaves together
  float* r = x + row * p.dim;
  double v[V];
#pragma unroll
  for (int j = 0; j < V; ++j) v[j] = static_cast<double>(bf16_round(r[lane * V + j]));
#pragma unroll
  for (int half = 1; half < V; half *= 2)
#pragma unroll
    for (int j = 0; j < V; ++j)
      if (!(j & half)) {
        const double a = v[j], b = v[j + half];
        v[j] = a + b;
        v[j + half] = a - b;
      }
  for (int half = V; half < 32 * V; half *= 2) {
    const int lane_mask = half / V;
    const bool upper = (lane & lane_mask) != 0;  // this lane holds the i + half of each pair
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const double other = __shfl_xor_sync(kFull, v[j], lane_mask);
      v[j] = upper ? other - v[j] : v[j] + other;
    }
  }
  float y[V];
#pragma unroll
  for (int j = 0; j < V; ++j) y[j] = bf16_round(__fmul_rn(static_cast<float>(v[j]), p.scale));
  // FP4 blocks of `block` values: block / V consecutive lanes (a power of two).
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < V; ++j) amax = fmaxf(amax, fabsf(y[j]));
  const int lanes_per_block = static_cast<int>(p.block / V);
  for (int offset = 1; offset < lanes_per_block; offset *= 2) amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, offset));
  const float s = e2m1_block_scale(amax);
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const float q = fminf(fmaxf(__fdiv_rn(y[j], s), -6.0f), 6.0f);  // std::clamp(x / s, -6, 6)
    r[lane * V + j] = bf16_round(__fmul_rn(e2m1_round(q), s));
  }
}

}  // namespace

cudaError_t hadamard_fp4_rows(const HadamardFp4Params& p, float* x, cudaStream_t stream) {
  const bool dim_ok = p.dim == 64 || p.dim == 128 || p.dim == 256;
  const int64_t per_lane = p.dim / 32;
  const int64_t lanes = dim_ok ? p.block / per_lane : 0;
  if (!dim_ok || p.rows < 0 || p.block < per_lane || p.block > p.dim || p.block % per_lane != 0 ||
      (lanes & (lanes - 1)) != 0 || !(p.scale > 0.0f))
    return cudaErrorInvalidValue;
  if (p.rows == 0) return cudaSuccess;
  const auto blocks = static_cast<unsigned>((p.rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
  if (p.dim == 64) launch_dependent(hadamard_fp4_kernel<2>, blocks, kWarpsPerBlock * 32, 0, stream, p, x);
  if (p.dim == 128) launch_dependent(hadamard_fp4_kernel<4>, blocks, kWarpsPerBlock * 32, 0, stream, p, x);
  if (p.dim == 256) launch_dependent(hadamard_fp4_kernel<8>, blocks, kWarpsPerBlock * 32, 0, stream, p, x);
  return cudaGetLastError();
}

}  // namespace dsv4::ops::cuda
