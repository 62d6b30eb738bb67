// The GPU-side weight sources against the host ones they replace, every tensor of every layer bit for bit:
// DeviceRandomWeightSource (--load-format dummy on the CUDA backend) against RandomWeightSource (wrapped in
// RequantizedExpertsSource for --expert-bits), in each expert encoding — fp32 experts, the release's FP8
// projections + MXFP4 experts, and both requantizations from each; DeviceRequantizedExpertsSource over the
// FP8 / MXFP4 checkpoint fixture against RequantizedExpertsSource over it; and the requantizer on dense and
// FP8 matrices. The values can differ from the host's by one ulp on about one element in
// 10^8 (core/random_fill.h); for these fixed seeds and shapes none does, and the test would show one. Skips
// without a GPU.
#include "model/cuda/device_random_weights.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <memory>
#include <optional>

#include "model/cuda/deepseek_v4_cuda.h"
#include "model/cuda/device_expert_requantizer.h"
#include "model/random_init.h"

namespace dsv4 {
namespace {

void expect_same(const Tensor& actual, const Tensor& expected, const std::string& what) {
  ASSERT_EQ(actual.shape, expected.shape) << what;
  EXPECT_EQ(0, std::memcmp(actual.ptr(), expected.ptr(), actual.data.size() * sizeof(float))) << what;
}

void expect_same(const LinearWeight& actual, const LinearWeight& expected, const std::string& what) {
  ASSERT_EQ(actual.encoding(), expected.encoding()) << what;
  ASSERT_EQ(actual.shape(), expected.shape()) << what;
  EXPECT_EQ(actual.codes(), expected.codes()) << what;
  EXPECT_EQ(actual.fp4_exponents(), expected.fp4_exponents()) << what;
  EXPECT_EQ(actual.group_scales(), expected.group_scales()) << what;
  if (!actual.empty()) expect_same(actual.dequantized(), expected.dequantized(), what);
}

void expect_same(const LayerWeights& a, const LayerWeights& e) {
  const std::pair<const Tensor*, const Tensor*> tensors[] = {
      {&a.hc_attn_fn, &e.hc_attn_fn}, {&a.hc_attn_base, &e.hc_attn_base}, {&a.hc_attn_scale, &e.hc_attn_scale},
      {&a.hc_ffn_fn, &e.hc_ffn_fn}, {&a.hc_ffn_base, &e.hc_ffn_base}, {&a.hc_ffn_scale, &e.hc_ffn_scale},
      {&a.attn_norm, &e.attn_norm}, {&a.ffn_norm, &e.ffn_norm}, {&a.q_norm, &e.q_norm}, {&a.kv_norm, &e.kv_norm},
      {&a.attn_sink, &e.attn_sink}, {&a.compressor.wkv, &e.compressor.wkv},
      {&a.compressor.wgate, &e.compressor.wgate}, {&a.compressor.ape, &e.compressor.ape},
      {&a.compressor.norm, &e.compressor.norm}, {&a.indexer_compressor.wkv, &e.indexer_compressor.wkv},
      {&a.indexer_compressor.wgate, &e.indexer_compressor.wgate},
      {&a.indexer_compressor.ape, &e.indexer_compressor.ape},
      {&a.indexer_compressor.norm, &e.indexer_compressor.norm},
      {&a.indexer_weights_proj, &e.indexer_weights_proj}, {&a.gate, &e.gate}, {&a.gate_bias, &e.gate_bias}};
  for (size_t i = 0; i < std::size(tensors); ++i)
    expect_same(*tensors[i].first, *tensors[i].second, "tensor " + std::to_string(i));
  const std::pair<const LinearWeight*, const LinearWeight*> linears[] = {
      {&a.wq_a, &e.wq_a}, {&a.wq_b, &e.wq_b}, {&a.wkv, &e.wkv}, {&a.wo_a, &e.wo_a}, {&a.wo_b, &e.wo_b},
      {&a.indexer_wq_b, &e.indexer_wq_b}, {&a.shared_w13, &e.shared_w13}, {&a.shared_w2, &e.shared_w2}};
  for (size_t i = 0; i < std::size(linears); ++i)
    expect_same(*linears[i].first, *linears[i].second, "linear " + std::to_string(i));
  EXPECT_EQ(a.tid2eid, e.tid2eid);
  ASSERT_EQ(a.experts_w13.size(), e.experts_w13.size());
  for (size_t x = 0; x < a.experts_w13.size(); ++x) {
    expect_same(a.experts_w13[x], e.experts_w13[x], "expert w13 " + std::to_string(x));
    expect_same(a.experts_w2[x], e.experts_w2[x], "expert w2 " + std::to_string(x));
  }
}

TEST(DeviceRandomWeights, EqualTheHostGeneratorInEveryExpertEncoding) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  ModelConfig released = ModelConfig::preset("tiny");
  released.fp8_block_weights = true;
  released.fp4_routed_experts = true;
  for (const ModelConfig& config : {ModelConfig::preset("tiny"), released})
    for (const std::optional<WeightEncoding> experts :
         {std::optional<WeightEncoding>{}, std::optional{WeightEncoding::kQ3G32},
          std::optional{WeightEncoding::kQ2G32}}) {
      SCOPED_TRACE(std::string(config.fp4_routed_experts ? "FP8 + MXFP4 config" : "fp32 config") + ", experts " +
                   (experts ? (*experts == WeightEncoding::kQ3G32 ? "Q3G32" : "Q2G32") : "as stored"));
      std::unique_ptr<ModelWeightSource> host = std::make_unique<RandomWeightSource>(config, 5);
      if (experts) host = std::make_unique<RequantizedExpertsSource>(std::move(host), *experts);
      DeviceRandomWeightSource device(config, 5, experts);
      const ModelWeights host_globals = host->globals(), device_globals = device.globals();
      expect_same(device_globals.embed, host_globals.embed, "embed");
      expect_same(device_globals.head, host_globals.head, "head");
      expect_same(device_globals.norm, host_globals.norm, "norm");
      expect_same(device_globals.hc_head_fn, host_globals.hc_head_fn, "hc_head_fn");
      expect_same(device_globals.hc_head_base, host_globals.hc_head_base, "hc_head_base");
      expect_same(device_globals.hc_head_scale, host_globals.hc_head_scale, "hc_head_scale");
      for (int64_t layer = 0; layer < config.num_hidden_layers; ++layer) {
        SCOPED_TRACE("layer " + std::to_string(layer));
        expect_same(device.layer(layer), host->layer(layer));
      }
      EXPECT_THROW((void)device.layer(config.num_hidden_layers), Error);
    }
}

TEST(DeviceRandomWeights, RequantizedCheckpointExpertsEqualTheHostRequantization) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  const char* override_root = std::getenv("DSV4_FIXTURES");
  const std::filesystem::path dir =
      std::filesystem::path(override_root ? override_root : DSV4_FIXTURES) / "deepseek_goldens" / "tiny_fp8_fp4";
  if (!std::filesystem::is_regular_file(dir / "model.safetensors")) GTEST_SKIP() << "no fixture at " << dir;
  const ModelConfig config = ModelConfig::from_file((dir / "config.json").string());
  for (const WeightEncoding encoding : {WeightEncoding::kQ3G32, WeightEncoding::kQ2G32}) {
    SCOPED_TRACE(encoding == WeightEncoding::kQ3G32 ? "Q3G32" : "Q2G32");
    RequantizedExpertsSource host(std::make_unique<CheckpointWeightSource>(config, dir.string()), encoding);
    DeviceRequantizedExpertsSource device(std::make_unique<CheckpointWeightSource>(config, dir.string()), encoding);
    for (int64_t layer = 0; layer < config.num_hidden_layers; ++layer) {
      SCOPED_TRACE("layer " + std::to_string(layer));
      const LayerWeights expected = host.layer(layer);
      ASSERT_EQ(expected.experts_w13.at(0).encoding(), encoding);
      expect_same(device.layer(layer), expected);
    }
  }
  // Matrices stored in other encodings are decoded on the host first: fp32 and FP8.
  Tensor dense({256, 160});
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  for (float& v : dense.data) v = normal(rng);
  DeviceExpertRequantizer requantizer(WeightEncoding::kQ2G32);
  for (const LinearWeight& w : {LinearWeight(dense), LinearWeight::quantize_fp8_blocks(dense)})
    expect_same(requantizer.requantize(w), w.requantized(WeightEncoding::kQ2G32), "a dense / FP8 matrix");
  EXPECT_THROW(DeviceExpertRequantizer(WeightEncoding::kFp4E2M1), Error);
}

}  // namespace
}  // namespace dsv4
