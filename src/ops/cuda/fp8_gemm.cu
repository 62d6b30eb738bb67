#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "ops/cuda/bf16.cuh"
#include "ops/cuda/fp8_gemm.h"
#include "ops/cuda/fp8_quantize.h"
#include "ops/cuda/launch.cuh"

namespace dsv4::ops::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerCta = 4;  // divides 128: the CTA's rows share one weight-scale row

// Two e4m3 bytes of `word` (picked by `selector`) -> bf16x2, exactly: sign, exponent and mantissa moved into
// bf16 position, then × 2^(127 − 7) to rebias (e4m3 subnormals become bf16 subnormals first and come out
// normal); the same decode as ops/cuda/indexer_scores.cu.
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint32_t word, uint32_t selector) {
  const uint32_t spread = __byte_perm(word, 0, selector);
  const uint32_t bits = (spread & 0x80008000u) | ((spread & 0x7f007f00u) >> 4);
  __nv_bfloat162 value = *reinterpret_cast<const __nv_bfloat162*>(&bits);
  value = __hmul2(value, __floats2bfloat162_rn(0x1p120f, 0x1p120f));
  return *reinterpret_cast<const uint32_t*>(&value);
}

// 16 e4m3 codes -> 16 floats (exact).
__device__ __forceinline__ void decode16(const uint4& v, float (&f)[16]) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t lo = e4m3x2_to_bf16x2(words[i], 0x1404), hi = e4m3x2_to_bf16x2(words[i], 0x3424);
    f[4 * i + 0] = __uint_as_float(lo << 16);
    f[4 * i + 1] = __uint_as_float(lo & 0xffff0000u);
    f[4 * i + 2] = __uint_as_float(hi << 16);
    f[4 * i + 3] = __uint_as_float(hi & 0xffff0000u);
  }
}

__device__ __forceinline__ float decode1(uint8_t code) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3);
  return __half2float(__half(h));
}

// grid (ceil(out / (4 · groups)), ceil(rows / kMaxRows)), groups = 8 / wpg: the CTA's warps form `groups`
// groups of wpg warps, each group owning 4 output rows and splitting `in` among its warps (wpg = how many
// warps `in`'s vectors fill, so a 1024-wide row does not leave 6 of 8 warps idle). kVec codes per load: 16
// (uint4) or 1 (bytes, any alignment).
template <int kMaxRows, int kVec>
__global__ void __launch_bounds__(kThreads)
    fp8_skinny_gemm_kernel(const Fp8GemmParams p, int wpg, const uint8_t* __restrict__ w,
                           const float* __restrict__ w_scales, const uint8_t* __restrict__ x,
                           const float* __restrict__ x_scales, void* y) {
  wait_for_prior_grid();
  allow_dependents();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int groups = kWarps / wpg, group = warp / wpg, group_warp = warp % wpg;
  const int64_t row0 = (static_cast<int64_t>(blockIdx.x) * groups + group) * kRowsPerCta;
  const int64_t t0 = static_cast<int64_t>(blockIdx.y) * kMaxRows;
  const int rows = static_cast<int>(p.rows - t0 < kMaxRows ? p.rows - t0 : kMaxRows);
  // A group past the last row streams nothing (it still meets the barrier).
  const int64_t vectors = row0 < p.out ? (p.in + kVec - 1) / kVec : 0;  // kVec = 16 only when in % 16 == 0
  const float* sw_row = w_scales + (row0 / kFp8Block) * p.w_scale_stride;

  float acc[kRowsPerCta][kMaxRows];
#pragma unroll
  for (int r = 0; r < kRowsPerCta; ++r)
#pragma unroll
    for (int t = 0; t < kMaxRows; ++t) acc[r][t] = 0.0f;
  const uint8_t* wrow[kRowsPerCta];
#pragma unroll
  for (int r = 0; r < kRowsPerCta; ++r) {
    const int64_t o = row0 + r < p.out ? row0 + r : p.out - 1;  // a clamped row is computed and not stored
    wrow[r] = w + o * p.w_stride;
  }
  for (int64_t v = static_cast<int64_t>(group_warp) * 32 + lane; v < vectors; v += wpg * 32) {
    const int64_t k = v * kVec;
    const int64_t kb = k / kFp8Block;  // a 16-code vector never straddles two 128-blocks
    const float sw = __ldg(sw_row + kb);
    float wf[kRowsPerCta][kVec];
    if constexpr (kVec == 16) {
      uint4 wv[kRowsPerCta];
#pragma unroll
      for (int r = 0; r < kRowsPerCta; ++r) wv[r] = __ldg(reinterpret_cast<const uint4*>(wrow[r] + k));
#pragma unroll
      for (int r = 0; r < kRowsPerCta; ++r) decode16(wv[r], wf[r]);
    } else {
#pragma unroll
      for (int r = 0; r < kRowsPerCta; ++r) wf[r][0] = decode1(__ldg(wrow[r] + k));
    }
#pragma unroll
    for (int t = 0; t < kMaxRows; ++t) {
      if (t >= rows) continue;
      const uint8_t* xrow = x + (t0 + t) * p.x_stride;
      float xf[kVec];
      if constexpr (kVec == 16)
        decode16(*reinterpret_cast<const uint4*>(xrow + k), xf);
      else
        xf[0] = decode1(xrow[k]);
      const float s = sw * x_scales[kb * p.x_scale_stride + t0 + t];
#pragma unroll
      for (int r = 0; r < kRowsPerCta; ++r) {
        float partial = 0.0f;
#pragma unroll
        for (int i = 0; i < kVec; ++i) partial = fmaf(wf[r][i], xf[i], partial);
        acc[r][t] = fmaf(partial, s, acc[r][t]);
      }
    }
  }
  __shared__ float partials[kWarps][kRowsPerCta * kMaxRows];
#pragma unroll
  for (int r = 0; r < kRowsPerCta; ++r)
#pragma unroll
    for (int t = 0; t < kMaxRows; ++t) {
      float s = acc[r][t];
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) s += __shfl_xor_sync(0xffffffffu, s, offset);
      if (lane == 0) partials[warp][r * kMaxRows + t] = s;
    }
  __syncthreads();
  constexpr int kPerGroup = kRowsPerCta * kMaxRows;
  for (int i = threadIdx.x; i < groups * kPerGroup; i += kThreads) {
    const int g = i / kPerGroup, j = i % kPerGroup;
    const int r = j / kMaxRows, t = j % kMaxRows;
    const int64_t o = (static_cast<int64_t>(blockIdx.x) * groups + g) * kRowsPerCta + r;
    if (t >= rows || o >= p.out) continue;
    float s = 0.0f;
    for (int k = 0; k < wpg; ++k) s += partials[g * wpg + k][j];  // warp order: deterministic
    const int64_t at = (t0 + t) * p.y_stride + o;
    if (p.bf16_output)
      static_cast<uint16_t*>(y)[at] = f32_to_bf16_bits(s);
    else
      static_cast<float*>(y)[at] = s;
  }
}

