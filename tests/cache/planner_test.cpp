// The capacity planner against the cache arithmetic of the source material (docs/MODEL.md, "Cache arithmetic
// from the source material") and hand computations.
#include "cache/planner.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace dsv4 {
namespace {

// One layer's FP8 region in a block (cache/kv_entry_format.h): entries · 584 B rounded up to a multiple of 576 B.
constexpr int64_t kFp8Region64 = (64 * 584 + 575) / 576 * 576;  // 37,440: SWA and C4 blocks of 64 entries
constexpr int64_t kFp8Region2 = (2 * 584 + 575) / 576 * 576;    // 1,728: C128 blocks of 2 entries

constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int64_t kGiB = int64_t{1} << 30;
constexpr int64_t kOneM = int64_t{1} << 20;  // 2^20 tokens

double gib(int64_t bytes) { return static_cast<double>(bytes) / static_cast<double>(kGiB); }
double mib(int64_t bytes) { return static_cast<double>(bytes) / static_cast<double>(kMiB); }

const GroupPlan& group(const CapacityPlan& plan, CacheGroupKind kind) {
  const GroupPlan* found = plan.find(kind);
  EXPECT_NE(found, nullptr) << cache_group_name(kind);
  return *found;
}

// V4-Pro at 2^20 tokens in BF16: 30 CSA layers × (256 + 64) B/token + 31 HCA layers × 8 B/token
// = 30×320 MiB + 31×8 MiB = 9848 MiB = 9.62 GiB of growing history per sequence.
TEST(PlannerTest, ProBf16HistoryAtOneMillion) {
  const CapacityPlan plan =
      plan_capacity(ModelConfig::preset("v4-pro"), KvStorage::kBf16, IndexStorage::kBf16, kOneM);
  EXPECT_EQ(group(plan, CacheGroupKind::kC4Main).layers, 30);
  EXPECT_EQ(group(plan, CacheGroupKind::kC128Main).layers, 31);
  EXPECT_DOUBLE_EQ(group(plan, CacheGroupKind::kC4Main).layer_bytes_per_token, 256.0);
  EXPECT_DOUBLE_EQ(group(plan, CacheGroupKind::kC4Index).layer_bytes_per_token, 64.0);
  EXPECT_DOUBLE_EQ(group(plan, CacheGroupKind::kC128Main).layer_bytes_per_token, 8.0);
  EXPECT_EQ(group(plan, CacheGroupKind::kC4Main).data_bytes, 30 * 256 * kMiB);
  EXPECT_EQ(group(plan, CacheGroupKind::kC4Index).data_bytes, 30 * 64 * kMiB);
  EXPECT_EQ(group(plan, CacheGroupKind::kC128Main).data_bytes, 31 * 8 * kMiB);
  EXPECT_EQ(plan.history.data, 30 * 320 * kMiB + 31 * 8 * kMiB);
  EXPECT_EQ(plan.history.data, int64_t{10326376448});
  EXPECT_EQ(plan.history.reserved, plan.history.data);  // 2^20 tokens fill whole blocks
  EXPECT_NEAR(gib(plan.history.data), 9.62, 0.005);
  EXPECT_DOUBLE_EQ(plan.history_bytes_per_token, 30 * 320.0 + 31 * 8.0);
  EXPECT_NE(format_capacity_plan(plan).find("9.62 GiB"), std::string::npos) << format_capacity_plan(plan);
}

// V4-Flash at 2^20 tokens, FP8 main + FP4 index: CSA main 3.00 GiB, CSA index 357 MiB, HCA 91 MiB, rings 3
// MiB, total 3.44 GiB. The source rounds loosely: CSA main is 2.994 GiB exactly and the exact sum is 3.435
// GiB; its 3.44 is the sum of its rounded parts (3072 + 357 + 91 + 3 MiB = 3.440 GiB).
TEST(PlannerTest, FlashFp8Fp4AtOneMillion) {
  const CapacityPlan plan =
      plan_capacity(ModelConfig::preset("v4-flash"), KvStorage::kFp8, IndexStorage::kFp4, kOneM);
  const GroupPlan& c4_main = group(plan, CacheGroupKind::kC4Main);
  const GroupPlan& c4_index = group(plan, CacheGroupKind::kC4Index);
  const GroupPlan& c128 = group(plan, CacheGroupKind::kC128Main);
  const GroupPlan& swa = group(plan, CacheGroupKind::kSwaKv);
  EXPECT_EQ(c4_main.layers, 21);
  EXPECT_EQ(c128.layers, 20);
  EXPECT_EQ(swa.layers, 43);

  EXPECT_EQ(c4_main.data_bytes, int64_t{21} * (kOneM / 4) * 584);
  EXPECT_EQ(c4_main.data_bytes, int64_t{3214934016});
  EXPECT_NEAR(gib(c4_main.data_bytes), 3.00, 0.01);
  EXPECT_EQ(c4_index.data_bytes, int64_t{21} * (kOneM / 4) * 68);
  EXPECT_EQ(c4_index.data_bytes, 357 * kMiB);
  EXPECT_EQ(c128.data_bytes, int64_t{20} * (kOneM / 128) * 584);
  EXPECT_NEAR(mib(c128.data_bytes), 91.0, 0.5);        // 91.25 MiB
  EXPECT_EQ(swa.data_bytes, int64_t{43} * 128 * 584);  // the SWA window: 3.07 MiB
  EXPECT_NEAR(mib(swa.data_bytes), 3.0, 0.1);
  EXPECT_EQ(plan.window.data, swa.data_bytes);
  EXPECT_EQ(swa.blocks, 2);  // 2^20 is on a 64-token boundary: the window is exactly two blocks
  // Blocks hold each layer's FP8 region as the kernels lay it out: 64 entries · 584 B rounded up to 576 B = 37,440 B
  // (2 C128 entries: 1,168 → 1,728 B), so reserved exceeds the entries' bytes by the padding.
  EXPECT_EQ(plan.window.reserved, 2 * 43 * kFp8Region64);

  const int64_t history_and_rings = int64_t{3214934016} + 374341632 + 95682560 + 3214336;
  EXPECT_EQ(plan.history_and_window().data, history_and_rings);
  const int64_t reserved = int64_t{4096} * 21 * kFp8Region64 + 374341632 + int64_t{4096} * 20 * kFp8Region2 +
                           2 * 43 * kFp8Region64;
  EXPECT_EQ(reserved, int64_t{3739558272});
  EXPECT_EQ(plan.history_and_window().reserved, reserved);
  EXPECT_NEAR(gib(history_and_rings), 3.44, 0.01);
  EXPECT_NEAR((3072.0 + 357.0 + 91.0 + 3.0) / 1024.0, 3.44, 0.005);  // the source's sum of rounded parts

  const std::string text = format_capacity_plan(plan);
  for (const char* figure : {"357.00 MiB", "91.25 MiB", "3.07 MiB", "2.99 GiB", "3.43 GiB"})
    EXPECT_NE(text.find(figure), std::string::npos) << figure << "\n" << text;
}

// C4A = 584/4 + 132/4 = 179 B per token and CSA layer with an FP8 index; C128A = 584/128 ≈ 4.6 B.
TEST(PlannerTest, Fp8C4aBytesPerToken) {
  const CapacityPlan plan =
      plan_capacity(ModelConfig::preset("v4-flash"), KvStorage::kFp8, IndexStorage::kFp8, 4096);
  const double c4a = group(plan, CacheGroupKind::kC4Main).layer_bytes_per_token +
                     group(plan, CacheGroupKind::kC4Index).layer_bytes_per_token;
  EXPECT_DOUBLE_EQ(c4a, 179.0);
  EXPECT_DOUBLE_EQ(group(plan, CacheGroupKind::kC128Main).layer_bytes_per_token, 4.5625);
  EXPECT_DOUBLE_EQ(plan.history_bytes_per_token, 21 * 179.0 + 20 * 4.5625);
  EXPECT_NE(format_capacity_plan(plan).find("CSA (C4A) 179.00 B"), std::string::npos);
}

TEST(PlannerTest, EntrySizes) {
  const ModelConfig flash = ModelConfig::preset("v4-flash");
  const CapacityPlan fp8 = plan_capacity(flash, KvStorage::kFp8, IndexStorage::kFp8, 256);
  const CapacityPlan fp4 = plan_capacity(flash, KvStorage::kFp8, IndexStorage::kFp4, 256);
  const CapacityPlan bf16 = plan_capacity(flash, KvStorage::kBf16, IndexStorage::kBf16, 256);
  for (const CacheGroupKind kind :
       {CacheGroupKind::kSwaKv, CacheGroupKind::kC4Main, CacheGroupKind::kC128Main}) {
    EXPECT_EQ(group(fp8, kind).entry_bytes, 584) << cache_group_name(kind);
    EXPECT_EQ(group(bf16, kind).entry_bytes, 1024) << cache_group_name(kind);
  }
  EXPECT_EQ(group(fp8, CacheGroupKind::kC4Index).entry_bytes, 132);
  EXPECT_EQ(group(fp4, CacheGroupKind::kC4Index).entry_bytes, 68);
  EXPECT_EQ(group(bf16, CacheGroupKind::kC4Index).entry_bytes, 256);
}

// Compressor state is fixed per request: fp32 kv and gate of (2·4) slots × (2·512) channels for the CSA main
// compressor, (2·4) × (2·128) for the indexer's, 128 × 512 for HCA; one block per request.
TEST(PlannerTest, FixedPerRequestState) {
  for (const int64_t context : {int64_t{1}, int64_t{1000}, kOneM}) {
    const CapacityPlan plan =
        plan_capacity(ModelConfig::preset("v4-flash"), KvStorage::kFp8, IndexStorage::kFp4, context);
    const GroupPlan& main_state = group(plan, CacheGroupKind::kC4MainState);
    EXPECT_EQ(main_state.data_bytes, int64_t{21} * 8 * 1024 * 2 * 4);
    EXPECT_EQ(main_state.blocks, 1);
    EXPECT_EQ(main_state.reserved_bytes(), main_state.data_bytes);
    EXPECT_EQ(group(plan, CacheGroupKind::kC4IndexState).data_bytes, int64_t{21} * 8 * 256 * 2 * 4);
    EXPECT_EQ(group(plan, CacheGroupKind::kC128State).data_bytes, int64_t{20} * 128 * 512 * 2 * 4);
    EXPECT_EQ(plan.state.data, int64_t{1376256} + 344064 + 10485760);
    EXPECT_EQ(plan.state.reserved, plan.state.data);
  }
}

TEST(PlannerTest, BlocksCoverWhatIsHeld) {
  const ModelConfig flash = ModelConfig::preset("v4-flash");
  auto blocks = [&](int64_t context, CacheGroupKind kind) {
    return group(plan_capacity(flash, KvStorage::kFp8, IndexStorage::kFp4, context), kind).blocks;
  };
  // Window 128 in 64-token blocks: positions [max(0, T - 128), T).
  EXPECT_EQ(blocks(1, CacheGroupKind::kSwaKv), 1);
  EXPECT_EQ(blocks(100, CacheGroupKind::kSwaKv), 2);
  EXPECT_EQ(blocks(128, CacheGroupKind::kSwaKv), 2);
  EXPECT_EQ(blocks(130, CacheGroupKind::kSwaKv), 3);  // [2, 130): blocks 0, 1, 2
  EXPECT_EQ(blocks(192, CacheGroupKind::kSwaKv), 2);  // [64, 192): blocks 1, 2
  // History: only complete windows have entries; 64 C4 entries or 2 C128 entries per block.
  EXPECT_EQ(blocks(3, CacheGroupKind::kC4Main), 0);
  EXPECT_EQ(blocks(4, CacheGroupKind::kC4Main), 1);
  EXPECT_EQ(blocks(256, CacheGroupKind::kC4Main), 1);
  EXPECT_EQ(blocks(259, CacheGroupKind::kC4Main), 1);
  EXPECT_EQ(blocks(260, CacheGroupKind::kC4Main), 2);
  EXPECT_EQ(blocks(127, CacheGroupKind::kC128Main), 0);
  EXPECT_EQ(blocks(384, CacheGroupKind::kC128Main), 2);  // 3 entries
  const CapacityPlan plan = plan_capacity(flash, KvStorage::kFp8, IndexStorage::kFp4, 260);
  const GroupPlan& c4_main = group(plan, CacheGroupKind::kC4Main);
  EXPECT_EQ(c4_main.entries, 65);
  EXPECT_EQ(c4_main.data_bytes, 65 * 584 * 21);
  EXPECT_EQ(c4_main.block_bytes, kFp8Region64 * 21);
  EXPECT_EQ(c4_main.reserved_bytes(), 2 * kFp8Region64 * 21);
}

TEST(PlannerTest, MonotoneInContext) {
  for (const char* preset : {"v4-flash", "v4-pro", "tiny"}) {
    const ModelConfig config = ModelConfig::preset(preset);
    PlanBytes previous;
    int64_t previous_history_reserved = 0;
    for (int64_t context = 1; context <= 5000; context += 7) {
      const CapacityPlan plan = plan_capacity(config, KvStorage::kFp8, IndexStorage::kFp4, context);
      EXPECT_GE(plan.total().data, previous.data) << preset << " at " << context;
      EXPECT_GE(plan.history.reserved, previous_history_reserved) << preset << " at " << context;
      EXPECT_GE(plan.total().reserved, plan.total().data) << preset << " at " << context;
      // The ring's reservation is exact, so it is not monotone: a window that straddles a block boundary
      // takes one block more than one that starts on it. It never exceeds ceil(window / block) + 1 blocks.
      const GroupPlan& swa = group(plan, CacheGroupKind::kSwaKv);
      const int64_t block_tokens = swa.block_bytes / (swa.entry_bytes * swa.layers);
      EXPECT_LE(swa.blocks, (config.sliding_window + block_tokens - 1) / block_tokens + 1)
          << preset << " at " << context;
      // Complete windows only: the history never exceeds bytes/token × context.
      EXPECT_LE(static_cast<double>(plan.history.data),
                plan.history_bytes_per_token * static_cast<double>(context));
      previous = plan.total();
      previous_history_reserved = plan.history.reserved;
    }
  }
}

// 80 GiB for the cache, Flash FP8/FP4 at 2^20: 3,751,764,352 reserved bytes per request → 22 requests.
TEST(PlannerTest, RequestsThatFit) {
  const CapacityPlan plan =
      plan_capacity(ModelConfig::preset("v4-flash"), KvStorage::kFp8, IndexStorage::kFp4, kOneM, 80.0, 10);
  const int64_t per_request = int64_t{3739558272} + 12206080;
  EXPECT_EQ(plan.total().reserved, per_request);
  ASSERT_TRUE(plan.memory_bytes && plan.requests_fit && plan.requests_bytes);
  EXPECT_EQ(*plan.memory_bytes, 80 * kGiB);
  EXPECT_EQ(*plan.requests_fit, 80 * kGiB / per_request);
  EXPECT_EQ(*plan.requests_fit, 22);  // 85,899,345,920 / 3,751,764,352 = 22.9
  EXPECT_EQ(*plan.requests_bytes, 10 * per_request);
  // A budget one byte short of 22 requests fits 21.
  const double just_short = static_cast<double>(22 * per_request - 1) / static_cast<double>(kGiB);
  EXPECT_EQ(
      *plan_capacity(ModelConfig::preset("v4-flash"), KvStorage::kFp8, IndexStorage::kFp4, kOneM, just_short)
           .requests_fit,
      21);
  const std::string text = format_capacity_plan(plan);
  EXPECT_NE(text.find("22 requests of 1048576 tokens fit"), std::string::npos) << text;
  const nlohmann::json json = capacity_plan_to_json(plan);
  EXPECT_EQ(json["requests_fit"].get<int64_t>(), 22);
  EXPECT_EQ(json["total_per_request"]["reserved_bytes"].get<int64_t>(), per_request);
  EXPECT_EQ(json["groups"].size(), plan.groups.size());
}

TEST(PlannerTest, RejectsBadInput) {
  const ModelConfig flash = ModelConfig::preset("v4-flash");
  EXPECT_THROW(plan_capacity(flash, KvStorage::kFp8, IndexStorage::kFp4, 0), Error);
  EXPECT_THROW(plan_capacity(flash, KvStorage::kFp8, IndexStorage::kFp4, -5), Error);
  EXPECT_THROW(plan_capacity(flash, KvStorage::kFp8, IndexStorage::kFp4, 100, 0.0), Error);
  EXPECT_THROW(plan_capacity(flash, KvStorage::kFp8, IndexStorage::kFp4, 100, std::nullopt, 0), Error);
  EXPECT_THROW(plan_capacity(flash, KvStorage::kFp8, IndexStorage::kFp4, int64_t{1} << 62),
               Error);  // overflow
  try {
    parse_kv_storage("fp4", "--kv-dtype");
    FAIL() << "fp4 main storage accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--kv-dtype 'fp4'"), std::string::npos) << e.what();
  }
  try {
    parse_index_storage("int8", "--index-dtype");
    FAIL() << "int8 index storage accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--index-dtype 'int8'"), std::string::npos) << e.what();
  }
  EXPECT_EQ(parse_kv_storage("fp8", "--kv-dtype"), KvStorage::kFp8);
  EXPECT_EQ(parse_index_storage("fp4", "--index-dtype"), IndexStorage::kFp4);
  EXPECT_EQ(parse_token_count("1048576", "--context"), kOneM);
  EXPECT_EQ(parse_token_count("1M", "--context"), kOneM);
  EXPECT_EQ(parse_token_count("128K", "--context"), 128 * 1024);
  for (const char* bad : {"", "0", "-3", "1.5", "abc", "M", "99999999999999999999"})
    EXPECT_THROW(parse_token_count(bad, "--context"), Error) << bad;
}

}  // namespace
}  // namespace dsv4

