#include "ops/cuda/hyper_connection.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>

#include "ops/cuda/bf16.cuh"
#include "ops/cuda/launch.cuh"
#include "ops/cuda/phase_probe.cuh"

namespace dsv4::ops::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kTokensPerCta = 4;  // tokens sharing one read of fn in the mix kernel
constexpr int kTargetCtas = 256;  // split-K until the mix grid has about this many CTAs
constexpr int kMaxSplits = 128;
constexpr int kMinSplitColumns = 32;  // vector columns of one split: a warp's worth
constexpr unsigned kFull = 0xffffffffu;

template <int VEC>
struct VecOf;
template <>
struct VecOf<1> {
  using T = float;
};
template <>
struct VecOf<4> {
  using T = float4;
};

template <int VEC>
__device__ __forceinline__ typename VecOf<VEC>::T load(const float* p, int64_t i) {
  return reinterpret_cast<const typename VecOf<VEC>::T*>(p)[i];
}
template <int VEC>
__device__ __forceinline__ void store(float* p, int64_t i, typename VecOf<VEC>::T v) {
  reinterpret_cast<typename VecOf<VEC>::T*>(p)[i] = v;
}
__device__ __forceinline__ float zero_vec(float) { return 0.0f; }
__device__ __forceinline__ float4 zero_vec(float4) { return make_float4(0.0f, 0.0f, 0.0f, 0.0f); }
__device__ __forceinline__ float one_vec(float) { return 1.0f; }
__device__ __forceinline__ float4 one_vec(float4) { return make_float4(1.0f, 1.0f, 1.0f, 1.0f); }
__device__ __forceinline__ float fma_dot(float a, float b, float acc) { return fmaf(a, b, acc); }
__device__ __forceinline__ float fma_dot(float4 a, float4 b, float acc) {
  return fmaf(a.w, b.w, fmaf(a.z, b.z, fmaf(a.y, b.y, fmaf(a.x, b.x, acc))));
}
// acc + w·v with both operations rounded, as the CPU's `sum += w * h` (no FMA contraction).
__device__ __forceinline__ float axpy_rn(float acc, float w, float v) { return __fadd_rn(acc, __fmul_rn(w, v)); }
__device__ __forceinline__ float4 axpy_rn(float4 acc, float w, float4 v) {
  return make_float4(axpy_rn(acc.x, w, v.x), axpy_rn(acc.y, w, v.y), axpy_rn(acc.z, w, v.z), axpy_rn(acc.w, w, v.w));
}
__device__ __forceinline__ float scale_rn(float w, float v) { return __fmul_rn(w, v); }
__device__ __forceinline__ float4 scale_rn(float w, float4 v) {
  return make_float4(__fmul_rn(w, v.x), __fmul_rn(w, v.y), __fmul_rn(w, v.z), __fmul_rn(w, v.w));
}

// kDeepSeek's hc_post: sublayer + mixed (the sublayer term is the left operand, as model.py's `post · x + mixed`;
// IEEE addition commutes), then bf16.
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float4 add_rn(float4 a, float4 b) {
  return make_float4(__fadd_rn(a.x, b.x), __fadd_rn(a.y, b.y), __fadd_rn(a.z, b.z), __fadd_rn(a.w, b.w));
}
__device__ __forceinline__ float round_bf16(float v) { return bf16_round(v); }
__device__ __forceinline__ float4 round_bf16(float4 v) {
  return make_float4(bf16_round(v.x), bf16_round(v.y), bf16_round(v.z), bf16_round(v.w));
}

__device__ __forceinline__ float sigmoid(float x) { return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-x))); }
// m·scale + base, each operation rounded (the CPU's expression, never an FMA).
__device__ __forceinline__ float affine(float m, float scale, float base) { return __fadd_rn(__fmul_rn(m, scale), base); }

// The fp32 formulas of ops/cpu/hyper_connection.h, shared by finish_kernel and the one-launch hand-over. The mixes'
// scale: 1 / sqrt(mean(h²) + eps) over the `count` flattened stream values, the mix being rms(h)·fnᵀ = scale·Σ h·fn.
__device__ __forceinline__ float mix_rms_scale(float sum_squares, float count, float eps) {
  return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(sum_squares, count), eps)));
}
// pre[s] = σ(mix·scale[0] + base[s]) + hc_eps, post[s] = 2·σ(mix·scale[1] + base[HC + s]).
__device__ __forceinline__ float pre_weight(float mix, float scale, float base, float hc_eps) {
  return __fadd_rn(sigmoid(affine(mix, scale, base)), hc_eps);
}
__device__ __forceinline__ float post_weight(float mix, float scale, float base) {
  return __fmul_rn(2.0f, sigmoid(affine(mix, scale, base)));
}
// The sublayer RMSNorm's 1 / rms of a row from its sum of squares (ops/cpu/norm.h: rsqrt(mean(x²) + eps)).
__device__ __forceinline__ float row_rms_scale(float sum_squares, int64_t D, float eps) {
  return rsqrtf(sum_squares / static_cast<float>(D) + eps);
}

// The Sinkhorn comb of one token in fp32, the CPU's sequential sums (gathered by shuffles): lane first_lane + l,
// l = j·HC + k < HC², returns comb[j][k] (a lane given l = 0 computes a copy of entry 0). mix: the token's
// (2 + HC)·HC mixes; the HC² lanes from first_lane must all call it (the whole warp converged).
template <int HC>
__device__ __forceinline__ float sinkhorn_comb(const float* mix, const float* scale, const float* base, int iters,
                                               float hc_eps, int first_lane, int l) {
  const int j = l / HC, k = l - j * HC;
  float c = affine(mix[2 * HC + l], scale[2], base[2 * HC + l]);
  float row_max = -INFINITY;
#pragma unroll
  for (int kk = 0; kk < HC; ++kk) {
    const float v = __shfl_sync(kFull, c, first_lane + j * HC + kk);
    row_max = row_max < v ? v : row_max;  // std::max
  }
  const float e = expf(__fsub_rn(c, row_max));
  float sum = 0.0f;
#pragma unroll
  for (int kk = 0; kk < HC; ++kk) sum = __fadd_rn(sum, __shfl_sync(kFull, e, first_lane + j * HC + kk));
  c = __fadd_rn(__fdiv_rn(e, sum), hc_eps);
  auto normalise_columns = [&] {
    float column = 0.0f;
#pragma unroll
    for (int jj = 0; jj < HC; ++jj) column = __fadd_rn(column, __shfl_sync(kFull, c, first_lane + jj * HC + k));
    c = __fdiv_rn(c, __fadd_rn(column, hc_eps));
  };
  auto normalise_rows = [&] {
    float row = 0.0f;
#pragma unroll
    for (int kk = 0; kk < HC; ++kk) row = __fadd_rn(row, __shfl_sync(kFull, c, first_lane + j * HC + kk));
    c = __fdiv_rn(c, __fadd_rn(row, hc_eps));
  };
  normalise_columns();
  for (int iter = 1; iter < iters; ++iter) {
    normalise_rows();
    normalise_columns();
  }
  return c;
}

// The split-K kernels' epilogue: each thread's sums acc[t][v] of its columns, added over the CTA (warp shuffles,
// then the warps in order) into partial[((t0 + t) · splits + split) · NV + v].
template <int TT, int NV>
__device__ __forceinline__ void store_split_partials(float (&acc)[TT][NV], int64_t t0, int64_t tokens, int split,
                                                     int splits, float* partial) {
  __shared__ float warp_sums[kWarps][TT * NV];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int t = 0; t < TT; ++t)
#pragma unroll
    for (int v = 0; v < NV; ++v) {
      float s = acc[t][v];
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) s += __shfl_xor_sync(kFull, s, offset);
      if (lane == 0) warp_sums[warp][t * NV + v] = s;
    }
  __syncthreads();
  const int warps = static_cast<int>(blockDim.x / 32);
  for (int i = threadIdx.x; i < TT * NV; i += blockDim.x) {
    const int t = i / NV, v = i - t * NV;
    if (t0 + t >= tokens) continue;
    float s = 0.0f;
    for (int w = 0; w < warps; ++w) s += warp_sums[w][i];
    partial[((t0 + t) * splits + split) * NV + v] = s;
  }
}

// partial[(t·splits + split)·(NOUT+1) + o] = Σ over this split's columns of h[t]·fn[o] (o < NOUT), and of h[t]²
// (o = NOUT). grid (ceil(tokens / kTokensPerCta), splits); `chunk` columns (in VEC units) per split, blockDim.x
// (a multiple of 32, ≤ kThreads) threads: at decode the splits are narrow (a warp or two of columns each) so that
// fn's 1.5 MB is read by ~128 SMs at once instead of 16 (7 µs a call before, the SMs' own load rate the limit).
// TT: tokens a CTA takes, kTokensPerCta, or 1 for a one-token batch (a decode step at batch 1: the CTA then reduces
// 25 sums instead of 100, three quarters of them for tokens that do not exist; the probe of session 32 put that
// reduction at 1.7 µs a call). Either way the stored sums are the same.
template <int NOUT, int VEC, int TT = kTokensPerCta>
__global__ void __launch_bounds__(kThreads) mix_partial_kernel(const float* __restrict__ streams,
                                                               const float* __restrict__ fn, int64_t tokens,
                                                               int64_t width, int64_t chunk, int splits,
                                                               float* __restrict__ partial) {
  using V = typename VecOf<VEC>::T;
  constexpr int NV = NOUT + 1;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * TT;
  const int split = static_cast<int>(blockIdx.y);
  const int64_t vec_cols = width / VEC;
  const int64_t begin = split * chunk, end = min(vec_cols, begin + chunk);
  PhaseProbe probe(kProbeHcMix, threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0);
  wait_for_prior_grid();
  allow_dependents();
  probe.mark();
  float acc[TT][NV];
#pragma unroll
  for (int t = 0; t < TT; ++t)
#pragma unroll
    for (int v = 0; v < NV; ++v) acc[t][v] = 0.0f;
  const float* x[TT];
  bool valid[TT];
#pragma unroll
  for (int t = 0; t < TT; ++t) {
    valid[t] = t0 + t < tokens;
    x[t] = streams + (valid[t] ? t0 + t : 0) * width;
  }
  for (int64_t c = begin + threadIdx.x; c < end; c += blockDim.x) {
    V xv[TT];
#pragma unroll
    for (int t = 0; t < TT; ++t) {
      xv[t] = valid[t] ? load<VEC>(x[t], c) : zero_vec(V{});
      acc[t][NOUT] = fma_dot(xv[t], xv[t], acc[t][NOUT]);
    }
#pragma unroll
    for (int o = 0; o < NOUT; ++o) {
      const V f = load<VEC>(fn + o * width, c);
#pragma unroll
      for (int t = 0; t < TT; ++t) acc[t][o] = fma_dot(xv[t], f, acc[t][o]);
    }
  }
  probe.mark();
  store_split_partials<TT, NV>(acc, t0, tokens, split, splits, partial);
  probe.mark();
  probe.report("hc_mix");
}

