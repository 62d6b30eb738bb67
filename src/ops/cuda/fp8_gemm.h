// The FP8 block-scaled product of DeepSeek's recipe on CUDA cores, for the few rows of a decode step and for
// the shapes cuBLASLt's block-scaled kernels do not take (ops/cuda/gemm.h picks; docs/kernels/fp8_gemm.md):
//   y [rows, out] = Σ_blocks (Σ_k∈block wq · xq) · sw[o / 128][block] · sx[block][row]
// W e4m3 [out, in] with fp32 scales [ceil(out/128), ceil(in/128)] (the checkpoint's 128 × 128 blocks), x e4m3
// codes [rows, in] with scales [ceil(in/128), x_scale_stride] (ops/cuda/fp8_quantize.h's layout), fp32
// accumulation, fp32 or bf16 y.
//
// Two kernels: where in is a multiple of 128 (every V4 FP8 linear) the f16 tensor-core one (fp8_gemm.cu: e4m3
// → f16 exactly, mma.sync m16n8k16 with fp32 accumulation, 16 weight rows × 8 tokens per warp tile; flat in
// time from 1 to 8 rows), else — or with cuda_cores — the CUDA-core one described next (its FFMA cost grows
// with the rows). cuBLASLt refuses fewer than 8 rows (and row counts not a multiple of 4) for block-scaled
// FP8.
//
// Why hand-written: at one to eight rows the product is a pure weight stream, and FP8 weights are half the
// bytes of bf16 (out · in bytes), so it runs at the copy bandwidth or not at all. A group of warps owns 4
// output rows (one weight-scale row, as 4 divides 128) and splits `in` in 16-byte vectors (16 codes of one
// 128-block; as many warps per group, up to the CTA's 8, as the row has 512-code spans, so short rows pack
// several groups per CTA); every lane decodes its 4 weight vectors once in registers (e4m3 → bf16 bits →
// fp32, exact) and reuses them for every token; each 16-code partial is summed in fp32 from zero, multiplied
// by sw · sx (a power of two in DeepSeek's checkpoints: exact) and added to the lane's fp32 accumulator.
// Products of two e4m3 values are exact in fp32, so the only roundings are the fp32 additions (the CPU recipe
// adds exact-in-double 128-block partials; rel. L2 ~1e-7 between the two). The warp partials are summed in a
// fixed order: deterministic. More than 8 rows run as chunks of 8 (grid.y), re-reading W from L2: a correct
// fallback, not a fast path, for shapes cuBLASLt refuses.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace dsv4::ops::cuda {

inline constexpr int64_t kFp8SkinnyChunkRows = 8;

struct Fp8GemmParams {
  int64_t rows = 0;
  int64_t out = 0;
  int64_t in = 0;
  int64_t w_stride = 0;        // bytes between rows of W; 0 = in
  int64_t x_stride = 0;        // bytes between rows of x's codes; 0 = in
  int64_t y_stride = 0;        // elements between rows of y; 0 = out
  int64_t w_scale_stride = 0;  // floats between rows of W's scales; 0 = ceil(in / 128)
  int64_t x_scale_stride = 0;  // floats between the scale rows of x's 128-blocks; 0 = rows
  bool bf16_output = false;    // y rounded to bf16 (round to nearest even) instead of fp32
  bool cuda_cores = false;  // keep to the FFMA kernel where the tensor-core one would run (to measure both)
};

// Any shape (rows, out, in ≥ 1, grid limits aside); 16-byte vectors when in, the strides and W / x are
// 16-byte aligned, byte loads otherwise. cudaErrorInvalidValue on a shape it cannot launch.
cudaError_t fp8_skinny_gemm(const Fp8GemmParams& p, const uint8_t* w, const float* w_scales, const uint8_t* x,
                            const float* x_scales, void* y, cudaStream_t stream);

}  // namespace dsv4::ops::cuda
