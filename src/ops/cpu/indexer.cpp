#include "ops/cpu/indexer.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/dtype.h"

namespace dsv4::ops::cpu {

void indexer_scores(const IndexerParams& p, const float* q, const float* head_weights, const float* const* keys,
                    int64_t num_entries, float* scores) {
  const float softmax_scale = 1.0f / std::sqrt(static_cast<float>(p.head_dim));
  for (int64_t s = 0; s < num_entries; ++s) {
    const float* key = keys[s];
    float score = 0;
    for (int64_t h = 0; h < p.heads; ++h) {
      const float* qh = q + h * p.head_dim;
      float dot = 0;
      for (int64_t i = 0; i < p.head_dim; ++i) dot += qh[i] * key[i];
      score += std::max(dot, 0.0f) * softmax_scale * head_weights[h];
    }
    scores[s] = score;
  }
}

std::vector<int32_t> top_k_indices(const float* scores, int64_t num_valid, int64_t k) {
  const int64_t count = std::min(k, num_valid);
  std::vector<int32_t> order(static_cast<size_t>(num_valid));
  std::iota(order.begin(), order.end(), 0);
  auto better = [scores](int32_t a, int32_t b) { return scores[a] > scores[b] || (scores[a] == scores[b] && a < b); };
  if (count < num_valid) {
    std::nth_element(order.begin(), order.begin() + count, order.end(), better);
    order.resize(static_cast<size_t>(count));
  }
  std::sort(order.begin(), order.end(), better);
  return order;
}

void indexer_scores_bf16(const IndexerParams& p, const float* q, const float* head_weights, const float* const* keys,
                         int64_t num_entries, float* scores) {
  for (int64_t s = 0; s < num_entries; ++s) {
    float score = 0;
    for (int64_t h = 0; h < p.heads; ++h) {
      double dot = 0.0;  // the einsum, exact products summed in double
      for (int64_t i = 0; i < p.head_dim; ++i) dot += static_cast<double>(q[h * p.head_dim + i]) * keys[s][i];
      score += bf16_round(std::max(bf16_round(static_cast<float>(dot)), 0.0f) * head_weights[h]);
    }
    scores[s] = bf16_round(score);
  }
}

}  // namespace dsv4::ops::cpu
