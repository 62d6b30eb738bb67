// DataParallelEngine (engine/data_parallel_engine.h) on a small random model: greedy outputs with 2 and 3
// ranks equal one Engine's, request by request; requests sharing a long prefix follow it to the rank that
// caches it and hit there; a rank whose backend throws fails exactly its own requests, with an error naming
// it, frees their blocks and takes no new ones, while the other ranks' requests equal the reference. Every
// drain runs under a deadline: a hang fails the test instead of stalling it.
#include "engine/data_parallel_engine.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "../model/test_models.h"
#include "fault_injecting_backends.h"
#include "core/error.h"
#include "parallel/communicator.h"
#include "parallel/deadline_communicator.h"
#include "engine/remote_rank_engine.h"

#include <sys/socket.h>
#include <unistd.h>

namespace dsv4 {
namespace {

using testing::FaultInjectingBackend;
using testing::HangingBackend;
using testing::random_model;
using testing::small_config;

std::vector<int32_t> random_ids(size_t n, int64_t vocab, std::mt19937& rng) {
  std::vector<int32_t> ids(n);
  for (auto& id : ids) id = static_cast<int32_t>(rng() % vocab);
  return ids;
}

struct Case {
  std::vector<int32_t> prompt;
  SamplingParams params;
};

// Random prompts, about half of them one of three shared prefixes (one and two logical blocks long) with a
// random tail, the rest unrelated; greedy, some stopping on eos.
std::vector<Case> mixed_cases(int64_t vocab, uint32_t seed, int count) {
  std::mt19937 rng(seed);
  std::vector<std::vector<int32_t>> prefixes;
  for (int i = 0; i < 3; ++i) prefixes.push_back(random_ids(260 + 250 * (i % 2) + rng() % 40, vocab, rng));
  std::vector<Case> cases;
  for (int i = 0; i < count; ++i) {
    Case c;
    if (rng() % 2) c.prompt = prefixes[rng() % prefixes.size()];
    const auto tail = random_ids(1 + rng() % 90, vocab, rng);
    c.prompt.insert(c.prompt.end(), tail.begin(), tail.end());
    c.params.max_tokens = 4 + static_cast<int64_t>(rng() % 9);  // every request needs several steps
    c.params.ignore_eos = rng() % 3 != 0;
    cases.push_back(std::move(c));
  }
  return cases;
}

EngineConfig engine_config() {
  EngineConfig config;
  config.max_num_seqs = 8;
  config.max_num_batched_tokens = 64;  // chunked prefills: requests stay on their rank for many steps
  config.checkpoint_interval = 256;
  config.kv_cache_bytes = int64_t{32} << 20;
  return config;
}

struct Outcome {
  std::vector<int32_t> tokens;
  RequestStatus status = RequestStatus::kRunning;
  std::string error;
  int64_t cached_tokens = 0;
  bool finished = false;
};

// Steps until nothing is unfinished; fails (instead of hanging) past the deadline.
void drain(ServingEngine& engine, std::map<RequestId, Outcome>& outcomes,
           std::chrono::seconds limit = std::chrono::seconds(180)) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (engine.has_unfinished()) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "the engine did not finish: a hang";
    for (const RequestOutput& output : engine.step()) {
      Outcome& outcome = outcomes[output.id];
      ASSERT_FALSE(outcome.finished) << "request " << output.id << " got an output after it finished";
      outcome.tokens.insert(outcome.tokens.end(), output.new_token_ids.begin(), output.new_token_ids.end());
      outcome.cached_tokens = std::max(outcome.cached_tokens, output.num_cached_tokens);
      if (output.finished) {
        outcome.finished = true;
        outcome.status = output.status;
        outcome.error = output.error;
      }
    }
  }
}

// The reference: one Engine over the same model serving every case (outputs do not depend on the batch:
// tests/engine/engine_test.cpp).
std::vector<Outcome> single_engine(DeepseekV4Model& model, const std::vector<Case>& cases) {
  Engine engine(model, engine_config());
  std::vector<RequestId> ids;
  for (const Case& c : cases) ids.push_back(engine.add_request(c.prompt, c.params));
  std::map<RequestId, Outcome> outcomes;
  drain(engine, outcomes);
  std::vector<Outcome> out;
  for (const RequestId id : ids) {
    EXPECT_TRUE(outcomes[id].finished);
    EXPECT_TRUE(outcomes[id].error.empty()) << outcomes[id].error;
    out.push_back(outcomes[id]);
  }
  return out;
}

// CPU backends over one model's read-only weights, one per rank.
struct RankBackends {
  std::vector<std::unique_ptr<ModelBackend>> owned;
  std::vector<ModelBackend*> pointers() const {
    std::vector<ModelBackend*> out;
    for (const auto& backend : owned) out.push_back(backend.get());
    return out;
  }
};
RankBackends cpu_backends(DeepseekV4Model& model, int ranks) {
  RankBackends backends;
  for (int r = 0; r < ranks; ++r) backends.owned.push_back(std::make_unique<CpuModelBackend>(model));
  return backends;
}

