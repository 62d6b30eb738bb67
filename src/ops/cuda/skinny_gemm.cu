#include "ops/cuda/skinny_gemm.h"

#include <algorithm>
#include <cstdlib>
#include <string_view>
#include <type_traits>

#include "ops/cuda/bf16.cuh"
#include "ops/cuda/launch.cuh"

namespace dsv4::ops::cuda {
namespace {

constexpr int kTileRows = 8;   // weight rows per CTA tile: the n of mma.m16n8k16
constexpr int kLineK = 64;     // one 128-byte line of a weight row: two 32-wide mma k steps
// Lines a warp has in flight per batch: 4 (8 16-byte vectors, 128 bytes a lane) at ≤ 8 tokens; 2 at 16, whose
// A fragments take twice the registers (both fit in 128 registers: 2 CTAs of 256 threads an SM, no spills).
__host__ __device__ constexpr int batch_lines(bool sixteen_tokens) { return sixteen_tokens ? 2 : 4; }
constexpr int kMaxWarps = 8;  // 256 threads: room for two register batches without spills

__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// A persistent grid: CTA c takes the 8-row tiles c, c + gridDim.x, … of batch blockIdx.y; its warps split each
// tile's 128-byte lines (warp w: lines w, w + warps, …), batch_lines() at a time. Work item i of a warp is
// (tile i / batches_per_tile, batch i % batches_per_tile), and the weights of item i + 1 are requested before the
// math of item i, across tile boundaries, so each warp always has a batch in flight and the stream never drains
// between tiles (a one-shot grid of ~4000 small CTAs came in waves and reached ~50 % of the copy bandwidth).
//
// Lane (g = lane / 4, q = lane % 4) loads, per 32-wide half of a line, elements [8q, 8q + 8) of weight row g
// (the B fragment's column g) and of tokens g and g + 8 (the A fragment's rows): as in fp8_gemm.cu, A and B
// share one permutation of k inside the half (vector words 0-1 are mma #1's k slots {2q, 2q+1, 2q+8, 2q+9},
// words 2-3 mma #2's), so the sum is the same. A warp's two loads of a line cover all 128 bytes of each row.
//
// PDL: the weights do not depend on the kernel before this one, so the first batch is requested before
// griddepcontrol.wait. The warp partials of a tile are summed in a fixed order (deterministic, no atomics).
template <bool kSixteenTokens>
constexpr int kVectorsOf = 2 * batch_lines(kSixteenTokens);

// How a weight vector is read (DSV4_SKINNY_LOAD, measured side by side in docs/PERF.md "skinny_gemm's weight
// loads"): kStreaming is ld.global.cs (evict first); the prefetch forms are ld.global.nc.L1::no_allocate with an
// L2 prefetch-size hint, so a lane's 64-byte request of one row brings the row's aligned 128 or 256 bytes into L2
// in one DRAM access. H100, session 31: the 128-byte form took the 4-layer decode step from 1.504-1.507 to
// 1.492-1.494 ms at batch 1 and 2.229-2.233 to 2.212-2.213 at batch 8 (two alternating rounds); 256 bytes gained
// nothing (its L2 hit rate rose from 2 to 43 %, the DRAM stayed 64 % busy: the stream is latency-bound, ncu's
// stalls are long-scoreboard, 24 % of the warp slots in use). The default is the 128-byte form.
enum class WeightLoad { kStreaming, kPrefetch128, kPrefetch256 };

template <WeightLoad kLoad>
__device__ __forceinline__ uint4 load_weight_vector(const uint16_t* at) {
  if constexpr (kLoad == WeightLoad::kStreaming) {
    return __ldcs(reinterpret_cast<const uint4*>(at));
  } else if constexpr (kLoad == WeightLoad::kPrefetch128) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.L2::128B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(at));
    return v;
  } else {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(at));
    return v;
  }
}

