// The CPU model with expert parallelism (DeepseekV4Model::set_expert_parallel, docs/parallel.md): R ranks, one
// thread and one model each, every rank serving its own request, stepping together (a prefill in two chunks,
// then greedy decode steps). Each rank's logits must equal one model's, without expert parallelism, for the same
// request: to fp32 summation order (the routed experts' sum is taken per rank, then in rank order) and with the
// same greedy tokens. With one rank the sublayer's order is the single model's, so the logits are bitwise equal.
#include <gtest/gtest.h>

#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "../parallel/counting_communicator.h"
#include "core/error.h"
#include "engine/sampler.h"
#include "parallel/communicator.h"
#include "test_models.h"

namespace dsv4 {
namespace {

using testing::CountingCommunicator;
using testing::random_ids;
using testing::random_model;
using testing::relative_l2;
using testing::small_config;

// One request's steps on `model`: its prompt in two chunks, then `decode` greedy tokens; the logits of every step.
// Every rank runs the same number of steps, which is all the lockstep of the expert-parallel sublayers needs.
std::vector<std::vector<float>> run_request(DeepseekV4Model& model, const std::vector<int32_t>& prompt, int decode) {
  auto state = model.new_sequence_state();
  std::vector<int32_t> tokens = prompt;
  std::vector<std::vector<float>> logits;
  const size_t half = prompt.size() / 2;
  size_t done = 0;
  for (const size_t length : {half, prompt.size() - half}) {
    const SequenceChunk chunk{state.get(), std::span<const int32_t>(tokens).subspan(done, length)};
    logits.push_back(model.forward(std::span(&chunk, 1), LogitsMode::kLastPerSequence).data);
    done += length;
  }
  for (int step = 0; step < decode; ++step) {
    tokens.push_back(argmax_token(logits.back()));
    const SequenceChunk chunk{state.get(), std::span<const int32_t>(tokens).subspan(done, 1)};
    logits.push_back(model.forward(std::span(&chunk, 1), LogitsMode::kLastPerSequence).data);
    ++done;
  }
  return logits;
}

TEST(ExpertParallelForward, RanksEqualOneModel) {
  const ModelConfig config = small_config();  // 6 routed experts, top-2, hash and score-routed layers
  const int decode = 6;
  for (const int R : {1, 2, 3, 4}) {
    std::vector<std::vector<int32_t>> prompts;
    for (int r = 0; r < R; ++r)
      prompts.push_back(random_ids(9 + 7 * static_cast<size_t>(r), config.vocab_size, 30 + static_cast<uint32_t>(r)));
    // The reference: one model, all experts, each request on its own.
    std::vector<std::vector<std::vector<float>>> expected;
    {
      DeepseekV4Model single = random_model(config, 5);
      for (int r = 0; r < R; ++r) expected.push_back(run_request(single, prompts[r], decode));
    }
    parallel::InProcessGroup group(R);
    std::vector<std::vector<std::vector<float>>> actual(static_cast<size_t>(R));
    std::vector<std::string> errors(static_cast<size_t>(R));
    std::vector<int64_t> collectives(static_cast<size_t>(R)), bytes_from_others(static_cast<size_t>(R));
    std::vector<std::thread> threads;
    for (int r = 0; r < R; ++r)
      threads.emplace_back([&, r] {
        try {
          DeepseekV4Model model = random_model(config, 5);
          CountingCommunicator comm(group.communicator(r));
          model.set_expert_parallel(&comm);
          actual[r] = run_request(model, prompts[r], decode);
          collectives[r] = comm.collectives;
          bytes_from_others[r] = comm.bytes_from_others;
        } catch (const std::exception& error) {
          errors[r] = error.what();
        }
      });
    for (std::thread& thread : threads) thread.join();
    int64_t crossed = 0;
    for (int r = 0; r < R; ++r) crossed += bytes_from_others[r];
    if (R > 1) {
      EXPECT_GT(crossed, 0) << "no row crossed ranks";
    }
    for (int r = 0; r < R; ++r) {
      ASSERT_EQ(errors[r], "") << R << " ranks, rank " << r;
      // 5 collectives (counts, rows, routes, weights, return) per MoE sublayer and step.
      EXPECT_EQ(collectives[r], 5 * config.num_hidden_layers * static_cast<int64_t>(expected[r].size())) << r;
      ASSERT_EQ(actual[r].size(), expected[r].size());
      for (size_t step = 0; step < expected[r].size(); ++step) {
        const std::vector<float>& e = expected[r][step];
        const std::vector<float>& a = actual[r][step];
        if (R == 1) {
          EXPECT_EQ(a, e) << "one rank, step " << step;
        } else {
          EXPECT_LE(relative_l2(a.data(), e.data(), e.size()), 1e-5) << R << " ranks, rank " << r << ", step " << step;
          EXPECT_EQ(argmax_token(a), argmax_token(e))
              << R << " ranks, rank " << r << ", step " << step;
        }
      }
    }
  }
}

// A rank with nothing to run still takes part: an empty batch runs every sublayer's collectives with no tokens.
// Rank 0 serves a request for 10 steps while rank 1 is idle for its first 4 and serves a shorter one after.
TEST(ExpertParallelForward, AnIdleRankStepsWithAnEmptyBatch) {
  const ModelConfig config = small_config();
  const std::vector<int32_t> prompt0 = random_ids(12, config.vocab_size, 51), prompt1 = random_ids(5, config.vocab_size, 52);
  const int decode0 = 8, decode1 = 4;  // rank 0: 2 prefill + 8 decode steps; rank 1: 4 idle + 2 + 4
  std::vector<std::vector<float>> expected0, expected1;
  {
    DeepseekV4Model single = random_model(config, 5);
    expected0 = run_request(single, prompt0, decode0);
    expected1 = run_request(single, prompt1, decode1);
  }
  parallel::InProcessGroup group(2);
  std::vector<std::vector<float>> actual0, actual1;
  std::vector<std::string> errors(2);
  std::vector<Tensor> idle_logits;
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      try {
        DeepseekV4Model model = random_model(config, 5);
        const std::unique_ptr<parallel::Communicator> comm = group.communicator(r);
        model.set_expert_parallel(comm.get());
        if (r == 0) {
          actual0 = run_request(model, prompt0, decode0);
        } else {
          for (int idle = 0; idle < 4; ++idle)
            idle_logits.push_back(model.forward(std::span<const SequenceChunk>(), LogitsMode::kLastPerSequence));
          actual1 = run_request(model, prompt1, decode1);
        }
      } catch (const std::exception& error) {
        errors[r] = error.what();
      }
    });
  for (std::thread& thread : threads) thread.join();
  ASSERT_EQ(errors[0], "");
  ASSERT_EQ(errors[1], "");
  for (const Tensor& logits : idle_logits) EXPECT_EQ(logits.data.size(), 0u) << "an empty batch has no logits";
  ASSERT_EQ(actual0.size(), expected0.size());
  ASSERT_EQ(actual1.size(), expected1.size());
  for (size_t step = 0; step < expected0.size(); ++step)
    EXPECT_LE(relative_l2(actual0[step].data(), expected0[step].data(), expected0[step].size()), 1e-5) << step;
  for (size_t step = 0; step < expected1.size(); ++step)
    EXPECT_LE(relative_l2(actual1[step].data(), expected1[step].data(), expected1[step].size()), 1e-5) << step;
}

