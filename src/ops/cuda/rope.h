// Interleaved partial RoPE on the device: the twin of ops/cpu/rope.h apply_rope. The trailing rope_dim channels of
// each head rotate in pairs (2i, 2i+1) by angle = fp32(inv_freq[i] · float(pos)); cos/sin are the precise
// (not __sinf) values of that fp32 angle times attention_scaling, as the CPU computes them; the rotation rounds each
// product as the CPU does (no FMA contraction), so the only difference from the twin is cosf/sinf's last ulp.
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

namespace dsv4::ops::cuda {

struct RopeParams {
  int64_t rows = 0;
  int64_t row_stride = 0;  // floats between rows
  int64_t heads = 1;
  int64_t head_dim = 0;
  int64_t rope_dim = 0;    // even, <= head_dim; inv_freq has rope_dim / 2 entries
  float attention_scaling = 1.0f;
  bool inverse = false;    // rotate by −angle (the attention output's de-rotation)
};

// In place over x [rows, heads, head_dim] (row stride row_stride); positions: int32 device [rows];
// inv_freq: fp32 device [rope_dim / 2]. One block per row: cos/sin once per (row, pair) in shared memory.
cudaError_t apply_rope(const RopeParams& p, float* x, const int32_t* positions, const float* inv_freq,
                       cudaStream_t stream);

}  // namespace dsv4::ops::cuda
