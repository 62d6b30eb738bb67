// The streamed weight sources (model/weights.h ModelWeightSource): piece by piece they must give exactly the
// weights the whole-model paths give, and a bad checkpoint must fail before the first piece is read.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "model/random_init.h"
#include "model/safetensors.h"
#include "model/weights.h"
#include "test_models.h"

namespace dsv4 {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

class TempDir {
 public:
  TempDir() {
    static int counter = 0;
    const auto* test = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::path(::testing::TempDir()) / ("dsv4_ws_" + std::string(test->name()) + "_" +
                                              std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string str() const { return path_.string(); }

 private:
  fs::path path_;
};

void expect_identical(const Tensor& actual, const Tensor& expected, const std::string& what) {
  EXPECT_EQ(actual.shape, expected.shape) << what;
  ASSERT_EQ(actual.data.size(), expected.data.size()) << what;
  if (actual.data.empty()) return;  // memcmp of an empty tensor's null data() would be undefined behaviour
  EXPECT_EQ(std::memcmp(actual.data.data(), expected.data.data(), actual.data.size() * sizeof(float)), 0) << what;
}

void expect_identical(const LinearWeight& actual, const LinearWeight& expected, const std::string& what) {
  EXPECT_EQ(actual.encoding(), expected.encoding()) << what;
  EXPECT_EQ(actual.storage_bytes(), expected.storage_bytes()) << what;
  expect_identical(actual.dequantized(), expected.dequantized(), what);
}

void expect_identical(const CompressorWeights& actual, const CompressorWeights& expected, const std::string& what) {
  expect_identical(actual.wkv, expected.wkv, what + ".wkv");
  expect_identical(actual.wgate, expected.wgate, what + ".wgate");
  expect_identical(actual.ape, expected.ape, what + ".ape");
  expect_identical(actual.norm, expected.norm, what + ".norm");
}

void expect_identical_globals(const ModelWeights& actual, const ModelWeights& expected) {
  expect_identical(actual.embed, expected.embed, "embed");
  expect_identical(actual.head, expected.head, "head");
  expect_identical(actual.norm, expected.norm, "norm");
  expect_identical(actual.hc_head_fn, expected.hc_head_fn, "hc_head_fn");
  expect_identical(actual.hc_head_base, expected.hc_head_base, "hc_head_base");
  expect_identical(actual.hc_head_scale, expected.hc_head_scale, "hc_head_scale");
}

void expect_identical(const LayerWeights& a, const LayerWeights& e, int64_t layer) {
  const std::string p = "layer " + std::to_string(layer) + " ";
  expect_identical(a.hc_attn_fn, e.hc_attn_fn, p + "hc_attn_fn");
  expect_identical(a.hc_attn_base, e.hc_attn_base, p + "hc_attn_base");
  expect_identical(a.hc_attn_scale, e.hc_attn_scale, p + "hc_attn_scale");
  expect_identical(a.hc_ffn_fn, e.hc_ffn_fn, p + "hc_ffn_fn");
  expect_identical(a.hc_ffn_base, e.hc_ffn_base, p + "hc_ffn_base");
  expect_identical(a.hc_ffn_scale, e.hc_ffn_scale, p + "hc_ffn_scale");
  expect_identical(a.attn_norm, e.attn_norm, p + "attn_norm");
  expect_identical(a.ffn_norm, e.ffn_norm, p + "ffn_norm");
  expect_identical(a.wq_a, e.wq_a, p + "wq_a");
  expect_identical(a.q_norm, e.q_norm, p + "q_norm");
  expect_identical(a.wq_b, e.wq_b, p + "wq_b");
  expect_identical(a.wkv, e.wkv, p + "wkv");
  expect_identical(a.kv_norm, e.kv_norm, p + "kv_norm");
  expect_identical(a.wo_a, e.wo_a, p + "wo_a");
  expect_identical(a.wo_b, e.wo_b, p + "wo_b");
  expect_identical(a.attn_sink, e.attn_sink, p + "attn_sink");
  expect_identical(a.compressor, e.compressor, p + "compressor");
  expect_identical(a.indexer_compressor, e.indexer_compressor, p + "indexer_compressor");
  expect_identical(a.indexer_wq_b, e.indexer_wq_b, p + "indexer_wq_b");
  expect_identical(a.indexer_weights_proj, e.indexer_weights_proj, p + "indexer_weights_proj");
  expect_identical(a.gate, e.gate, p + "gate");
  expect_identical(a.gate_bias, e.gate_bias, p + "gate_bias");
  EXPECT_EQ(a.tid2eid, e.tid2eid) << p << "tid2eid";
  ASSERT_EQ(a.experts_w13.size(), e.experts_w13.size()) << p;
  ASSERT_EQ(a.experts_w2.size(), e.experts_w2.size()) << p;
  for (size_t x = 0; x < a.experts_w13.size(); ++x) {
    expect_identical(a.experts_w13[x], e.experts_w13[x], p + "expert " + std::to_string(x) + " w13");
    expect_identical(a.experts_w2[x], e.experts_w2[x], p + "expert " + std::to_string(x) + " w2");
  }
  expect_identical(a.shared_w13, e.shared_w13, p + "shared_w13");
  expect_identical(a.shared_w2, e.shared_w2, p + "shared_w2");
}

// Reads `source` piece by piece and compares each piece with the whole-model weights `expected`.
void expect_source_gives(ModelWeightSource& source, const ModelWeights& expected) {
  ASSERT_EQ(static_cast<size_t>(source.config().num_hidden_layers), expected.layers.size());
  const ModelWeights globals = source.globals();
  EXPECT_TRUE(globals.layers.empty());
  expect_identical_globals(globals, expected);
  // Out of order on purpose: a layer depends on nothing read before it.
  for (int64_t layer = source.config().num_hidden_layers - 1; layer >= 0; --layer)
    expect_identical(source.layer(layer), expected.layers[static_cast<size_t>(layer)], layer);
}

struct NamedConfig {
  const char* name;
  ModelConfig config;
};
std::vector<NamedConfig> configs() {
  return {{"tiny", ModelConfig::preset("tiny")}, {"small", testing::small_config()}};
}

TEST(CheckpointWeightSource, StreamsWhatLoadReads) {
  for (const auto& [name, config] : configs()) {
    for (const StorageDType dtype : {StorageDType::kF32, StorageDType::kBF16}) {
      SCOPED_TRACE(std::string(name) + (dtype == StorageDType::kF32 ? " f32" : " bf16"));
      TempDir dir;
      write_random_model(config, 7, dtype, dir.str());
      CheckpointWeightSource source(config, dir.str());
      expect_source_gives(source, ModelWeights::load(config, dir.str()));
      // fp32 storage is lossless: the streamed checkpoint is the random model itself.
      if (dtype == StorageDType::kF32) {
        CheckpointWeightSource again(config, dir.str());
        expect_source_gives(again, random_weights(config, 7));
      }
    }
  }
}

TEST(RandomWeightSource, GivesRandomWeights) {
  for (const auto& [name, config] : configs()) {
    SCOPED_TRACE(name);
    RandomWeightSource source(config, 11);
    expect_source_gives(source, random_weights(config, 11));
  }
}

// A config declaring FP8 weights (quantization_config.quant_method "fp8", as the released config.json files
// do):
// --load-format dummy gives the projections the release stores FP8 in that layout, the rest as before.
TEST(RandomWeightSource, Fp8ConfigGivesFp8Projections) {
  nlohmann::json json = ModelConfig::preset("tiny").to_json();
  json["quantization_config"] = {{"quant_method", "fp8"}, {"fmt", "e4m3"}, {"weight_block_size", {128, 128}}};
  const ModelConfig config = ModelConfig::from_json(json);
  ASSERT_TRUE(config.fp8_block_weights);
  RandomWeightSource source(config, 4);
  const ModelWeights dense = random_weights(config, 4);
  for (int64_t index : {int64_t{0}, config.num_hidden_layers - 1}) {
    const LayerWeights layer = source.layer(index);
    const LayerWeights& expected = dense.layers[static_cast<size_t>(index)];
    EXPECT_EQ(layer.wq_a.encoding(), WeightEncoding::kF8E4M3);
    EXPECT_EQ(layer.shared_w2.encoding(), WeightEncoding::kF8E4M3);
    EXPECT_EQ(layer.wo_a.encoding(), WeightEncoding::kF32);  // bf16 in the release
    expect_identical(layer.wo_a, expected.wo_a, "wo_a");
    expect_identical(layer.wq_b, LinearWeight::quantize_fp8_blocks(expected.wq_b.dense()), "wq_b");
  }
}

// expert_dtype "fp4" (the released config.json): --load-format dummy gives MXFP4 routed experts, the
// quantization of the dense random experts; the shared expert is untouched.
TEST(RandomWeightSource, Fp4ExpertConfigGivesMxfp4RoutedExperts) {
  nlohmann::json json = testing::small_config().to_json();
  json["expert_dtype"] = "fp4";
  EXPECT_THROW((void)ModelConfig::from_json(json),
               Error);  // moe_intermediate_size 12: not whole scale groups
  json["moe_intermediate_size"] = 32;
  const ModelConfig config = ModelConfig::from_json(json);
  ASSERT_TRUE(config.fp4_routed_experts);
  RandomWeightSource source(config, 6);
  const ModelWeights dense = random_weights(config, 6);
  const LayerWeights layer = source.layer(0);
  const LayerWeights& expected = dense.layers[0];
  ASSERT_EQ(layer.experts_w13.size(), expected.experts_w13.size());
  for (size_t e = 0; e < layer.experts_w13.size(); ++e) {
    EXPECT_EQ(layer.experts_w13[e].encoding(), WeightEncoding::kFp4E2M1);
    expect_identical(layer.experts_w13[e],
                     LinearWeight::quantize_mxfp4_groups(expected.experts_w13[e].dense()), "experts_w13");
    expect_identical(layer.experts_w2[e], LinearWeight::quantize_mxfp4_groups(expected.experts_w2[e].dense()),
                     "experts_w2");
  }
  EXPECT_EQ(layer.shared_w13.encoding(), WeightEncoding::kF32);
}

TEST(WeightSources, LayerOutsideTheModelThrows) {
  const ModelConfig config = testing::small_config();
  RandomWeightSource random(config, 1);
  EXPECT_THROW(random.layer(config.num_hidden_layers), Error);
  EXPECT_THROW(random.layer(-1), Error);
  TempDir dir;
  write_random_model(config, 1, StorageDType::kF32, dir.str());
  CheckpointWeightSource checkpoint(config, dir.str());
  EXPECT_THROW(checkpoint.layer(config.num_hidden_layers), Error);
}

// A checkpoint missing a tensor of its last layer, with an extra tensor and a mis-shaped one: the constructor
// (before any data is read) names all three in one error, as ModelWeights::load does.
TEST(CheckpointWeightSource, BadCheckpointFailsUpFrontListingEveryProblem) {
  const ModelConfig config = testing::small_config();
  const std::string missing = "model.layers.3.attn.wq_a.weight";
  const std::string misshaped = "model.layers.1.ffn.experts.2.w2.weight";
  std::vector<TensorToWrite> files;
  for (const auto& [name, tensor] : random_tensors(config, 3)) {
    if (name == missing) continue;
    TensorToWrite entry{name, DType::kF32, tensor.shape, {}};
    if (name == misshaped) entry.shape = {tensor.shape[1], tensor.shape[0]};  // same bytes, transposed shape
    entry.bytes.resize(tensor.data.size() * sizeof(float));
    std::memcpy(entry.bytes.data(), tensor.data.data(), entry.bytes.size());
    files.push_back(std::move(entry));
  }
  files.push_back({"model.layers.9.attn.wq_a.weight", DType::kF32, {1}, std::vector<uint8_t>(4)});
  TempDir dir;
  write_safetensors(dir.str() + "/model.safetensors", files);
  for (const bool streamed : {true, false}) {
    SCOPED_TRACE(streamed ? "CheckpointWeightSource" : "ModelWeights::load");
    try {
      if (streamed) {
        CheckpointWeightSource source(config, dir.str());
      } else {
        ModelWeights::load(config, dir.str());
      }
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      const std::string message = e.what();
      EXPECT_THAT(message, HasSubstr("does not match its config"));
      EXPECT_THAT(message, HasSubstr("missing 1 tensors:\n    " + missing + " [16, 32]"));
      EXPECT_THAT(message, HasSubstr("unexpected 1 tensors:\n    model.layers.9.attn.wq_a.weight"));
      EXPECT_THAT(message, HasSubstr(misshaped + ": shape [12, 32] (F32), expected [32, 12]"));
    }
  }
}

}  // namespace
}  // namespace dsv4
