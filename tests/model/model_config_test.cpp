#include "model/model_config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace dsv4 {
namespace {

using ::testing::HasSubstr;
using json = nlohmann::json;

int count(const ModelConfig& c, AttentionType type) {
  return static_cast<int>(std::count(c.layer_types.begin(), c.layer_types.end(), type));
}

std::string error_of(const json& config) {
  try {
    ModelConfig::from_json(config);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(ModelConfig, FlashPresetHasTheReleasedLayout) {
  const ModelConfig c = ModelConfig::preset("v4-flash");
  EXPECT_EQ(c.num_hidden_layers, 43);
  EXPECT_EQ(count(c, AttentionType::kSlidingWindow), 2);
  EXPECT_EQ(count(c, AttentionType::kCompressedSparse), 21);
  EXPECT_EQ(count(c, AttentionType::kHeavilyCompressed), 20);
  EXPECT_EQ(c.mlp_layer_types[2], MlpType::kHashMoe);
  EXPECT_EQ(c.mlp_layer_types[3], MlpType::kMoe);
  EXPECT_EQ(c.qk_rope_head_dim, 64);
  EXPECT_EQ(c.index_topk, 512);
  EXPECT_EQ(c.rope_compress.rope_type, "yarn");
  EXPECT_EQ(c.rope_compress.attention_factor, 1.0);
  EXPECT_EQ(c.rope_main.rope_type, "default");
}

TEST(ModelConfig, ProPresetHasTheReleasedLayout) {
  const ModelConfig c = ModelConfig::preset("v4-pro");
  EXPECT_EQ(c.num_hidden_layers, 61);
  EXPECT_EQ(count(c, AttentionType::kSlidingWindow), 0);
  EXPECT_EQ(count(c, AttentionType::kCompressedSparse), 30);
  EXPECT_EQ(count(c, AttentionType::kHeavilyCompressed), 31);
  EXPECT_EQ(c.index_topk, 1024);
  EXPECT_EQ(c.routed_scaling_factor, 2.5);
}

TEST(ModelConfig, YarnMatchesTheClosedForm) {
  // V4 compress rope: theta 160000, 64 rotated channels, factor 16, original 65536, beta 32/1 -> the ramp runs
  // from pair 15 to pair 25 (docs research/model_spec.md §3.4).
  const ModelConfig c = ModelConfig::preset("v4-flash");
  const std::vector<float> inv_freq = c.inv_freq(RopeKind::kCompress);
  ASSERT_EQ(inv_freq.size(), 32u);
  for (int j = 0; j < 32; ++j) {
    const double base = std::pow(160000.0, -2.0 * j / 64.0);
    const double ramp = std::clamp((j - 15.0) / 10.0, 0.0, 1.0);
    const double expected = base * (1 - ramp) + base / 16.0 * ramp;
    EXPECT_NEAR(inv_freq[j], expected, 1e-6 * expected) << j;
  }
  const std::vector<float> main = c.inv_freq(RopeKind::kMain);
  for (int j = 0; j < 32; ++j) EXPECT_NEAR(main[j], std::pow(10000.0, -2.0 * j / 64.0), 1e-6);
}

TEST(ModelConfig, LegacyKeysFoldInLikeTransformers) {
  const json config = {{"model_type", "deepseek_v4"}, {"num_hidden_layers", 3}, {"compress_ratios", {0, 4, 128, 0}},
                       {"num_hash_layers", 1}, {"qk_rope_head_dim", 32}, {"head_dim", 128},
                       {"compress_rate_csa", 8}, {"compress_rate_hca", 64}};
  const ModelConfig c = ModelConfig::from_json(config);
  EXPECT_EQ(c.layer_types, (std::vector<AttentionType>{AttentionType::kSlidingWindow, AttentionType::kCompressedSparse,
                                                       AttentionType::kHeavilyCompressed}));
  EXPECT_EQ(c.mlp_layer_types, (std::vector<MlpType>{MlpType::kHashMoe, MlpType::kMoe, MlpType::kMoe}));
  EXPECT_EQ(c.qk_rope_head_dim, 32);
  EXPECT_EQ(c.partial_rotary_factor, 0.25);
  EXPECT_EQ(c.compress_rate(1), 8);
  EXPECT_EQ(c.compress_rate(2), 64);
  EXPECT_EQ(c.compress_rate(0), 0);
  // No rope_scaling: both rope types are plain, with their own theta.
  EXPECT_EQ(c.rope_compress.rope_type, "default");
  EXPECT_EQ(c.rope_compress.rope_theta, 160000.0);
}

TEST(ModelConfig, DefaultLayoutIsTwoHcaThenInterleaved) {
  const ModelConfig c = ModelConfig::from_json({{"num_hidden_layers", 5}});
  // transformers: ["HCA", "HCA"] + ["CSA" if i % 2 else "HCA" for i in range(n - 2)]
  EXPECT_EQ(c.layer_types, (std::vector<AttentionType>{
                               AttentionType::kHeavilyCompressed, AttentionType::kHeavilyCompressed,
                               AttentionType::kHeavilyCompressed, AttentionType::kCompressedSparse,
                               AttentionType::kHeavilyCompressed}));
  EXPECT_EQ(c.mlp_layer_types[2], MlpType::kHashMoe);
  EXPECT_EQ(c.mlp_layer_types[3], MlpType::kMoe);
}

TEST(ModelConfig, NestedRopeParametersAndRoundTrip) {
  const ModelConfig flash = ModelConfig::preset("tiny");
  const ModelConfig again = ModelConfig::from_json(flash.to_json());
  EXPECT_EQ(again.layer_types, flash.layer_types);
  EXPECT_EQ(again.mlp_layer_types, flash.mlp_layer_types);
  EXPECT_EQ(again.inv_freq(RopeKind::kCompress), flash.inv_freq(RopeKind::kCompress));
  EXPECT_EQ(again.inv_freq(RopeKind::kMain), flash.inv_freq(RopeKind::kMain));
  EXPECT_EQ(again.to_json(), flash.to_json());
}

TEST(ModelConfig, YarnDefaultsFollowTransformers) {
  // No attention_factor: get_mscale(factor) = 0.1 ln(factor) + 1; no factor: max_pos / original.
  json config = {{"num_hidden_layers", 1}, {"max_position_embeddings", 4096},
                 {"rope_parameters", {{"main", {{"rope_type", "default"}, {"rope_theta", 10000.0}}},
                                      {"compress", {{"rope_type", "yarn"}, {"rope_theta", 5000.0},
                                                    {"original_max_position_embeddings", 1024},
                                                    {"partial_rotary_factor", 0.125}}}}}};
  const ModelConfig c = ModelConfig::from_json(config);
  EXPECT_DOUBLE_EQ(c.rope_compress.factor, 4.0);
  EXPECT_NEAR(c.rope_compress.attention_factor, 0.1 * std::log(4.0) + 1.0, 1e-12);
  EXPECT_EQ(c.rope_dim(RopeKind::kCompress), 64);
  EXPECT_EQ(c.rope_dim(RopeKind::kMain), 512);  // nested dict without partial_rotary_factor: HF uses 1.0
}

// The released config.json files: `quantization_config` (fp8, 128×128 blocks) and `expert_dtype` "fp4"
// describe the storage layouts (what --load-format dummy reproduces); `dtype` wins over the legacy
// `torch_dtype` either way.
TEST(ModelConfig, ReleaseQuantizationKeysAreRead) {
  json config = ModelConfig::preset("tiny").to_json();
  config["dtype"] = "bfloat16";
  config["torch_dtype"] = "float32";
  EXPECT_FALSE(ModelConfig::from_json(config).fp8_block_weights);
  EXPECT_FALSE(ModelConfig::from_json(config).fp4_routed_experts);
  config["quantization_config"] = {
      {"quant_method", "fp8"}, {"fmt", "e4m3"}, {"weight_block_size", {128, 128}}};
  config["expert_dtype"] = "fp4";
  const ModelConfig released = ModelConfig::from_json(config);
  EXPECT_TRUE(released.fp8_block_weights);
  EXPECT_TRUE(released.fp4_routed_experts);
  EXPECT_EQ(released.torch_dtype, "bfloat16");
  config.erase("dtype");
  EXPECT_EQ(ModelConfig::from_json(config).torch_dtype, "float32");
  config["expert_dtype"] = "fp8";  // the -Base checkpoints: FP8 experts, not MXFP4
  EXPECT_FALSE(ModelConfig::from_json(config).fp4_routed_experts);
}

TEST(ModelConfig, BadConfigsNameTheFieldAndValue) {
  EXPECT_THAT(error_of({{"hidden_size", -4}}), HasSubstr("'hidden_size' = -4"));
  EXPECT_THAT(error_of({{"hidden_size", "big"}}), HasSubstr("'hidden_size' = \"big\""));
  EXPECT_THAT(error_of({{"model_type", "llama"}}), HasSubstr("model_type"));
  EXPECT_THAT(error_of({{"num_hidden_layers", 4}, {"layer_types", {"sliding_attention"}}}), HasSubstr("layer_types"));
  EXPECT_THAT(error_of({{"num_hidden_layers", 2}, {"layer_types", {"sliding_attention", "full_attention"}}}),
              HasSubstr("layer_types[1]' = \"full_attention\""));
  EXPECT_THAT(error_of({{"num_hidden_layers", 2}, {"compress_ratios", {0, 16}}}), HasSubstr("compress_ratios[1]' = 16"));
  EXPECT_THAT(error_of({{"num_attention_heads", 6}, {"o_groups", 4}}), HasSubstr("'o_groups' = 4"));
  EXPECT_THAT(error_of({{"num_key_value_heads", 8}}), HasSubstr("num_key_value_heads"));
  EXPECT_THAT(error_of({{"rope_scaling", {{"type", "longrope"}}}}), HasSubstr("longrope"));
  EXPECT_THAT(error_of({{"num_experts_per_tok", 9}, {"n_routed_experts", 8}}), HasSubstr("num_experts_per_tok"));
  EXPECT_THAT(error_of(json::array()), HasSubstr("object"));
  EXPECT_THAT(error_of({{"partial_rotary_factor", 0.3}}), HasSubstr("partial_rotary_factor"));
  EXPECT_THROW(ModelConfig::preset("v5"), Error);
}

// The default layer_types / mlp_layer_types are built from num_hidden_layers before validate() runs; a huge
// count must be refused first, not allocated (config_fuzz ran out of memory on exactly this).
TEST(ModelConfig, HugeLayerCountIsRefusedBeforeAnyAllocation) {
  EXPECT_THAT(error_of({{"num_hidden_layers", 1000000000000LL}}), HasSubstr("'num_hidden_layers' = 1000000000000"));
  EXPECT_THAT(error_of({{"num_hidden_layers", (1 << 16) + 1}, {"num_hash_layers", 0}}),
              HasSubstr("implausibly large"));
  EXPECT_EQ(ModelConfig::from_json({{"num_hidden_layers", 1 << 16}}).layer_types.size(), size_t{1} << 16);
}

}  // namespace
}  // namespace dsv4
