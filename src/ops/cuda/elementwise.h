// Small elementwise ops of the device forward: the fp32 <-> bf16 casts (bitwise the CPU's core/dtype.h
// f32_to_bf16 / bf16_to_f32, round to nearest even, NaN kept quiet), the kDeepSeek in-place bf16 rounding
// (ops/cpu/quantize.h round_to_bf16), y += x, y *= s, and a gather of rows (the last token of each request before
// the head). Device pointers; no allocation, no host synchronisation (CUDA-graph safe). n = 0 launches nothing.
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

namespace dsv4::ops::cuda {

// out[i] = f32_to_bf16(in[i]) (bf16 as uint16_t bits).
cudaError_t f32_to_bf16(const float* in, uint16_t* out, int64_t n, cudaStream_t stream);
// out[i] = bf16_to_f32(in[i]).
cudaError_t bf16_to_f32(const uint16_t* in, float* out, int64_t n, cudaStream_t stream);
// x[i] = bf16_to_f32(f32_to_bf16(x[i])): the twin of ops::cpu::round_to_bf16.
cudaError_t round_to_bf16(float* x, int64_t n, cudaStream_t stream);
// y[i] += x[i] (y == x allowed).
cudaError_t add_inplace(float* y, const float* x, int64_t n, cudaStream_t stream);
// y[i] *= s.
cudaError_t scale_inplace(float* y, float s, int64_t n, cudaStream_t stream);

struct GatherRowsParams {
  int64_t count = 0;      // rows written
  int64_t row_elems = 0;  // fp32 values per row
};
// out[i, :] = in[rows[i], :] for i < count; rows: int32 device [count]. out may not alias in.
cudaError_t gather_rows(const GatherRowsParams& p, const float* in, const int32_t* rows, float* out,
                        cudaStream_t stream);

}  // namespace dsv4::ops::cuda
