// Lightning indexer of CSA layers (docs/MODEL.md "Lightning indexer"; transformers DeepseekV4IndexerScorer):
// score_s = Σ_h w_h · relu(q_h · K_s) · index_head_dim^-0.5, with w = weights_proj(x) · index_n_heads^-0.5,
// then top-k over the entries the query may see.
#pragma once
#include <cstdint>
#include <vector>

namespace dsv4::ops::cpu {

struct IndexerParams {
  int64_t heads = 0;     // index_n_heads
  int64_t head_dim = 0;  // index_head_dim
};

// q [heads, head_dim], head_weights [heads] (already scaled by heads^-0.5), keys: num_entries pointers to
// head_dim floats (the index keys, wherever the cache keeps them) -> scores [num_entries].
void indexer_scores(const IndexerParams& p, const float* q, const float* head_weights, const float* const* keys,
                    int64_t num_entries, float* scores);

// Numerics::kDeepSeek: the reference's indexer score on bf16 tensors (research model_spec.md §8 step 6): each
// head's q·k (double accumulation → fp32) rounded to bf16, relu, × w rounded to bf16, the heads summed in fp32 in
// order, the score rounded to bf16. `head_weights` carry index_head_dim^-0.5 · heads^-0.5 already.
void indexer_scores_bf16(const IndexerParams& p, const float* q, const float* head_weights, const float* const* keys,
                         int64_t num_entries, float* scores);

// Indices of the k largest scores among [0, num_valid), ordered by descending score; equal scores keep the lower
// index first, so the selection is deterministic. Returns min(k, num_valid) indices.
std::vector<int32_t> top_k_indices(const float* scores, int64_t num_valid, int64_t k);

}  // namespace dsv4::ops::cpu