// Adds `cases` to a DP engine in waves (so later requests are routed with the prefix events of earlier ones),
// recording each one's rank at submission.
std::vector<RequestId> submit_in_waves(DataParallelEngine& engine, const std::vector<Case>& cases,
                                       std::map<RequestId, Outcome>& outcomes, std::vector<int>& ranks) {
  std::vector<RequestId> ids;
  for (size_t i = 0; i < cases.size(); ++i) {
    ids.push_back(engine.add_request(cases[i].prompt, cases[i].params));
    ranks.push_back(engine.rank_of(ids.back()));
    if (i % 4 == 3)
      for (int s = 0; s < 30 && engine.has_unfinished(); ++s)
        for (const RequestOutput& output : engine.step()) {
          Outcome& outcome = outcomes[output.id];
          outcome.tokens.insert(outcome.tokens.end(), output.new_token_ids.begin(),
                                output.new_token_ids.end());
          outcome.cached_tokens = std::max(outcome.cached_tokens, output.num_cached_tokens);
          if (output.finished)
            outcome.finished = true, outcome.status = output.status, outcome.error = output.error;
        }
  }
  return ids;
}

// Serves `cases` in waves and compares each request with one Engine's outcome; the router must have used every
// rank, shared prefixes must have hit, and every block and router entry must be gone at the end.
void serve_and_compare(DataParallelEngine& engine, const std::vector<Case>& cases,
                       const std::vector<Outcome>& expected) {
  std::map<RequestId, Outcome> outcomes;
  std::vector<int> ranks;
  const auto ids = submit_in_waves(engine, cases, outcomes, ranks);
  drain(engine, outcomes);
  for (size_t i = 0; i < cases.size(); ++i) {
    const Outcome& got = outcomes[ids[i]];
    EXPECT_TRUE(got.finished) << "request " << i;
    EXPECT_TRUE(got.error.empty()) << got.error;
    EXPECT_EQ(got.tokens, expected[i].tokens) << "request " << i << " on rank " << ranks[i];
    EXPECT_EQ(got.status, expected[i].status) << "request " << i;
  }
  EXPECT_EQ(std::set<int>(ranks.begin(), ranks.end()).size(), static_cast<size_t>(engine.num_ranks()))
      << "the router left a rank idle";
  for (int r = 0; r < engine.num_ranks(); ++r) {
    EXPECT_EQ(engine.rank_stats(r).used_bytes, 0) << "rank " << r << " still holds blocks";
    EXPECT_FALSE(engine.rank_failed(r));
  }
  EXPECT_GT(engine.stats().prefix_hit_tokens, 0) << "no shared prefix ever hit on its rank";
  EXPECT_EQ(engine.router().num_tracked_requests(), 0) << "the router still counts finished requests";
}

TEST(DataParallelEngine, GreedyOutputsEqualASingleEngine) {
  const ModelConfig config = small_config();
  DeepseekV4Model model = random_model(config, 31);
  const auto cases = mixed_cases(config.vocab_size, 5, 20);
  const auto expected = single_engine(model, cases);
  for (const int num_ranks : {2, 3}) {
    SCOPED_TRACE(std::to_string(num_ranks) + " ranks");
    RankBackends backends = cpu_backends(model, num_ranks);
    DataParallelEngine engine(backends.pointers(), engine_config());
    serve_and_compare(engine, cases, expected);
  }
}

TEST(DataParallelEngine, RequestsSharingALongPrefixLandOnTheRankThatCachesIt) {
  const ModelConfig config = small_config();
  DeepseekV4Model model = random_model(config, 32);
  std::mt19937 rng(17);
  const auto prefix = random_ids(2 * 256 + 30, config.vocab_size, rng);
  std::vector<Case> cases;
  for (int i = 0; i < 7; ++i) {
    Case c{prefix, {}};
    const auto tail = random_ids(1 + rng() % 40, config.vocab_size, rng);
    c.prompt.insert(c.prompt.end(), tail.begin(), tail.end());
    c.params.max_tokens = 5;
    c.params.ignore_eos = true;
    cases.push_back(std::move(c));
  }
  const auto expected = single_engine(model, cases);
  RankBackends backends = cpu_backends(model, 3);
  DataParallelEngine engine(backends.pointers(), engine_config());
  // Some unrelated traffic first, so the prefix's rank is not simply the idle rank 0.
  std::map<RequestId, Outcome> outcomes;
  for (int i = 0; i < 2; ++i) {
    SamplingParams params;
    params.max_tokens = 3;
    engine.add_request(random_ids(200, config.vocab_size, rng), params);
  }
  const RequestId first = engine.add_request(cases[0].prompt, cases[0].params);
  const int holder = engine.rank_of(first);
  drain(engine, outcomes);  // the first request leaves the prefix cached (and checkpointed) on `holder`
  const int64_t hits_before = engine.rank_stats(holder).prefix_hit_tokens;
  std::vector<RequestId> ids{first};
  for (size_t i = 1; i < cases.size(); ++i) {  // a burst: the router's load books see each one admitted
    ids.push_back(engine.add_request(cases[i].prompt, cases[i].params));
    EXPECT_EQ(engine.rank_of(ids.back()), holder) << "request " << i << " left the rank holding its prefix";
  }
  drain(engine, outcomes);
  for (size_t i = 0; i < cases.size(); ++i)
    EXPECT_EQ(outcomes[ids[i]].tokens, expected[i].tokens) << "request " << i;
  for (size_t i = 1; i < cases.size(); ++i)
    EXPECT_EQ(outcomes[ids[i]].cached_tokens, 2 * 256) << "request " << i << " did not hit the cached prefix";
  EXPECT_EQ(engine.rank_stats(holder).prefix_hit_tokens - hits_before, 6 * 2 * 256);
  for (int r = 0; r < 3; ++r) {
    if (r != holder) {
      EXPECT_EQ(engine.rank_stats(r).prefix_hit_tokens, 0) << "rank " << r;
    }
  }
}