// Tensor-core mixes for prefill-sized batches: the same partial sums (layout and meaning) as mix_partial_kernel.
// mix_partial_kernel reads fn (1.5 MB at V4) from L2 once per 4 tokens: 1.5 GB a call at 4K tokens, ~280 µs,
// L2-bound (ncu, 2026-12-06). Here Σ h·fn[o] runs on mma.sync m16n8k8 TF32 with 16 tokens of a warp sharing each fn fragment
// and a CTA's 4 warps sharing it through L1 (fn then crosses L2 once per 64 tokens and split). "3xTF32": each
// fp32 operand is split into big = tf32(x) and small = tf32(x − big), and small·big + big·small + big·big is
// accumulated in fp32 (the small·small term, ~2^-22 of a product, is dropped): fp32-class products, unlike one
// TF32 pass (~2^-11). Measured at 4K tokens (H100): 173 µs a call against 280. Σ h² stays in fp32 FMAs. The k dimension is permuted (A and B agree): in k-step s of a 16-column block, lane
// position t's logical k t and t + 4 are the columns 4t + 2s and 4t + 2s + 1, so each lane loads float4s.
constexpr int kTcWarps = 4;
constexpr int kTcTokens = 16 * kTcWarps;         // tokens of one CTA
constexpr int64_t kTensorCoreMinTokens = 512;     // below this the split-K kernel above keeps the SMs busier
constexpr int kTensorCoreMaxSplits = 16;

__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ void mma_tf32(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One k-step: A rows g (lo) and g + 8 (hi) at logical k t (a*0) and t + 4 (a*4); B column g of each n-tile.
template <int NT>
__device__ __forceinline__ void mma_3xtf32_step(float (&acc)[NT][4], float lo0, float hi0, float lo4, float hi4,
                                                const float (&b0)[NT], const float (&b4)[NT]) {
  const uint32_t a_big[4] = {to_tf32(lo0), to_tf32(hi0), to_tf32(lo4), to_tf32(hi4)};
  const uint32_t a_small[4] = {to_tf32(lo0 - __uint_as_float(a_big[0])), to_tf32(hi0 - __uint_as_float(a_big[1])),
                               to_tf32(lo4 - __uint_as_float(a_big[2])), to_tf32(hi4 - __uint_as_float(a_big[3]))};
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const uint32_t b_big0 = to_tf32(b0[nt]), b_big4 = to_tf32(b4[nt]);
    const uint32_t b_small0 = to_tf32(b0[nt] - __uint_as_float(b_big0)),
                   b_small4 = to_tf32(b4[nt] - __uint_as_float(b_big4));
    mma_tf32(acc[nt], a_small[0], a_small[1], a_small[2], a_small[3], b_big0, b_big4);
    mma_tf32(acc[nt], a_big[0], a_big[1], a_big[2], a_big[3], b_small0, b_small4);
    mma_tf32(acc[nt], a_big[0], a_big[1], a_big[2], a_big[3], b_big0, b_big4);
  }
}

// The tensor cores add into their fp32 accumulator without rounding to nearest, so a long chain drifts: every few
// blocks of 16 columns the accumulator is added into `total` (round to nearest) and restarted.
template <int NT>
__device__ __forceinline__ void fold_chain(float (&acc)[NT][4], float (&total)[NT][4]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      total[nt][i] += acc[nt][i];
      acc[nt][i] = 0.0f;
    }
}

// The tensor-core kernels' epilogue: a warp's 16 rows (row_lo = its g, row_hi = g + 8) of mixes and sums of
// squares into partial[(row · splits + split) · (NOUT + 1) + o]; acc[nt][e] is row g (e < 2) or g + 8, output
// 8·nt + 2t + e % 2, and the 4 lanes of a row each hold a quarter of its squares.
template <int NOUT, int NT>
__device__ __forceinline__ void store_tf32_partials(float (&acc)[NT][4], float (&total)[NT][4], float squares_lo,
                                                    float squares_hi, int64_t row_lo, int64_t row_hi, int t,
                                                    int64_t tokens, int split, int splits, float* partial) {
  constexpr int NV = NOUT + 1;
  fold_chain<NT>(acc, total);
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int o = 8 * nt + 2 * t + (e & 1);
      const int64_t row = e < 2 ? row_lo : row_hi;
      if (o < NOUT && row < tokens) partial[(row * splits + split) * NV + o] = total[nt][e];
    }
  squares_lo += __shfl_xor_sync(kFull, squares_lo, 1);
  squares_lo += __shfl_xor_sync(kFull, squares_lo, 2);
  squares_hi += __shfl_xor_sync(kFull, squares_hi, 1);
  squares_hi += __shfl_xor_sync(kFull, squares_hi, 2);
  if (t == 0 && row_lo < tokens) partial[(row_lo * splits + split) * NV + NOUT] = squares_lo;
  if (t == 0 && row_hi < tokens) partial[(row_hi * splits + split) * NV + NOUT] = squares_hi;
}

