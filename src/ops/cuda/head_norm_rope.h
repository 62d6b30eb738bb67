// Per-head RMSNorm + partial RoPE + the bf16 operand, in one pass: the decode path's q (per-head unweighted norm,
// docs/MODEL.md §attention "q = rms(q_head) then RoPE"), K=V (kv_norm then RoPE) and the indexer query (RoPE only)
// each took two or three launches (rms_norm, apply_rope, f32_to_bf16) on a few kilobytes; this is one.
// The twin is ops/cpu/norm.h rms_norm over each head followed by ops/cpu/rope.h apply_rope: the same formulas as
// ops/cuda/rms_norm.h and ops/cuda/rope.h (value = weight · (x · rsqrt(mean(x²) + eps)); cos/sin the precise
// values of fp32(inv_freq · pos) times attention_scaling; rotation products rounded without FMA contraction).
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

namespace dsv4::ops::cuda {

struct HeadNormRopeParams {
  int64_t rows = 0;           // tokens
  int64_t heads = 1;
  int64_t head_dim = 0;       // even
  int64_t rope_dim = 0;       // even, <= head_dim: the trailing rope_dim channels of each head rotate
  bool normalize = true;      // RMSNorm each head first (false: RoPE only)
  float eps = 1e-6f;
  float attention_scaling = 1.0f;
  // false (needs x_bf16): x is left as it was and only the bf16 result is stored: a caller whose next kernel reads
  // only the bf16 operand (the tuned attention's q, the tuned indexer's q) skips the fp32 write-back, a third of
  // the bytes (at a 4,096-token prefill 537 MB per q call).
  bool keep_fp32 = true;
  // Numerics::kDeepSeek (docs/numerics.md): the reference's bf16 tensors — a weighted norm's output rounded before
  // RoPE; an unweighted per-head norm with every intermediate in bf16 (model.py's q norm, the CPU's
  // head_rms_norm_bf16: bf16 squares summed in fp32, bf16 mean, bf16 rsqrt, bf16 products); the result rounded.
  bool deepseek_roundings = false;
};

// x [rows, heads, head_dim] fp32, updated in place; norm_weight: fp32 device [head_dim] or nullptr (unweighted);
// positions: int32 device [rows]; inv_freq: fp32 device [rope_dim / 2]; x_bf16: device [rows, heads, head_dim]
// or nullptr — the result rounded to bf16 (round to nearest even), the next kernel's operand.
// One warp per (row, head), up to 8 heads of a row per block. CUDA-graph safe (no allocation, no synchronisation).
cudaError_t head_norm_rope(const HeadNormRopeParams& p, float* x, const float* norm_weight, const int32_t* positions,
                           const float* inv_freq, uint16_t* x_bf16, cudaStream_t stream);

}  // namespace dsv4::ops::cuda
