// Numerics::kDeepSeek (docs/numerics.md): against goldens of DeepSeek's own inference code
// (tools/reference/deepseek_reference.py, fixtures under tests/fixtures/deepseek_goldens/, skipped when absent),
// against the kHf path (a small, non-zero difference), and its own prefill / decode consistency.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>

#include "cache/index_key_format.h"
#include "cache/kv_entry_format.h"
#include "cache/weight_plan.h"
#include "core/error.h"
#include "core/npy.h"
#include "ops/cpu/quantize.h"
#include "test_models.h"

namespace dsv4 {
namespace {

namespace fs = std::filesystem;

std::vector<float> last_logits(DeepseekV4Model& model, const std::vector<int32_t>& ids,
                               const std::vector<int64_t>& chunks) {
  auto state = model.new_sequence_state();
  Tensor logits;
  int64_t offset = 0;
  for (const int64_t length : chunks) {
    const SequenceChunk chunk{state.get(), std::span<const int32_t>(ids).subspan(offset, length)};
    logits = model.forward(std::span(&chunk, 1), LogitsMode::kLastPerSequence);
    offset += length;
  }
  return logits.data;
}

std::vector<fs::path> golden_dirs() {
  std::vector<fs::path> dirs;
  // DSV4_DEEPSEEK_GOLDENS points the test at another folder of sets, e.g. a freshly generated one
  // (docs/numerics.md "The oracle").
  const char* override_root = std::getenv("DSV4_DEEPSEEK_GOLDENS");
  const fs::path root = override_root ? fs::path(override_root) : fs::path(DSV4_FIXTURES) / "deepseek_goldens";
  if (fs::is_directory(root))
    for (const auto& entry : fs::directory_iterator(root))
      if (fs::is_regular_file(entry.path() / "golden.json")) dirs.push_back(entry.path());
  std::sort(dirs.begin(), dirs.end());
  return dirs;
}

TEST(DeepSeekNumerics, MatchesTheReferenceGoldens) {
  const std::vector<fs::path> dirs = golden_dirs();
  if (dirs.empty()) GTEST_SKIP() << "no goldens under tests/fixtures/deepseek_goldens (tools/reference/deepseek_reference.py)";
  for (const fs::path& dir : dirs) {
    std::ifstream in(dir / "golden.json");
    const auto golden = nlohmann::json::parse(in);
    const std::vector<int32_t> ids = golden["ids"].get<std::vector<int32_t>>();
    ModelConfig config = ModelConfig::from_file((dir / "config.json").string());
    config.numerics = Numerics::kDeepSeek;
    DeepseekV4Model model(config, ModelWeights::load(config, dir.string()));
    // The reference returns the last position's logits: prefill, and after each decode step.
    const NpyArray expected = read_npy((dir / "logits.npy").string());
    const std::vector<float> actual = last_logits(model, ids, {static_cast<int64_t>(ids.size())});
    ASSERT_EQ(actual.size(), expected.data.size()) << dir;
    const double error = testing::relative_l2(actual.data(), expected.data.data(), actual.size());
    std::printf("deepseek golden %s: relative L2 %.3g\n", dir.filename().c_str(), error);
    EXPECT_LE(error, 1e-3) << dir;
    // The reference's decode path: prefill of the first decode_from tokens, then one token per step.
    if (golden.contains("decode_from") && fs::is_regular_file(dir / "logits_decode.npy")) {
      const auto from = golden["decode_from"].get<int64_t>();
      std::vector<int64_t> chunks = {from};
      for (auto i = from; i < static_cast<int64_t>(ids.size()); ++i) chunks.push_back(1);
      const NpyArray expected_decode = read_npy((dir / "logits_decode.npy").string());
      const std::vector<float> stepped = last_logits(model, ids, chunks);
      ASSERT_EQ(stepped.size(), expected_decode.data.size()) << dir;
      const double decode_error = testing::relative_l2(stepped.data(), expected_decode.data.data(), stepped.size());
      std::printf("deepseek golden %s, decode path: relative L2 %.3g\n", dir.filename().c_str(), decode_error);
      EXPECT_LE(decode_error, 1e-3) << dir;
    }
  }
}

// Every LinearWeight field as fp32 (what ModelWeights held before issue 7 kept them quantized).
ModelWeights dequantized_copy(const ModelWeights& weights) {
  ModelWeights dense = weights;
  for (LayerWeights& l : dense.layers) {
    for (LinearWeight* w :
         {&l.wq_a, &l.wq_b, &l.wkv, &l.wo_a, &l.wo_b, &l.indexer_wq_b, &l.shared_w13, &l.shared_w2})
      *w = LinearWeight(w->dequantized());
    for (auto* experts : {&l.experts_w13, &l.experts_w2})
      for (LinearWeight& w : *experts) w = LinearWeight(w.dequantized());
  }
  return dense;
}

// An FP8 / FP4 checkpoint stays quantized in host memory (issue 7 item 1) and computes exactly what its fp32
// dequantization computes: bit for bit in kDeepSeek (double accumulation), to fp32 rounding in kHf.
TEST(DeepSeekNumerics, QuantizedWeightsStayQuantizedAndComputeTheSame) {
  const std::vector<fs::path> dirs = golden_dirs();
  if (dirs.empty()) GTEST_SKIP() << "no goldens under tests/fixtures/deepseek_goldens";
  for (const fs::path& dir : dirs) {
    ModelConfig config = ModelConfig::from_file((dir / "config.json").string());
    const ModelWeights quantized = ModelWeights::load(config, dir.string());
    const LayerWeights& layer = quantized.layers.at(0);
    EXPECT_EQ(layer.wq_a.encoding(), WeightEncoding::kF8E4M3) << dir;
    EXPECT_EQ(layer.shared_w2.encoding(), WeightEncoding::kF8E4M3) << dir;
    EXPECT_EQ(layer.experts_w13.at(0).encoding(), WeightEncoding::kFp4E2M1) << dir;
    EXPECT_EQ(layer.wo_a.encoding(), WeightEncoding::kF32)
        << dir;  // stored BF16, as in the released checkpoints
    const ModelWeights dense = dequantized_copy(quantized);
    size_t quantized_linear = 0, dense_linear = 0;
    for (size_t i = 0; i < quantized.layers.size(); ++i) {
      const LayerWeights &q = quantized.layers[i], &d = dense.layers[i];
      for (size_t e = 0; e < q.experts_w13.size(); ++e) {
        quantized_linear += q.experts_w13[e].storage_bytes() + q.experts_w2[e].storage_bytes();
        dense_linear += d.experts_w13[e].storage_bytes() + d.experts_w2[e].storage_bytes();
      }
    }
    std::printf("%s: host bytes %zu quantized, %zu fp32; routed experts %zu vs %zu (%.2f bits/param)\n",
                dir.filename().c_str(), quantized.host_bytes(), dense.host_bytes(), quantized_linear,
                dense_linear,
                32.0 * static_cast<double>(quantized_linear) / static_cast<double>(dense_linear));
    // MXFP4: 4 bits + one exponent byte per 32 = 4.25 bits per parameter.
    EXPECT_EQ(quantized_linear * 128, dense_linear * 17) << dir;
    EXPECT_LT(quantized.host_bytes(), dense.host_bytes()) << dir;

    const ModelConfig hf_config = config;
    config.numerics = Numerics::kDeepSeek;
    const std::vector<int32_t> ids = testing::random_ids(21, config.vocab_size, 4);
    DeepseekV4Model deepseek_quantized(config, quantized), deepseek_dense(config, dense);
    EXPECT_EQ(last_logits(deepseek_quantized, ids, {21}), last_logits(deepseek_dense, ids, {21})) << dir;
    DeepseekV4Model hf_quantized(hf_config, quantized), hf_dense(hf_config, dense);
    const std::vector<float> a = last_logits(hf_quantized, ids, {21}), b = last_logits(hf_dense, ids, {21});
    const double error = testing::relative_l2(a.data(), b.data(), a.size());
    std::printf("%s, kHf: quantized vs fp32 weights relative L2 %.3g\n", dir.filename().c_str(), error);
    EXPECT_LE(error, 1e-5) << dir;
  }
}

// --expert-bits 3.5 / 2.5 on a real FP8/FP4 checkpoint: the routed experts requantized as each layer is read,
// everything else as stored; the planner's routed-expert bytes are the bytes held; the logits move by the
// requantization only (measured, printed).
TEST(DeepSeekNumerics, RequantizedExpertsSourceHoldsWhatThePlannerCounts) {
  const std::vector<fs::path> dirs = golden_dirs();
  if (dirs.empty()) GTEST_SKIP() << "no goldens under tests/fixtures/deepseek_goldens";
  const fs::path dir = dirs.front();
  ModelConfig config = ModelConfig::from_file((dir / "config.json").string());
  config.numerics = Numerics::kDeepSeek;
  const ModelWeights as_stored = ModelWeights::load(config, dir.string());
  const std::vector<int32_t> ids = testing::random_ids(33, config.vocab_size, 6);
  DeepseekV4Model reference(config, as_stored);
  const std::vector<float> expected = last_logits(reference, ids, {33});
  for (const char* bits : {"3.5", "2.5"}) {
    const std::optional<WeightEncoding> encoding = parse_expert_requantization(bits, "--expert-bits");
    ASSERT_TRUE(encoding.has_value());
    RequantizedExpertsSource source(std::make_unique<CheckpointWeightSource>(config, dir.string()),
                                    *encoding);
    const ModelWeights requantized = ModelWeights::from_source(source);
    size_t expert_bytes = 0;
    for (size_t i = 0; i < requantized.layers.size(); ++i) {
      const LayerWeights &l = requantized.layers[i], &s = as_stored.layers[i];
      EXPECT_EQ(l.wq_a.encoding(), WeightEncoding::kF8E4M3);  // the dense FP8 linears untouched
      EXPECT_EQ(l.shared_w13.storage_bytes(), s.shared_w13.storage_bytes());
      for (size_t e = 0; e < l.experts_w13.size(); ++e) {
        EXPECT_EQ(l.experts_w13[e].encoding(), *encoding);
        expert_bytes += l.experts_w13[e].storage_bytes() + l.experts_w2[e].storage_bytes();
      }
    }
    const WeightPlan plan = plan_weights(config, {std::stod(bits), true});
    ASSERT_EQ(plan.classes.front().name, "routed experts");
    EXPECT_EQ(static_cast<int64_t>(expert_bytes), plan.classes.front().bytes) << bits;
    DeepseekV4Model model(config, requantized);
    const std::vector<float> actual = last_logits(model, ids, {33});
    const double error = testing::relative_l2(actual.data(), expected.data(), expected.size());
    const auto argmax = [](const std::vector<float>& v) {
      return std::max_element(v.begin(), v.end()) - v.begin();
    };
    std::printf(
        "%s: experts requantized to %s bits/param: %zu bytes (planner %lld); logits relative L2 %.3g vs "
        "MXFP4, top-1 %s\n",
        dir.filename().c_str(), bits, expert_bytes, static_cast<long long>(plan.classes.front().bytes), error,
        argmax(actual) == argmax(expected) ? "same" : "differs");
    EXPECT_GT(error, 0.0);
    EXPECT_LT(error, 0.5);
  }
  EXPECT_THROW(parse_expert_requantization("3", "--expert-bits"), Error);
  EXPECT_FALSE(parse_expert_requantization("auto", "--expert-bits").has_value());
}

// ModelConfig::fp8_activations (the CPU twin of the GPU's FP8 linears): live on an FP8 checkpoint (measured
// on the tiny FP8/FP4 set, 40 positions: median 0.056 relative L2, top-1 kept at 33 of 40 — random weights
// amplify e4m3's 3-bit mantissa), a no-op on dense weights.
TEST(DeepSeekNumerics, Fp8ActivationsQuantizeOnlyFp8Linears) {
  const std::vector<fs::path> dirs = golden_dirs();
  if (dirs.empty()) GTEST_SKIP() << "no goldens under tests/fixtures/deepseek_goldens";
  ModelConfig config = ModelConfig::from_file((dirs.front() / "config.json").string());
  const ModelWeights weights = ModelWeights::load(config, dirs.front().string());
  const std::vector<int32_t> ids = testing::random_ids(40, config.vocab_size, 1);
  DeepseekV4Model exact(config, weights);
  config.fp8_activations = Fp8Activations::kFromBf16;
  DeepseekV4Model quantized(config, weights);
  const std::vector<float> a = last_logits(exact, ids, {40}), b = last_logits(quantized, ids, {40});
  const double error = testing::relative_l2(b.data(), a.data(), a.size());
  std::printf("fp8_activations on the FP8 checkpoint: last-token logits relative L2 %.3g\n", error);
  EXPECT_GT(error, 1e-4);
  EXPECT_LT(error, 0.6);
  DeepseekV4Model dense(config, dequantized_copy(weights));  // no FP8 weight left: nothing is quantized
  EXPECT_EQ(last_logits(dense, ids, {40}), a);
}

// ModelConfig::fp8_kv_cache (--kv-cache-dtype fp8, the CPU twin of the GPU's FP8 cache): its entries are exactly
// the FP8 cache formats' values (the CPU's quantize_e4m3_blocks on a bf16 row = kv_quantize_entry's kFp8 entry,
// dequantized; on a bf16 key with one block = the FP8 index key written and read back); in kHf it perturbs the logits a little; in kDeepSeek, which simulates FP8 entries already, it
// changes nothing.
TEST(DeepSeekNumerics, Fp8KvCacheSimulatesTheFp8CacheEntries) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 64; ++trial) {
    const float magnitude = std::exp2(std::uniform_real_distribution<float>(-14.0f, 10.0f)(rng));
    std::normal_distribution<float> normal(0.0f, magnitude);
    std::vector<uint16_t> row(kKvHeadDim);
    std::vector<float> simulated(kKvHeadDim), stored(kKvHeadDim);
    for (int c = 0; c < kKvHeadDim; ++c) {
      row[c] = f32_to_bf16(normal(rng));
      simulated[c] = bf16_to_f32(row[c]);
    }
    ops::cpu::quantize_e4m3_blocks(simulated.data(), kKvNopeDim, kKvScaleBlock);
    uint8_t entry[kKvFp8EntryBytes];
    const KvEntryAddress address{entry, entry + kKvFp8DataBytes};
    kv_quantize_entry(KvEntryFormat::kFp8, row.data(), address, false);
    kv_dequantize_entry(KvEntryFormat::kFp8, address, stored.data());
    ASSERT_EQ(simulated, stored) << "trial " << trial;
    // The first 128 channels as an index key: one scale over the key (cache/index_key_format.h).
    const IndexKeyPagedLayout layout{IndexKeyDtype::kFp8, 128, 1, 0, 132, 132, 1};
    std::vector<std::byte> pool(132);
    const int64_t slot = 0;
    write_index_keys_cpu(layout, row.data(), &slot, 1, pool.data());
    std::vector<float> key(128), key_stored(128);
    for (int c = 0; c < 128; ++c) key[c] = bf16_to_f32(row[c]);
    ops::cpu::quantize_e4m3_blocks(key.data(), 128, 128);
    read_index_key_cpu(layout, pool.data(), 0, 0, key_stored.data());
    ASSERT_EQ(key, key_stored) << "trial " << trial;
  }
  ModelConfig config = ModelConfig::preset("tiny");
  const ModelWeights weights = random_weights(config, 0);
  const std::vector<int32_t> ids = testing::random_ids(150, config.vocab_size, 4);  // past the window (128)
  DeepseekV4Model hf(config, weights);
  config.fp8_kv_cache = true;
  DeepseekV4Model hf_fp8(config, weights);
  const std::vector<float> a = last_logits(hf, ids, {100, 50}), b = last_logits(hf_fp8, ids, {100, 50});
  const double error = testing::relative_l2(b.data(), a.data(), a.size());
  std::printf("tiny preset, 150 tokens: fp8_kv_cache vs kHf last-token logits relative L2 %.4g\n", error);
  EXPECT_GT(error, 1e-5);
  EXPECT_LT(error, 0.3);
  config.numerics = Numerics::kDeepSeek;
  DeepseekV4Model deepseek_fp8(config, weights);
  config.fp8_kv_cache = false;
  DeepseekV4Model deepseek(config, weights);
  EXPECT_EQ(last_logits(deepseek_fp8, ids, {100, 50}), last_logits(deepseek, ids, {100, 50}));
}

