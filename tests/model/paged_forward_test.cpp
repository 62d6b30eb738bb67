// The forward over the paged KV cache: the same logits as the contiguous reference state, chunk by chunk, and a
// prefix hit restored from a checkpoint gives exactly the logits of a cold run.
#include <gtest/gtest.h>

#include <random>

#include "engine/paged_sequence_state.h"
#include "test_models.h"

namespace dsv4 {
namespace {

using testing::random_ids;
using testing::random_model;
using testing::relative_l2;
using testing::small_config;

struct PagedRun {
  HybridKvCacheManager manager;
  KvArena arena;
  PagedRun(const ModelConfig& config, int64_t pool_bytes, bool prefix)
      : manager(CacheLayout::for_model(config, KvStorage::kF32, IndexStorage::kF32), pool_bytes,
                {prefix, 512, "test"}),
        arena(manager.pool().num_pages() * manager.pool().page_bytes()) {}

  // Feeds `tokens` from the request's computed length in chunks that end on 256-token boundaries when they can;
  // returns the logits of every position computed.
  std::vector<float> run(DeepseekV4Model& model, RequestId id, const std::vector<int32_t>& tokens, int64_t chunk) {
    const auto hit = manager.admit(id, tokens);
    EXPECT_TRUE(hit.has_value());
    arena.execute(manager.take_pending_copies());
    PagedSequenceState state(model.config(), manager, arena, id);
    std::vector<float> logits;
    int64_t done = *hit;
    while (done < static_cast<int64_t>(tokens.size())) {
      int64_t end = std::min<int64_t>(done + chunk, static_cast<int64_t>(tokens.size()));
      if (end / 256 * 256 > done) end = end / 256 * 256;  // a checkpoint at the last full block
      EXPECT_TRUE(manager.allocate(id, end - done));
      const SequenceChunk step{&state, std::span<const int32_t>(tokens).subspan(done, end - done)};
      const Tensor out = model.forward(std::span(&step, 1), LogitsMode::kAllPositions);
      logits.insert(logits.end(), out.data.begin(), out.data.end());
      manager.commit(id, tokens, end);
      arena.execute(manager.take_pending_copies());
      manager.check_invariants();
      done = end;
    }
    return logits;
  }
};

std::vector<float> contiguous(DeepseekV4Model& model, const std::vector<int32_t>& tokens) {
  auto state = model.new_sequence_state();
  const SequenceChunk chunk{state.get(), tokens};
  return model.forward(std::span(&chunk, 1), LogitsMode::kAllPositions).data;
}


TEST(PagedForward, MatchesTheContiguousState) {
  const ModelConfig config = small_config();
  DeepseekV4Model model = random_model(config, 21);
  const auto ids = random_ids(700, config.vocab_size, 5);
  const std::vector<float> expected = contiguous(model, ids);
  for (const int64_t chunk : {700, 97, 1}) {
    PagedRun paged(config, int64_t{32} << 20, false);
    const std::vector<float> logits = paged.run(model, 1, ids, chunk);
    ASSERT_EQ(logits.size(), expected.size());
    EXPECT_LE(relative_l2(logits.data(), expected.data(), expected.size()), 1e-5) << "chunk " << chunk;
  }
}

TEST(PagedForward, PrefixHitEqualsColdRun) {
  const ModelConfig config = small_config();
  DeepseekV4Model model = random_model(config, 22);
  PagedRun paged(config, int64_t{32} << 20, true);
  auto first = random_ids(900, config.vocab_size, 6);
  paged.run(model, 1, first, 300);  // checkpoints at 256 (rolling) then 512 (interval)
  paged.manager.release(1);
  // A second request shares the first 600 tokens, then diverges.
  auto second = std::vector<int32_t>(first.begin(), first.begin() + 600);
  const auto tail = random_ids(150, config.vocab_size, 7);
  second.insert(second.end(), tail.begin(), tail.end());
  const std::vector<float> hot = paged.run(model, 2, second, 4096);
  EXPECT_EQ(paged.manager.stats().prefix_hit_tokens, 512);
  const std::vector<float> cold = contiguous(model, second);
  const int64_t V = config.vocab_size;
  ASSERT_EQ(hot.size(), static_cast<size_t>((750 - 512) * V));
  EXPECT_LE(relative_l2(hot.data(), cold.data() + 512 * V, hot.size()), 1e-5);
}

}  // namespace
}  // namespace dsv4