TEST(DataParallelEngine, AFailedRankFailsOnlyItsRequestsAndTakesNoMore) {
  const ModelConfig config = small_config();
  DeepseekV4Model model = random_model(config, 33);
  const auto cases = mixed_cases(config.vocab_size, 9, 12);
  const auto later_cases = mixed_cases(config.vocab_size, 10, 8);
  const auto expected = single_engine(model, cases);
  const auto later_expected = single_engine(model, later_cases);
  constexpr int kFailing = 1;
  CpuModelBackend rank0(model), rank2(model);
  FaultInjectingBackend rank1(model, /*fail_at=*/3);
  DataParallelEngine engine({&rank0, &rank1, &rank2}, engine_config());
  std::map<RequestId, Outcome> outcomes;
  std::vector<RequestId> ids;
  std::vector<int> ranks;
  for (const Case& c : cases) {  // a burst: spread over the three ranks before rank 1 fails
    ids.push_back(engine.add_request(c.prompt, c.params));
    ranks.push_back(engine.rank_of(ids.back()));
  }
  ASSERT_GT(std::count(ranks.begin(), ranks.end(), kFailing), 0) << "nothing was routed to the failing rank";
  drain(engine, outcomes);
  int64_t failed = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const Outcome& got = outcomes[ids[i]];
    ASSERT_TRUE(got.finished) << "request " << i;
    if (ranks[i] == kFailing) {  // every request needs more than the two forwards before the fault
      ++failed;
      EXPECT_EQ(got.status, RequestStatus::kFinishedAborted) << "request " << i;
      EXPECT_NE(got.error.find("data-parallel rank 1 failed"), std::string::npos) << got.error;
      EXPECT_NE(got.error.find("injected fault in forward 3"), std::string::npos) << got.error;
    } else {
      EXPECT_TRUE(got.error.empty()) << "request " << i << " on rank " << ranks[i] << ": " << got.error;
      EXPECT_EQ(got.tokens, expected[i].tokens) << "request " << i << " on rank " << ranks[i];
      EXPECT_EQ(got.status, expected[i].status) << "request " << i;
    }
  }
  EXPECT_GT(failed, 0);
  EXPECT_EQ(rank1.forwards(), 3) << "the failed rank kept stepping";
  EXPECT_TRUE(engine.rank_failed(kFailing));
  EXPECT_EQ(engine.rank_stats(kFailing).used_bytes, 0) << "the failed rank's requests still hold blocks";
  EXPECT_EQ(engine.stats().failed_ranks, 1);
  EXPECT_TRUE(engine.router().rank_failed(kFailing));

  // The survivors keep serving, and nothing more goes to the failed rank.
  std::vector<RequestId> later_ids;
  for (const Case& c : later_cases) {
    later_ids.push_back(engine.add_request(c.prompt, c.params));
    EXPECT_NE(engine.rank_of(later_ids.back()), kFailing);
  }
  drain(engine, outcomes);
  for (size_t i = 0; i < later_cases.size(); ++i) {
    EXPECT_TRUE(outcomes[later_ids[i]].error.empty()) << outcomes[later_ids[i]].error;
    EXPECT_EQ(outcomes[later_ids[i]].tokens, later_expected[i].tokens) << "later request " << i;
  }
  EXPECT_EQ(rank1.forwards(), 3);
}