// grid (ceil(tokens / kTcTokens), splits), kTcWarps warps; `chunk` columns per split, a multiple of 16, as is
// width; streams and fn 16-byte aligned.
template <int NOUT>
__global__ void __launch_bounds__(32 * kTcWarps) mix_partial_tf32_kernel(const float* __restrict__ streams,
                                                                        const float* __restrict__ fn, int64_t tokens,
                                                                        int64_t width, int64_t chunk, int splits,
                                                                        float* __restrict__ partial) {
  wait_for_prior_grid();
  allow_dependents();
  constexpr int NT = (NOUT + 7) / 8;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  const int split = static_cast<int>(blockIdx.y);
  const int64_t row_lo = static_cast<int64_t>(blockIdx.x) * kTcTokens + warp * 16 + g, row_hi = row_lo + 8;
  const bool valid_lo = row_lo < tokens, valid_hi = row_hi < tokens;
  const float* x_lo = streams + (valid_lo ? row_lo : 0) * width;
  const float* x_hi = streams + (valid_hi ? row_hi : 0) * width;
  const float* f[NT];
  bool valid_f[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    valid_f[nt] = 8 * nt + g < NOUT;
    f[nt] = fn + (valid_f[nt] ? 8 * nt + g : 0) * width;
  }
  // The accumulator chain (fold_chain): one accumulator over a 2,048-column split measured 9e-5 relative error
  // in post; restarted every kChain blocks of 16 columns it stays within the fp32 twin's bounds.
  constexpr int kChain = 4;
  float acc[NT][4], total[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[nt][i] = total[nt][i] = 0.0f;
  float squares_lo = 0.0f, squares_hi = 0.0f;
  const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  const int64_t begin = split * chunk, end = min(width, begin + chunk);
  int blocks = 0;
#pragma unroll 2
  for (int64_t k = begin + 4 * t; k < end; k += 16) {
    const float4 lo = valid_lo ? load<4>(x_lo, k / 4) : zero, hi = valid_hi ? load<4>(x_hi, k / 4) : zero;
    float b[4][NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const float4 v = valid_f[nt] ? load<4>(f[nt], k / 4) : zero;
      b[0][nt] = v.x;
      b[1][nt] = v.y;
      b[2][nt] = v.z;
      b[3][nt] = v.w;
    }
    squares_lo = fma_dot(lo, lo, squares_lo);
    squares_hi = fma_dot(hi, hi, squares_hi);
    mma_3xtf32_step<NT>(acc, lo.x, hi.x, lo.y, hi.y, b[0], b[1]);
    mma_3xtf32_step<NT>(acc, lo.z, hi.z, lo.w, hi.w, b[2], b[3]);
    if (++blocks == kChain) {  // warp-uniform: every lane runs the same number of blocks
      blocks = 0;
      fold_chain<NT>(acc, total);
    }
  }
  store_tf32_partials<NOUT, NT>(acc, total, squares_lo, squares_hi, row_lo, row_hi, t, tokens, split, splits, partial);
}

// hc_post fused with the next sublayer's tensor-core mixes (prefill): the streams hc_post writes are the A operand
// of mix_partial_tf32_kernel as they are made, so the next hc_pre reads them once (its collapse) instead of twice.
// At 4K tokens and V4-Flash widths the streams are 268 MB, one pass ≈ 90 µs on an H100, 7 boundaries a 4-layer
// prefill. grid (ceil(tokens / kTcTokens), splits over the hidden columns), kTcWarps warps; a warp's 16 tokens and
// a lane's 4 columns as in mix_partial_tf32_kernel. Split `split` sums the flattened columns {k·D + d : d in its
// `chunk` hidden columns, every stream k}; partial has mix_partial_kernel's layout, so finish_kernel reads it
// unchanged. The new streams are hc_post_kernel's bit for bit (the same operations in the same order).
// D and chunk multiples of 16; y, streams, out and fn 16-byte aligned.
template <int HC, int kMinBlocks>
__global__ void __launch_bounds__(32 * kTcWarps, kMinBlocks) post_mix_tf32_kernel(
    const float* __restrict__ y, const float* __restrict__ streams, const float* __restrict__ post,
    const float* __restrict__ comb, float* __restrict__ out, const float* __restrict__ fn, int64_t tokens, int64_t D,
    int64_t chunk, int splits, float* __restrict__ partial) {
  wait_for_prior_grid();
  allow_dependents();
  constexpr int NOUT = (2 + HC) * HC, NT = (NOUT + 7) / 8;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  const int split = static_cast<int>(blockIdx.y);
  const int64_t width = HC * D;
  const int64_t row_lo = static_cast<int64_t>(blockIdx.x) * kTcTokens + warp * 16 + g, row_hi = row_lo + 8;
  const bool valid_lo = row_lo < tokens, valid_hi = row_hi < tokens;
  const int64_t safe_lo = valid_lo ? row_lo : 0, safe_hi = valid_hi ? row_hi : 0;
  // hc_post's weights of the CTA's rows in shared memory (in registers they cost 40 a thread and a third of the
  // occupancy): per row, post[k] then comb[j][k] (HC + HC² floats; zero for a row past the batch, whose new
  // streams are zero and never stored). Rows g = 0..7 of a warp land in distinct banks (stride HC + HC²).
  constexpr int kRowWeights = HC + HC * HC;
  __shared__ float weights[kTcTokens * kRowWeights];
  const int64_t first_row = static_cast<int64_t>(blockIdx.x) * kTcTokens;
  for (int i = threadIdx.x; i < kTcTokens * kRowWeights; i += 32 * kTcWarps) {
    const int64_t row = first_row + i / kRowWeights;
    const int e = i % kRowWeights;
    weights[i] = row >= tokens ? 0.0f : e < HC ? post[row * HC + e] : comb[row * HC * HC + (e - HC)];
  }
  __syncthreads();
  const float* weights_lo = weights + (warp * 16 + g) * kRowWeights;
  const float* weights_hi = weights_lo + 8 * kRowWeights;
  const float* f[NT];
  bool valid_f[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    valid_f[nt] = 8 * nt + g < NOUT;
    f[nt] = fn + (valid_f[nt] ? 8 * nt + g : 0) * width;
  }
  // The accumulator restarted every 32 flattened columns (mix_partial_tf32_kernel: 64; measured here at 64, post
  // was 1.09e-5 off the CPU's against the 1e-5 both kernels are held to).
  constexpr int kChainBlocks = 2;
  float acc[NT][4], total[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[nt][i] = total[nt][i] = 0.0f;
  float squares_lo = 0.0f, squares_hi = 0.0f;
  const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  const float* y_lo = y + safe_lo * D;
  const float* y_hi = y + safe_hi * D;
  const float* h_lo = streams + safe_lo * width;
  const float* h_hi = streams + safe_hi * width;
  float* out_lo = out + safe_lo * width;
  float* out_hi = out + safe_hi * width;
  const int64_t begin = split * chunk, end = min(D, begin + chunk);
  int blocks = 0;
  for (int64_t d = begin + 4 * t; d < end; d += 16) {
    const int64_t v = d / 4;
    const float4 ylo = valid_lo ? load<4>(y_lo, v) : zero, yhi = valid_hi ? load<4>(y_hi, v) : zero;
    float4 hlo[HC], hhi[HC];
#pragma unroll
    for (int j = 0; j < HC; ++j) {
      hlo[j] = valid_lo ? load<4>(h_lo + j * D, v) : zero;
      hhi[j] = valid_hi ? load<4>(h_hi + j * D, v) : zero;
    }
    // One output stream at a time, not unrolled: unrolled, the compiler hoists every stream's fn loads and the
    // kernel needs ~180 registers (2 CTAs an SM instead of 4).
#pragma unroll 1
    for (int k = 0; k < HC; ++k) {
      float4 lo = scale_rn(weights_lo[k], ylo), hi = scale_rn(weights_hi[k], yhi);
#pragma unroll
      for (int j = 0; j < HC; ++j) {
        lo = axpy_rn(lo, weights_lo[HC + j * HC + k], hlo[j]);
        hi = axpy_rn(hi, weights_hi[HC + j * HC + k], hhi[j]);
      }
      if (valid_lo) store<4>(out_lo + k * D, v, lo);
      if (valid_hi) store<4>(out_hi + k * D, v, hi);
      float b[4][NT];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const float4 fv = valid_f[nt] ? load<4>(f[nt] + k * D, v) : zero;
        b[0][nt] = fv.x;
        b[1][nt] = fv.y;
        b[2][nt] = fv.z;
        b[3][nt] = fv.w;
      }
      squares_lo = fma_dot(lo, lo, squares_lo);
      squares_hi = fma_dot(hi, hi, squares_hi);
      mma_3xtf32_step<NT>(acc, lo.x, hi.x, lo.y, hi.y, b[0], b[1]);
      mma_3xtf32_step<NT>(acc, lo.z, hi.z, lo.w, hi.w, b[2], b[3]);
      if (++blocks == kChainBlocks) {  // warp-uniform
        blocks = 0;
        fold_chain<NT>(acc, total);
      }
    }
  }
  store_tf32_partials<NOUT, NT>(acc, total, squares_lo, squares_hi, row_lo, row_hi, t, tokens, split, splits, partial);
}

// hc_post fused with the next sublayer's split-K mixes (decode-sized batches, below the tensor-core mixes): the
// twin of mix_partial_kernel<NOUT, 4> whose operand is made on the fly. Thread column c of split `split` is stream
// k = c / chunk at the hidden float4 v = split·chunk + c % chunk; for each of the CTA's tokens it computes the new
// stream value as hc_post_kernel does (bit for bit), stores it, and adds it into the mixes and the sum of squares.
// A split covers the same hidden columns of every stream, so the partial sums have mix_partial_kernel's layout
// and meaning (finish_kernel reads them unchanged). It saves hc_post's launch and a dependent kernel in the chain
// of a decode step. grid (ceil(tokens / kTokensPerCta), splits); D % 4 == 0, all rows 16-byte aligned.
template <int HC>
__global__ void __launch_bounds__(kThreads) post_mix_partial_kernel(
    const float* __restrict__ y, const float* __restrict__ streams, const float* __restrict__ post,
    const float* __restrict__ comb, float* __restrict__ out, const float* __restrict__ fn, int64_t tokens, int64_t D,
    int64_t chunk, int splits, float* __restrict__ partial) {
  wait_for_prior_grid();
  allow_dependents();
  constexpr int NOUT = (2 + HC) * HC, TT = kTokensPerCta, NV = NOUT + 1;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * TT;
  const int split = static_cast<int>(blockIdx.y);
  const int64_t vec_d = D / 4, width = HC * D;
  const int64_t begin = split * chunk, end = min(vec_d, begin + chunk);
  float acc[TT][NV];
#pragma unroll
  for (int t = 0; t < TT; ++t)
#pragma unroll
    for (int v = 0; v < NV; ++v) acc[t][v] = 0.0f;
  const int64_t span = end > begin ? end - begin : 0;
  for (int64_t c = threadIdx.x; c < HC * span; c += blockDim.x) {
    const int k = static_cast<int>(c / span);
    const int64_t v = begin + c % span;
    float4 value[TT];
#pragma unroll
    for (int t = 0; t < TT; ++t) {
      if (t0 + t >= tokens) {
        value[t] = zero_vec(float4{});
        continue;
      }
      const int64_t row = t0 + t;
      const float* h = streams + row * width;
      float4 sum = scale_rn(post[row * HC + k], load<4>(y + row * D, v));
#pragma unroll
      for (int j = 0; j < HC; ++j) sum = axpy_rn(sum, comb[(row * HC + j) * HC + k], load<4>(h + j * D, v));
      store<4>(out + row * width + k * D, v, sum);
      value[t] = sum;
      acc[t][NOUT] = fma_dot(sum, sum, acc[t][NOUT]);
    }
    const int64_t column = k * vec_d + v;  // float4 column of the flattened streams
#pragma unroll
    for (int o = 0; o < NOUT; ++o) {
      const float4 f = load<4>(fn + o * width, column);
#pragma unroll
      for (int t = 0; t < TT; ++t) acc[t][o] = fma_dot(value[t], f, acc[t][o]);
    }
  }
  store_split_partials<TT, NV>(acc, t0, tokens, split, splits, partial);
}

// finish_kernel's collapse threads: all of them for hc_head; for hc_pre all but warp 0, which runs the Sinkhorn.
__host__ __device__ constexpr int first_collapse_warp(bool head) { return head ? 0 : 1; }
__host__ __device__ constexpr int collapse_threads_of(bool head) { return kThreads - 32 * first_collapse_warp(head); }

// Columns (VEC units) a collapse thread keeps in registers in the decode form (kKeep): D / VEC ≤ this × the
// collapse threads (224 or 256), e.g. 4096 / 4 = 1,024 ≤ 8 × 224, and V4-Pro's 7168 / 4 = 1,792 ≤ 8 × 224.
constexpr int kKeptColumns = 8;

// The fused norm's 1 / rms of the collapsed row from each collapse thread's sum of squares: warp sums, then the
// collapse warps' in warp order, behind named barrier 1 over their threads (warp 0 may still be in the Sinkhorn).
// ops/cpu/norm.h: y = weight ⊙ x · rsqrt(mean(x²) + eps), as ops/cuda/rms_norm.h computes it.
template <bool kHead>
__device__ __forceinline__ float collapsed_row_rms(float sum_squares, float (&norm_sums)[kWarps], int64_t D,
                                                   float eps) {
  for (int offset = 16; offset > 0; offset /= 2) sum_squares += __shfl_xor_sync(kFull, sum_squares, offset);
  if (threadIdx.x % 32 == 0) norm_sums[threadIdx.x / 32] = sum_squares;
  asm volatile("bar.sync 1, %0;" ::"r"(collapse_threads_of(kHead)) : "memory");
  float total = 0.0f;
#pragma unroll
  for (int i = first_collapse_warp(kHead); i < kWarps; ++i) total += norm_sums[i];
  return row_rms_scale(total, D, eps);
}

// The norm weight's VEC values at column c (VEC units), read element by element (the weight need not be 16-byte
// aligned); ones for an unweighted norm.
template <int VEC>
__device__ __forceinline__ typename VecOf<VEC>::T norm_weight_at(const float* weight, int64_t c) {
  typename VecOf<VEC>::T w = one_vec(typename VecOf<VEC>::T{});
  if (weight == nullptr) return w;
  float* values = reinterpret_cast<float*>(&w);
#pragma unroll
  for (int i = 0; i < VEC; ++i) values[i] = weight[c * VEC + i];
  return w;
}

// Column c (VEC units) of token t's normalized row: weight ⊙ (value · rms) (weight: its VEC values, ones for an
// unweighted norm) into x, and its bf16 copy when the norm keeps one.
template <int VEC>
__device__ __forceinline__ void store_normalized(const typename VecOf<VEC>::T& value,
                                                 const typename VecOf<VEC>::T& weight, float rms,
                                                 const CollapseNorm& norm, int64_t t, int64_t D, int64_t c, float* x) {
  const float* in = reinterpret_cast<const float*>(&value);
  const float* w = reinterpret_cast<const float*>(&weight);
  float out[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    out[i] = w[i] * (in[i] * rms);
    if (norm.bf16) norm.bf16[t * D + c * VEC + i] = f32_to_bf16_bits(out[i]);
  }
  store<VEC>(x, c, *reinterpret_cast<const typename VecOf<VEC>::T*>(out));
}

// One CTA per token: the mixes from the splits, pre (and for hc_pre post and the Sinkhorn comb), the collapse,
// and, when `norm_weight_or_flag` is set (kNorm), the sublayer's RMSNorm of the collapsed row with its bf16 copy.
// kKeep (decode-sized launches, kNorm only; opt-in, DSV4_HC_FINISH=keep): a thread keeps its collapsed columns in registers for the norm, and
// loads its columns of the norm weight before the PDL wait (weights never come from the kernel before), so the
// norm pass only stores: the plain form writes the collapsed row, reads it back, reads the weight, then writes
// again, 1-3 more L2 round trips on the critical path of every decode layer's mHC hand-over (the CUPTI trace of
// session 31: finish ends ≈ 7.5-9 µs after its mix). Same values in the same order: the outputs are the plain
// form's bit for bit.
template <int HC, bool kHead, int VEC, bool kNorm, bool kKeep = false>
__global__ void __launch_bounds__(kThreads) finish_kernel(const float* __restrict__ partial, int splits,
                                                          const float* __restrict__ streams,
                                                          const float* __restrict__ base,
                                                          const float* __restrict__ scale, int64_t D, float hc_eps,
                                                          float norm_eps, int iters, float* __restrict__ collapsed,
                                                          float* __restrict__ post, float* __restrict__ comb,
                                                          CollapseNorm norm, bool deepseek, double hc_eps_d) {
  static_assert(!kKeep || kNorm, "the decode form keeps columns for the fused norm");
  using V = typename VecOf<VEC>::T;
  constexpr int first_thread = 32 * first_collapse_warp(kHead), collapse_threads = collapse_threads_of(kHead);
  const int64_t n = D / VEC;  // the row's columns in VEC units
  [[maybe_unused]] V kept_weight[kKeep ? kKeptColumns : 1];
  if constexpr (kKeep) {
#pragma unroll
    for (int u = 0; u < kKeptColumns; ++u) {
      const int64_t c = static_cast<int64_t>(threadIdx.x) - first_thread + int64_t{u} * collapse_threads;
      kept_weight[u] = one_vec(V{});
      if (norm.weight != nullptr && static_cast<int>(threadIdx.x) >= first_thread && c < n)
        kept_weight[u] = load<VEC>(norm.weight, c);
    }
  }
  PhaseProbe probe(kProbeHcFinishHead, threadIdx.x == 0 && blockIdx.x == 0);
  PhaseProbe collapse_probe(kProbeHcFinishCollapse, threadIdx.x == first_thread && blockIdx.x == 0);
  wait_for_prior_grid();
  allow_dependents();
  probe.mark();  // 1: inputs ready
  constexpr int NOUT = kHead ? HC : (2 + HC) * HC, NV = NOUT + 1;
  static_assert(NV <= 32 && HC * HC <= 32, "one warp holds the mixes and comb");
  __shared__ float mix[NOUT];
  __shared__ float pre[HC];
  // The splits' partial sums, staged by the whole CTA first: read one by one by a lane they were ~splits
  // dependent L2 round trips, the largest part of this kernel at decode (128 splits for one token). A thread's
  // share (≤ 13 values) is loaded into registers before any is stored, so the loads go out together: one round
  // trip (a plain loop, unrolled by 4, took four at 128 splits).
  __shared__ float staged[kMaxSplits * NV];
  __shared__ float norm_sums[kWarps];
  const int64_t t = blockIdx.x;
  {
    constexpr int kPerThread = (kMaxSplits * NV + kThreads - 1) / kThreads;
    const int count = splits * NV;
    const float* token_partial = partial + t * count;
    float values[kPerThread];
#pragma unroll
    for (int r = 0; r < kPerThread; ++r) {
      const int i = r * kThreads + static_cast<int>(threadIdx.x);
      values[r] = i < count ? token_partial[i] : 0.0f;
    }
#pragma unroll
    for (int r = 0; r < kPerThread; ++r) {
      const int i = r * kThreads + static_cast<int>(threadIdx.x);
      if (i < count) staged[i] = values[r];
    }
  }
  __syncthreads();
  probe.mark();  // 2: split sums staged
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    float s = 0.0f;
    if (lane < NV)
      for (int split = 0; split < splits; ++split) s += staged[split * NV + lane];  // the same order as before
    const float sumsq = __shfl_sync(kFull, s, NOUT);
    // The CPU's rms_norm scale: 1 / sqrt(mean(h²) + eps); the mix is rms(h)·fnᵀ = scale · Σ h·fn.
    const float rms = mix_rms_scale(sumsq, static_cast<float>(HC * D), norm_eps);
    if (lane < NOUT) mix[lane] = __fmul_rn(s, rms);
    __syncwarp();
    if (deepseek) {
      auto sigmoid_d = [](double x) { return 1.0 / (1.0 + exp(-x)); };
      if constexpr (kHead) {  // hc_head_deepseek: the affine in fp32, the sigmoid in double, + eps in fp32
        if (lane < HC)
          pre[lane] = __fadd_rn(static_cast<float>(sigmoid_d(affine(mix[lane], scale[0], base[lane]))), hc_eps);
      } else {  // hc_pre_deepseek: everything in double, rounded once
        if (lane < HC) {
          pre[lane] = static_cast<float>(sigmoid_d(static_cast<double>(mix[lane]) * scale[0] + base[lane]) + hc_eps_d);
          post[t * HC + lane] =
              static_cast<float>(2.0 * sigmoid_d(static_cast<double>(mix[HC + lane]) * scale[1] + base[HC + lane]));
        }
      }
    } else {
      if (lane < HC) pre[lane] = pre_weight(mix[lane], scale[0], base[lane], hc_eps);
      if constexpr (!kHead) {
        if (lane < HC)
          post[t * HC + lane] = post_weight(mix[HC + lane], scale[1], base[HC + lane]);
      }
    }
    probe.mark();  // 3: mixes, pre and post
  }
  __syncthreads();
  collapse_probe.mark();  // 1: pre shared
  // hc_pre: warp 0 runs the Sinkhorn comb (a serial chain of 2·iters dependent shuffles and divisions, ~4 µs at
  // 20 iterations) while the other warps collapse the streams, which need only `pre`: the kernel takes the
  // longer of the two instead of their sum.
  if constexpr (!kHead) {
    if (threadIdx.x < 32) {
      const int lane = threadIdx.x;
      // Lane l < HC² holds comb[j][k], l = j·HC + k; every sum is the CPU's sequential one (gathered by shuffles).
      const int l = lane < HC * HC ? lane : 0;
      const int j = l / HC, k = l - j * HC;
      if (deepseek) {  // hc_pre_deepseek: the same chain in double, rounded once
        double c = static_cast<double>(mix[2 * HC + l]) * scale[2] + base[2 * HC + l];
        double row_max = -INFINITY;
#pragma unroll
        for (int kk = 0; kk < HC; ++kk) row_max = fmax(row_max, __shfl_sync(kFull, c, j * HC + kk));
        const double e = exp(c - row_max);
        double sum = 0.0;
#pragma unroll
        for (int kk = 0; kk < HC; ++kk) sum += __shfl_sync(kFull, e, j * HC + kk);
        c = e / sum + hc_eps_d;
        auto normalise_columns = [&] {
          double column = 0.0;
#pragma unroll
          for (int jj = 0; jj < HC; ++jj) column += __shfl_sync(kFull, c, jj * HC + k);
          c /= column + hc_eps_d;
        };
        auto normalise_rows = [&] {
          double row = 0.0;
#pragma unroll
          for (int kk = 0; kk < HC; ++kk) row += __shfl_sync(kFull, c, j * HC + kk);
          c /= row + hc_eps_d;
        };
        normalise_columns();
        for (int iter = 1; iter < iters; ++iter) {
          normalise_rows();
          normalise_columns();
        }
        if (lane < HC * HC) comb[t * HC * HC + lane] = static_cast<float>(c);
        probe.mark();  // 4: Sinkhorn
        probe.report("hc_finish.sinkhorn");
        return;
      }
      const float c = sinkhorn_comb<HC>(mix, scale, base, iters, hc_eps, 0, l);
      if (lane < HC * HC) comb[t * HC * HC + lane] = c;
      probe.mark();  // 4: Sinkhorn
      probe.report("hc_finish.sinkhorn");
      return;
    }
  }
  float w[HC];
#pragma unroll
  for (int s = 0; s < HC; ++s) w[s] = pre[s];
  const float* h = streams + t * HC * D;
  float* x = collapsed + t * D;
  float sum_squares = 0.0f;
  if constexpr (kKeep) {
    // This thread's columns c = first + u · collapse_threads (the plain loop's, in its order), kept for the norm.
    V kept[kKeptColumns];
#pragma unroll
    for (int u = 0; u < kKeptColumns; ++u) {
      const int64_t c = static_cast<int64_t>(threadIdx.x) - first_thread + int64_t{u} * collapse_threads;
      kept[u] = zero_vec(V{});
      if (c < n) {
        V sum = zero_vec(V{});
#pragma unroll
        for (int s = 0; s < HC; ++s) sum = axpy_rn(sum, w[s], load<VEC>(h + s * D, c));
        kept[u] = sum;
        sum_squares = fma_dot(sum, sum, sum_squares);
      }
    }
    collapse_probe.mark();  // 2: collapsed
    const float rms = collapsed_row_rms<kHead>(sum_squares, norm_sums, D, norm.eps);
    collapse_probe.mark();  // 3: row rms
#pragma unroll
    for (int u = 0; u < kKeptColumns; ++u) {
      const int64_t c = static_cast<int64_t>(threadIdx.x) - first_thread + int64_t{u} * collapse_threads;
      if (c >= n) continue;
      store_normalized<VEC>(kept[u], kept_weight[u], rms, norm, t, D, c, x);
    }
  } else {
    // Unrolled so a thread's loads of all its columns (4 × 4 float4 at D = 4096) are in flight together: one
    // memory latency instead of one per column step (the kernel took 10 µs per call at decode before).
#pragma unroll 4
    for (int64_t c = threadIdx.x - first_thread; c < n; c += collapse_threads) {
      V sum = zero_vec(V{});
#pragma unroll
      for (int s = 0; s < HC; ++s) sum = axpy_rn(sum, w[s], load<VEC>(h + s * D, c));
      store<VEC>(x, c, sum);
      if constexpr (kNorm) sum_squares = fma_dot(sum, sum, sum_squares);
    }
    collapse_probe.mark();  // 2: collapsed
    if constexpr (kNorm) {
      // Each thread reads back only the columns it wrote.
      const float rms = collapsed_row_rms<kHead>(sum_squares, norm_sums, D, norm.eps);
      collapse_probe.mark();  // 3: row rms
      for (int64_t c = threadIdx.x - first_thread; c < n; c += collapse_threads)
        store_normalized<VEC>(load<VEC>(x, c), norm_weight_at<VEC>(norm.weight, c), rms, norm, t, D, c, x);
    }
  }
  collapse_probe.mark();  // 4: normalized (stores issued)
  collapse_probe.report(kHead ? "hc_finish.collapse_head" : "hc_finish.collapse");
  if constexpr (kHead) probe.report("hc_finish.head");
}