template <int kVec>
cudaError_t launch(const Fp8GemmParams& p, int wpg, const uint8_t* w, const float* ws, const uint8_t* x,
                   const float* xs, void* y, cudaStream_t stream) {
  const int64_t rows_per_cta = kRowsPerCta * (kWarps / wpg);
  const int64_t ctas = (p.out + rows_per_cta - 1) / rows_per_cta;
  const int64_t chunks = (p.rows + kFp8SkinnyChunkRows - 1) / kFp8SkinnyChunkRows;
  if (ctas > 0x7fffffff || chunks > 65535) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(ctas), static_cast<unsigned>(chunks));
  if (p.rows <= 1)
    return launch_dependent(fp8_skinny_gemm_kernel<1, kVec>, grid, kThreads, 0, stream, p, wpg, w, ws, x, xs,
                            y);
  if (p.rows <= 2)
    return launch_dependent(fp8_skinny_gemm_kernel<2, kVec>, grid, kThreads, 0, stream, p, wpg, w, ws, x, xs,
                            y);
  if (p.rows <= 4)
    return launch_dependent(fp8_skinny_gemm_kernel<4, kVec>, grid, kThreads, 0, stream, p, wpg, w, ws, x, xs,
                            y);
  return launch_dependent(fp8_skinny_gemm_kernel<8, kVec>, grid, kThreads, 0, stream, p, wpg, w, ws, x, xs,
                          y);
}

}  // namespace

cudaError_t fp8_skinny_gemm(const Fp8GemmParams& params, const uint8_t* w, const float* w_scales,
                            const uint8_t* x, const float* x_scales, void* y, cudaStream_t stream) {
  Fp8GemmParams p = params;
  if (p.w_stride == 0) p.w_stride = p.in;
  if (p.x_stride == 0) p.x_stride = p.in;
  if (p.y_stride == 0) p.y_stride = p.out;
  if (p.w_scale_stride == 0) p.w_scale_stride = (p.in + kFp8Block - 1) / kFp8Block;
  if (p.x_scale_stride == 0) p.x_scale_stride = p.rows;
  if (p.rows < 1 || p.out < 1 || p.in < 1 || p.w_stride < p.in || p.x_stride < p.in || p.y_stride < p.out ||
      p.x_scale_stride < p.rows)
    return cudaErrorInvalidValue;
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  const bool vector =
      p.in % 16 == 0 && p.w_stride % 16 == 0 && p.x_stride % 16 == 0 && aligned(w) && aligned(x);
  // Warps per 4-row group: enough for one vector per lane of each warp (a power of two up to 8).
  const int64_t vectors = vector ? p.in / 16 : p.in;
  int wpg = 1;
  while (wpg < kWarps && wpg * 32 < vectors) wpg *= 2;
  return vector ? launch<16>(p, wpg, w, w_scales, x, x_scales, y, stream)
                : launch<1>(p, wpg, w, w_scales, x, x_scales, y, stream);
}

}  // namespace dsv4::ops::cuda
