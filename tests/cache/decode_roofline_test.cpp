#include "cache/decode_roofline.h"

#include <gtest/gtest.h>

#include <string>

#include "core/error.h"
#include "model/model_config.h"

namespace dsv4 {
namespace {

ModelConfig bench_config(const std::string& file) {
  return ModelConfig::from_file(std::string(DSV4_FIXTURES) + "/../../bench/configs/" + file);
}

// The expected bytes come from an independent count over the config's fields (the shapes of MODEL.md written out
// by hand: q/kv/o projections, compressors, indexer, shared and routed experts, mHC mixes, LM head), not from
// checkpoint_tensors; the small fp32 vectors (norms, compressor position biases, sinks) it leaves out are
// < 0.1 % of a step.
void expect_near_relative(double actual, double expected, const char* what) {
  EXPECT_NEAR(actual, expected, 1e-3 * expected) << what;
}

TEST(DecodeRoofline, FourLayerCutMatchesTheHandCount) {
  const ModelConfig config = bench_config("v4_flash_4layer.json");
  const WeightFormat bf16{16.0, false, 16.0};  // every weight bf16 but the fp32 mHC and router
  // Batch 1 at 1K: 6 of 16 experts a layer; batch 8: 16 · (1 − (10/16)^8) = 15.6 of them.
  const DecodeRoofline one = decode_roofline(config, bf16, KvStorage::kBf16, IndexStorage::kBf16, 1, 1024);
  expect_near_relative(one.weight_bytes, 3.384549e9, "weights, batch 1");
  expect_near_relative(one.kv_bytes, 8.601600e5, "KV, batch 1");
  const DecodeRoofline eight = decode_roofline(config, bf16, KvStorage::kBf16, IndexStorage::kBf16, 8, 1024);
  expect_near_relative(eight.weight_bytes, 5.322873e9, "weights, batch 8");
  expect_near_relative(eight.kv_bytes, 6.881280e6, "KV, batch 8");
  EXPECT_LT(one.routed_expert_bytes, eight.routed_expert_bytes);
  EXPECT_DOUBLE_EQ(one.bytes(), one.weight_bytes + one.kv_bytes);
  EXPECT_DOUBLE_EQ(one.seconds_at(1e9), one.bytes() / 1e9);
}

TEST(DecodeRoofline, FullDepthShapesMatchTheHandCount) {
  const WeightFormat bf16{16.0, false, 16.0};
  const DecodeRoofline b32 = decode_roofline(bench_config("v4_flash_43layer_32experts.json"), bf16, KvStorage::kBf16,
                                             IndexStorage::kBf16, 32, 8192);
  expect_near_relative(b32.weight_bytes, 8.271750e10, "43 layers x 32 experts, batch 32, 8K: weights");
  expect_near_relative(b32.kv_bytes, 9.269412e8, "43 layers x 32 experts, batch 32, 8K: KV");
  // FP8 cache: 584-byte main entries, 132-byte index keys; 128K context, batch 4.
  const DecodeRoofline fp8 = decode_roofline(bench_config("v4_flash_43layer_16experts.json"), bf16, KvStorage::kFp8,
                                             IndexStorage::kFp8, 4, 131072);
  expect_near_relative(fp8.weight_bytes, 4.288410e10, "43 layers x 16 experts, batch 4, 128K: weights");
  expect_near_relative(fp8.kv_bytes, 4.491469e8, "43 layers x 16 experts, batch 4, 128K, FP8: KV");
}

TEST(DecodeRoofline, LowBitExpertsShrinkOnlyTheExperts) {
  const ModelConfig config = bench_config("v4_flash_4layer.json");
  const DecodeRoofline bf16 =
      decode_roofline(config, WeightFormat{16.0, false, 16.0}, KvStorage::kBf16, IndexStorage::kBf16, 1, 4096);
  const DecodeRoofline q2 =
      decode_roofline(config, WeightFormat{2.5, false, 16.0}, KvStorage::kBf16, IndexStorage::kBf16, 1, 4096);
  EXPECT_NEAR(q2.routed_expert_bytes, bf16.routed_expert_bytes * 2.5 / 16, 1e-6 * bf16.routed_expert_bytes);
  EXPECT_NEAR(bf16.weight_bytes - q2.weight_bytes, bf16.routed_expert_bytes - q2.routed_expert_bytes,
              1e-6 * bf16.weight_bytes);
  EXPECT_DOUBLE_EQ(bf16.kv_bytes, q2.kv_bytes);
}

TEST(DecodeRoofline, RejectsEmptyBatchesAndContexts) {
  const ModelConfig config = ModelConfig::preset("tiny");
  EXPECT_THROW(decode_roofline(config, WeightFormat{}, KvStorage::kBf16, IndexStorage::kBf16, 0, 16), Error);
  EXPECT_THROW(decode_roofline(config, WeightFormat{}, KvStorage::kBf16, IndexStorage::kBf16, 1, 0), Error);
}

}  // namespace
}  // namespace dsv4