TEST(ExpertParallelForward, RefusesWhatItCannotRun) {
  ModelConfig config = small_config();
  parallel::InProcessGroup seven(7);  // more ranks than the 6 routed experts
  auto comm = seven.communicator(0);
  DeepseekV4Model model = random_model(config, 5);
  EXPECT_THROW(model.set_expert_parallel(comm.get()), Error);
  config.numerics = Numerics::kDeepSeek;
  DeepseekV4Model deepseek = random_model(config, 5);
  parallel::InProcessGroup two(2);
  auto other = two.communicator(0);
  EXPECT_THROW(deepseek.set_expert_parallel(other.get()), Error);
  // Dropping the other ranks' experts needs expert parallelism, and leaves no way back to all experts here.
  EXPECT_THROW(model.drop_remote_experts(), Error);
  model.set_expert_parallel(other.get());
  model.drop_remote_experts();
  EXPECT_THROW(model.set_expert_parallel(nullptr), Error);
  auto second = two.communicator(1);
  EXPECT_THROW(model.set_expert_parallel(second.get()), Error);  // another rank's partition
}

// A rank that dropped the other ranks' experts computes what it computed holding them all: they were never used.
TEST(ExpertParallelForward, DroppingRemoteExpertsChangesNothing) {
  const ModelConfig config = small_config();
  const std::vector<int32_t> prompt = random_ids(11, config.vocab_size, 61);
  auto run = [&](bool drop) {
    parallel::InProcessGroup group(2);
    std::vector<std::vector<std::vector<float>>> logits(2);  // per rank, per step
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r)
      threads.emplace_back([&, r] {
        DeepseekV4Model model = random_model(config, 5);
        auto comm = group.communicator(r);
        model.set_expert_parallel(comm.get());
        if (drop) model.drop_remote_experts();
        logits[r] = run_request(model, prompt, 3);
      });
    for (std::thread& thread : threads) thread.join();
    return logits;
  };
  EXPECT_EQ(run(true), run(false)) << "dropping the remote experts changed the logits";
}

}  // namespace
}  // namespace dsv4
