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

// V4-Flash's attention shapes at a small width: 64 heads × 512 with 64 rope channels, an indexer of 64 × 128,
// every layer kind, top-k far below the entries of a few hundred tokens.
inline ModelConfig v4_shaped_config() {
  const nlohmann::json config = {
      {"model_type", "deepseek_v4"}, {"vocab_size", 4096}, {"hidden_size", 512}, {"num_hidden_layers", 4},
      {"num_attention_heads", 64}, {"head_dim", 512}, {"qk_rope_head_dim", 64}, {"q_lora_rank", 256},
      {"o_groups", 8}, {"o_lora_rank", 128}, {"sliding_window", 128}, {"compress_ratios", {0, 4, 128, 4}},
      {"num_hash_layers", 1}, {"n_routed_experts", 8}, {"num_experts_per_tok", 2}, {"moe_intermediate_size", 256},
      {"index_n_heads", 64}, {"index_head_dim", 128}, {"index_topk", 64},
      {"rope_scaling",
       {{"type", "yarn"}, {"factor", 16}, {"original_max_position_embeddings", 65536}, {"beta_fast", 32},
        {"beta_slow", 1}}}};
  return ModelConfig::from_json(config);
}

// The weights in the release's encodings (research model_spec.md §2.1): the projections that DeepSeek stores FP8
// block-quantized (128 × 128, UE8M0), the routed experts MXFP4.
inline ModelWeights with_release_encodings(ModelWeights weights) {
  for (LayerWeights& l : weights.layers) {
    for (LinearWeight* w : {&l.wq_a, &l.wq_b, &l.wkv, &l.wo_b, &l.indexer_wq_b, &l.shared_w13, &l.shared_w2})
      if (!w->empty()) *w = LinearWeight::quantize_fp8_blocks(w->dense());
    for (LinearWeight& w : l.experts_w13) w = LinearWeight::quantize_mxfp4_groups(w.dense());
    for (LinearWeight& w : l.experts_w2) w = LinearWeight::quantize_mxfp4_groups(w.dense());
  }
  return weights;
}

}  // namespace dsv4::testing