TEST(DeepSeekNumerics, DiffersFromHfByQuantizationNoiseOnly) {
  ModelConfig config = ModelConfig::preset("tiny");
  const ModelWeights weights = random_weights(config, 0);
  DeepseekV4Model hf(config, weights);
  config.numerics = Numerics::kDeepSeek;
  DeepseekV4Model deepseek(config, weights);
  const std::vector<int32_t> ids = testing::random_ids(40, config.vocab_size, 3);
  const std::vector<float> a = last_logits(hf, ids, {40}), b = last_logits(deepseek, ids, {40});
  const double error = testing::relative_l2(b.data(), a.data(), a.size());
  std::printf("tiny preset, 40 tokens: kDeepSeek vs kHf last-token logits relative L2 %.4g\n", error);
  EXPECT_GT(error, 1e-4);  // the quantizers are live
  EXPECT_LT(error, 0.5);   // and only perturb the function (measured 0.199, docs/numerics.md)
}

// Bit for bit: every kDeepSeek GEMM accumulates in double and rounds once (ops::cpu::linear_f64), so no result depends
// on the number of rows in the call (docs/numerics.md "Canonical accumulation in kDeepSeek"; with OpenBLAS sgemm the
// two paths differed by 0.031 on the tiny oracle set).
TEST(DeepSeekNumerics, PrefillAndDecodeAgree) {
  ModelConfig config = testing::small_config();
  config.numerics = Numerics::kDeepSeek;
  DeepseekV4Model model = testing::random_model(config, 5);
  const std::vector<int32_t> ids = testing::random_ids(37, config.vocab_size, 9);
  const std::vector<float> one_shot = last_logits(model, ids, {37});
  std::vector<int64_t> decode = {12};
  for (int i = 12; i < 37; ++i) decode.push_back(1);
  const std::vector<float> stepped = last_logits(model, ids, decode);
  const double error = testing::relative_l2(stepped.data(), one_shot.data(), one_shot.size());
  std::printf("kDeepSeek one-shot vs 12 + 25 decode steps: relative L2 %.3g\n", error);
  EXPECT_EQ(stepped, one_shot);
}

