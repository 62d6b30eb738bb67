// EngineService (server/engine_service.h) on a small random model with the real tokenizer: the tokens and text
// it streams equal the Engine run directly, a cancel frees the request's blocks, the queue bound answers 503,
// and a request the engine can never run comes back as a 400 without disturbing the others.
#include "server/engine_service.h"

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <random>

#include "../engine/fault_injecting_backends.h"
#include "../model/test_models.h"
#include "../tokenizer/deepseek_tokenizer.h"
#include "engine/data_parallel_engine.h"

namespace dsv4::server {
namespace {

using dsv4::testing::FaultInjectingBackend;
using dsv4::testing::random_ids;
using dsv4::testing::random_model;
using dsv4::testing::small_config;

// Collects every update of one job; wait() blocks until the job is done.
struct Collector {
  std::mutex mutex;
  std::condition_variable done_cv;
  std::vector<JobUpdate> updates;
  bool done = false;
  std::map<int64_t, std::vector<int32_t>> tokens;
  std::map<int64_t, std::string> text;
  std::map<int64_t, std::string> finish;
  int error_status = 0;
  std::string error;

  JobListener listener() {
    return [this](JobUpdate update) {
      std::lock_guard lock(mutex);
      for (const auto& choice : update.choices) {
        tokens[choice.index].insert(tokens[choice.index].end(), choice.token_ids.begin(), choice.token_ids.end());
        text[choice.index] += choice.text;
        if (choice.finish_reason) finish[choice.index] = *choice.finish_reason;
      }
      if (update.error_status) {
        error_status = update.error_status;
        error = update.error;
      }
      if (update.done) done = true;
      updates.push_back(std::move(update));
      done_cv.notify_all();
    };
  }
  bool wait(std::chrono::seconds limit = std::chrono::seconds(60)) {
    std::unique_lock lock(mutex);
    return done_cv.wait_for(lock, limit, [this] { return done; });
  }
  size_t token_count() {
    std::lock_guard lock(mutex);
    size_t n = 0;
    for (const auto& [index, ids] : tokens) n += ids.size();
    return n;
  }
};

EngineConfig small_engine() {
  EngineConfig config;
  config.max_num_seqs = 8;
  config.max_num_batched_tokens = 64;
  config.kv_cache_bytes = int64_t{64} << 20;
  return config;
}

TEST(EngineService, StreamsWhatTheEngineComputes) {
  REQUIRE_DEEPSEEK();
  const ModelConfig config = small_config();
  DeepseekV4Model model = random_model(config, 5);
  std::mt19937 rng(11);
  std::vector<std::vector<int32_t>> prompts;
  std::vector<int64_t> lengths;
  for (int i = 0; i < 4; ++i) {
    prompts.push_back(random_ids(3 + rng() % 40, config.vocab_size, 100 + i));
    lengths.push_back(1 + rng() % 20);
  }
  // The reference: each request alone in a fresh engine.
  std::vector<std::vector<int32_t>> expected;
  for (size_t i = 0; i < prompts.size(); ++i) {
    Engine engine(model, small_engine());
    SamplingParams params;
    params.max_tokens = lengths[i];
    engine.add_request(prompts[i], params);
    std::vector<int32_t> out;
    while (engine.has_unfinished())
      for (const auto& output : engine.step()) out.insert(out.end(), output.new_token_ids.begin(), output.new_token_ids.end());
    expected.push_back(out);
  }
  ServerMetrics metrics;
  EngineService service(model, *tok, small_engine(), {}, metrics);
  std::vector<std::unique_ptr<Collector>> collectors;
  for (size_t i = 0; i < prompts.size(); ++i) {
    JobSpec spec;
    spec.choices.push_back({prompts[i], SamplingParams{}, 0});
    spec.choices[0].params.max_tokens = lengths[i];
    collectors.push_back(std::make_unique<Collector>());
    service.submit(std::move(spec), collectors.back()->listener());
  }
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_TRUE(collectors[i]->wait());
    Collector& c = *collectors[i];
    EXPECT_TRUE(c.updates.front().accepted);
    EXPECT_EQ(c.tokens[0], expected[i]) << "request " << i;
    EXPECT_EQ(c.text[0], tok->decode(expected[i], /*skip_special_tokens=*/true));
    EXPECT_TRUE(c.finish[0] == "length" || c.finish[0] == "stop");
    const Usage& usage = c.updates.back().usage;
    EXPECT_EQ(usage.prompt_tokens, static_cast<int64_t>(prompts[i].size()));
    EXPECT_EQ(usage.completion_tokens, static_cast<int64_t>(expected[i].size()));
  }
  EXPECT_EQ(service.active_jobs(), 0);
  EXPECT_EQ(metrics.time_to_first_token.count(), prompts.size());
}

// The service over a DataParallelEngine (dsv4 serve --data-parallel-size 3): the same jobs stream the same
// tokens and text as a single Engine computes, an impossible request is still a 400, and the gauges sum the
// ranks.
TEST(EngineService, DataParallelEngineStreamsWhatASingleEngineComputes) {
  REQUIRE_DEEPSEEK();
  const ModelConfig config = small_config();
  DeepseekV4Model model = random_model(config, 8);
  std::mt19937 rng(13);
  std::vector<std::vector<int32_t>> prompts;
  std::vector<int64_t> lengths;
  const std::vector<int32_t> shared = random_ids(300, config.vocab_size, 77);
  for (int i = 0; i < 9; ++i) {
    std::vector<int32_t> prompt = i % 3 == 0 ? shared : std::vector<int32_t>{};
    const auto tail = random_ids(3 + rng() % 40, config.vocab_size, 200 + i);
    prompt.insert(prompt.end(), tail.begin(), tail.end());
    prompts.push_back(prompt);
    lengths.push_back(2 + rng() % 16);
  }
  std::vector<std::vector<int32_t>> expected;
  {
    Engine engine(model, small_engine());
    std::map<RequestId, std::vector<int32_t>> out;
    std::vector<RequestId> ids;
    for (size_t i = 0; i < prompts.size(); ++i) {
      SamplingParams params;
      params.max_tokens = lengths[i];
      ids.push_back(engine.add_request(prompts[i], params));
    }
    while (engine.has_unfinished())
      for (const auto& output : engine.step())
        out[output.id].insert(out[output.id].end(), output.new_token_ids.begin(), output.new_token_ids.end());
    for (const RequestId id : ids) expected.push_back(out[id]);
  }
  std::vector<std::unique_ptr<ModelBackend>> backends;
  std::vector<ModelBackend*> ranks;
  for (int r = 0; r < 3; ++r) {
    backends.push_back(std::make_unique<CpuModelBackend>(model));
    ranks.push_back(backends.back().get());
  }
  ServerMetrics metrics;
  EngineService service(std::make_unique<DataParallelEngine>(ranks, small_engine()), *tok, {}, metrics);
  EXPECT_EQ(service.max_model_len(), config.max_position_embeddings);
  std::vector<std::unique_ptr<Collector>> collectors;
  for (size_t i = 0; i < prompts.size(); ++i) {
    JobSpec spec;
    spec.choices.push_back({prompts[i], SamplingParams{}, 0});
    spec.choices[0].params.max_tokens = lengths[i];
    collectors.push_back(std::make_unique<Collector>());
    service.submit(std::move(spec), collectors.back()->listener());
  }
  JobSpec impossible;
  impossible.choices.push_back({random_ids(10, config.vocab_size, 5), SamplingParams{}, 0});
  impossible.choices[0].params.max_tokens = config.max_position_embeddings;
  Collector rejected;
  service.submit(impossible, rejected.listener());
  for (size_t i = 0; i < prompts.size(); ++i) {
    ASSERT_TRUE(collectors[i]->wait()) << "job " << i << " never finished";
    Collector& c = *collectors[i];
    EXPECT_TRUE(c.updates.front().accepted);
    EXPECT_EQ(c.tokens[0], expected[i]) << "request " << i;
    EXPECT_EQ(c.text[0], tok->decode(expected[i], /*skip_special_tokens=*/true));
    EXPECT_EQ(c.updates.back().usage.completion_tokens, static_cast<int64_t>(expected[i].size()));
  }
  ASSERT_TRUE(rejected.wait());
  EXPECT_EQ(rejected.updates.front().error_status, 400);
  EXPECT_EQ(service.active_jobs(), 0);
  EXPECT_EQ(metrics.time_to_first_token.count(), prompts.size());
  const int64_t one_pool = Engine(model, small_engine()).stats().pool_bytes;
  EXPECT_EQ(metrics.engine().pool_bytes, 3 * one_pool);
}

// A rank failing under the server: every job still finishes (none hangs); the failed rank's choices end with
// finish_reason "abort" and an HTTP 500 error naming the engine failure, are counted as errors, every other
// job streams what a single Engine computes, and the service goes on taking jobs.
TEST(EngineService, AFailedDataParallelRankAbortsItsJobsAndTheOthersComplete) {
  REQUIRE_DEEPSEEK();
  const ModelConfig config = small_config();
  DeepseekV4Model model = random_model(config, 9);
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 9; ++i) prompts.push_back(random_ids(100 + 13 * i, config.vocab_size, 300 + i));
  SamplingParams params;
  params.max_tokens = 6;
  params.ignore_eos = true;
  std::vector<std::vector<int32_t>> expected;
  for (const auto& prompt : prompts) {
    Engine engine(model, small_engine());
    engine.add_request(prompt, params);
    std::vector<int32_t> out;
    while (engine.has_unfinished())
      for (const auto& output : engine.step())
        out.insert(out.end(), output.new_token_ids.begin(), output.new_token_ids.end());
    expected.push_back(out);
  }
  CpuModelBackend rank0(model), rank2(model);
  FaultInjectingBackend rank1(model, /*fail_at=*/2);
  ServerMetrics metrics;
  EngineService service(std::make_unique<DataParallelEngine>(std::vector<ModelBackend*>{&rank0, &rank1, &rank2},
                                                             small_engine()),
                        *tok, {}, metrics);
  auto run_jobs = [&](size_t first, size_t count) {
    std::vector<std::unique_ptr<Collector>> collectors;
    for (size_t i = first; i < first + count; ++i) {
      JobSpec spec;
      spec.choices.push_back({prompts[i], params, 0});
      collectors.push_back(std::make_unique<Collector>());
      service.submit(std::move(spec), collectors.back()->listener());
    }
    int64_t aborted = 0;
    for (size_t j = 0; j < count; ++j) {
      Collector& c = *collectors[j];
      EXPECT_TRUE(c.wait(std::chrono::seconds(120))) << "job " << first + j << " hung";
      if (c.finish[0] == "abort") {
        ++aborted;
        EXPECT_LT(c.tokens[0].size(), expected[first + j].size());
        // The client is told why (HTTP 500 / an error event), not just finish_reason "abort".
        EXPECT_EQ(c.error_status, 500) << "job " << first + j;
        EXPECT_NE(c.error.find("the engine failed this request"), std::string::npos) << c.error;
      } else {
        EXPECT_EQ(c.tokens[0], expected[first + j]) << "job " << first + j;
        EXPECT_EQ(c.error_status, 0) << c.error;
      }
    }
    return aborted;
  };
  EXPECT_GT(run_jobs(0, 6), 0) << "the failing rank took no job";
  EXPECT_EQ(run_jobs(6, 3), 0) << "a job went to the failed rank";
  EXPECT_EQ(service.active_jobs(), 0);
  const std::string rendered = metrics.render();
  const std::string error_counter = "dsv4:request_success_total{finished_reason=\"error\"} ";
  const size_t at = rendered.find(error_counter);
  ASSERT_NE(at, std::string::npos) << rendered;
  EXPECT_GT(std::stoll(rendered.substr(at + error_counter.size())), 0) << "the failed choices were not counted";
}