// ---- The decode hand-over in one launch (hc_post_pre for ≤ kHandoverMaxTokens tokens) ----
// hc_post, the next sublayer's mixes, pre / post / Sinkhorn comb, the collapse and its RMSNorm in one grid. As
// three dependent kernels (hc_post, mix, finish) the hand-over took ≈ 14 µs at batch 1, 8 times a step (session
// 31's CUPTI trace): two kernel boundaries, and one CTA doing a token's whole collapse after the mix. Here the
// splits of a token group meet at two grid barriers instead:
//   1. each split CTA (32 hidden float4 columns of every stream at HC = 4) makes its columns' new streams (hc_post's
//      values, bit for bit) and their mix partial sums; the last CTA to arrive sums the splits (a fixed order),
//      writes pre and post, releases the others, then runs the Sinkhorn (two tokens a warp) while they go on;
//   2. each split's warp 0 collapses its own columns from shared memory (the streams are not read again) and adds
//      their squares; the last to arrive sums them (a fixed order) into the row's RMS scale;
//   3. each split normalises its columns (the norm weight was loaded before the PDL wait) and stores them with
//      their bf16 copy.
// The barriers need every CTA of the grid resident at once; the launcher checks the occupancy, and PDL's dependents
// cannot take the SMs first (they launch only once every CTA here has run allow_dependents).
constexpr int kHandoverThreads = 128;
constexpr int64_t kHandoverMaxTokens = 8;
constexpr int kHandoverMaxSpan = 32;  // hidden float4 columns of a split: warp 0 collapses them
// One token a group: a CTA then does one token's work whatever the batch, and the groups (each its own 32 splits
// and barrier words) run side by side. The first two versions took 4 tokens a group (kTokensPerCta, the mix
// kernel's), and at 8 tokens the one launch (two groups, 4 tokens a CTA) took 20.8 µs against 12.4 at one token
// (kbench, H100, session 33): the work a CTA does between the barriers grew with its tokens. 8 groups of 32 CTAs
// stay resident at once on an H100 or H200 (128 registers: 4 CTAs an SM; handover_fits checks).
constexpr int kHandoverTokensPerGroup = 1;
static_assert(hc_handover_generation_word(
                  (kHandoverMaxTokens + kHandoverTokensPerGroup - 1) / kHandoverTokensPerGroup - 1, 1) <
                  kHcHandoverSyncBytes / sizeof(unsigned),
              "the caller's sync words cover every token group");

