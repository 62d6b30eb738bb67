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

// ---- tensor-core variant (rows ≤ 8 per chunk, in a multiple of 128, 16-byte aligned) ----
//
// The same sum on the fp16 tensor cores: e4m3 → f16 is exact (cvt.rn.f16x2.e4m3x2, one instruction per two
// codes) and f16 products are exact in the mma's fp32 accumulation, so this keeps the CUDA-core kernel's
// precision (not the FP8 mma's, whose truncated accumulation costs ~2e-4, docs/kernels/fp8_gemm.md) while the
// per-code work drops from a decode plus one FMA per token to half a cvt: mma.sync m16n8k16 takes 16 weight
// rows × 8 tokens. A warp owns a 16-row tile and a share of its 128-blocks; lane (g = lane / 4, t = lane % 4)
// loads bytes [32t, 32t + 32) of the block from weight rows g and g + 8 and from token g's codes, and uses
// byte 4s + j as k-slot j of mma step s (A and B share the permutation, so the sum is the same). Each block's
// mma sum starts from zero and is scaled by sw · sx[token] into the fp32 accumulators, as the CUDA-core
// kernel does per 16 codes.

__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t pair) {
  uint32_t out;
  asm("{\n .reg .b16 lo;\n cvt.u16.u32 lo, %1;\n cvt.rn.f16x2.e4m3x2 %0, lo;\n}" : "=r"(out) : "r"(pair));
  return out;
}

__device__ __forceinline__ void mma_f16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

struct MmaBlock {
  uint4 w0[2], w1[2], x[2];  // 32 bytes of rows g and g + 8, and of token g
};