TEST(EngineService, StopStringEndsTheChoiceAndNSharesThePrompt) {
  REQUIRE_DEEPSEEK();
  const ModelConfig config = small_config();
  DeepseekV4Model model = random_model(config, 6);
  ServerMetrics metrics;
  EngineService service(model, *tok, small_engine(), {}, metrics);
  const std::vector<int32_t> prompt = random_ids(20, config.vocab_size, 3);
  JobSpec greedy;
  greedy.choices.push_back({prompt, SamplingParams{}, 0});
  greedy.choices[0].params.max_tokens = 24;
  greedy.choices[0].params.ignore_eos = true;
  Collector full;
  service.submit(greedy, full.listener());
  ASSERT_TRUE(full.wait());
  const std::string text = full.text[0];
  ASSERT_GE(text.size(), 8u) << text;
  const std::string stop = text.substr(text.size() / 2, 2);
  JobSpec cut = greedy;
  cut.stop = {stop};
  cut.choices.push_back(cut.choices[0]);  // n = 2 of one prompt
  Collector stopped;
  service.submit(cut, stopped.listener());
  ASSERT_TRUE(stopped.wait());
  for (int64_t index : {0, 1}) {
    EXPECT_EQ(stopped.text[index], text.substr(0, text.find(stop)));
    EXPECT_EQ(stopped.finish[index], "stop");
  }
  EXPECT_EQ(stopped.updates.back().usage.prompt_tokens, 20) << "the prompt of n choices counts once";
}