template <bool kSixteenTokens, WeightLoad kLoad>
__global__ void __launch_bounds__(kMaxWarps * 32, 2)
    skinny_gemm_kernel(const SkinnyGemmParams p, const uint16_t* __restrict__ w, const uint16_t* x, void* y) {
  const int warps = static_cast<int>(blockDim.x / 32);
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  const int g = lane / 4, q = lane % 4;
  constexpr int kVectors = kVectorsOf<kSixteenTokens>;
  const int64_t b = blockIdx.y;
  const int64_t tiles = (p.out + kTileRows - 1) / kTileRows;
  const int64_t lines = (p.in + kLineK - 1) / kLineK;
  const int64_t lines_per_batch = static_cast<int64_t>(batch_lines(kSixteenTokens)) * warps;
  const int64_t batches_per_tile = (lines + lines_per_batch - 1) / lines_per_batch;
  const int64_t my_tiles = blockIdx.x < tiles ? (tiles - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
  const int64_t items = my_tiles * batches_per_tile;
  const int rows = static_cast<int>(p.rows);
  const uint16_t* xb = x + b * p.x_batch_stride + 8 * q;
  const bool has_low = g < rows, has_high = kSixteenTokens && g + 8 < rows;
  const uint16_t* xlow = xb + (has_low ? g : 0) * p.x_stride;
  const uint16_t* xhigh = xb + (has_high ? g + 8 : 0) * p.x_stride;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  // Element offset (within a row) of this lane's vector u of item i; 32-bit: in < 2^31 (skinny_gemm_supported).
  const int in = static_cast<int>(p.in);
  const int lines_per_batch_int = static_cast<int>(lines_per_batch);
  auto vector_k = [&](int64_t item, int u) {
    const int line = static_cast<int>(item % batches_per_tile) * lines_per_batch_int + (u / 2) * warps + warp;
    return line * kLineK + (u % 2) * 32 + 8 * q;
  };
  // This batch's weights: W + b · stride, or for gathered batches W + index[b] · stride (set after the wait).
  const uint16_t* w_batch = w + b * p.w_batch_stride;
  bool batch_valid = true;
  auto load_weights = [&](int64_t item, uint4 (&v)[kVectors]) {
    const int64_t tile = blockIdx.x + (item / batches_per_tile) * gridDim.x;
    const int64_t row = tile * kTileRows + g < p.out ? tile * kTileRows + g : p.out - 1;  // clamped: not stored
    const uint16_t* wrow = w_batch + row * p.w_stride;
    const int k0 = vector_k(item, 0);
#pragma unroll
    for (int u = 0; u < kVectors; ++u) {
      const int k = k0 + (u / 2) * warps * kLineK + (u % 2) * 32;
      v[u] = k < in ? load_weight_vector<kLoad>(wrow + k) : zero;  // streamed once
    }
  };
  __shared__ float partial[kMaxWarps][16][kTileRows];  // [warp][token][row]
  uint4 wv[kVectors], next[kVectors];
  float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // (token g, rows 2q, 2q + 1), (token g + 8, rows 2q, 2q + 1)
  if (p.w_batch_index == nullptr) {
    if (items > 0) load_weights(0, wv);
    wait_for_prior_grid();  // x (and y when accumulating) come from earlier kernels
    allow_dependents();
  } else {
    wait_for_prior_grid();  // the index too
    allow_dependents();
    const int32_t index = p.w_batch_index[b];
    batch_valid = index >= 0 && index < p.w_batch_count;
    w_batch = w + (batch_valid ? int64_t{index} : 0) * p.w_batch_stride;
    if (items > 0) load_weights(0, wv);
  }
  // One work item: x loads, the next item's weight loads, the math, and at a tile's end the CTA reduction.
  // Two named register buffers (wv, next) swapped by unrolling the loop by two, not copied.
  auto run_item = [&](int64_t item, uint4 (&current)[kVectors], uint4 (&following)[kVectors]) {
    uint4 xl[kVectors], xh[kVectors];
    const int k0 = vector_k(item, 0);
#pragma unroll
    for (int u = 0; u < kVectors; ++u) {
      const int k = k0 + (u / 2) * warps * kLineK + (u % 2) * 32;
      const bool inside = k < in;
      xl[u] = inside && has_low ? *reinterpret_cast<const uint4*>(xlow + (k - 8 * q)) : zero;
      xh[u] = inside && has_high ? *reinterpret_cast<const uint4*>(xhigh + (k - 8 * q)) : zero;
    }
    if (item + 1 < items) load_weights(item + 1, following);
#pragma unroll
    for (int u = 0; u < kVectors; ++u) {
      mma_bf16(c, xl[u].x, xh[u].x, xl[u].y, xh[u].y, current[u].x, current[u].y);
      mma_bf16(c, xl[u].z, xh[u].z, xl[u].w, xh[u].w, current[u].z, current[u].w);
    }
    if ((item + 1) % batches_per_tile == 0) {  // the tile is done: every warp of the CTA reaches this together
      const int64_t row0 = (blockIdx.x + (item / batches_per_tile) * gridDim.x) * kTileRows;
      partial[warp][g][2 * q] = c[0];
      partial[warp][g][2 * q + 1] = c[1];
      if (kSixteenTokens) {
        partial[warp][g + 8][2 * q] = c[2];
        partial[warp][g + 8][2 * q + 1] = c[3];
      }
      c[0] = c[1] = c[2] = c[3] = 0.0f;
      __syncthreads();
      for (int i = static_cast<int>(threadIdx.x); i < 16 * kTileRows; i += static_cast<int>(blockDim.x)) {
        const int t = i / kTileRows, r = i % kTileRows;
        if (t >= rows || row0 + r >= p.out) continue;
        float s = 0.0f;
        for (int k = 0; k < warps; ++k) s += partial[k][t][r];  // warp order: deterministic
        if (!batch_valid) s = 0.0f;
        const int64_t at = b * p.y_batch_stride + t * p.y_stride + row0 + r;
        if (p.bf16_output) {
          static_cast<uint16_t*>(y)[at] = f32_to_bf16_bits(s);
        } else {
          float* out = static_cast<float*>(y) + at;
          *out = p.accumulate ? *out + s : s;
        }
      }
      __syncthreads();
    }
  };
  for (int64_t item = 0; item < items; item += 2) {
    run_item(item, wv, next);
    if (item + 1 < items) run_item(item + 1, next, wv);
  }
}

// DSV4_SKINNY_LOAD=cs|256 picks another load form (read once); unset or anything else keeps the 128-byte prefetch.
WeightLoad weight_load() {
  static const WeightLoad load = [] {
    const char* value = std::getenv("DSV4_SKINNY_LOAD");
    const std::string_view choice = value != nullptr ? value : "";
    return choice == "cs" ? WeightLoad::kStreaming : choice == "256" ? WeightLoad::kPrefetch256 : WeightLoad::kPrefetch128;
  }();
  return load;
}

int skinny_gemm_warps(const SkinnyGemmParams& p) {
  // Enough warps to split a tile's lines into full batches, up to kMaxWarps.
  const int64_t lines = (p.in + kLineK - 1) / kLineK, per_batch = batch_lines(p.rows > 8);
  return static_cast<int>(std::clamp<int64_t>((lines + per_batch - 1) / per_batch, 1, kMaxWarps));
}

// CTAs resident at once on the device for this block size (the persistent grid's size).
int skinny_gemm_resident_ctas(bool sixteen_tokens, int warps) {
  static int cached[2][kMaxWarps + 1] = {};
  int& ctas = cached[sixteen_tokens ? 1 : 0][warps];
  if (ctas == 0) {
    int device = 0, sms = 0, per_sm = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    // Every load form has the same registers (one asm load for another); the streaming one stands for all.
    if (sixteen_tokens) {
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, skinny_gemm_kernel<true, WeightLoad::kStreaming>,
                                                    warps * 32, 0);
    } else {
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, skinny_gemm_kernel<false, WeightLoad::kStreaming>,
                                                    warps * 32, 0);
    }
    ctas = std::max(1, sms * std::max(1, per_sm));
  }
  return ctas;
}

