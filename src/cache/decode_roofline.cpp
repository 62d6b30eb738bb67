#include "cache/decode_roofline.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include "cache/planner.h"
#include "core/error.h"

namespace dsv4 {

DecodeRoofline decode_roofline(const ModelConfig& config, const WeightFormat& weights, KvStorage kv,
                               IndexStorage index, int64_t batch, int64_t context) {
  DSV4_CHECK(batch >= 1, "decode roofline: batch must be >= 1, got " + std::to_string(batch));
  DSV4_CHECK(context >= 1, "decode roofline: context must be >= 1, got " + std::to_string(context));
  const double experts = static_cast<double>(config.n_routed_experts);
  const double picked = static_cast<double>(config.num_experts_per_tok);
  // Expected distinct experts of a layer over the batch's tokens, each picking `picked` of `experts`.
  const double distinct = experts * (1.0 - std::pow(1.0 - picked / experts, static_cast<double>(batch)));
  // The weight planner's classes: routed experts, dense (FP8) linears, bf16 tensors (the embedding among them),
  // fp32 tensors, hash tables (read a row a token: not counted).
  const WeightPlan held = plan_weights(config, weights);
  const double vocab = static_cast<double>(config.vocab_size), hidden = static_cast<double>(config.hidden_size);
  const double unread_embedding = (vocab - std::min(static_cast<double>(batch), vocab)) * hidden *
                                  held.classes[2].bits / 8.0;
  DecodeRoofline r;
  r.routed_expert_bytes = static_cast<double>(held.classes[0].bytes) * distinct / experts;
  r.weight_bytes = r.routed_expert_bytes + static_cast<double>(held.classes[1].bytes) +
                   static_cast<double>(held.classes[2].bytes) - unread_embedding +
                   static_cast<double>(held.classes[3].bytes);
  const CapacityPlan plan = plan_capacity(config, kv, index, context);
  double per_request = 0;
  for (const GroupPlan& g : plan.groups) {
    const double layers = static_cast<double>(g.layers), entry = static_cast<double>(g.entry_bytes);
    switch (g.kind) {
      case CacheGroupKind::kSwaKv:
      case CacheGroupKind::kC4Index:
      case CacheGroupKind::kC128Main:
        per_request += static_cast<double>(g.entries) * entry * layers;
        break;
      case CacheGroupKind::kC4Main:
        per_request += static_cast<double>(std::min<int64_t>(g.entries, config.index_topk)) * entry * layers;
        break;
      default:
        break;  // compressor state: a few KB a request
    }
  }
  r.kv_bytes = per_request * static_cast<double>(batch);
  return r;
}

std::string format_decode_roofline(const DecodeRoofline& r) {
  char text[160];
  std::snprintf(text, sizeof text, "%.2f GB a step (weights %.2f, of them routed experts %.2f; KV %.3f)",
                r.bytes() / 1e9, r.weight_bytes / 1e9, r.routed_expert_bytes / 1e9, r.kv_bytes / 1e9);
  return text;
}

}  // namespace dsv4
