#include "ops/cuda/skinny_gemm.h"

#include <algorithm>

#include "ops/cuda/bf16.cuh"
#include "ops/cuda/launch.cuh"

namespace dsv4::ops::cuda {
namespace {

constexpr int kTileRows = 8;     // weight rows per warp tile: the n of mma.m16n8k16
constexpr int kStepK = 32;       // k per warp step: 4 lanes × one 16-byte vector of 8 bf16
constexpr int kBatchSteps = 8;   // steps whose weight vectors are in flight together (128 bytes a lane)
constexpr int kMaxWarps = 16;  // 512 threads: up to 128 registers a lane, no spills

__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// grid (ceil(out / 8), batch), blockDim.x / 32 warps all on the CTA's 8 weight rows, warp w taking the k steps
// w, w + warps, …. Lane (g = lane / 4, q = lane % 4) loads, per step s, elements [32s + 8q, 32s + 8q + 8) of
// weight row g (the B fragment's column g) and of tokens g and g + 8 (the A fragment's rows): as in
// fp8_gemm.cu, A and B share one permutation of k inside the step (vector words 0-1 are mma #1's k slots
// {2q, 2q+1, 2q+8, 2q+9}, words 2-3 mma #2's), so the sum is the same.
//
// PDL: the weights do not depend on the kernel before this one, so the first batch of weight vectors is
// requested before griddepcontrol.wait — the weight stream starts while the previous kernel drains. Each warp
// then keeps one batch (8 vectors, 128 bytes a lane) in flight; the many warps of an SM overlap one another's
// math and loads.
template <bool kSixteenTokens>
__global__ void __launch_bounds__(kMaxWarps * 32)
    skinny_gemm_kernel(const SkinnyGemmParams p, const uint16_t* __restrict__ w, const uint16_t* x, void* y) {
  const int warps = static_cast<int>(blockDim.x / 32);
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  const int g = lane / 4, q = lane % 4;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kTileRows;
  const int64_t b = blockIdx.y;
  const int64_t row = row0 + g < p.out ? row0 + g : p.out - 1;  // a clamped row is computed and not stored
  const uint16_t* wrow = w + b * p.w_batch_stride + row * p.w_stride + 8 * q;
  const int rows = static_cast<int>(p.rows);
  const uint16_t* xb = x + b * p.x_batch_stride + 8 * q;
  const bool has_low = g < rows, has_high = kSixteenTokens && g + 8 < rows;
  const uint16_t* xlow = xb + (has_low ? g : 0) * p.x_stride;
  const uint16_t* xhigh = xb + (has_high ? g + 8 : 0) * p.x_stride;
  const int64_t steps = (p.in + kStepK - 1) / kStepK;
  const uint4 zero = make_uint4(0, 0, 0, 0);

  uint4 wv[kBatchSteps];
  auto load_weights = [&](int64_t first) {
#pragma unroll
    for (int u = 0; u < kBatchSteps; ++u) {
      const int64_t k = (first + static_cast<int64_t>(u) * warps) * kStepK + 8 * q;
      wv[u] = k < p.in ? __ldg(reinterpret_cast<const uint4*>(wrow + (k - 8 * q))) : zero;
    }
  };
  float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // (token g, rows 2q, 2q + 1), (token g + 8, rows 2q, 2q + 1)
  int64_t first = warp;
  load_weights(first);
  wait_for_prior_grid();  // x (and y when accumulating) come from earlier kernels
  allow_dependents();
  for (; first < steps; first += static_cast<int64_t>(kBatchSteps) * warps) {
    uint4 xl[kBatchSteps], xh[kBatchSteps];
#pragma unroll
    for (int u = 0; u < kBatchSteps; ++u) {
      const int64_t k = (first + static_cast<int64_t>(u) * warps) * kStepK + 8 * q;
      const bool inside = k < p.in;
      xl[u] = inside && has_low ? *reinterpret_cast<const uint4*>(xlow + (k - 8 * q)) : zero;
      xh[u] = inside && has_high ? *reinterpret_cast<const uint4*>(xhigh + (k - 8 * q)) : zero;
    }
#pragma unroll
    for (int u = 0; u < kBatchSteps; ++u) {
      mma_bf16(c, xl[u].x, xh[u].x, xl[u].y, xh[u].y, wv[u].x, wv[u].y);
      mma_bf16(c, xl[u].z, xh[u].z, xl[u].w, xh[u].w, wv[u].z, wv[u].w);
    }
    const int64_t next = first + static_cast<int64_t>(kBatchSteps) * warps;
    if (next < steps) load_weights(next);
  }
  __shared__ float partial[kMaxWarps][16][kTileRows];  // [warp][token][row]
  partial[warp][g][2 * q] = c[0];
  partial[warp][g][2 * q + 1] = c[1];
  if (kSixteenTokens) {
    partial[warp][g + 8][2 * q] = c[2];
    partial[warp][g + 8][2 * q + 1] = c[3];
  }
  __syncthreads();
  for (int i = static_cast<int>(threadIdx.x); i < 16 * kTileRows; i += static_cast<int>(blockDim.x)) {
    const int t = i / kTileRows, r = i % kTileRows;
    if (t >= rows || row0 + r >= p.out) continue;
    float s = 0.0f;
    for (int k = 0; k < warps; ++k) s += partial[k][t][r];  // warp order: deterministic
    const int64_t at = b * p.y_batch_stride + t * p.y_stride + row0 + r;
    if (p.bf16_output) {
      static_cast<uint16_t*>(y)[at] = f32_to_bf16_bits(s);
    } else {
      float* out = static_cast<float*>(y) + at;
      *out = p.accumulate ? *out + s : s;
    }
  }
}

int skinny_gemm_warps(const SkinnyGemmParams& p) {
  // Enough warps in flight to cover the HBM latency (≈ 4096 warps of 128 bytes each: 16 MB, several times
  // bandwidth × latency), split over the k steps of each 8-row tile, but at least one full batch of steps
  // per warp so that no warp idles.
  const int64_t tiles = (p.out + kTileRows - 1) / kTileRows * p.batch;
  const int64_t steps = (p.in + kStepK - 1) / kStepK;
  const int64_t wanted = std::max<int64_t>(4, (4096 + tiles - 1) / tiles);
  const int64_t by_k = std::max<int64_t>(1, (steps + kBatchSteps - 1) / kBatchSteps);
  return static_cast<int>(std::min<int64_t>({wanted, by_k, kMaxWarps}));
}

}  // namespace

bool skinny_gemm_supported(const SkinnyGemmParams& p, const void* w, const void* x) {
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  return p.rows >= 1 && p.rows <= kSkinnyMaxRows && p.out >= 1 && p.in >= 8 && p.in % 8 == 0 &&
         p.w_stride % 8 == 0 && p.x_stride % 8 == 0 && p.w_batch_stride % 8 == 0 && p.x_batch_stride % 8 == 0 &&
         p.batch >= 1 && p.batch <= 65535 && (p.out + kTileRows - 1) / kTileRows <= 0x7fffffff &&
         !(p.accumulate && p.bf16_output) && aligned(w) && aligned(x);
}

cudaError_t skinny_gemm(const SkinnyGemmParams& p, const void* w, const void* x, void* y,
                        cudaStream_t stream) {
  if (!skinny_gemm_supported(p, w, x)) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>((p.out + kTileRows - 1) / kTileRows), static_cast<unsigned>(p.batch));
  const dim3 block(static_cast<unsigned>(32 * skinny_gemm_warps(p)));
  const auto* wb = static_cast<const uint16_t*>(w);
  const auto* xb = static_cast<const uint16_t*>(x);
  if (p.rows <= 8) return launch_dependent(skinny_gemm_kernel<false>, grid, block, 0, stream, p, wb, xb, y);
  return launch_dependent(skinny_gemm_kernel<true>, grid, block, 0, stream, p, wb, xb, y);
}

}  // namespace dsv4::ops::cuda