constexpr int kF32Threads = 256;

// One CTA per weight row `o`: thread t covers the float4s t, t + 256, … of the row (and of every x row), then
// each row's sum over a warp by shuffles and over the 8 warps in warp order.
template <int kRows>
__global__ void __launch_bounds__(kF32Threads) skinny_gemm_f32_kernel(SkinnyGemmParams p, const float* __restrict__ w,
                                                                      const float* __restrict__ x,
                                                                      float* __restrict__ y) {
  wait_for_prior_grid();
  allow_dependents();
  const int64_t o = blockIdx.x;
  const int64_t vectors = p.in / 4;
  const auto* w_row = reinterpret_cast<const float4*>(w + o * p.w_stride);
  float acc[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) acc[r] = 0.0f;
#pragma unroll 4
  for (int64_t v = threadIdx.x; v < vectors; v += kF32Threads) {
    const float4 wv = w_row[v];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (r >= p.rows) break;
      const float4 xv = reinterpret_cast<const float4*>(x + r * p.x_stride)[v];
      acc[r] = fmaf(wv.w, xv.w, fmaf(wv.z, xv.z, fmaf(wv.y, xv.y, fmaf(wv.x, xv.x, acc[r]))));
    }
  }
  __shared__ float warp_sums[kF32Threads / 32][kRows];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    float s = acc[r];
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) s += __shfl_xor_sync(0xffffffffu, s, offset);
    if (lane == 0) warp_sums[warp][r] = s;
  }
  __syncthreads();
  if (threadIdx.x < p.rows) {
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < kF32Threads / 32; ++i) s += warp_sums[i][threadIdx.x];
    y[threadIdx.x * p.y_stride + o] = s;
  }
}

}  // namespace