TEST(DataParallelEngine, WithEveryRankFailedNewRequestsAreRefused) {
  const ModelConfig config = small_config();
  DeepseekV4Model model = random_model(config, 34);
  FaultInjectingBackend rank0(model, 1), rank1(model, 1);
  DataParallelEngine engine({&rank0, &rank1}, engine_config());
  std::mt19937 rng(3);
  SamplingParams params;
  params.max_tokens = 4;
  std::vector<RequestId> ids;
  // Both ranks fail on their first forward, possibly while this loop still adds: a request added after both
  // failed is refused on the spot, one added before fails with the error. Either way none is lost.
  int64_t refused = 0;
  for (int i = 0; i < 4; ++i) {
    try {
      ids.push_back(engine.add_request(random_ids(20 + i, config.vocab_size, rng), params));
    } catch (const Error& error) {
      ++refused;
      EXPECT_NE(std::string(error.what()).find("ranks has failed"), std::string::npos) << error.what();
    }
  }
  ASSERT_FALSE(ids.empty()) << "the first request is added before any rank has stepped";
  EXPECT_EQ(static_cast<int64_t>(ids.size()) + refused, 4);
  std::map<RequestId, Outcome> outcomes;
  drain(engine, outcomes);
  for (const RequestId id : ids) {
    EXPECT_EQ(outcomes[id].status, RequestStatus::kFinishedAborted);
    EXPECT_NE(outcomes[id].error.find("failed: injected fault"), std::string::npos) << outcomes[id].error;
  }
  EXPECT_THROW(engine.add_request(random_ids(5, config.vocab_size, rng), params), Error);
  EXPECT_FALSE(engine.has_unfinished());
}

// A request that can never run is refused by add_request itself, as by a single Engine, and nothing is
// queued; an aborted request gets no further output and its blocks are freed on its rank.
TEST(DataParallelEngine, RejectsAndAbortsAsASingleEngine) {
  const ModelConfig config = small_config();
  DeepseekV4Model model = random_model(config, 35);
  RankBackends backends = cpu_backends(model, 2);
  DataParallelEngine engine(backends.pointers(), engine_config());
  Engine single(model, engine_config());
  SamplingParams too_long;
  too_long.max_tokens = single.max_model_len();
  std::mt19937 rng(4);
  const auto prompt = random_ids(30, config.vocab_size, rng);
  EXPECT_THROW(single.add_request(prompt, too_long), Error);
  EXPECT_THROW(engine.add_request(prompt, too_long), Error);
  EXPECT_THROW(engine.add_request({1, static_cast<int32_t>(config.vocab_size)}, {}), Error);
  EXPECT_THROW(engine.add_request({}, {}), Error);
  EXPECT_FALSE(engine.has_unfinished());
  EXPECT_EQ(engine.max_model_len(), single.max_model_len());

  SamplingParams params;
  params.max_tokens = 50;
  params.ignore_eos = true;
  const RequestId kept = engine.add_request(prompt, params);
  // Long: the rank threads run concurrently, and on busy cores a 50-token request on the other rank could finish
  // before `kept` has its 3 tokens (seen once in 40 runs with 3 busy cores), and then abort() rightly says false.
  SamplingParams long_params = params;
  long_params.max_tokens = 2000;
  const RequestId aborted = engine.add_request(random_ids(300, config.vocab_size, rng), long_params);
  std::map<RequestId, Outcome> outcomes;
  while (outcomes[kept].tokens.size() < 3 && engine.has_unfinished())
    for (const RequestOutput& output : engine.step()) {
      auto& tokens = outcomes[output.id].tokens;
      tokens.insert(tokens.end(), output.new_token_ids.begin(), output.new_token_ids.end());
    }
  EXPECT_TRUE(engine.abort(aborted));
  EXPECT_FALSE(engine.abort(aborted));
  const size_t tokens_at_abort = outcomes[aborted].tokens.size();
  drain(engine, outcomes);
  EXPECT_EQ(outcomes[aborted].tokens.size(), tokens_at_abort) << "output after abort";
  EXPECT_FALSE(outcomes[aborted].finished);
  EXPECT_EQ(outcomes[kept].tokens.size(), 50u);
  // The rank frees the aborted request's blocks on its own thread; the engine counts as unfinished until it
  // has reported doing so, so after the drain the stats show them free.
  EXPECT_EQ(engine.stats().used_bytes, 0);
}

// Expert-parallel CPU ranks (docs/parallel.md): each rank's model holds the same weights and computes only its
// share of the routed experts, over one in-process group; rank `faulty` (if any) throws at forward `fail_at`.
struct ExpertParallelRanks {
  parallel::InProcessGroup group;
  std::vector<std::unique_ptr<parallel::Communicator>> communicators;
  std::vector<std::unique_ptr<DeepseekV4Model>> models;
  RankBackends backends;
  ExpertParallelRanks(const ModelConfig& config, uint64_t seed, int num_ranks, int faulty = -1, int64_t fail_at = 0)
      : group(num_ranks) {
    for (int r = 0; r < num_ranks; ++r) {
      communicators.push_back(group.communicator(r));
      models.push_back(std::make_unique<DeepseekV4Model>(random_model(config, seed)));
      models.back()->set_expert_parallel(communicators.back().get());
      if (r == faulty)
        backends.owned.push_back(std::make_unique<FaultInjectingBackend>(*models.back(), fail_at));
      else
        backends.owned.push_back(std::make_unique<CpuModelBackend>(*models.back()));
    }
  }
};