struct HandoverArgs {
  const float* y;        // [tokens, D] the sublayer's output
  const float* streams;  // [tokens, HC, D]
  const float* post;     // [tokens, HC] this sublayer's
  const float* comb;     // [tokens, HC, HC]
  const float* fn;       // the next sublayer's mix weights [(2 + HC)·HC, HC·D], base, scale
  const float* base;
  const float* scale;
  float* out;        // [tokens, HC, D] the new streams
  float* collapsed;  // [tokens, D] normalised
  float* next_post;  // may alias post (read before the first barrier, written after it)
  float* next_comb;  // may alias comb
  CollapseNorm norm;
  float* partial;  // workspace: [tokens, splits, NOUT + 1] mix partial sums
  float* squares;  // [tokens, splits] the collapsed row's partial sums of squares
  float* pre;      // [tokens, HC]
  float* rms;      // [tokens]
  unsigned* sync;  // kHcHandoverSyncBytes, zero between calls
  int64_t tokens, D, chunk;
  int splits, iters;
  float hc_eps, norm_eps;
};

__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
  unsigned value;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(value) : "l"(p) : "memory");
  return value;
}
// One arrival: release (this CTA's writes before it) and acquire (the last arriver sees everyone's) in one atomic,
// instead of a full fence on each side (the first version's two __threadfence()s and polling without pause made
// each barrier of 128 CTAs cost ≈ 4-5 µs on an H100, session 32's phase probe).
__device__ __forceinline__ unsigned add_acq_rel(unsigned* p, unsigned value) {
  unsigned old;
  asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(value) : "memory");
  return old;
}
__device__ __forceinline__ void add_release(unsigned* p, unsigned value) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(value) : "memory");
}

// One CTA's (or, with kWarp, one warp's) arrival at a barrier of `arrivals` CTAs over (count, generation), after its
// writes. True, in every thread, in the CTA that arrived last: it sees every other CTA's writes, does the group's
// serial step, then calls release_group; the others call wait_group with the generation read before arriving
// (valid in thread 0).
template <bool kWarp>
__device__ __forceinline__ bool arrive_group(unsigned* count, const unsigned* generation, unsigned arrivals,
                                             unsigned& seen_generation) {
  __shared__ int last_shared;
  int last = 0;
  if constexpr (kWarp) __syncwarp();
  else __syncthreads();
  if (threadIdx.x == 0) {
    seen_generation = load_acquire(generation);  // before arriving: the release cannot have happened yet
    last = add_acq_rel(count, 1u) == arrivals - 1;
    if constexpr (!kWarp) last_shared = last;
  }
  if constexpr (kWarp) {
    __syncwarp();  // memory order: the other lanes read what lane 0's arrival saw
    return __shfl_sync(kFull, last, 0) != 0;
  }
  __syncthreads();
  return last_shared != 0;
}

template <bool kWarp>
__device__ __forceinline__ void release_group(unsigned* count, unsigned* generation) {
  if constexpr (kWarp) __syncwarp();
  else __syncthreads();  // the last CTA's writes before the release
  if (threadIdx.x == 0) {
    atomicExch(count, 0u);  // every CTA has arrived: none adds to it until the next call
    add_release(generation, 1u);
  }
}

template <bool kWarp>
__device__ __forceinline__ void wait_group(const unsigned* generation, unsigned seen_generation) {
  if (threadIdx.x == 0)
    while (load_acquire(generation) == seen_generation) __nanosleep(32);  // fewer polls of the line being released
  if constexpr (kWarp) __syncwarp();
  else __syncthreads();
}

// grid (ceil(tokens / kHandoverTokensPerGroup), splits), kHandoverThreads; D % 4 == 0, rows 16-byte aligned,
// HC·chunk ≤ kHandoverThreads and chunk ≤ kHandoverMaxSpan (hidden float4 columns per split). kPost: the streams
// are made from y, post and comb first (hc_post_pre); otherwise they are read as they are (a first hc_pre, or
// hc_head). kHead: hc_head's mixes (HC of them: pre only; no post, no Sinkhorn).
template <int HC, bool kPost, bool kHead>
__global__ void __launch_bounds__(kHandoverThreads) post_pre_handover_kernel(const HandoverArgs a) {
  static_assert(!(kPost && kHead), "hc_head follows an hc_post of its own");
  constexpr int NOUT = kHead ? HC : (2 + HC) * HC, TT = kHandoverTokensPerGroup, NV = NOUT + 1;
  static_assert(HC * HC <= 16, "two tokens' Sinkhorn a warp");
  static_assert(TT <= 4, "warps 1 and 2 run the group's Sinkhorns, two tokens each");
  const int group = static_cast<int>(blockIdx.x), split = static_cast<int>(blockIdx.y);
  const int64_t t0 = int64_t{group} * TT;
  const int64_t vec_d = a.D / 4, width = HC * a.D;
  const int64_t begin = split * a.chunk, end = min(vec_d, begin + a.chunk);
  const int span = static_cast<int>(end > begin ? end - begin : 0);
  const int c = static_cast<int>(threadIdx.x);
  // Thread c < HC·span makes stream k = c / span at hidden float4 v, as post_mix_partial_kernel's thread c.
  const bool stream_thread = c < HC * span;
  const int k = stream_thread ? c / span : 0;
  const int64_t v = begin + (stream_thread ? c % span : 0);
  // Weights, never written by an earlier kernel, so read before the PDL wait: fn at this thread's stream column,
  // and the norm weight of hidden column begin + c (warp 0 normalises it).
  float4 f[NOUT];
#pragma unroll
  for (int o = 0; o < NOUT; ++o)
    f[o] = stream_thread ? load<4>(a.fn + o * width, k * vec_d + v) : zero_vec(float4{});
  float4 weight = one_vec(float4{});
  if (c < span && a.norm.weight != nullptr) weight = load<4>(a.norm.weight, begin + c);
  PhaseProbe probe(kProbeHcHandover, c == 0 && group == 0 && split == 0);
  wait_for_prior_grid();
  allow_dependents();
  probe.mark();  // 1: inputs ready
  // Each barrier's count and generation on their own 128-byte lines (hc_handover_generation_word).
  unsigned* count1 = a.sync + hc_handover_generation_word(group, 0) - 32;
  unsigned* generation1 = count1 + 32;
  unsigned* count2 = a.sync + hc_handover_generation_word(group, 1) - 32;
  unsigned* generation2 = count2 + 32;

  // 1. New streams and mix partial sums: store_split_partials' reduction (shuffles, then the warps in order), each
  // sum reduced as soon as it is made so the CTA never holds TT·NV of them.
  __shared__ float4 fresh[TT][kHandoverThreads];
  __shared__ float warp_sums[kHandoverThreads / 32][TT * NV];
  const int lane = c % 32, warp = c / 32;
  auto reduce_into = [&](float value, int slot) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(kFull, value, offset);
    if (lane == 0) warp_sums[warp][slot] = value;
  };
