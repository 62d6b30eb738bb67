// Token embedding on the device, the twin of the first step of DeepseekV4Model::forward: every one of the hc
// residual streams of a token starts as its embedding row, out[t, s, :] = table[token_ids[t], :] for s < hc.
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

namespace dsv4::ops::cuda {

struct EmbeddingParams {
  int64_t tokens = 0;
  int64_t vocab = 0;   // rows of the table
  int64_t hidden = 0;  // D
  int64_t hc = 1;      // residual streams written per token
};

// table: device [vocab, D] fp32 (or bf16 bits, widened exactly); token_ids: int32 device [tokens];
// out: fp32 device [tokens, hc, D]. A token id outside [0, vocab) gets NaN rows (never an out-of-bounds read).
// One block per token: the row is read once and written hc times (float4 when D % 4 == 0 and aligned).
cudaError_t embedding(const EmbeddingParams& p, const float* table, const int32_t* token_ids, float* out,
                      cudaStream_t stream);
cudaError_t embedding_bf16(const EmbeddingParams& p, const uint16_t* table, const int32_t* token_ids, float* out,
                           cudaStream_t stream);

}  // namespace dsv4::ops::cuda