// Expert parallelism (docs/parallel.md): each rank's model computes only its share of the routed experts
// (DeepseekV4Model::set_expert_parallel over an in-process group), so every forward is a collective and the
// ranks step in lockstep, an idle one over an empty batch. Greedy outputs equal one Engine's over the whole
// model. Two waves: the second arrives after every rank went idle and asleep (the gate must wake for it), and
// the lone request of the second wave leaves the other rank with nothing to run while it decodes.
TEST(DataParallelEngine, LockstepExpertParallelRanksEqualOneEngine) {
  const ModelConfig config = small_config();  // 6 routed experts, top-2: rows cross ranks every sublayer
  DeepseekV4Model reference = random_model(config, 41);
  const std::vector<Case> first = mixed_cases(config.vocab_size, 71, 4), second = mixed_cases(config.vocab_size, 72, 1);
  const std::vector<Outcome> expected_first = single_engine(reference, first);
  const std::vector<Outcome> expected_second = single_engine(reference, second);
  const int num_ranks = 2;
  ExpertParallelRanks ranks(config, 41, num_ranks);
  DataParallelEngine engine(ranks.backends.pointers(), engine_config(), {}, /*lockstep=*/true);
  auto serve = [&](const std::vector<Case>& cases, const std::vector<Outcome>& expected, const char* wave) {
    std::map<RequestId, Outcome> outcomes;
    std::vector<RequestId> ids;
    for (const Case& c : cases) ids.push_back(engine.add_request(c.prompt, c.params));
    drain(engine, outcomes);
    for (size_t i = 0; i < cases.size(); ++i) {
      const Outcome& got = outcomes[ids[i]];
      EXPECT_TRUE(got.finished) << wave << " request " << i;
      EXPECT_TRUE(got.error.empty()) << got.error;
      EXPECT_EQ(got.tokens, expected[i].tokens) << wave << " request " << i;
      EXPECT_EQ(got.status, expected[i].status) << wave << " request " << i;
    }
  };
  serve(first, expected_first, "first wave");
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // every rank idle: asleep at the gate
  serve(second, expected_second, "second wave");
  for (int r = 0; r < num_ranks; ++r) {
    EXPECT_EQ(engine.rank_stats(r).used_bytes, 0) << "rank " << r << " still holds blocks";
    EXPECT_FALSE(engine.rank_failed(r));
  }
}

// A lockstep expert-parallel rank whose forward throws: it aborts the group, so the other rank, waiting for it in
// a collective of the same step, fails too instead of hanging (without the other's experts it cannot serve).
// Every request finishes aborted with an error that names the failure, and every block goes back.
TEST(DataParallelEngine, AFailingExpertParallelRankFailsTheGroupWithoutAHang) {
  const ModelConfig config = small_config();
  const std::vector<Case> cases = mixed_cases(config.vocab_size, 73, 4);
  const int num_ranks = 2;
  ExpertParallelRanks ranks(config, 41, num_ranks, /*faulty=*/1, /*fail_at=*/4);
  DataParallelEngine engine(ranks.backends.pointers(), engine_config(), {}, /*lockstep=*/true);
  std::map<RequestId, Outcome> outcomes;
  std::vector<RequestId> ids;
  for (const Case& c : cases) ids.push_back(engine.add_request(c.prompt, c.params));
  drain(engine, outcomes, std::chrono::seconds(60));
  for (size_t i = 0; i < ids.size(); ++i) {
    const Outcome& got = outcomes[ids[i]];
    EXPECT_TRUE(got.finished) << "request " << i;
    EXPECT_EQ(got.status, RequestStatus::kFinishedAborted) << "request " << i;
    EXPECT_NE(got.error.find("injected fault in forward 4"), std::string::npos) << "request " << i << ": " << got.error;
  }
  for (int r = 0; r < num_ranks; ++r) {
    EXPECT_TRUE(engine.rank_failed(r)) << "rank " << r;
    EXPECT_EQ(engine.rank_stats(r).used_bytes, 0) << "rank " << r << " still holds blocks";
  }
  EXPECT_THROW(engine.add_request(cases[0].prompt, cases[0].params), Error);
}

