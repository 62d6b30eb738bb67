// The engine end to end on a small random model: greedy outputs of a mixed batch (chunked prefills, decodes,
// prefix hits) equal each request run alone, forced preemption does not change them, aborts free blocks, and
// requests that can never run are rejected with the numbers.
#include "engine/engine.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <random>

#include "../model/test_models.h"
#include "core/error.h"
#include "engine/paged_sequence_state.h"

namespace dsv4 {
namespace {

using ::testing::HasSubstr;
using testing::random_model;
using testing::small_config;

std::vector<int32_t> random_ids(size_t n, int64_t vocab, std::mt19937& rng) {
  std::vector<int32_t> ids(n);
  for (auto& id : ids) id = static_cast<int32_t>(rng() % vocab);
  return ids;
}

struct EngineRun {
  std::map<RequestId, std::vector<int32_t>> tokens;
  std::map<RequestId, RequestStatus> status;
  int64_t steps = 0, mixed_steps = 0;
};

// One step: collects the outputs, counts steps that mixed a decode with a prefill chunk, checks invariants.
void step(Engine& engine, EngineRun& run) {
  for (const RequestOutput& output : engine.step()) {
    auto& tokens = run.tokens[output.id];
    tokens.insert(tokens.end(), output.new_token_ids.begin(), output.new_token_ids.end());
    if (output.finished) run.status[output.id] = output.status;
    EXPECT_TRUE(output.error.empty()) << output.error;
  }
  bool decode = false, prefill = false;
  for (const ScheduledChunk& chunk : engine.last_scheduled().scheduled)
    (chunk.num_tokens == 1 && chunk.samples ? decode : prefill) = true;
  run.mixed_steps += decode && prefill;
  engine.cache().check_invariants();
  engine.scheduler().check_invariants();
  ++run.steps;
}

// Steps until nothing is unfinished.
void drain(Engine& engine, EngineRun& run, int64_t max_steps = 100000) {
  while (engine.has_unfinished() && run.steps < max_steps) step(engine, run);
  ASSERT_FALSE(engine.has_unfinished()) << "not finished after " << max_steps << " steps";
}

struct Case {
  std::vector<int32_t> prompt;
  SamplingParams params;
};

std::vector<Case> mixed_cases(int64_t vocab) {
  std::mt19937 rng(7);
  const auto shared = random_ids(512 + 40, vocab, rng);  // crosses two logical blocks
  std::vector<Case> cases;
  auto add = [&](std::vector<int32_t> prompt, int64_t max_tokens, bool ignore_eos) {
    SamplingParams params;
    params.max_tokens = max_tokens;
    params.ignore_eos = ignore_eos;
    cases.push_back({std::move(prompt), params});
  };
  add(random_ids(1, vocab, rng), 12, true);
  add(random_ids(5, vocab, rng), 20, false);
  add(random_ids(41, vocab, rng), 9, true);
  add(random_ids(300, vocab, rng), 15, true);
  add(random_ids(700, vocab, rng), 6, true);
  for (int i = 0; i < 3; ++i) {  // a shared prefix with different tails: prefix hits at 256 / 512
    auto prompt = shared;
    const auto tail = random_ids(1 + 30 * i, vocab, rng);
    prompt.insert(prompt.end(), tail.begin(), tail.end());
    add(prompt, 8 + i, true);
  }
  add(shared, 10, true);  // the same prompt again
  add(shared, 10, true);
  return cases;
}

// Each case in its own engine, alone, one chunk per prefill, no prefix cache.
std::vector<std::vector<int32_t>> alone(DeepseekV4Model& model, const std::vector<Case>& cases,
                                        std::vector<RequestStatus>* statuses = nullptr) {
  std::vector<std::vector<int32_t>> outputs;
  for (const Case& c : cases) {
    EngineConfig config;
    config.max_num_batched_tokens = 4096;
    config.enable_prefix_caching = false;
    config.kv_cache_bytes = int64_t{64} << 20;
    Engine engine(model, config);
    const RequestId id = engine.add_request(c.prompt, c.params);
    EngineRun run;
    drain(engine, run);
    outputs.push_back(run.tokens[id]);
    if (statuses) statuses->push_back(run.status[id]);
  }
  return outputs;
}

int64_t page_bytes(DeepseekV4Model& model) {
  EngineConfig config;
  config.kv_cache_bytes = int64_t{64} << 20;
  return Engine(model, config).cache().pool().page_bytes();
}

TEST(Engine, MixedBatchEqualsEachRequestAlone) {
  const ModelConfig config = small_config();
  DeepseekV4Model model = random_model(config, 21);
  const auto cases = mixed_cases(config.vocab_size);
  std::vector<RequestStatus> statuses;
  const auto expected = alone(model, cases, &statuses);

  EngineConfig engine_config;
  engine_config.max_num_batched_tokens = 96;  // chunked prefills mixed with decodes in most steps
  engine_config.checkpoint_interval = 256;
  engine_config.kv_cache_bytes = int64_t{64} << 20;
  Engine engine(model, engine_config);  // the paged state in the engine's own arena
  std::vector<RequestId> ids;
  EngineRun run;
  for (size_t i = 0; i < cases.size(); ++i) {
    ids.push_back(engine.add_request(cases[i].prompt, cases[i].params));
    // Staggered arrivals: some requests arrive while others decode, the repeats after the first has finished.
    if (i % 3 == 2 || i + 1 >= cases.size() - 1)
      for (int s = 0; s < 40 && engine.has_unfinished(); ++s) step(engine, run);
  }
  drain(engine, run);
  for (size_t i = 0; i < cases.size(); ++i) {
    EXPECT_EQ(run.tokens[ids[i]], expected[i]) << "request " << i << " of " << cases[i].prompt.size() << " tokens";
    EXPECT_EQ(run.status[ids[i]], statuses[i]) << "request " << i;
  }
  EXPECT_GT(run.mixed_steps, 10) << "decodes and prefill chunks never shared a step";
  for (const auto& output : expected) EXPECT_GE(output.size(), 5u) << "eos too early to compare much";
  EXPECT_GT(engine.cache().stats().prefix_hit_tokens, 0) << "the shared prefix never hit";
  EXPECT_EQ(engine.runner().num_recomputed_tokens(), 0) << "the paged state restores every prefix hit";
  EXPECT_EQ(engine.runner().num_states(), 0) << "finished requests keep model state";
  EXPECT_EQ(engine.cache().pool().usage().used_block_bytes, 0);
}

// Six long requests that an 8-page pool cannot hold at once.
std::vector<Case> long_cases(int64_t vocab) {
  std::mt19937 rng(8);
  std::vector<Case> cases;
  for (int i = 0; i < 6; ++i) {
    SamplingParams params;
    params.max_tokens = 40;
    params.ignore_eos = true;
    cases.push_back({random_ids(400 + 97 * static_cast<size_t>(i), vocab, rng), params});
  }
  return cases;
}

TEST(Engine, PreemptionGivesTheUndisturbedOutputs) {
  const ModelConfig config = small_config();
  DeepseekV4Model model = random_model(config, 22);
  const auto cases = long_cases(config.vocab_size);
  const auto expected = alone(model, cases);
  for (const bool prefix_caching : {false, true}) {
    SCOPED_TRACE(prefix_caching ? "prefix caching" : "no prefix caching");
    EngineConfig engine_config;
    engine_config.max_num_batched_tokens = 128;
    engine_config.enable_prefix_caching = prefix_caching;
    engine_config.checkpoint_interval = 256;
    // One page per cache group and one to share: the C4 history of three of these requests already overflows it.
    engine_config.kv_cache_bytes = 8 * page_bytes(model);
    Engine engine(model, engine_config);
    std::vector<RequestId> ids;
    for (const Case& c : cases) ids.push_back(engine.add_request(c.prompt, c.params));
    EngineRun run;
    drain(engine, run);
    EXPECT_GT(engine.scheduler().num_preemptions(), 0) << "the pool never ran short";
    for (size_t i = 0; i < cases.size(); ++i) EXPECT_EQ(run.tokens[ids[i]], expected[i]) << "request " << i;
    const auto usage = engine.cache().pool().usage();
    EXPECT_EQ(usage.used_block_bytes, 0);
    if (!prefix_caching) {
      EXPECT_EQ(usage.free_page_bytes, usage.pool_bytes);
    }
  }
}

// The seam: PagedSequenceState bound by hand through the runner's two callbacks to a test-owned arena (what the
// engine does by default). Prefix hits are restored by the copies instead of recomputed, and blocks are reused
// across requests (small pool, preemption, eviction).
TEST(Engine, PagedStateThroughTheRunnerSeamGivesTheSameOutputs) {
  const ModelConfig config = small_config();
  DeepseekV4Model model = random_model(config, 21);
  for (const bool small_pool : {false, true}) {
    SCOPED_TRACE(small_pool ? "long requests, 8-page pool" : "mixed requests, large pool");
    const auto cases = small_pool ? long_cases(config.vocab_size) : mixed_cases(config.vocab_size);
    const auto expected = alone(model, cases);
    EngineConfig engine_config;
    engine_config.max_num_batched_tokens = small_pool ? 128 : 96;
    engine_config.checkpoint_interval = 256;
    engine_config.kv_cache_bytes = small_pool ? 8 * page_bytes(model) : int64_t{64} << 20;
    Engine engine(model, engine_config);
    KvArena arena(engine.cache().pool().num_pages() * engine.cache().pool().page_bytes());
    engine.runner().set_state_factory([&](const ScheduledChunk& chunk) {
      return std::make_unique<PagedSequenceState>(model.config(), engine.cache(), arena, chunk.id);
    });
    engine.runner().set_copy_executor(
        [&](std::span<const BlockCopy> copies) { arena.execute({copies.begin(), copies.end()}); });
    std::vector<RequestId> ids;
    EngineRun run;
    for (size_t i = 0; i < cases.size(); ++i) {
      ids.push_back(engine.add_request(cases[i].prompt, cases[i].params));
      if (!small_pool && (i % 3 == 2 || i + 1 >= cases.size() - 1))
        for (int s = 0; s < 40 && engine.has_unfinished(); ++s) step(engine, run);
    }
    drain(engine, run);
    for (size_t i = 0; i < cases.size(); ++i)
      EXPECT_EQ(run.tokens[ids[i]], expected[i]) << "request " << i << " of " << cases[i].prompt.size() << " tokens";
    EXPECT_EQ(engine.runner().num_recomputed_tokens(), 0) << "the paged state restores every prefix hit";
    if (small_pool) {
      EXPECT_GT(engine.scheduler().num_preemptions(), 0);
    } else {
      EXPECT_GT(engine.cache().stats().prefix_hit_tokens, 0);
    }
  }
}

TEST(Engine, AbortMidRunFreesBlocks) {
  const ModelConfig config = small_config();
  DeepseekV4Model model = random_model(config, 23);
  std::mt19937 rng(9);
  EngineConfig engine_config;
  engine_config.max_num_batched_tokens = 64;
  engine_config.enable_prefix_caching = false;
  engine_config.kv_cache_bytes = int64_t{16} << 20;
  Engine engine(model, engine_config);
  SamplingParams params;
  params.max_tokens = 50;
  params.ignore_eos = true;
  const RequestId a = engine.add_request(random_ids(300, config.vocab_size, rng), params);
  const RequestId b = engine.add_request(random_ids(20, config.vocab_size, rng), params);
  const RequestId c = engine.add_request(random_ids(20, config.vocab_size, rng), params);
  for (int i = 0; i < 3; ++i) engine.step();  // a mid-prefill (64-token chunks); b, c wait or start
  ASSERT_TRUE(engine.cache().has_request(a));
  const int64_t used = engine.cache().pool().usage().used_block_bytes;
  EXPECT_TRUE(engine.abort(a));
  EXPECT_FALSE(engine.cache().has_request(a));
  EXPECT_LT(engine.cache().pool().usage().used_block_bytes, used);
  EXPECT_FALSE(engine.abort(a));
  EngineRun run;
  for (int i = 0; i < 10; ++i)
    for (const RequestOutput& output : engine.step()) EXPECT_NE(output.id, a) << "output for an aborted request";
  EXPECT_TRUE(engine.abort(b));
  drain(engine, run);
  EXPECT_EQ(run.status[c], RequestStatus::kFinishedLength);
  EXPECT_EQ(engine.runner().num_states(), 0);
  const auto usage = engine.cache().pool().usage();
  EXPECT_EQ(usage.used_block_bytes, 0);
  EXPECT_EQ(usage.free_page_bytes, usage.pool_bytes);
}

TEST(Engine, RejectsRequestsThatCanNeverRunNamingTheNumbers) {
  const ModelConfig config = small_config();
  DeepseekV4Model model = random_model(config, 24);
  std::mt19937 rng(10);
  EngineConfig engine_config;
  engine_config.max_model_len = 100;
  engine_config.kv_cache_bytes = int64_t{16} << 20;
  Engine engine(model, engine_config);
  SamplingParams params;
  params.max_tokens = 20;
  try {
    engine.add_request(random_ids(90, config.vocab_size, rng), params);
    FAIL() << "accepted 90 + 20 tokens with max_model_len 100";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("90 tokens"));
    EXPECT_THAT(e.what(), HasSubstr("max_tokens 20"));
    EXPECT_THAT(e.what(), HasSubstr("max_model_len 100"));
  }
  try {
    engine.add_request({1, 2, 97}, params);
    FAIL() << "accepted a token outside the vocabulary";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("97"));
  }
  EXPECT_THROW(engine.add_request({}, params), Error);
  EXPECT_FALSE(engine.has_unfinished()) << "a rejected request was queued";
  // Larger than the whole pool.
  EngineConfig tiny_pool = engine_config;
  tiny_pool.max_model_len = 0;
  tiny_pool.kv_cache_bytes = 8 * page_bytes(model);
  Engine small(model, tiny_pool);
  try {
    small.add_request(random_ids(5000, config.vocab_size, rng), params);
    FAIL() << "accepted a request larger than the pool";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("5020 tokens"));
    EXPECT_THAT(e.what(), HasSubstr(std::to_string(tiny_pool.kv_cache_bytes) + " bytes"));
  }
  // An accepted request still runs.
  params.max_tokens = 3;
  const RequestId id = engine.add_request(random_ids(10, config.vocab_size, rng), params);
  EngineRun run;
  drain(engine, run);
  EXPECT_TRUE(run.status.count(id));
}

}  // namespace
}  // namespace dsv4