TEST(EngineService, CancelFreesBlocksAndQueueBoundAnswers503) {
  REQUIRE_DEEPSEEK();
  const ModelConfig config = small_config();
  DeepseekV4Model model = random_model(config, 7);
  ServerMetrics metrics;
  ServiceOptions options;
  options.max_queued_jobs = 2;
  EngineService service(model, *tok, small_engine(), options, metrics);
  std::vector<std::unique_ptr<Collector>> collectors;
  std::vector<JobId> ids;
  for (int i = 0; i < 2; ++i) {
    JobSpec spec;
    spec.choices.push_back({random_ids(30, config.vocab_size, 40 + i), SamplingParams{}, 0});
    spec.choices[0].params.max_tokens = 2000;
    spec.choices[0].params.ignore_eos = true;
    collectors.push_back(std::make_unique<Collector>());
    ids.push_back(service.submit(std::move(spec), collectors.back()->listener()));
  }
  JobSpec third;
  third.choices.push_back({{1, 2, 3}, SamplingParams{}, 0});
  try {
    service.submit(third, [](JobUpdate) {});
    ADD_FAILURE() << "a full queue accepted a job";
  } catch (const ApiError& error) {
    EXPECT_EQ(error.status(), 503);
  }
  // Let both produce tokens, then cancel: the engine frees their blocks and takes new work.
  for (int spin = 0; spin < 2000 && (collectors[0]->token_count() < 3 || collectors[1]->token_count() < 3); ++spin)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ASSERT_GE(collectors[0]->token_count(), 3u);
  EXPECT_GT(metrics.engine().used_bytes, 0);
  for (const JobId id : ids) service.cancel(id);
  for (int spin = 0; spin < 2000 && (service.active_jobs() > 0 || metrics.engine().running > 0); ++spin)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ(service.active_jobs(), 0);
  for (int spin = 0; spin < 200 && metrics.engine().used_bytes > 0; ++spin)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  const EngineGauges gauges = metrics.engine();
  EXPECT_EQ(gauges.running, 0);
  EXPECT_EQ(gauges.used_bytes, 0) << "blocks of cancelled requests are freed";
  EXPECT_FALSE(collectors[0]->done) << "a cancelled job gets no further update";
  Collector after;
  service.submit(third, after.listener());
  EXPECT_TRUE(after.wait());
}