// A lockstep expert-parallel rank that hangs in its forward: the other rank waits for it in a collective until
// its deadline (DeadlineCommunicator, the CLI's --dist-timeout) aborts the group, so that rank's requests fail
// with the deadline's error instead of waiting for ever. Released later, the hung rank meets the aborted group
// at its next collective and fails too. Every request finishes aborted, every block goes back.
TEST(DataParallelEngine, AHungExpertParallelRankFailsTheGroupOnTheDeadline) {
  const ModelConfig config = small_config();
  const std::vector<Case> cases = mixed_cases(config.vocab_size, 74, 4);
  parallel::InProcessGroup group(2);
  std::vector<std::unique_ptr<parallel::Communicator>> communicators;
  std::vector<std::unique_ptr<DeepseekV4Model>> models;
  for (int r = 0; r < 2; ++r) {
    communicators.push_back(std::make_unique<parallel::DeadlineCommunicator>(group.communicator(r),
                                                                             std::chrono::milliseconds(300)));
    models.push_back(std::make_unique<DeepseekV4Model>(random_model(config, 41)));
    models.back()->set_expert_parallel(communicators.back().get());
  }
  CpuModelBackend rank0(*models[0]);
  HangingBackend rank1(*models[1], /*hang_at=*/4);
  DataParallelEngine engine({&rank0, &rank1}, engine_config(), {}, /*lockstep=*/true);
  std::map<RequestId, Outcome> outcomes;
  std::vector<RequestId> ids;
  std::vector<int> ranks;
  for (const Case& c : cases) {
    ids.push_back(engine.add_request(c.prompt, c.params));
    ranks.push_back(engine.rank_of(ids.back()));
  }
  ASSERT_GT(std::count(ranks.begin(), ranks.end(), 0), 0) << "nothing was routed to rank 0";
  ASSERT_GT(std::count(ranks.begin(), ranks.end(), 1), 0) << "nothing was routed to rank 1";
  auto collect = [&] {
    for (const RequestOutput& output : engine.step()) {
      Outcome& outcome = outcomes[output.id];
      if (output.finished) outcome.finished = true, outcome.status = output.status, outcome.error = output.error;
    }
  };
  auto rank0_done = [&] {
    for (size_t i = 0; i < ids.size(); ++i)
      if (ranks[i] == 0 && !outcomes[ids[i]].finished) return false;
    return true;
  };
  const auto limit = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!rank0_done() && std::chrono::steady_clock::now() < limit) collect();
  ASSERT_TRUE(rank0_done()) << "rank 0 still waits for the hung rank: no deadline";
  EXPECT_TRUE(rank1.hanging());
  EXPECT_TRUE(engine.rank_failed(0));
  for (size_t i = 0; i < ids.size(); ++i)
    if (ranks[i] == 0) {
      EXPECT_EQ(outcomes[ids[i]].status, RequestStatus::kFinishedAborted) << "request " << i;
      EXPECT_NE(outcomes[ids[i]].error.find("--dist-timeout"), std::string::npos) << outcomes[ids[i]].error;
    }
  rank1.release();
  drain(engine, outcomes, std::chrono::seconds(60));
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_TRUE(outcomes[ids[i]].finished) << "request " << i;
    EXPECT_EQ(outcomes[ids[i]].status, RequestStatus::kFinishedAborted) << "request " << i;
    EXPECT_NE(outcomes[ids[i]].error.find("--dist-timeout"), std::string::npos)
        << "request " << i << ": " << outcomes[ids[i]].error;
  }
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(engine.rank_failed(r)) << "rank " << r;
    EXPECT_EQ(engine.rank_stats(r).used_bytes, 0) << "rank " << r << " still holds blocks";
  }
  EXPECT_THROW(engine.add_request(cases[0].prompt, cases[0].params), Error);
}


// ---- Ranks behind a connection (engine/remote_rank_engine.h) ----
// The worker side runs on a thread here instead of a process of its own: the same serve_rank loop at the far end
// of a socketpair, so the protocol, the front's bookkeeping and the failure paths are what a worker process sees.
// (tests/cli/cli_checks.sh runs real worker processes through `--data-parallel-backend mp`.)