#pragma unroll
  for (int t = 0; t < TT; ++t) {
    if (t0 + t >= a.tokens) break;  // uniform across the CTA
    const int64_t row = t0 + t;
    float4 value = zero_vec(float4{});
    if (stream_thread) {
      const float* h = a.streams + row * width;
      if constexpr (kPost) {
        value = scale_rn(a.post[row * HC + k], load<4>(a.y + row * a.D, v));
#pragma unroll
        for (int j = 0; j < HC; ++j) value = axpy_rn(value, a.comb[(row * HC + j) * HC + k], load<4>(h + j * a.D, v));
        store<4>(a.out + row * width + k * a.D, v, value);
      } else {
        value = load<4>(h + k * a.D, v);
      }
    }
    fresh[t][c] = value;
    reduce_into(fma_dot(value, value, 0.0f), t * NV + NOUT);
#pragma unroll
    for (int o = 0; o < NOUT; ++o) reduce_into(fma_dot(value, f[o], 0.0f), t * NV + o);
  }
  __syncthreads();
  for (int i = c; i < TT * NV; i += kHandoverThreads) {
    const int t = i / NV, o = i - t * NV;
    if (t0 + t >= a.tokens) continue;
    float sum = 0.0f;
    for (int w = 0; w < kHandoverThreads / 32; ++w) sum += warp_sums[w][i];
    a.partial[((t0 + t) * a.splits + split) * NV + o] = sum;
  }

  probe.mark();  // 2: new streams and partial sums stored
  // 2. Barrier 1; the last CTA makes pre and post, then the Sinkhorn comb.
  __shared__ float quarter[4][NV];
  __shared__ float mixes[TT][NOUT];
  unsigned seen = 0;
  if (arrive_group<false>(count1, generation1, static_cast<unsigned>(a.splits), seen)) {
    const int per_quarter = (a.splits + 3) / 4;
    for (int t = 0; t < TT; ++t) {
      if (c < NOUT) mixes[t][c] = 0.0f;
      if (t0 + t >= a.tokens) continue;  // uniform across the CTA
      const float* token_partial = a.partial + (t0 + t) * a.splits * NV;
      if (c < 4 * NV) {  // quarter q of the splits of output o, in split order
        const int o = c % NV, q = c / NV;
        const int first = q * per_quarter, last = min(a.splits, first + per_quarter);
        float s = 0.0f;
#pragma unroll 8
        for (int sp = first; sp < last; ++sp) s += __ldcg(token_partial + sp * NV + o);
        quarter[q][o] = s;
      }
      __syncthreads();
      if (c < NOUT) {
        const float sum = ((quarter[0][c] + quarter[1][c]) + quarter[2][c]) + quarter[3][c];
        const float sumsq = ((quarter[0][NOUT] + quarter[1][NOUT]) + quarter[2][NOUT]) + quarter[3][NOUT];
        const float mix = __fmul_rn(sum, mix_rms_scale(sumsq, static_cast<float>(HC * a.D), a.norm_eps));
        mixes[t][c] = mix;
        if (c < HC) {
          a.pre[(t0 + t) * HC + c] = pre_weight(mix, a.scale[0], a.base[c], a.hc_eps);
        } else if (!kHead && c < 2 * HC) {
          a.next_post[(t0 + t) * HC + c - HC] = post_weight(mix, a.scale[1], a.base[c]);
        }
      }
      __syncthreads();
    }
    release_group<false>(count1, generation1);
    // Warps 1 and 2: the comb of tokens 2·(warp − 1) + half, 16 lanes each (off the path of the collapse).
    if (!kHead && (warp == 1 || warp == 2)) {
      const int t = 2 * (warp - 1) + lane / 16, l16 = lane % 16;
      // Every lane takes part in the shuffles; lanes past the group's tokens run token 0's and store nothing.
      const float comb = sinkhorn_comb<HC>(mixes[t < TT ? t : 0], a.scale, a.base, a.iters, a.hc_eps, lane & 16,
                                           l16 < HC * HC ? l16 : 0);
      if (t < TT && t0 + t < a.tokens && l16 < HC * HC) a.next_comb[(t0 + t) * HC * HC + l16] = comb;
    }
  } else {
    wait_group<false>(generation1, seen);
  }
  probe.mark();  // 3: past barrier 1
  if (c >= 32) return;

  // 3. Warp 0: the collapse of this split's columns and their squares.
  float4 collapsed[TT];
#pragma unroll
  for (int t = 0; t < TT; ++t) {
    collapsed[t] = zero_vec(float4{});
    float squares = 0.0f;
    if (t0 + t < a.tokens) {
      if (c < span) {
        float4 sum = zero_vec(float4{});
#pragma unroll
        for (int s = 0; s < HC; ++s) sum = axpy_rn(sum, __ldcg(a.pre + (t0 + t) * HC + s), fresh[t][s * span + c]);
        collapsed[t] = sum;
        squares = fma_dot(sum, sum, 0.0f);
      }
      for (int offset = 16; offset > 0; offset /= 2) squares += __shfl_xor_sync(kFull, squares, offset);
      if (c == 0) a.squares[(t0 + t) * a.splits + split] = squares;
    }
  }
  // 4. Barrier 2 (warp 0 of every split); the last sums the squares into each row's RMS scale.
  if (arrive_group<true>(count2, generation2, static_cast<unsigned>(a.splits), seen)) {
    for (int t = 0; t < TT && t0 + t < a.tokens; ++t) {
      float total = 0.0f;
      for (int sp = c; sp < a.splits; sp += 32) total += __ldcg(a.squares + (t0 + t) * a.splits + sp);
      for (int offset = 16; offset > 0; offset /= 2) total += __shfl_xor_sync(kFull, total, offset);
      if (c == 0) a.rms[t0 + t] = row_rms_scale(total, a.D, a.norm.eps);
    }
    release_group<true>(count2, generation2);
  } else {
    wait_group<true>(generation2, seen);
  }
  probe.mark();  // 4: past barrier 2
  // 5. The normalised columns and their bf16 copy.
  if (c < span) {
#pragma unroll
    for (int t = 0; t < TT; ++t) {
      if (t0 + t >= a.tokens) break;
      const int64_t row = t0 + t;
      store_normalized<4>(collapsed[t], weight, __ldcg(a.rms + row), a.norm, row, a.D, begin + c,
                          a.collapsed + row * a.D);
    }
  }
  probe.mark();  // 5: stored
  probe.report("hc_handover");
}

// grid (tokens, column blocks): out[t, k] = post[t, k]·y[t] + Σ_j comb[t, j, k]·h[t, j]; kDeepSeek: Σ_j first,
// the sublayer term last, the sum rounded to bf16.
template <int HC, int VEC, bool kDeepSeek = false>
__global__ void __launch_bounds__(kThreads) hc_post_kernel(const float* __restrict__ y,
                                                           const float* __restrict__ streams,
                                                           const float* __restrict__ post,
                                                           const float* __restrict__ comb, float* __restrict__ out,
                                                           int64_t D) {
  PhaseProbe probe(kProbeHcPost, threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0);
  wait_for_prior_grid();
  allow_dependents();
  probe.mark();
  using V = typename VecOf<VEC>::T;
  const int64_t t = blockIdx.x;
  float w[HC], cm[HC][HC];
#pragma unroll
  for (int k = 0; k < HC; ++k) w[k] = post[t * HC + k];
#pragma unroll
  for (int j = 0; j < HC; ++j)
#pragma unroll
    for (int k = 0; k < HC; ++k) cm[j][k] = comb[(t * HC + j) * HC + k];
  const float* h = streams + t * HC * D;
  const int64_t n = D / VEC;
  for (int64_t c = blockIdx.y * int64_t{kThreads} + threadIdx.x; c < n; c += int64_t{gridDim.y} * kThreads) {
    const V yv = load<VEC>(y + t * D, c);
    V hv[HC];
#pragma unroll
    for (int j = 0; j < HC; ++j) hv[j] = load<VEC>(h + j * D, c);
#pragma unroll
    for (int k = 0; k < HC; ++k) {
      if constexpr (kDeepSeek) {
        V mixed = zero_vec(V{});
#pragma unroll
        for (int j = 0; j < HC; ++j) mixed = axpy_rn(mixed, cm[j][k], hv[j]);
        store<VEC>(out + (t * HC + k) * D, c, round_bf16(add_rn(scale_rn(w[k], yv), mixed)));
      } else {
        V sum = scale_rn(w[k], yv);
#pragma unroll
        for (int j = 0; j < HC; ++j) sum = axpy_rn(sum, cm[j][k], hv[j]);
        store<VEC>(out + (t * HC + k) * D, c, sum);
      }
    }
  }
  probe.mark();
  probe.report("hc_post");
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Tokens up to which finish_kernel takes its decode form (one CTA a token; beyond a wave of CTAs its extra
// registers would cost occupancy where the plain form's round trips overlap across CTAs anyway).
constexpr int64_t kKeepMaxTokens = 64;

int mix_splits(int64_t tokens, int64_t vec_cols) {
  const int64_t groups = (tokens + kTokensPerCta - 1) / kTokensPerCta;
  int64_t splits = (kTargetCtas + groups - 1) / groups;
  splits = std::min<int64_t>(splits, std::max<int64_t>(1, vec_cols / kMinSplitColumns));
  return static_cast<int>(std::clamp<int64_t>(splits, 1, kMaxSplits));
}

// Splits of the tensor-core mix for this batch, or 0 where it does not apply (few tokens, unaligned rows, or
// DSV4_HC_MIX_KERNEL=simt, read per call, to measure the two). A power of two, up to about 512 CTAs.
int tensor_core_splits(int64_t tokens, int64_t width, bool vec4) {
  if (tokens < kTensorCoreMinTokens || !vec4 || width % 16 != 0) return 0;
  const char* choice = std::getenv("DSV4_HC_MIX_KERNEL");
  if (choice != nullptr && std::strcmp(choice, "simt") == 0) return 0;
  const int64_t blocks = (tokens + kTcTokens - 1) / kTcTokens;
  int splits = 1;
  while (splits < kTensorCoreMaxSplits && blocks * splits < 512 && width % (32 * splits) == 0) splits *= 2;
  return splits;
}

bool valid_params(const HyperConnectionParams& p) {
  return p.tokens >= 0 && p.tokens <= 0x7fffffff && (p.hc == 1 || p.hc == 2 || p.hc == 4) && p.hidden > 0 &&
         p.sinkhorn_iters >= 1 && p.sinkhorn_iters <= 0x7fffffff;
}

// finish_kernel over the partial sums of `splits` splits: one CTA a token.
template <int HC, bool kHead, int VEC>
void launch_finish(const HyperConnectionParams& p, const float* partial, int splits, const float* streams,
                   const float* base, const float* scale, float* collapsed, float* post, float* comb,
                   const CollapseNorm* norm, cudaStream_t stream) {
  const CollapseNorm fused = norm ? *norm : CollapseNorm{};
  // The decode form where its registers hold a thread's columns and the CTAs are few, opt-in (DSV4_HC_FINISH=keep,
  // read per call) until it has been timed on a device: written in session 31 after its device time ran out.
  const char* finish_choice = std::getenv("DSV4_HC_FINISH");
  const bool plain_only = finish_choice == nullptr || std::strcmp(finish_choice, "keep") != 0;
  const bool keep = norm != nullptr && !plain_only && p.tokens <= kKeepMaxTokens &&
                    p.hidden / VEC <= int64_t{kKeptColumns} * collapse_threads_of(kHead);
  const auto kernel = keep ? finish_kernel<HC, kHead, VEC, true, true>
                      : norm ? finish_kernel<HC, kHead, VEC, true> : finish_kernel<HC, kHead, VEC, false>;
  launch_dependent(kernel, static_cast<unsigned>(p.tokens), kThreads, 0, stream, partial, splits, streams, base, scale,
                   p.hidden, p.hc_eps, p.norm_eps, static_cast<int>(p.sinkhorn_iters), collapsed, post, comb, fused,
                   p.deepseek, p.deepseek_hc_eps);
}

// Whether every CTA of a `ctas`-CTA grid of the hand-over kernel is resident at once on the current device (its
// barriers need that); the answer per device is cached.
template <int HC, bool kPost, bool kHead>
bool handover_fits(int64_t ctas) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  static std::atomic<int> resident[64] = {};  // CTAs resident at once per device, 0 until asked
  if (device < 0 || device >= 64) return false;
  if (resident[device].load() == 0) {
    int per_sm = 0, sms = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, post_pre_handover_kernel<HC, kPost, kHead>,
                                                      kHandoverThreads, 0) !=
            cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
      return false;
    resident[device].store(std::max(1, per_sm * sms));
  }
  return ctas <= resident[device].load();
}

