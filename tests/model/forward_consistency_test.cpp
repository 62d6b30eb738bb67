// The forward's own invariants: any split into chunks gives the one-shot logits, and a batch of requests at
// different positions gives what each request gets alone.
#include <gtest/gtest.h>

#include <random>

#include "core/error.h"
#include "test_models.h"

namespace dsv4 {
namespace {

using testing::random_ids;
using testing::random_model;
using testing::relative_l2;
using testing::small_config;


Tensor run_chunks(DeepseekV4Model& model, const std::vector<int32_t>& ids, const std::vector<size_t>& chunks) {
  auto state = model.new_sequence_state();
  Tensor all({0});
  all.shape = {0, model.config().vocab_size};
  size_t offset = 0;
  for (const size_t length : chunks) {
    const SequenceChunk chunk{state.get(), std::span<const int32_t>(ids).subspan(offset, length)};
    const Tensor logits = model.forward(std::span(&chunk, 1), LogitsMode::kAllPositions);
    all.data.insert(all.data.end(), logits.data.begin(), logits.data.end());
    offset += length;
  }
  all.shape[0] = static_cast<int64_t>(offset);
  return all;
}

TEST(ForwardConsistency, AnyChunkingGivesTheOneShotLogits) {
  const ModelConfig config = small_config();
  DeepseekV4Model model = random_model(config, 11);
  const auto ids = random_ids(90, config.vocab_size, 3);
  const Tensor one_shot = run_chunks(model, ids, {ids.size()});
  std::mt19937 rng(5);
  for (int trial = 0; trial < 6; ++trial) {
    std::vector<size_t> chunks;
    for (size_t left = ids.size(); left > 0;) {
      const size_t length = std::min<size_t>(left, trial == 0 ? 1 : 1 + rng() % (trial * 7));
      chunks.push_back(length);
      left -= length;
    }
    const Tensor chunked = run_chunks(model, ids, chunks);
    EXPECT_LE(relative_l2(chunked.ptr(), one_shot.ptr(), one_shot.data.size()), 1e-5) << "trial " << trial;
  }
}

TEST(ForwardConsistency, ABatchEqualsEachRequestAlone) {
  const ModelConfig config = small_config();
  DeepseekV4Model model = random_model(config, 12);
  const auto a = random_ids(40, config.vocab_size, 1), b = random_ids(70, config.vocab_size, 2);
  const auto c = random_ids(5, config.vocab_size, 3);
  // Alone: prefixes, then one more chunk each.
  const Tensor a_alone = run_chunks(model, a, {30, 10});
  const Tensor b_alone = run_chunks(model, b, {17, 53});
  const Tensor c_alone = run_chunks(model, c, {5});
  // Together: the prefixes one by one, then the second chunks of a and b with all of c in one batch.
  auto sa = model.new_sequence_state(), sb = model.new_sequence_state(), sc = model.new_sequence_state();
  const SequenceChunk first[] = {{sa.get(), std::span<const int32_t>(a).first(30)},
                                 {sb.get(), std::span<const int32_t>(b).first(17)}};
  model.forward(first, LogitsMode::kAllPositions);
  const SequenceChunk second[] = {{sb.get(), std::span<const int32_t>(b).subspan(17)},
                                  {sc.get(), std::span<const int32_t>(c)},
                                  {sa.get(), std::span<const int32_t>(a).subspan(30)}};
  const Tensor together = model.forward(second, LogitsMode::kAllPositions);
  const int64_t V = config.vocab_size;
  EXPECT_LE(relative_l2(together.ptr(), b_alone.ptr() + 17 * V, 53 * V), 1e-6);
  EXPECT_LE(relative_l2(together.ptr() + 53 * V, c_alone.ptr(), 5 * V), 1e-6);
  EXPECT_LE(relative_l2(together.ptr() + 58 * V, a_alone.ptr() + 30 * V, 10 * V), 1e-6);
  // The last-token mode returns each request's final row.
  auto sd = model.new_sequence_state();
  const SequenceChunk last[] = {{sd.get(), std::span<const int32_t>(c)}};
  const Tensor final_row = model.forward(last, LogitsMode::kLastPerSequence);
  ASSERT_EQ(final_row.shape, (std::vector<int64_t>{1, V}));
  EXPECT_LE(relative_l2(final_row.ptr(), c_alone.ptr() + 4 * V, V), 1e-6);
}

TEST(ForwardConsistency, TheCompressedPathIsLive) {
  // A token far outside the window must still change the last logits (through CSA/HCA entries).
  const ModelConfig config = small_config();
  DeepseekV4Model model = random_model(config, 13);
  auto ids = random_ids(64, config.vocab_size, 4);
  const Tensor before = run_chunks(model, ids, {ids.size()});
  ids[2] = (ids[2] + 1) % config.vocab_size;
  const Tensor after = run_chunks(model, ids, {ids.size()});
  const int64_t V = config.vocab_size;
  EXPECT_GT(relative_l2(after.ptr() + 63 * V, before.ptr() + 63 * V, V), 1e-3);
}

TEST(ForwardConsistency, BadBatchesAreRejectedWithoutSideEffects) {
  const ModelConfig config = small_config();
  DeepseekV4Model model = random_model(config, 14);
  auto state = model.new_sequence_state();
  const std::vector<int32_t> bad = {1, 2, 97};
  const SequenceChunk chunk{state.get(), bad};
  EXPECT_THROW(model.forward(std::span(&chunk, 1), LogitsMode::kAllPositions), Error);
  EXPECT_EQ(state->num_tokens(), 0);
  const SequenceChunk empty{state.get(), {}};
  EXPECT_THROW(model.forward(std::span(&empty, 1), LogitsMode::kAllPositions), Error);
}

}  // namespace
}  // namespace dsv4