// stop() returns only after every job's listener is destroyed: a running job's and one still queued. The HTTP
// layer's listeners own connections of its I/O context, so the server must be able to drop them before that
// context goes (the shutdown use-after-free this guards against).
TEST(EngineService, StopDestroysEveryListenerBeforeReturning) {
  REQUIRE_DEEPSEEK();
  const ModelConfig config = small_config();
  DeepseekV4Model model = random_model(config, 7);
  ServerMetrics metrics;
  EngineService service(model, *tok, small_engine(), ServiceOptions{}, metrics);
  auto owned = std::make_shared<int>(0);  // stands for a connection a listener keeps alive
  Collector running;
  JobSpec spec;
  spec.choices.push_back({random_ids(20, config.vocab_size, 61), SamplingParams{}, 0});
  spec.choices[0].params.max_tokens = 5000;
  spec.choices[0].params.ignore_eos = true;
  auto forward = running.listener();
  service.submit(spec, [owned, forward](JobUpdate update) { forward(std::move(update)); });
  for (int spin = 0; spin < 2000 && running.token_count() < 2; ++spin)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ASSERT_GE(running.token_count(), 2u);
  service.submit(spec, [owned](JobUpdate) {});
  EXPECT_EQ(owned.use_count(), 3);
  service.stop();
  EXPECT_EQ(owned.use_count(), 1) << "a listener outlived stop()";
  try {
    service.submit(spec, [](JobUpdate) {});
    ADD_FAILURE() << "a stopped service accepted a job";
  } catch (const ApiError& error) {
    EXPECT_EQ(error.status(), 503);
  }
  service.stop();  // idempotent
}

TEST(EngineService, ImpossibleRequestIsA400AndOthersGoOn) {
  REQUIRE_DEEPSEEK();
  const ModelConfig config = small_config();
  DeepseekV4Model model = random_model(config, 8);
  ServerMetrics metrics;
  EngineConfig engine = small_engine();
  engine.max_model_len = 64;
  EngineService service(model, *tok, engine, {}, metrics);
  JobSpec too_long;
  too_long.choices.push_back({random_ids(60, config.vocab_size, 1), SamplingParams{}, 0});
  too_long.choices[0].params.max_tokens = 10;
  JobSpec fine;
  fine.choices.push_back({random_ids(10, config.vocab_size, 2), SamplingParams{}, 0});
  fine.choices[0].params.max_tokens = 4;
  Collector rejected, served;
  service.submit(too_long, rejected.listener());
  service.submit(fine, served.listener());
  ASSERT_TRUE(rejected.wait());
  ASSERT_TRUE(served.wait());
  EXPECT_EQ(rejected.updates.front().error_status, 400);
  EXPECT_NE(rejected.updates.front().error.find("max_model_len"), std::string::npos) << rejected.updates.front().error;
  EXPECT_TRUE(served.updates.front().accepted);
  EXPECT_EQ(service.active_jobs(), 0);
}

}  // namespace
}  // namespace dsv4::server
