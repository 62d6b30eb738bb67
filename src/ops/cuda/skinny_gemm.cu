#include "ops/cuda/skinny_gemm.h"

#include "ops/cuda/bf16.cuh"
#include "ops/cuda/launch.cuh"

namespace dsv4::ops::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerCta = 4;
constexpr int kVec = 8;  // bf16 per 16-byte load

__device__ __forceinline__ void unpack(const uint4& v, float (&f)[kVec]) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(words[i] << 16);
    f[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
  }
}

// grid (ceil(out / 4), batch). Warp w takes the 16-byte columns w·32 + lane, + 256, …; partials of the 4 rows
// × rows tokens are reduced across the warp by shuffles, then across the warps in warp order through shared
// memory.
template <int kMaxRows>
__global__ void __launch_bounds__(kThreads)
    skinny_gemm_kernel(const SkinnyGemmParams p, const uint16_t* __restrict__ w,
                       const uint16_t* __restrict__ x, void* y) {
  wait_for_prior_grid();
  allow_dependents();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRowsPerCta;
  const int64_t b = blockIdx.y;
  const uint16_t* wb = w + b * p.w_batch_stride;
  const uint16_t* xb = x + b * p.x_batch_stride;
  const int rows = static_cast<int>(p.rows);
  const int64_t vectors = p.in / kVec;

  float acc[kRowsPerCta][kMaxRows];
#pragma unroll
  for (int r = 0; r < kRowsPerCta; ++r)
#pragma unroll
    for (int t = 0; t < kMaxRows; ++t) acc[r][t] = 0.0f;
  const uint4* wrow[kRowsPerCta];
#pragma unroll
  for (int r = 0; r < kRowsPerCta; ++r) {
    const int64_t o = row0 + r < p.out ? row0 + r : p.out - 1;  // a clamped row is computed and not stored
    wrow[r] = reinterpret_cast<const uint4*>(wb + o * p.w_stride);
  }
  for (int64_t v = static_cast<int64_t>(warp) * 32 + lane; v < vectors; v += kThreads) {
    uint4 wv[kRowsPerCta];
#pragma unroll
    for (int r = 0; r < kRowsPerCta; ++r) wv[r] = __ldg(wrow[r] + v);
    uint4 xv[kMaxRows];
#pragma unroll
    for (int t = 0; t < kMaxRows; ++t)
      if (t < rows) xv[t] = *(reinterpret_cast<const uint4*>(xb + t * p.x_stride) + v);
#pragma unroll
    for (int r = 0; r < kRowsPerCta; ++r) {
      float wf[kVec];
      unpack(wv[r], wf);
#pragma unroll
      for (int t = 0; t < kMaxRows; ++t) {
        if (t >= rows) continue;
        float xf[kVec];
        unpack(xv[t], xf);
#pragma unroll
        for (int i = 0; i < kVec; ++i) acc[r][t] = fmaf(wf[i], xf[i], acc[r][t]);
      }
    }
  }
  __shared__ float partial[kWarps][kRowsPerCta * kMaxRows];
#pragma unroll
  for (int r = 0; r < kRowsPerCta; ++r)
#pragma unroll
    for (int t = 0; t < kMaxRows; ++t) {
      float s = acc[r][t];
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) s += __shfl_xor_sync(0xffffffffu, s, offset);
      if (lane == 0) partial[warp][r * kMaxRows + t] = s;
    }
  __syncthreads();
  for (int i = threadIdx.x; i < kRowsPerCta * kMaxRows; i += kThreads) {
    const int r = i / kMaxRows, t = i % kMaxRows;
    if (t >= rows || row0 + r >= p.out) continue;
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < kWarps; ++k) s += partial[k][i];
    const int64_t at = b * p.y_batch_stride + t * p.y_stride + row0 + r;
    if (p.bf16_output)
      static_cast<uint16_t*>(y)[at] = f32_to_bf16_bits(s);
    else
      static_cast<float*>(y)[at] = s;
  }
}

}  // namespace

bool skinny_gemm_supported(const SkinnyGemmParams& p, const void* w, const void* x) {
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  return p.rows >= 1 && p.rows <= kSkinnyMaxRows && p.out >= 1 && p.in >= kVec && p.in % kVec == 0 &&
         p.w_stride % kVec == 0 && p.x_stride % kVec == 0 && p.w_batch_stride % kVec == 0 &&
         p.x_batch_stride % kVec == 0 && p.batch >= 1 && p.batch <= 65535 &&
         (p.out + kRowsPerCta - 1) / kRowsPerCta <= 0x7fffffff && aligned(w) && aligned(x);
}

cudaError_t skinny_gemm(const SkinnyGemmParams& p, const void* w, const void* x, void* y,
                        cudaStream_t stream) {
  if (!skinny_gemm_supported(p, w, x)) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>((p.out + kRowsPerCta - 1) / kRowsPerCta),
                  static_cast<unsigned>(p.batch));
  const auto* wb = static_cast<const uint16_t*>(w);
  const auto* xb = static_cast<const uint16_t*>(x);
  if (p.rows <= 1)
    launch_dependent(skinny_gemm_kernel<1>, grid, kThreads, 0, stream, p, wb, xb, y);
  else if (p.rows <= 2)
    launch_dependent(skinny_gemm_kernel<2>, grid, kThreads, 0, stream, p, wb, xb, y);
  else if (p.rows <= 4)
    launch_dependent(skinny_gemm_kernel<4>, grid, kThreads, 0, stream, p, wb, xb, y);
  else
    launch_dependent(skinny_gemm_kernel<8>, grid, kThreads, 0, stream, p, wb, xb, y);
  return cudaGetLastError();
}

}  // namespace dsv4::ops::cuda
