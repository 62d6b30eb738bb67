#include "ops/cpu/indexer_paged.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/dtype.h"
#include "ops/cpu/indexer.h"

namespace dsv4::ops::cpu {

// Dequantizes the visible keys through cache/index_key_format.h and scores them with ops/cpu/indexer.h, so the
// twin is the model's own indexer plus the paged read.
void indexer_scores_paged(const IndexerScoresParams& p) {
  const int64_t d = p.keys.head_dim;
  const IndexerParams params{p.heads, d};
  // indexer_scores multiplies by head_dim^-0.5 itself; fold the ratio to the requested scale into the weights.
  const float ratio = p.softmax_scale * std::sqrt(static_cast<float>(d));
  std::vector<float> q(static_cast<size_t>(p.heads * d)), weights(static_cast<size_t>(p.heads));
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const int32_t r = p.token_request[t];
    const int64_t visible = std::min<int64_t>(p.request_entries[r], (p.token_position[t] + 1) / p.compress_ratio);
    const int64_t shown = std::clamp<int64_t>(visible, 0, p.max_entries);
    std::vector<float> keys(static_cast<size_t>(shown * d));
    std::vector<const float*> key_ptrs(static_cast<size_t>(shown));
    for (int64_t s = 0; s < shown; ++s) {
      const int32_t block = p.block_tables[r * p.block_table_stride + s / p.keys.entries_per_block];
      read_index_key_cpu(p.keys, p.pool, block, static_cast<int32_t>(s % p.keys.entries_per_block), &keys[s * d]);
      key_ptrs[s] = &keys[s * d];
    }
    for (int64_t i = 0; i < p.heads * d; ++i) q[i] = bf16_to_f32(p.q[t * p.heads * d + i]);
    float* row = p.scores + t * p.max_entries;
    if (p.deepseek_roundings) {
      for (int64_t h = 0; h < p.heads; ++h) weights[h] = p.weights[t * p.heads + h] * p.softmax_scale;
      indexer_scores_bf16(params, q.data(), weights.data(), key_ptrs.data(), shown, row);
    } else {
      for (int64_t h = 0; h < p.heads; ++h) weights[h] = p.weights[t * p.heads + h] * ratio;
      indexer_scores(params, q.data(), weights.data(), key_ptrs.data(), shown, row);
    }
    std::fill(row + shown, row + p.max_entries, -std::numeric_limits<float>::infinity());
  }
}

void top_k(const TopKParams& p) {
  std::vector<float> valid;
  std::vector<int32_t> entry;
  for (int64_t r = 0; r < p.rows; ++r) {
    const float* row = p.scores + r * p.row_stride;
    const int64_t length = p.row_lengths ? std::clamp<int64_t>(p.row_lengths[r], 0, p.columns) : p.columns;
    valid.clear();
    entry.clear();
    for (int64_t c = 0; c < length; ++c) {
      if (std::isnan(row[c]) || row[c] == -std::numeric_limits<float>::infinity()) continue;
      valid.push_back(row[c]);
      entry.push_back(static_cast<int32_t>(c));
    }
    // top_k_indices breaks ties to the lower position in `valid`, which keeps entry order.
    std::vector<int32_t> chosen = top_k_indices(valid.data(), static_cast<int64_t>(valid.size()), p.k);
    for (int32_t& i : chosen) i = entry[i];
    std::sort(chosen.begin(), chosen.end());
    int32_t* out = p.indices + r * p.k;
    std::fill(out, out + p.k, -1);
    std::copy(chosen.begin(), chosen.end(), out);
    p.lengths[r] = static_cast<int32_t>(chosen.size());
  }
}

}  // namespace dsv4::ops::cpu
