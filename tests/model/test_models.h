// Small random-weight models shared by the model tests.
#pragma once
#include <nlohmann/json.hpp>
#include <random>
#include <vector>

#include "model/deepseek_v4.h"
#include "model/random_init.h"

namespace dsv4::testing {

// Every layer kind, both MoE kinds, ratios other than 4/128, YaRN, a window the tests cross many times, and an
// index_topk far below the number of entries.
inline ModelConfig small_config() {
  const nlohmann::json config = {
      {"model_type", "deepseek_v4"}, {"vocab_size", 97}, {"hidden_size", 32}, {"num_hidden_layers", 4},
      {"num_attention_heads", 4}, {"head_dim", 16}, {"qk_rope_head_dim", 8}, {"q_lora_rank", 16},
      {"o_groups", 2}, {"o_lora_rank", 8}, {"sliding_window", 8}, {"compress_ratios", {4, 0, 128, 4}},
      {"compress_rate_csa", 4}, {"compress_rate_hca", 16}, {"num_hash_layers", 2}, {"n_routed_experts", 6},
      {"num_experts_per_tok", 2}, {"moe_intermediate_size", 12}, {"index_n_heads", 2}, {"index_head_dim", 8},
      {"index_topk", 3}, {"hc_sinkhorn_iters", 5},
      {"rope_scaling", {{"type", "yarn"}, {"factor", 4}, {"original_max_position_embeddings", 32}}}};
  return ModelConfig::from_json(config);
}

inline DeepseekV4Model random_model(const ModelConfig& config, uint64_t seed) {
  return DeepseekV4Model(config, random_weights(config, seed));
}

inline std::vector<int32_t> random_ids(size_t n, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> ids(n);
  for (auto& id : ids) id = static_cast<int32_t>(rng() % vocab);
  return ids;
}

inline double relative_l2(const float* actual, const float* expected, size_t n) {
  double err = 0, norm = 0;
  for (size_t i = 0; i < n; ++i) {
    err += (double(actual[i]) - expected[i]) * (double(actual[i]) - expected[i]);
    norm += double(expected[i]) * expected[i];
  }
  return std::sqrt(err / std::max(norm, 1e-300));
}

}  // namespace dsv4::testing