bool skinny_gemm_f32_supported(const SkinnyGemmParams& p, const void* w, const void* x) {
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  return p.rows >= 1 && p.rows <= kSkinnyF32MaxRows && p.out >= 1 && p.out <= 0x7fffffff && p.in >= 4 &&
         p.in % 4 == 0 && p.w_stride % 4 == 0 && p.x_stride % 4 == 0 && p.y_stride >= p.out && p.batch == 1 &&
         !p.accumulate && !p.bf16_output && aligned(w) && aligned(x);
}

cudaError_t skinny_gemm_f32(const SkinnyGemmParams& p, const float* w, const float* x, float* y, cudaStream_t stream) {
  if (!skinny_gemm_f32_supported(p, w, x)) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(p.out));
  if (p.rows == 1) return launch_dependent(skinny_gemm_f32_kernel<1>, grid, kF32Threads, 0, stream, p, w, x, y);
  return launch_dependent(skinny_gemm_f32_kernel<kSkinnyF32MaxRows>, grid, kF32Threads, 0, stream, p, w, x, y);
}

bool skinny_gemm_supported(const SkinnyGemmParams& p, const void* w, const void* x) {
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  return p.rows >= 1 && p.rows <= kSkinnyMaxRows && p.out >= 1 && p.in >= 8 && p.in % 8 == 0 && p.in < (int64_t{1} << 30) &&
         p.w_stride % 8 == 0 && p.x_stride % 8 == 0 && p.w_batch_stride % 8 == 0 && p.x_batch_stride % 8 == 0 &&
         p.batch >= 1 && p.batch <= 65535 && (p.out + kTileRows - 1) / kTileRows <= 0x7fffffff &&
         !(p.accumulate && p.bf16_output) && !(p.w_batch_index != nullptr && (p.accumulate || p.w_batch_count < 1)) &&
         aligned(w) && aligned(x);
}

cudaError_t skinny_gemm(const SkinnyGemmParams& p, const void* w, const void* x, void* y,
                        cudaStream_t stream) {
  if (!skinny_gemm_supported(p, w, x)) return cudaErrorInvalidValue;
  const bool sixteen_tokens = p.rows > 8;
  const int warps = skinny_gemm_warps(p);
  const int64_t tiles = (p.out + kTileRows - 1) / kTileRows;
  const int64_t ctas_per_batch = std::max<int64_t>(1, skinny_gemm_resident_ctas(sixteen_tokens, warps) / p.batch);
  const dim3 grid(static_cast<unsigned>(std::min(tiles, ctas_per_batch)), static_cast<unsigned>(p.batch));
  const dim3 block(static_cast<unsigned>(32 * warps));
  const auto* wb = static_cast<const uint16_t*>(w);
  const auto* xb = static_cast<const uint16_t*>(x);
  auto launch = [&](auto load) {
    constexpr WeightLoad kLoad = decltype(load)::value;
    if (!sixteen_tokens) return launch_dependent(skinny_gemm_kernel<false, kLoad>, grid, block, 0, stream, p, wb, xb, y);
    return launch_dependent(skinny_gemm_kernel<true, kLoad>, grid, block, 0, stream, p, wb, xb, y);
  };
  switch (weight_load()) {
    case WeightLoad::kStreaming:
      return launch(std::integral_constant<WeightLoad, WeightLoad::kStreaming>{});
    case WeightLoad::kPrefetch256:
      return launch(std::integral_constant<WeightLoad, WeightLoad::kPrefetch256>{});
    case WeightLoad::kPrefetch128:
      break;
  }
  return launch(std::integral_constant<WeightLoad, WeightLoad::kPrefetch128>{});
}

}  // namespace dsv4::ops::cuda
