// The lightning indexer over the paged index-key cache and its top-k, as the device runs them: the parameter
// structs shared by the CPU twins here and the CUDA kernels (ops/cuda/indexer_scores.h, ops/cuda/top_k.h).
// Pointers are host memory for the twins, device memory for the kernels. Same semantics as ops/cpu/indexer.h:
//   score[t, s] = softmax_scale · Σ_h w[t, h] · relu(q[t, h] · K_s)   for s < visible(t), −inf beyond,
//   visible(t)  = min(request_entries[r], (position(t) + 1) div compress_ratio)   (MODEL.md "Lightning indexer"),
// and top-k takes the k largest valid scores per row, equal scores to the lower entry index.
#pragma once
#include <cstddef>
#include <cstdint>

#include "cache/index_key_format.h"

namespace dsv4::ops {

struct IndexerScoresParams {
  int64_t num_tokens = 0;
  int64_t heads = 64;          // index_n_heads (the kernel supports 64)
  int64_t max_entries = 0;     // columns of `scores`, its row stride
  int64_t compress_ratio = 4;  // compress_rate_csa
  float softmax_scale = 0;     // index_head_dim^-0.5
  IndexKeyPagedLayout keys;    // dtype, head_dim (128), addressing of the layer's keys in the pool
  const std::byte* pool = nullptr;
  const int32_t* block_tables = nullptr;  // [requests, block_table_stride] block ids of the c4_index group
  int64_t block_table_stride = 0;
  const int32_t* request_entries = nullptr;  // [requests] entries in the cache
  const int32_t* token_request = nullptr;    // [num_tokens] request of each query token
  const int32_t* token_position = nullptr;   // [num_tokens] absolute position of each query token
  const uint16_t* q = nullptr;               // bf16 [num_tokens, heads, head_dim]
  const float* weights = nullptr;            // [num_tokens, heads] (weights_proj(x) · heads^-0.5)
  float* scores = nullptr;                   // [num_tokens, max_entries]
  // Numerics::kDeepSeek (ops/cpu/indexer.h indexer_scores_bf16): each head's q·k and its weighted relu rounded to
  // bf16, the heads summed in fp32, the score bf16; softmax_scale is then applied to the weights (1 when they carry
  // it, as the CUDA model's do in that mode). bf16 keys only.
  bool deepseek_roundings = false;
};

struct TopKParams {
  int64_t rows = 0;
  int64_t columns = 0;     // scores per row (≤ 262,144)
  int64_t row_stride = 0;  // of `scores`
  int64_t k = 0;           // ≤ 1024
  const float* scores = nullptr;         // [rows, row_stride]; −inf (and NaN) entries are never chosen
  const int32_t* row_lengths = nullptr;  // optional [rows]: columns ≥ length are masked without being read
  int32_t* indices = nullptr;            // [rows, k]: chosen entries in ascending order, then −1 padding
  int32_t* lengths = nullptr;            // [rows]: how many were chosen, min(k, valid entries)
};

namespace cpu {

void indexer_scores_paged(const IndexerScoresParams& p);
void top_k(const TopKParams& p);

}  // namespace cpu
}  // namespace dsv4::ops
