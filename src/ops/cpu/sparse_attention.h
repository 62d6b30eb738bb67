// Sparse sink attention over the paged main K=V cache (docs/kernels/attention.md): the CPU twin of
// ops/cuda/sparse_attention.h, same parameters (host pointers here, device pointers there).
//
// For query token i at absolute position t_i, the keys (= values) are the union of
//   the raw window: positions max(0, t_i − W + 1) … t_i of the window pool, and
//   the selected compressed entries: compressed_indices[i][0 … compressed_lengths[i]) of the compressed pool
//   (top-k for CSA, every visible entry for HCA); an index < 0 is skipped.
// One softmax over both with the per-head sink in the denominator only (ops/cpu/attention.h, model_spec.md §6.5):
//   o_h = Σ_j exp(s_j − m) kv_j / (Σ_j exp(s_j − m) + exp(sink_h − m)),  s_j = scale · q_h · kv_j,
// then the output's rope channels (448…511) rotate by −t_i (inverse interleaved RoPE, model_spec.md §6.6).
// Prefill is the same computation with several query tokens per request (rows) and the chunk's own keys in a
// separate pool (chunk_starts below): SWA, CSA (per-query top-k) and HCA (per-query visible entries) layers.
// q and out are [tokens, heads, 512] bf16; a token with no key outputs zeros.
#pragma once
#include <cstdint>

#include "cache/kv_entry_format.h"

namespace dsv4::ops {

struct SparseAttentionParams {
  int64_t tokens = 0;
  int64_t heads = 0;  // a multiple of 64 (V4-Flash 64, V4-Pro 128)
  float scale = 0;    // softmax scale: 512^-0.5 in the model
  KvEntryFormat format = KvEntryFormat::kFp8;
  PagedKvPool window;  // the layer's SWA window entries, indexed by absolute position
  int64_t window_size = 128;
  PagedKvPool compressed;  // the layer's compressed entries, indexed by entry number
  const int32_t* compressed_indices = nullptr;  // [tokens, compressed_stride]
  const int32_t* compressed_lengths = nullptr;  // [tokens]; nullptr = no compressed keys (SWA layer)
  int64_t compressed_stride = 0;
  const int32_t* positions = nullptr;  // [tokens] absolute positions
  const int32_t* rows = nullptr;       // [tokens] block-table row of each token's request; nullptr = token index
  const float* sinks = nullptr;        // [heads]
  const float* rope_inv_freq = nullptr;  // [32]: the layer's RoPE frequencies (main or compress/YaRN)
  float rope_attention_scaling = 1.0f;
  int64_t num_splits = 0;  // CUDA: key splits per (token, 64 heads); 0 = choose from the grid size
  // Prefill: the step's own chunk is not in the paged window yet (the manager holds window blocks only for the
  // step's last `window` positions). With chunk_starts set, window positions ≥ chunk_starts[i] are read from
  // `chunk` (entry position − chunk_starts[i], same table row) instead; causality is the window rule itself
  // (query t reads positions ≤ t). nullptr: decode, every window key from `window`.
  PagedKvPool chunk;
  const int32_t* chunk_starts = nullptr;  // [tokens]
};

namespace cpu {

// Gathers and dequantizes the keys, runs ops/cpu/attention.h's sink_attention in fp32, applies
// ops/cpu/rope.h's inverse RoPE, rounds to bf16.
void sparse_attention(const SparseAttentionParams& p, const uint16_t* q, uint16_t* out);

}  // namespace cpu
}  // namespace dsv4::ops