// V4's attention shapes (64 heads × 512, an indexer of 64 × 128) with the release's encodings — FP8 projections,
// MXFP4 routed experts — through kDeepSeek: finite logits, within quantization noise of kHf on the same weights.
TEST(DeepSeekNumerics, V4ShapesWithTheReleaseEncodingsGiveFiniteLogits) {
  ModelConfig config = testing::v4_shaped_config();
  const ModelWeights weights = testing::with_release_encodings(random_weights(config, 5));
  DeepseekV4Model hf(config, weights);
  config.numerics = Numerics::kDeepSeek;
  DeepseekV4Model deepseek(config, weights);
  // 300 tokens in chunks of 128: the window, 75 CSA entries against a top-k of 64, 2 HCA entries.
  const std::vector<int32_t> ids = testing::random_ids(300, config.vocab_size, 18);
  const std::vector<float> a = last_logits(hf, ids, {128, 128, 44}), b = last_logits(deepseek, ids, {128, 128, 44});
  int64_t finite = 0;
  for (const float v : b) finite += std::isfinite(v);
  EXPECT_EQ(finite, static_cast<int64_t>(b.size()));
  const double error = testing::relative_l2(b.data(), a.data(), a.size());
  std::printf("V4 shapes, 300 tokens: kDeepSeek vs kHf relative L2 %.4g\n", error);
  EXPECT_LT(error, 0.5);
  // Two requests in one step (as the engine batches them): each row finite.
  auto first = deepseek.new_sequence_state(), second = deepseek.new_sequence_state();
  const std::vector<int32_t> other = testing::random_ids(40, config.vocab_size, 19);
  const SequenceChunk batch[2] = {{first.get(), std::span<const int32_t>(ids).first(128)},
                                  {second.get(), std::span<const int32_t>(other)}};
  const Tensor both = deepseek.forward(batch, LogitsMode::kLastPerSequence);
  finite = 0;
  for (const float v : both.data) finite += std::isfinite(v);
  EXPECT_EQ(finite, static_cast<int64_t>(both.data.size()));
}

}  // namespace
}  // namespace dsv4
