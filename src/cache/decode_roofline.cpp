#include "cache/decode_roofline.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "cache/planner.h"
#include "core/error.h"
#include "model/weights.h"

namespace dsv4 {

DecodeRoofline decode_roofline(const ModelConfig& config, const WeightBytes& weights, KvStorage kv,
                               IndexStorage index, int64_t batch, int64_t context) {
  DSV4_CHECK(batch >= 1, "decode roofline: batch must be >= 1, got " + std::to_string(batch));
  DSV4_CHECK(context >= 1, "decode roofline: context must be >= 1, got " + std::to_string(context));
  const double experts = static_cast<double>(config.n_routed_experts);
  const double picked = static_cast<double>(config.num_experts_per_tok);
  // Expected distinct experts of a layer over the batch's tokens, each picking `picked` of `experts`.
  const double distinct = experts * (1.0 - std::pow(1.0 - picked / experts, static_cast<double>(batch)));
  DecodeRoofline r;
  for (const TensorSpec& spec : checkpoint_tensors(config)) {
    double params = 1;
    for (const int64_t d : spec.shape) params *= static_cast<double>(d);
    const std::string& name = spec.name;
    if (spec.role == TensorRole::kEmbedding) {
      r.weight_bytes += weights.dense_per_param * static_cast<double>(std::min<int64_t>(batch, spec.shape[0])) *
                        static_cast<double>(spec.shape[1]);
    } else if (name.find(".ffn.experts.") != std::string::npos) {
      const double bytes = params * weights.routed_expert_per_param * distinct / experts;
      r.weight_bytes += bytes;
      r.routed_expert_bytes += bytes;
    } else if (spec.role == TensorRole::kLinear && name.find(".ffn.gate.") == std::string::npos) {
      r.weight_bytes += params * weights.dense_per_param;
    } else if (spec.role != TensorRole::kHashTable) {
      r.weight_bytes += params * 4.0;  // fp32: mHC weights, router, norms, sinks, biases
    }
  }
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

}  // namespace dsv4