// Weight memory: V4-Flash as released (FP8 dense, MXFP4 experts) is the 148.66 GiB checkpoint less its MTP layer
// (about 3.4 GB, which the engine does not load), perf_anchors.md §6.2; requantized experts at 3.5 / 2.5 bits
// leave room for the KV cache on one H200.
#include "cache/weight_plan.h"

namespace dsv4 {
namespace {

TEST(WeightPlan, V4FlashAsReleasedIsTheCheckpointLessMtp) {
  const WeightPlan plan = plan_weights(ModelConfig::preset("v4-flash"), {4.25, true});
  const double gib = static_cast<double>(plan.bytes) / double(int64_t{1} << 30);
  const double checkpoint_less_mtp = 148.66 - 3.4e9 / double(int64_t{1} << 30);
  EXPECT_NEAR(gib, checkpoint_less_mtp, 0.01 * checkpoint_less_mtp);
  // 43 layers × 256 experts × 3 × 4096 × 2048 routed parameters.
  EXPECT_EQ(plan.classes[0].params, int64_t{43} * 256 * 3 * 4096 * 2048);
  int64_t sum = 0;
  for (const WeightClass& c : plan.classes) sum += c.params;
  EXPECT_EQ(sum, plan.params);
}

// The router's gate is held in fp32 on the device (DeepSeek's reference computes the gate in fp32, model_spec §9.1):
// the fp32 class holds every layer's [E, D] gate besides the hc / sink / bias / ape tensors.
TEST(WeightPlan, RouterGateCountsAsFp32) {
  const ModelConfig config = ModelConfig::preset("v4-flash");
  const WeightPlan plan = plan_weights(config, {4.25, true});
  ASSERT_EQ(plan.classes[3].name, "fp32 tensors");
  const int64_t gates = config.num_hidden_layers * config.n_routed_experts * config.hidden_size;
  EXPECT_GE(plan.classes[3].params, gates);
  EXPECT_EQ(plan.classes[3].bytes, plan.classes[3].params * 4);
}

TEST(WeightPlan, FewerExpertBitsShrinkOnlyTheExperts) {
  const ModelConfig config = ModelConfig::preset("v4-flash");
  const WeightPlan released = plan_weights(config, {4.25, true}), q25 = plan_weights(config, {2.5, true});
  EXPECT_EQ(released.bytes - q25.bytes, released.classes[0].bytes - q25.classes[0].bytes);
  EXPECT_NEAR(static_cast<double>(q25.classes[0].bytes) / static_cast<double>(released.classes[0].bytes),
              2.5 / 4.25, 1e-6);
  const WeightPlan bf16_dense = plan_weights(config, {4.25, false});
  EXPECT_EQ(bf16_dense.classes[1].params, released.classes[1].params);
  EXPECT_GT(bf16_dense.classes[1].bytes, released.classes[1].bytes * 19 / 10);
}

TEST(WeightPlan, ParsesExpertBits) {
  EXPECT_DOUBLE_EQ(parse_expert_bits("fp4", "--expert-bits"), 4.25);
  EXPECT_DOUBLE_EQ(parse_expert_bits("2.5", "--expert-bits"), 2.5);
  EXPECT_DOUBLE_EQ(parse_expert_bits("bf16", "--expert-bits"), 16.0);
  EXPECT_THROW(parse_expert_bits("0.5", "--expert-bits"), Error);
  EXPECT_THROW(parse_expert_bits("3bits", "--expert-bits"), Error);
}

}  // namespace
}  // namespace dsv4
