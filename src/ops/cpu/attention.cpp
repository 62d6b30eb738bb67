#include "ops/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace dsv4::ops::cpu {

void sink_attention(const SinkAttentionParams& p, const float* q, const float* const* keys, int64_t num_keys,
                    const float* sinks, float* out) {
  const int64_t d = p.head_dim;
  std::vector<float> logits(static_cast<size_t>(num_keys));
  for (int64_t h = 0; h < p.heads; ++h) {
    const float* qh = q + h * d;
    float* oh = out + h * d;
    float max_logit = sinks[h];
    for (int64_t j = 0; j < num_keys; ++j) {
      const float* k = keys[j];
      float dot = 0;
      for (int64_t i = 0; i < d; ++i) dot += qh[i] * k[i];
      logits[j] = dot * p.scale;
      max_logit = std::max(max_logit, logits[j]);
    }
    float denominator = std::exp(sinks[h] - max_logit);
    for (int64_t j = 0; j < num_keys; ++j) denominator += (logits[j] = std::exp(logits[j] - max_logit));
    std::fill(oh, oh + d, 0.0f);
    for (int64_t j = 0; j < num_keys; ++j) {
      const float weight = logits[j] / denominator;
      const float* v = keys[j];
      for (int64_t i = 0; i < d; ++i) oh[i] += weight * v[i];
    }
  }
}

}  // namespace dsv4::ops::cpu
