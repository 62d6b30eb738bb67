// Sink attention and the lightning indexer over the paged cache for ANY head count and width (the tiny test
// models, fp32 storage): the general-shape twins of ops/cpu/attention.h and ops/cpu/indexer.h that the GPU model
// uses when the tuned kernels (ops/cuda/sparse_attention.h: 64·k heads × 512, bf16/FP8; ops/cuda/
// indexer_scores.h: 64 × 128 heads) do not apply — and always in the exact fp32 mode. Plus the two small steps
// around attention: writing the step's raw K=V into the window and the all-visible entry list of HCA layers.
//
// Keys of query token t at absolute position p (request row r, MODEL.md "Attention sublayer"):
//   window   positions max(0, p − W + 1) … p: from the step's own kv rows when ≥ chunk_start[r], else the window;
//   compressed  CSA: compressed_indices[t][0 … lengths[t]) (top-k, −1 skipped); HCA (dense_ratio > 0): entries
//            0 … (p + 1) div dense_ratio − 1; SWA: none.
// Entries are `head_dim` fp32 or bf16 values at the PagedGroupView address.
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

#include "cache/paged_group_view.h"

namespace dsv4::ops::cuda {

struct PagedSinkAttentionParams {
  int64_t tokens = 0, heads = 0, head_dim = 0;  // head_dim ≤ 512
  float scale = 0;
  bool bf16_entries = false;
  // Numerics::kDeepSeek (the reference's sparse_attn, the CPU's sink_attention_bf16): two passes — the max over
  // the keys' logits first, then p = exp(logit − max) in fp32 summed in fp32 for the denominator (plus the sink's
  // exp) and cast to bf16 before P·V; the output rounded to bf16. Otherwise one pass of online softmax.
  bool deepseek_softmax = false;
  PagedGroupView window;  // indexed by absolute position
  int64_t window_size = 0;
  PagedGroupView compressed;
  const int32_t* compressed_indices = nullptr;  // [tokens, compressed_stride]
  const int32_t* compressed_lengths = nullptr;  // [tokens]; nullptr with dense_ratio 0: no compressed keys
  int64_t compressed_stride = 0;
  int64_t dense_ratio = 0;
  const float* chunk_kv = nullptr;       // [tokens, head_dim] this step's K=V (fp32)
  const int32_t* token_row = nullptr;    // [tokens] block-table row (request) of each token
  const int32_t* positions = nullptr;    // [tokens]
  const int32_t* chunk_start = nullptr;  // [rows] first position of the row's chunk
  const int32_t* chunk_offset = nullptr; // [rows] first token of the row's chunk
  const float* sinks = nullptr;          // [heads]
  const float* q = nullptr;              // [tokens, heads, head_dim]
  float* out = nullptr;                  // [tokens, heads, head_dim]
};
cudaError_t paged_sink_attention(const PagedSinkAttentionParams& p, cudaStream_t stream);

// score[t, s] = softmax_scale · Σ_h w[t, h] · relu(q[t, h] · K_s) for s < visible(t) = (p + 1) div ratio, −inf
// for visible(t) ≤ s < max_entries.
struct PagedIndexerScoresParams {
  int64_t tokens = 0, heads = 0, head_dim = 0;  // head_dim ≤ 256; heads · head_dim ≤ 8192
  int64_t max_entries = 0, ratio = 4;
  float softmax_scale = 0;
  bool bf16_keys = false;
  // Numerics::kDeepSeek (model.py's indexer on bf16 tensors, the CPU's indexer_scores_bf16): each head's q·k
  // rounded to bf16, relu, × w rounded to bf16, the heads summed in fp32, the score rounded to bf16.
  bool deepseek_roundings = false;
  PagedGroupView keys;
  const int32_t* token_row = nullptr;
  const int32_t* positions = nullptr;
  const float* q = nullptr;        // [tokens, heads, head_dim]
  const float* weights = nullptr;  // [tokens, heads]
  float* scores = nullptr;         // [tokens, max_entries]
};
cudaError_t paged_indexer_scores(const PagedIndexerScoresParams& p, cudaStream_t stream);

// HCA's key list for the tuned attention kernel: indices[t][j] = j for j < (p + 1) div ratio, −1 up to stride;
// lengths[t] = that count.
cudaError_t dense_entry_indices(int64_t tokens, const int32_t* positions, int64_t ratio, int64_t stride,
                                int32_t* indices, int32_t* lengths, cudaStream_t stream);

// The window keeps the last W raw K=V vectors of every request: token t (row r) is written at its position
// when position ≥ row_end[r] − W (written after every read of the step).
struct WindowWriteParams {
  int64_t tokens = 0, head_dim = 0, window_size = 0;
  bool bf16_entries = false;
  PagedGroupView window;
  const float* kv = nullptr;  // [tokens, head_dim]
  const int32_t* token_row = nullptr;
  const int32_t* positions = nullptr;
  const int32_t* row_end = nullptr;  // [rows] position after the row's chunk
};
cudaError_t write_window(const WindowWriteParams& p, cudaStream_t stream);

}  // namespace dsv4::ops::cuda