// Up to how many tokens the one-launch hand-over runs (read per call, so a run can compare the forms): by default
// every decode-sized batch (kHandoverMaxTokens). With one token a group it beat the kernels at every batch (H100,
// session 34: kbench hc_post + hc_pre 13.5 / 13.8 / 13.5 / 14.4 µs at 1 / 2 / 4 / 8 tokens against 18.1 / 16.8 /
// 17.0 / 17.5 for the two calls; decode at batch 8 2.265 / 2.261 ms against 2.288 / 2.340 with it at one token only
// and 2.334 / 2.313 with it off). DSV4_HC_HANDOVER=0: never.
int64_t handover_max_tokens() {
  const char* choice = std::getenv("DSV4_HC_HANDOVER");
  if (choice != nullptr && std::strcmp(choice, "0") == 0) return 0;
  return kHandoverMaxTokens;
}

// The one-launch hand-over where it applies (a decode-sized batch, the fused norm, fp32 numerics, aligned rows, its
// sync words, a workspace that fits, the grid resident at once); false to take the kernels below. kPost / kHead as
// the kernel's (y, post, comb and out unused without kPost; next_post and next_comb with kHead).
template <int HC, bool kPost, bool kHead>
bool launch_handover(const HyperConnectionParams& p, const float* y, const float* streams, const float* post,
                     const float* comb, float* out, const float* fn, const float* base, const float* scale,
                     float* collapsed, float* next_post, float* next_comb, void* workspace, size_t workspace_bytes,
                     const CollapseNorm* norm, unsigned* sync, cudaStream_t stream) {
  if (sync == nullptr || norm == nullptr || p.deepseek || p.tokens > handover_max_tokens() || p.hidden % 4 != 0)
    return false;
  if ((kPost && (!aligned16(y) || !aligned16(out))) || !aligned16(streams) || !aligned16(fn) ||
      !aligned16(collapsed) || (norm->weight != nullptr && !aligned16(norm->weight)))
    return false;
  constexpr int NOUT = kHead ? HC : (2 + HC) * HC;
  const int64_t vec_d = p.hidden / 4;
  // Splits as wide as a CTA allows (HC·chunk stream columns ≤ its threads, chunk ≤ warp 0's lanes): each barrier
  // then has 32 arrivals at D = 4096 instead of post_mix_partial_kernel's 128 splits (the first version's; ≈ 4-5
  // µs a barrier, and 2.5 µs worse per hand-over at 8 tokens than the kernels). fn, read before the PDL wait, no
  // longer needs 128 SMs to arrive in time.
  const int64_t chunk = std::min<int64_t>(kHandoverMaxSpan, kHandoverThreads / HC);
  const int splits = static_cast<int>((vec_d + chunk - 1) / chunk);
  const int64_t groups = (p.tokens + kHandoverTokensPerGroup - 1) / kHandoverTokensPerGroup;
  // The workspace: the mix partial sums, then the squares per split, pre and the RMS scale per token.
  HandoverArgs a{};
  a.partial = static_cast<float*>(workspace);
  a.squares = a.partial + p.tokens * splits * (NOUT + 1);
  a.pre = a.squares + p.tokens * splits;
  a.rms = a.pre + p.tokens * HC;
  const size_t floats = static_cast<size_t>(a.rms + p.tokens - a.partial);
  if (workspace == nullptr || workspace_bytes < floats * sizeof(float)) return false;
  if (!handover_fits<HC, kPost, kHead>(groups * splits)) return false;
  a.y = y;
  a.streams = streams;
  a.post = post;
  a.comb = comb;
  a.fn = fn;
  a.base = base;
  a.scale = scale;
  a.out = out;
  a.collapsed = collapsed;
  a.next_post = next_post;
  a.next_comb = next_comb;
  a.norm = *norm;
  a.sync = sync;
  a.tokens = p.tokens;
  a.D = p.hidden;
  a.chunk = chunk;
  a.splits = splits;
  a.iters = static_cast<int>(p.sinkhorn_iters);
  a.hc_eps = p.hc_eps;
  a.norm_eps = p.norm_eps;
  launch_dependent(post_pre_handover_kernel<HC, kPost, kHead>,
                   dim3(static_cast<unsigned>(groups), static_cast<unsigned>(splits)), kHandoverThreads, 0, stream, a);
  return true;
}

// The mix kernel then the finish kernel, for hc_pre (kHead false) and hc_head; or the one-launch hand-over.
template <int HC, bool kHead>
cudaError_t launch_mix(const HyperConnectionParams& p, const float* streams, const float* fn, const float* base,
                       const float* scale, float* collapsed, float* post, float* comb, void* workspace,
                       size_t workspace_bytes, const CollapseNorm* norm, unsigned* sync, cudaStream_t stream) {
  if (launch_handover<HC, false, kHead>(p, nullptr, streams, nullptr, nullptr, nullptr, fn, base, scale, collapsed,
                                        post, comb, workspace, workspace_bytes, norm, sync, stream))
    return cudaGetLastError();
  constexpr int NOUT = kHead ? HC : (2 + HC) * HC;
  const int64_t width = HC * p.hidden;
  const bool vec4 = p.hidden % 4 == 0 && aligned16(streams) && aligned16(fn) && aligned16(collapsed);
  const int64_t vec_cols = vec4 ? width / 4 : width;
  const int tc_splits = tensor_core_splits(p.tokens, width, vec4);
  const int splits = tc_splits > 0 ? tc_splits : mix_splits(p.tokens, vec_cols);
  const int64_t chunk = (vec_cols + splits - 1) / splits;
  const size_t need = static_cast<size_t>(p.tokens) * splits * (NOUT + 1) * sizeof(float);
  if (workspace == nullptr || workspace_bytes < need) return cudaErrorInvalidValue;
  auto* partial = static_cast<float*>(workspace);
  const dim3 mix_grid(static_cast<unsigned>((p.tokens + kTokensPerCta - 1) / kTokensPerCta),
                      static_cast<unsigned>(splits));
  const auto mix_threads = static_cast<unsigned>(std::min<int64_t>(kThreads, (chunk + 31) / 32 * 32));
  if (tc_splits > 0) {
    const dim3 grid(static_cast<unsigned>((p.tokens + kTcTokens - 1) / kTcTokens), static_cast<unsigned>(splits));
    launch_dependent(mix_partial_tf32_kernel<NOUT>, grid, 32 * kTcWarps, 0, stream, streams, fn, p.tokens, width,
                     width / splits, splits, partial);
    launch_finish<HC, kHead, 4>(p, partial, splits, streams, base, scale, collapsed, post, comb, norm, stream);
  } else if (vec4) {
    launch_dependent(p.tokens == 1 ? mix_partial_kernel<NOUT, 4, 1> : mix_partial_kernel<NOUT, 4>, mix_grid,
                     mix_threads, 0, stream, streams, fn, p.tokens, width, chunk, splits, partial);
    launch_finish<HC, kHead, 4>(p, partial, splits, streams, base, scale, collapsed, post, comb, norm, stream);
  } else {
    launch_dependent(mix_partial_kernel<NOUT, 1>, mix_grid, mix_threads, 0, stream, streams, fn, p.tokens,
                     width, chunk, splits, partial);
    launch_finish<HC, kHead, 1>(p, partial, splits, streams, base, scale, collapsed, post, comb, norm, stream);
  }
  return cudaGetLastError();
}