// grid (ceil(out / (16 · groups)), ceil(rows / 8)); groups = 8 / wpg tiles per CTA, wpg warps per tile.
__global__ void __launch_bounds__(kThreads)
    fp8_mma_gemm_kernel(const Fp8GemmParams p, int wpg, const uint8_t* __restrict__ w,
                        const float* __restrict__ w_scales, const uint8_t* __restrict__ x,
                        const float* __restrict__ x_scales, void* y) {
  wait_for_prior_grid();
  allow_dependents();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int groups = kWarps / wpg, group = warp / wpg, group_warp = warp % wpg;
  const int64_t tile0 = (static_cast<int64_t>(blockIdx.x) * groups + group) * 16;
  const int64_t t0 = static_cast<int64_t>(blockIdx.y) * 8;
  const int rows = static_cast<int>(p.rows - t0 < 8 ? p.rows - t0 : 8);
  const int64_t kblocks = tile0 < p.out ? p.in / kFp8Block : 0;
  const int64_t r0 = tile0 + g < p.out ? tile0 + g : p.out - 1,
                r1 = tile0 + g + 8 < p.out ? tile0 + g + 8 : p.out - 1;
  const uint8_t* w0 = w + r0 * p.w_stride + 32 * t;
  const uint8_t* w1 = w + r1 * p.w_stride + 32 * t;
  const bool has_token = g < rows;
  const uint8_t* xr = x + (t0 + (has_token ? g : 0)) * p.x_stride + 32 * t;
  const float* sw_row = w_scales + (tile0 / kFp8Block) * p.w_scale_stride;
  auto load = [&](int64_t kb, MmaBlock& b) {
    const int64_t k = kb * kFp8Block;
    b.w0[0] = __ldg(reinterpret_cast<const uint4*>(w0 + k));
    b.w0[1] = __ldg(reinterpret_cast<const uint4*>(w0 + k + 16));
    b.w1[0] = __ldg(reinterpret_cast<const uint4*>(w1 + k));
    b.w1[1] = __ldg(reinterpret_cast<const uint4*>(w1 + k + 16));
    if (has_token) {
      b.x[0] = *reinterpret_cast<const uint4*>(xr + k);
      b.x[1] = *reinterpret_cast<const uint4*>(xr + k + 16);
    } else {
      b.x[0] = b.x[1] = make_uint4(0, 0, 0, 0);
    }
  };
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // (row g, tokens 2t, 2t + 1), (row g + 8, tokens 2t, 2t + 1)
  MmaBlock cur, next;
  int64_t kb = group_warp;
  if (kb < kblocks) load(kb, cur);
  for (; kb < kblocks; kb += wpg) {
    if (kb + wpg < kblocks) load(kb + wpg, next);  // the next block's bytes in flight during this one's math
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const uint32_t* wa = reinterpret_cast<const uint32_t*>(cur.w0);
    const uint32_t* wb = reinterpret_cast<const uint32_t*>(cur.w1);
    const uint32_t* xv = reinterpret_cast<const uint32_t*>(cur.x);
#pragma unroll
    for (int step = 0; step < 8; ++step) {
      const uint32_t a[4] = {e4m3x2_to_f16x2(wa[step]), e4m3x2_to_f16x2(wb[step]),
                             e4m3x2_to_f16x2(wa[step] >> 16), e4m3x2_to_f16x2(wb[step] >> 16)};
      mma_f16(c, a, e4m3x2_to_f16x2(xv[step]), e4m3x2_to_f16x2(xv[step] >> 16));
    }
    const float sw = __ldg(sw_row + kb);
    const int n0 = 2 * t, n1 = 2 * t + 1;
    const float s0 = n0 < rows ? sw * x_scales[kb * p.x_scale_stride + t0 + n0] : 0.0f;
    const float s1 = n1 < rows ? sw * x_scales[kb * p.x_scale_stride + t0 + n1] : 0.0f;
    acc[0] = fmaf(c[0], s0, acc[0]);
    acc[1] = fmaf(c[1], s1, acc[1]);
    acc[2] = fmaf(c[2], s0, acc[2]);
    acc[3] = fmaf(c[3], s1, acc[3]);
    cur = next;
  }
  __shared__ float partials[kWarps][32][4];
#pragma unroll
  for (int i = 0; i < 4; ++i) partials[warp][lane][i] = acc[i];
  __syncthreads();
  for (int i = threadIdx.x; i < groups * 32 * 4; i += kThreads) {
    const int tile = i / 128, l = (i / 4) % 32, e = i % 4;
    const int64_t o = (static_cast<int64_t>(blockIdx.x) * groups + tile) * 16 + l / 4 + (e >= 2 ? 8 : 0);
    const int n = 2 * (l % 4) + (e & 1);
    if (n >= rows || o >= p.out) continue;
    float s = 0.0f;
    for (int k = 0; k < wpg; ++k) s += partials[tile * wpg + k][l][e];  // warp order: deterministic
    const int64_t at = (t0 + n) * p.y_stride + o;
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
  if (vector && p.in % kFp8Block == 0 && !p.cuda_cores) {
    // Warps per 16-row tile: up to 8, no more than the row has 128-blocks (a power of two).
    const int64_t kblocks = p.in / kFp8Block;
    int wpg = 1;
    while (wpg < kWarps && 2 * wpg <= kblocks) wpg *= 2;
    const int64_t rows_per_cta = 16 * (kWarps / wpg);
    const int64_t ctas = (p.out + rows_per_cta - 1) / rows_per_cta;
    const int64_t chunks = (p.rows + 7) / 8;
    if (ctas > 0x7fffffff || chunks > 65535) return cudaErrorInvalidValue;
    return launch_dependent(fp8_mma_gemm_kernel,
                            dim3(static_cast<unsigned>(ctas), static_cast<unsigned>(chunks)), kThreads, 0,
                            stream, p, wpg, w, w_scales, x, x_scales, y);
  }
  // Warps per 4-row group: enough for one vector per lane of each warp (a power of two up to 8).
  const int64_t vectors = vector ? p.in / 16 : p.in;
  int wpg = 1;
  while (wpg < kWarps && wpg * 32 < vectors) wpg *= 2;
  return vector ? launch<16>(p, wpg, w, w_scales, x, x_scales, y, stream)
                : launch<1>(p, wpg, w, w_scales, x, x_scales, y, stream);
}

}  // namespace dsv4::ops::cuda