// One rank in a worker thread: its LocalRankEngine, the thread serving it, and the RemoteRankEngine the front
// drives. `die_after_steps` > 0: the worker closes the connection in its n-th step, as a killed process would.
class ThreadWorker {
 public:
  ThreadWorker(ModelBackend& backend, const EngineConfig& config, int rank, bool lockstep, int die_after_steps = 0) {
    int fds[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
    worker_fd_ = fds[1];
    local_ = std::make_unique<LocalRankEngine>(backend, DataParallelEngine::rank_config(config, lockstep));
    if (die_after_steps > 0) dying_ = std::make_unique<Dying>(*local_, worker_fd_, die_after_steps);
    remote_ = std::make_unique<RemoteRankEngine>(fds[0], 0, local_->max_model_len(), local_->stats());
    RankEngine& served = dying_ ? static_cast<RankEngine&>(*dying_) : *local_;
    thread_ = std::thread([this, rank, &served] { serve_rank(worker_fd_, rank, served); });
  }
  ~ThreadWorker() {  // the engine (and its RemoteRankEngine) is gone by now: the loop has returned or will
    if (thread_.joinable()) thread_.join();
    ::close(worker_fd_);
  }
  std::unique_ptr<RankEngine> take_remote() { return std::move(remote_); }
  // The worker's end closes, as when its process is killed.
  void kill_connection() { ::shutdown(worker_fd_, SHUT_RDWR); }
  const LocalRankEngine& local() const { return *local_; }

 private:
  // Forwards to the rank's engine; its n-th step shuts the connection down and throws, so the reply never goes
  // out: the front sees the connection close mid-call.
  class Dying final : public RankEngine {
   public:
    Dying(RankEngine& inner, int fd, int at) : inner_(inner), fd_(fd), at_(at) {}
    void check_request(RequestId id, std::span<const int32_t> prompt, const SamplingParams& params) const override {
      inner_.check_request(id, prompt, params);
    }
    int64_t max_model_len() const override { return inner_.max_model_len(); }
    bool apply(std::deque<RankCommand> commands, RankReport& report) override {
      return inner_.apply(std::move(commands), report);
    }
    void step(bool forward, RankReport& report) override {
      if (forward && ++steps_ == at_) {
        ::shutdown(fd_, SHUT_RDWR);
        throw Error("worker killed");
      }
      inner_.step(forward, report);
    }
    bool has_unfinished() const override { return inner_.has_unfinished(); }
    EngineStats stats() const override { return inner_.stats(); }
    void fail(const std::string& error, RankReport& report) override { inner_.fail(error, report); }
    void abort_collectives(const std::string& reason) override { inner_.abort_collectives(reason); }

   private:
    RankEngine& inner_;
    int fd_, at_, steps_ = 0;
  };

  int worker_fd_ = -1;
  std::unique_ptr<LocalRankEngine> local_;
  std::unique_ptr<Dying> dying_;
  std::unique_ptr<RemoteRankEngine> remote_;
  std::thread thread_;
};

// Rank 0 in this process, ranks 1 and 2 behind connections: greedy outputs equal one Engine's, the router uses
// every rank (its prefix events come back over the connection: shared prefixes hit), and every block goes back.
TEST(DataParallelEngine, RanksBehindAConnectionEqualASingleEngine) {
  const ModelConfig config = small_config();
  DeepseekV4Model model = random_model(config, 31);
  const auto cases = mixed_cases(config.vocab_size, 5, 20);
  const auto expected = single_engine(model, cases);
  RankBackends backends = cpu_backends(model, 3);
  std::vector<std::unique_ptr<ThreadWorker>> workers;
  std::vector<std::unique_ptr<RankEngine>> remote;
  for (int r = 1; r < 3; ++r) {
    workers.push_back(std::make_unique<ThreadWorker>(*backends.owned[static_cast<size_t>(r)], engine_config(), r,
                                                     /*lockstep=*/false));
    remote.push_back(workers.back()->take_remote());
  }
  {
    DataParallelEngine engine({backends.owned[0].get()}, engine_config(), {}, false, std::move(remote));
    serve_and_compare(engine, cases, expected);
  }
  for (const auto& worker : workers) EXPECT_EQ(worker->local().engine().stats().used_bytes, 0);
}

// A worker whose connection closes mid-step (its process was killed) and one whose forward throws (the error comes
// back as the reply): each fails exactly its own requests at once, with an error naming the rank and the cause,
// takes no new ones, and the local rank's requests equal the reference.
TEST(DataParallelEngine, ARankBehindAConnectionThatDiesFailsOnlyItsRequests) {
  const ModelConfig config = small_config();
  DeepseekV4Model model = random_model(config, 33);
  const auto cases = mixed_cases(config.vocab_size, 9, 12);
  const auto expected = single_engine(model, cases);
  for (const bool killed : {true, false}) {
    SCOPED_TRACE(killed ? "connection closed" : "forward threw");
    RankBackends backends = cpu_backends(model, 1);
    FaultInjectingBackend faulty(model, killed ? 0 : 3);
    CpuModelBackend healthy(model);
    ThreadWorker worker(killed ? static_cast<ModelBackend&>(healthy) : faulty, engine_config(), 1, false,
                        killed ? 3 : 0);
    std::vector<std::unique_ptr<RankEngine>> remote;
    remote.push_back(worker.take_remote());
    DataParallelEngine engine(backends.pointers(), engine_config(), {}, false, std::move(remote));
    std::map<RequestId, Outcome> outcomes;
    std::vector<int> ranks;
    std::vector<RequestId> ids;
    for (const Case& c : cases) {
      ids.push_back(engine.add_request(c.prompt, c.params));
      ranks.push_back(engine.rank_of(ids.back()));
    }
    drain(engine, outcomes, std::chrono::seconds(120));
    int failed = 0;
    for (size_t i = 0; i < cases.size(); ++i) {
      const Outcome& got = outcomes[ids[i]];
      EXPECT_TRUE(got.finished) << "request " << i;
      if (ranks[i] == 0) {
        EXPECT_TRUE(got.error.empty()) << got.error;
        EXPECT_EQ(got.tokens, expected[i].tokens) << "request " << i;
      } else {
        ++failed;
        EXPECT_EQ(got.status, RequestStatus::kFinishedAborted) << "request " << i;
        EXPECT_NE(got.error.find("data-parallel rank 1 failed"), std::string::npos) << got.error;
        EXPECT_NE(got.error.find(killed ? "worker process ended" : "injected fault in forward 3"),
                  std::string::npos)
            << got.error;
      }
    }
    EXPECT_GT(failed, 0) << "no request was routed to the dying rank";
    EXPECT_TRUE(engine.rank_failed(1));
    EXPECT_FALSE(engine.rank_failed(0));
    EXPECT_EQ(engine.rank_stats(0).used_bytes, 0);
    // New requests go to the live rank.
    const RequestId after = engine.add_request(cases[0].prompt, cases[0].params);
    EXPECT_EQ(engine.rank_of(after), 0);
    outcomes.clear();
    drain(engine, outcomes);
    EXPECT_EQ(outcomes[after].tokens, expected[0].tokens);
  }
}

// A worker killed while its rank is idle: the rank fails within its next connection check (100 ms), before any
// request is routed to it, and every later request goes to the live rank.
TEST(DataParallelEngine, AnIdleRankWhoseWorkerDiesFailsBeforeARequestReachesIt) {
  const ModelConfig config = small_config();
  DeepseekV4Model model = random_model(config, 34);
  const auto cases = mixed_cases(config.vocab_size, 10, 4);
  const auto expected = single_engine(model, cases);
  RankBackends backends = cpu_backends(model, 2);
  ThreadWorker worker(*backends.owned[1], engine_config(), 1, false);
  std::vector<std::unique_ptr<RankEngine>> remote;
  remote.push_back(worker.take_remote());
  DataParallelEngine engine({backends.owned[0].get()}, engine_config(), {}, false, std::move(remote));
  worker.kill_connection();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!engine.rank_failed(1) && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_TRUE(engine.rank_failed(1)) << "a dead idle worker went unnoticed";
  std::map<RequestId, Outcome> outcomes;
  std::vector<RequestId> ids;
  for (const Case& c : cases) {
    ids.push_back(engine.add_request(c.prompt, c.params));
    EXPECT_EQ(engine.rank_of(ids.back()), 0);
  }
  drain(engine, outcomes);
  for (size_t i = 0; i < cases.size(); ++i) {
    EXPECT_TRUE(outcomes[ids[i]].error.empty()) << outcomes[ids[i]].error;
    EXPECT_EQ(outcomes[ids[i]].tokens, expected[i].tokens) << "request " << i;
  }
}

// Lockstep expert-parallel ranks with rank 1 behind a connection: the gate, the idle rank's empty forwards and the
// collectives work through it, and greedy outputs equal one Engine's over the whole model.
TEST(DataParallelEngine, LockstepExpertParallelRankBehindAConnectionEqualsOneEngine) {
  const ModelConfig config = small_config();
  DeepseekV4Model reference = random_model(config, 41);
  const std::vector<Case> first = mixed_cases(config.vocab_size, 71, 4), second = mixed_cases(config.vocab_size, 72, 1);
  const std::vector<Outcome> expected_first = single_engine(reference, first);
  const std::vector<Outcome> expected_second = single_engine(reference, second);
  ExpertParallelRanks ranks(config, 41, 2);
  ThreadWorker worker(*ranks.backends.owned[1], engine_config(), 1, /*lockstep=*/true);
  std::vector<std::unique_ptr<RankEngine>> remote;
  remote.push_back(worker.take_remote());
  DataParallelEngine engine({ranks.backends.owned[0].get()}, engine_config(), {}, /*lockstep=*/true,
                            std::move(remote));
  auto serve = [&](const std::vector<Case>& cases, const std::vector<Outcome>& expected, const char* wave) {
    std::map<RequestId, Outcome> outcomes;
    std::vector<RequestId> ids;
    for (const Case& c : cases) ids.push_back(engine.add_request(c.prompt, c.params));
    drain(engine, outcomes, std::chrono::seconds(120));
    for (size_t i = 0; i < cases.size(); ++i) {
      const Outcome& got = outcomes[ids[i]];
      EXPECT_TRUE(got.error.empty()) << got.error;
      EXPECT_EQ(got.tokens, expected[i].tokens) << wave << " request " << i;
    }
  };
  serve(first, expected_first, "first wave");
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  serve(second, expected_second, "second wave");
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(engine.rank_stats(r).used_bytes, 0) << "rank " << r;
    EXPECT_FALSE(engine.rank_failed(r));
  }
}

}  // namespace
}  // namespace dsv4