template <bool kHead>
cudaError_t dispatch_mix(const HyperConnectionParams& p, const float* streams, const float* fn, const float* base,
                         const float* scale, float* collapsed, float* post, float* comb, void* workspace,
                         size_t workspace_bytes, const CollapseNorm* norm, unsigned* sync, cudaStream_t stream) {
  if (!valid_params(p)) return cudaErrorInvalidValue;
  if (p.tokens == 0) return cudaSuccess;
  if (norm && norm->bf16 && reinterpret_cast<uintptr_t>(norm->bf16) % 2 != 0) return cudaErrorInvalidValue;
  switch (p.hc) {
    case 1: return launch_mix<1, kHead>(p, streams, fn, base, scale, collapsed, post, comb, workspace, workspace_bytes, norm, sync, stream);
    case 2: return launch_mix<2, kHead>(p, streams, fn, base, scale, collapsed, post, comb, workspace, workspace_bytes, norm, sync, stream);
    case 4: return launch_mix<4, kHead>(p, streams, fn, base, scale, collapsed, post, comb, workspace, workspace_bytes, norm, sync, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <int HC>
cudaError_t launch_post(const HyperConnectionParams& p, const float* y, const float* streams, const float* post,
                        const float* comb, float* out, cudaStream_t stream) {
  const bool vec4 = p.hidden % 4 == 0 && aligned16(y) && aligned16(streams) && aligned16(out);
  const int64_t n = vec4 ? p.hidden / 4 : p.hidden;
  const dim3 grid(static_cast<unsigned>(p.tokens),
                  static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535)));
  const auto kernel = p.deepseek ? (vec4 ? hc_post_kernel<HC, 4, true> : hc_post_kernel<HC, 1, true>)
                                 : (vec4 ? hc_post_kernel<HC, 4, false> : hc_post_kernel<HC, 1, false>);
  launch_dependent(kernel, grid, kThreads, 0, stream, y, streams, post, comb, out, p.hidden);
  return cudaGetLastError();
}

// Splits over the hidden columns of post_mix_tf32_kernel: up to about 512 CTAs, as tensor_core_splits, each
// split a multiple of 16 hidden columns (DSV4_HC_POST_MIX_SPLITS=n overrides it, to measure).
int post_mix_splits(const HyperConnectionParams& p) {
  const int64_t blocks = (p.tokens + kTcTokens - 1) / kTcTokens;
  int splits = 1;
  while (splits < kTensorCoreMaxSplits && blocks * splits < 512 && p.hidden % (32 * splits) == 0) splits *= 2;
  if (const char* forced = std::getenv("DSV4_HC_POST_MIX_SPLITS")) {
    const int n = std::atoi(forced);
    if (n >= 1 && n <= kTensorCoreMaxSplits && p.hidden % (16 * n) == 0) splits = n;
  }
  return splits;
}

// The fused kernels are opt-in until they have run on a GPU (written 2026-12-06, session 25, whose device time ran
// out): DSV4_HC_POST_MIX=1 (or 3: the tensor-core kernel's 3-CTA build, 150 registers instead of 128, to
// measure), read per call. Where the mixes would run on the tensor cores, post_mix_tf32_kernel; below,
// post_mix_partial_kernel; otherwise (switch off, unaligned rows, a short workspace) hc_post then hc_pre.
template <int HC>
cudaError_t launch_post_pre(const HyperConnectionParams& p, const float* y, const float* streams, const float* post,
                            const float* comb, float* out, const float* fn, const float* base, const float* scale,
                            float* collapsed, float* next_post, float* next_comb, void* workspace,
                            size_t workspace_bytes, const CollapseNorm* norm, unsigned* sync, cudaStream_t stream) {
  if (launch_handover<HC, true, false>(p, y, streams, post, comb, out, fn, base, scale, collapsed, next_post,
                                       next_comb, workspace, workspace_bytes, norm, sync, stream))
    return cudaGetLastError();
  constexpr int NOUT = (2 + HC) * HC;
  const char* choice = std::getenv("DSV4_HC_POST_MIX");
  const bool fuse = choice != nullptr && (std::strcmp(choice, "1") == 0 || std::strcmp(choice, "3") == 0);
  const bool vec4 = p.hidden % 4 == 0 && aligned16(y) && aligned16(streams) && aligned16(out) && aligned16(fn);
  auto fits = [&](int splits) {
    return workspace != nullptr &&
           workspace_bytes >= static_cast<size_t>(p.tokens) * splits * (NOUT + 1) * sizeof(float);
  };
  auto* partial = static_cast<float*>(workspace);
  if (fuse && vec4 && tensor_core_splits(p.tokens, p.hc * p.hidden, vec4) == 0) {
    // Split-K sizes as hc_pre's mix_partial_kernel takes them (mix_splits over the flattened float4 columns),
    // each split a range of hidden float4s of every stream.
    const int64_t vec_d = p.hidden / 4;
    const int splits =
        static_cast<int>(std::min<int64_t>(mix_splits(p.tokens, HC * vec_d), std::max<int64_t>(1, vec_d)));
    const int64_t chunk = (vec_d + splits - 1) / splits;
    if (fits(splits)) {
      const dim3 grid(static_cast<unsigned>((p.tokens + kTokensPerCta - 1) / kTokensPerCta),
                      static_cast<unsigned>(splits));
      const auto threads = static_cast<unsigned>(std::min<int64_t>(kThreads, (HC * chunk + 31) / 32 * 32));
      launch_dependent(post_mix_partial_kernel<HC>, grid, threads, 0, stream, y, streams, post, comb, out, fn,
                       p.tokens, p.hidden, chunk, splits, partial);
      launch_finish<HC, false, 4>(p, partial, splits, out, base, scale, collapsed, next_post, next_comb, norm, stream);
      return cudaGetLastError();
    }
  } else if (fuse && vec4 && p.hidden % 16 == 0) {  // the mixes would run on the tensor cores
    const int splits = post_mix_splits(p);
    if (fits(splits)) {
      const dim3 grid(static_cast<unsigned>((p.tokens + kTcTokens - 1) / kTcTokens), static_cast<unsigned>(splits));
      const auto kernel = std::strcmp(choice, "3") == 0 ? post_mix_tf32_kernel<HC, 3> : post_mix_tf32_kernel<HC, 4>;
      launch_dependent(kernel, grid, 32 * kTcWarps, 0, stream, y, streams, post, comb, out, fn, p.tokens, p.hidden,
                       p.hidden / splits, splits, partial);
      launch_finish<HC, false, 4>(p, partial, splits, out, base, scale, collapsed, next_post, next_comb, norm, stream);
      return cudaGetLastError();
    }
  }
  const cudaError_t posted = launch_post<HC>(p, y, streams, post, comb, out, stream);
  if (posted != cudaSuccess) return posted;
  return dispatch_mix<false>(p, out, fn, base, scale, collapsed, next_post, next_comb, workspace, workspace_bytes, norm,
                             nullptr, stream);
}

}  // namespace

size_t hc_workspace_bytes(int64_t max_tokens, int64_t hc) {
  // tokens·splits <= min(kMaxSplits·T, T·ceil(kTargetCtas / groups)) <= min(kMaxSplits·T, kTokensPerCta·kTargetCtas + T),
  // which grows with T, so the bound at max_tokens covers every smaller batch; hc_pre's mix is the wider one.
  // The tensor-core mix (from kTensorCoreMinTokens) uses at most kTensorCoreMaxSplits splits a token.
  const int64_t T = std::max<int64_t>(max_tokens, 0);
  int64_t rows = std::min<int64_t>(kMaxSplits * T, int64_t{kTokensPerCta} * kTargetCtas + T);
  if (T >= kTensorCoreMinTokens) rows = std::max<int64_t>(rows, kTensorCoreMaxSplits * T);
  // The one-launch hand-over (≤ kHandoverMaxTokens) also keeps a sum of squares per split, and pre and the RMS
  // scale per token.
  return (static_cast<size_t>(rows) * static_cast<size_t>((2 + hc) * hc + 2) + static_cast<size_t>(T * (hc + 1))) *
         sizeof(float);
}

cudaError_t hc_pre(const HyperConnectionParams& p, const float* streams, const float* fn, const float* base,
                   const float* scale, float* collapsed, float* post, float* comb, void* workspace,
                   size_t workspace_bytes, cudaStream_t stream, const CollapseNorm* norm, unsigned* handover_sync) {
  return dispatch_mix<false>(p, streams, fn, base, scale, collapsed, post, comb, workspace, workspace_bytes, norm,
                             handover_sync, stream);
}

cudaError_t hc_head(const HyperConnectionParams& p, const float* streams, const float* fn, const float* base,
                    const float* scale, float* out, void* workspace, size_t workspace_bytes, cudaStream_t stream,
                    const CollapseNorm* norm, unsigned* handover_sync) {
  return dispatch_mix<true>(p, streams, fn, base, scale, out, nullptr, nullptr, workspace, workspace_bytes, norm,
                            handover_sync, stream);
}

cudaError_t hc_post_pre(const HyperConnectionParams& p, const float* y, const float* streams, const float* post,
                        const float* comb, float* out, const float* fn, const float* base, const float* scale,
                        float* collapsed, float* next_post, float* next_comb, void* workspace, size_t workspace_bytes,
                        cudaStream_t stream, const CollapseNorm* norm, unsigned* handover_sync) {
  if (!valid_params(p)) return cudaErrorInvalidValue;
  if (p.tokens == 0) return cudaSuccess;
  if (norm && norm->bf16 && reinterpret_cast<uintptr_t>(norm->bf16) % 2 != 0) return cudaErrorInvalidValue;
  if (p.deepseek) return cudaErrorInvalidValue;  // the fused paths keep kHf's order: hc_post, then hc_pre
  switch (p.hc) {
    case 1: return launch_post_pre<1>(p, y, streams, post, comb, out, fn, base, scale, collapsed, next_post, next_comb, workspace, workspace_bytes, norm, handover_sync, stream);
    case 2: return launch_post_pre<2>(p, y, streams, post, comb, out, fn, base, scale, collapsed, next_post, next_comb, workspace, workspace_bytes, norm, handover_sync, stream);
    case 4: return launch_post_pre<4>(p, y, streams, post, comb, out, fn, base, scale, collapsed, next_post, next_comb, workspace, workspace_bytes, norm, handover_sync, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t hc_post(const HyperConnectionParams& p, const float* y, const float* streams, const float* post,
                    const float* comb, float* out, cudaStream_t stream) {
  if (!valid_params(p)) return cudaErrorInvalidValue;
  if (p.tokens == 0) return cudaSuccess;
  switch (p.hc) {
    case 1: return launch_post<1>(p, y, streams, post, comb, out, stream);
    case 2: return launch_post<2>(p, y, streams, post, comb, out, stream);
    case 4: return launch_post<4>(p, y, streams, post, comb, out, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace dsv4::ops::cuda
