#include "ops/cpu/moe.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace dsv4::ops::cpu {

void router_scores(float* logits, int64_t tokens, int64_t experts, RouterScore func) {
  for (int64_t t = 0; t < tokens; ++t) {
    float* row = logits + t * experts;
    switch (func) {
      case RouterScore::kSqrtSoftplus:
        // torch softplus (beta 1, threshold 20): x above the threshold passes through.
        for (int64_t e = 0; e < experts; ++e) row[e] = std::sqrt(row[e] > 20.0f ? row[e] : std::log1p(std::exp(row[e])));
        break;
      case RouterScore::kSigmoid:
        for (int64_t e = 0; e < experts; ++e) row[e] = 1.0f / (1.0f + std::exp(-row[e]));
        break;
      case RouterScore::kSoftmax: {
        const float max_logit = *std::max_element(row, row + experts);
        float sum = 0;
        for (int64_t e = 0; e < experts; ++e) sum += (row[e] = std::exp(row[e] - max_logit));
        for (int64_t e = 0; e < experts; ++e) row[e] /= sum;
        break;
      }
    }
  }
}

void route_token(const float* scores, const float* bias, int64_t experts, int64_t top_k, const int32_t* fixed_experts,
                 float routed_scaling_factor, int32_t* chosen, float* weights) {
  if (fixed_experts) {
    std::copy(fixed_experts, fixed_experts + top_k, chosen);
  } else {
    std::vector<int32_t> order(static_cast<size_t>(experts));
    std::iota(order.begin(), order.end(), 0);
    auto key = [&](int32_t e) { return scores[e] + (bias ? bias[e] : 0.0f); };
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                      [&](int32_t a, int32_t b) { return key(a) > key(b) || (key(a) == key(b) && a < b); });
    std::copy(order.begin(), order.begin() + top_k, chosen);
  }
  float sum = 0;
  for (int64_t i = 0; i < top_k; ++i) sum += (weights[i] = scores[chosen[i]]);
  for (int64_t i = 0; i < top_k; ++i) weights[i] = weights[i] / (sum + 1e-20f) * routed_scaling_factor;
}

void swiglu_clamped(const float* gate_up, int64_t rows, int64_t inter, float limit, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = gate_up + r * 2 * inter;
    const float* up = gate + inter;
    for (int64_t i = 0; i < inter; ++i) {
      const float g = std::min(gate[i], limit);
      const float u = std::clamp(up[i], -limit, limit);
      out[r * inter + i] = g / (1.0f + std::exp(-g)) * u;
    }
  }
}

}  // namespace dsv4::ops::cpu
