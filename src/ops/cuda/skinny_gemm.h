// y [rows, out] = x [rows, in] · Wᵀ for the few rows of a decode step (rows ≤ kSkinnyMaxRows), bf16 W and x,
// fp32 accumulation, fp32 or bf16 y; strided batches as ops/cuda/gemm.h's linear_batched.
//
// Why hand-written: at one to sixteen rows the product is a pure weight stream (bytes = out · in · 2), but
// cuBLASLt's kernels for these shapes reached ~45 % of the copy bandwidth on the H200 (ncu of a V4-Flash
// decode step: 12-CTA split-K grids plus a separate reduction launch for the 1024-wide projections), and the
// projections are the largest share of a full-depth decode step after the experts (docs/PERF.md). Here the
// tensor cores do the (tiny) math — mma.m16n8k16 with the tokens as A and 8 weight rows as B — so the kernel
// is free to be a pure stream: a persistent grid whose CTAs walk 8-row tiles, every warp of a CTA taking every
// warps-th 128-byte line of the tile's rows, the next work item's weights always requested before the current
// item's math, the first batch before the PDL wait. The warp partials are summed in a fixed order
// (deterministic, no atomics).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace dsv4::ops::cuda {

inline constexpr int64_t kSkinnyMaxRows = 16;

struct SkinnyGemmParams {
  int64_t rows = 0;  // ≤ kSkinnyMaxRows
  int64_t out = 0;
  int64_t in = 0;        // multiple of 8
  int64_t w_stride = 0;  // elements between rows of W (multiple of 8)
  int64_t x_stride = 0;  // elements between rows of x (multiple of 8)
  int64_t y_stride = 0;  // elements between rows of y
  int64_t batch = 1;
  int64_t w_batch_stride = 0, x_batch_stride = 0,
          y_batch_stride = 0;  // elements (multiples of 8 for W and x)
  bool bf16_output = false;    // y rounded to bf16 (round to nearest even) instead of fp32
  bool accumulate = false;     // y += x · Wᵀ (fp32 y only)
  // Gathered batches: batch b reads W + w_batch_index[b] · w_batch_stride (device int32 [batch], e.g. the routed
  // experts a decode token chose; read after the PDL wait, so such a launch requests no weights before it). An
  // index outside [0, w_batch_count) writes zeros for its batch. Not with `accumulate`.
  const int32_t* w_batch_index = nullptr;
  int64_t w_batch_count = 0;
};

// Whether the kernel takes these shapes and pointers (16-byte aligned W and x).
bool skinny_gemm_supported(const SkinnyGemmParams& p, const void* w, const void* x);

// W, x: bf16 device arrays; y fp32 or bf16. cudaErrorInvalidValue when !skinny_gemm_supported.
cudaError_t skinny_gemm(const SkinnyGemmParams& p, const void* w, const void* x, void* y,
                        cudaStream_t stream);

// The fp32 twin for small weights at decode rows: y [rows, out] = x [rows, in] · Wᵀ, fp32 W, x and y, fp32 FMAs
// (no TF32). For the MoE router (V4-Flash: 256 × 4096, fp32 as DeepSeek's reference keeps it), where cuBLASLt
// picks a split dot kernel plus a reduction launch (two kernels, 6.4 µs at one row on an H100, ncu): one CTA a
// weight row, its 8 warps each over an eighth of `in`, x's rows read beside it, the partial sums added in a fixed
// order (deterministic). Takes rows ≤ kSkinnyF32MaxRows, in a multiple of 4, 16-byte aligned W and x rows,
// batch 1, no accumulation.
inline constexpr int64_t kSkinnyF32MaxRows = 8;
bool skinny_gemm_f32_supported(const SkinnyGemmParams& p, const void* w, const void* x);
cudaError_t skinny_gemm_f32(const SkinnyGemmParams& p, const float* w, const float* x, float* y, cudaStream_t stream);

}  // namespace dsv4::ops::cuda
