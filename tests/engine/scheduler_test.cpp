// The scheduler with the real HybridKvCacheManager and a fake model step (the next token is a hash of everything
// before it, so a request's output does not depend on how it was chunked, batched, preempted or prefix-hit):
// chunk alignment, the token budget, preemption order, rejection messages, stop conditions, aborts, and random
// workloads over thousands of steps that check every invariant after every step and leave the pool empty.
#include "engine/scheduler.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>

#include "core/error.h"

namespace dsv4 {
namespace {

using ::testing::HasSubstr;

constexpr int32_t kEos = 7;
constexpr int32_t kFakeVocab = 512;  // sampled ids; eos and stop tokens come up now and then

// The fake model: the next token after `context` (FNV-1a over the ids).
int32_t fake_token(std::span<const int32_t> context) {
  uint64_t h = 1469598103934665603ull;
  for (const int32_t id : context) h = (h ^ static_cast<uint32_t>(id)) * 1099511628211ull;
  return static_cast<int32_t>((h >> 17) % kFakeVocab);
}

std::vector<int32_t> random_tokens(size_t n, std::mt19937& rng) {
  std::vector<int32_t> tokens(n);
  for (auto& t : tokens) t = static_cast<int32_t>(rng() % 50000);
  return tokens;
}

CacheLayout tiny_layout() {
  return CacheLayout::for_model(ModelConfig::preset("tiny"), KvStorage::kF32, IndexStorage::kF32);
}

int64_t page_bytes(const CacheLayout& layout) {
  return HybridKvCacheManager(layout, int64_t{1} << 32).pool().page_bytes();
}

// What the request produces alone, one token at a time: the reference for every scheduled run.
std::vector<int32_t> reference_output(std::vector<int32_t> tokens, const SamplingParams& params, int64_t max_model_len,
                                      RequestStatus* status) {
  std::vector<int32_t> output;
  const size_t prompt = tokens.size();
  while (true) {
    const int32_t token = fake_token(tokens);
    tokens.push_back(token);
    output.push_back(token);
    if ((!params.ignore_eos && token == kEos) ||
        std::find(params.stop_token_ids.begin(), params.stop_token_ids.end(), token) != params.stop_token_ids.end()) {
      *status = RequestStatus::kFinishedStopped;
      return output;
    }
    if (static_cast<int64_t>(tokens.size() - prompt) >= params.max_tokens ||
        static_cast<int64_t>(tokens.size()) >= max_model_len) {
      *status = RequestStatus::kFinishedLength;
      return output;
    }
  }
}

// The scheduler and manager driven the way the engine drives them, with the fake model in the middle.
struct FakeEngine {
  FakeEngine(CacheLayout layout, int64_t pool_bytes, PrefixCacheOptions options, SchedulerConfig config)
      : manager(std::move(layout), pool_bytes, options),
        scheduler(with_eos(std::move(config)), manager),
        prefix_caching(options.enabled) {}

  static SchedulerConfig with_eos(SchedulerConfig config) {
    config.eos_token_ids = {kEos};
    return config;
  }

  RequestId add(std::vector<int32_t> prompt, SamplingParams params) {
    const RequestId id = next_id++;
    scheduler.add_request(id, prompt, params);
    prompts[id] = std::move(prompt);
    sampling[id] = std::move(params);
    return id;
  }

  // Checks the scheduler output against the rules of scheduler.h.
  void validate(const SchedulerOutput& s) const {
    const SchedulerConfig& c = scheduler.config();
    int64_t tokens = 0;
    std::set<RequestId> ids;
    for (const ScheduledChunk& chunk : s.scheduled) {
      SCOPED_TRACE("request " + std::to_string(chunk.id));
      ASSERT_TRUE(ids.insert(chunk.id).second) << "scheduled twice";
      const Request* request = scheduler.find(chunk.id);
      ASSERT_NE(request, nullptr);
      ASSERT_GE(chunk.num_tokens, 1);
      tokens += chunk.num_tokens;
      const int64_t end = chunk.start + chunk.num_tokens;
      EXPECT_EQ(chunk.start, request->num_computed_tokens);
      ASSERT_LE(end, request->num_tokens());
      EXPECT_EQ(chunk.samples, end == request->num_tokens());
      const auto chunk_ids = chunk.token_ids();
      EXPECT_TRUE(std::equal(chunk_ids.begin(), chunk_ids.end(), request->token_ids.begin() + chunk.start,
                             request->token_ids.begin() + end));
      EXPECT_EQ(static_cast<int64_t>(chunk.context.size()), end);
      if (c.long_prefill_token_threshold > 0) {
        EXPECT_LE(chunk.num_tokens, c.long_prefill_token_threshold);
      }
      if (chunk.first_chunk) {
        EXPECT_EQ(chunk.start % kLogicalBlockTokens, 0) << "a prefix hit ends on a logical block";
        if (!prefix_caching) {
          EXPECT_EQ(chunk.start, 0);
        }
      }
      if (chunk.samples && c.align_prefill_chunks && c.checkpoint_last_full_block) {
        // The final chunk crosses no 256 boundary: it stopped at the last one first.
        EXPECT_TRUE(end % kLogicalBlockTokens == 0 || end / kLogicalBlockTokens * kLogicalBlockTokens <= chunk.start);
      }
      const int64_t last_full_block = request->num_tokens() / kLogicalBlockTokens * kLogicalBlockTokens;
      if (!chunk.samples && c.align_prefill_chunks && !(c.checkpoint_last_full_block && end == last_full_block)) {
        // Ends on a 256 boundary unless none lies in (start, end]; on an interval multiple if one does.
        if (end / kLogicalBlockTokens * kLogicalBlockTokens > chunk.start) {
          EXPECT_EQ(end % kLogicalBlockTokens, 0);
        }
        if (end / c.checkpoint_interval * c.checkpoint_interval > chunk.start) {
          EXPECT_EQ(end % c.checkpoint_interval, 0);
        }
      }
    }
    EXPECT_EQ(tokens, s.num_scheduled_tokens);
    EXPECT_LE(tokens, c.max_num_batched_tokens);
    EXPECT_LE(static_cast<int64_t>(s.scheduled.size()), c.max_num_seqs);
    for (const RequestId id : s.preempted_ids) {
      EXPECT_EQ(ids.count(id), 0u) << "request " << id << " preempted and scheduled in one step";
      const Request* request = scheduler.find(id);
      ASSERT_NE(request, nullptr);
      EXPECT_EQ(request->status, RequestStatus::kPreempted);
      EXPECT_EQ(request->num_computed_tokens, 0);
    }
    if (!s.preempted_ids.empty()) {
      for (const ScheduledChunk& chunk : s.scheduled)
        EXPECT_FALSE(chunk.first_chunk) << "admitted in a preempting step";
    }
  }

  // Mirrors the scheduler's running list (admission order): preemption takes victims from its back, and running
  // requests are scheduled in its order.
  void track_running_order(const SchedulerOutput& s) {
    for (const RequestId id : s.preempted_ids) {
      ASSERT_FALSE(running_order.empty());
      EXPECT_EQ(running_order.back(), id) << "the preempted request is not the newest running one";
      running_order.erase(std::find(running_order.begin(), running_order.end(), id));
    }
    size_t next = 0;
    for (const ScheduledChunk& chunk : s.scheduled) {
      if (chunk.first_chunk) {
        running_order.push_back(chunk.id);
        continue;
      }
      const auto from = running_order.begin() + static_cast<std::ptrdiff_t>(next);
      const auto it = std::find(from, running_order.end(), chunk.id);
      ASSERT_NE(it, running_order.end()) << "request " << chunk.id << " scheduled out of admission order";
      next = static_cast<size_t>(it - running_order.begin()) + 1;
    }
  }
  void forget(RequestId id) {
    const auto it = std::find(running_order.begin(), running_order.end(), id);
    if (it != running_order.end()) running_order.erase(it);
  }
  bool abort(RequestId id) {
    if (!scheduler.abort(id)) return false;
    aborted.insert(id);
    forget(id);
    return true;
  }

  // One step. `abort_mid_step`: aborts one scheduled request between schedule() and update().
  void step(std::mt19937* abort_mid_step = nullptr) {
    scheduler.schedule(out);
    manager.take_pending_copies();
    validate(out);
    track_running_order(out);
    sampled.assign(out.scheduled.size(), kNoToken);
    for (size_t i = 0; i < out.scheduled.size(); ++i)
      if (out.scheduled[i].samples) sampled[i] = fake_token(out.scheduled[i].context);
    if (abort_mid_step && !out.scheduled.empty()) {
      const RequestId id = out.scheduled[(*abort_mid_step)() % out.scheduled.size()].id;
      ASSERT_TRUE(abort(id));
    }
    scheduled_tokens += out.num_scheduled_tokens;
    scheduler.update(out, sampled, updates);
    manager.take_pending_copies();
    for (const TokenUpdate& update : updates) {
      EXPECT_EQ(aborted.count(update.id), 0u) << "an update for aborted request " << update.id;
      EXPECT_TRUE(update.error == nullptr) << *update.error;
      if (update.token != kNoToken) outputs[update.id].push_back(update.token);
      if (is_finished(update.status)) {
        finished[update.id] = update.status;
        forget(update.id);
      }
    }
    manager.check_invariants();
    scheduler.check_invariants();
    ++steps;
  }

  // Runs until nothing is left; false if it did not finish within `max_steps`.
  bool drain(int64_t max_steps) {
    for (int64_t i = 0; i < max_steps && scheduler.has_unfinished(); ++i) {
      step();
      if (::testing::Test::HasFailure()) return false;
    }
    return !scheduler.has_unfinished();
  }

  // Every request that was not aborted produced exactly what it produces alone.
  void expect_reference_outputs() const {
    for (const auto& [id, prompt] : prompts) {
      if (aborted.count(id)) continue;
      SCOPED_TRACE("request " + std::to_string(id) + " of " + std::to_string(prompt.size()) + " prompt tokens");
      RequestStatus status;
      const auto expected = reference_output(prompt, sampling.at(id), scheduler.config().max_model_len, &status);
      ASSERT_TRUE(finished.count(id));
      EXPECT_EQ(finished.at(id), status);
      EXPECT_EQ(outputs.count(id) ? outputs.at(id) : std::vector<int32_t>{}, expected);
    }
  }

  HybridKvCacheManager manager;
  Scheduler scheduler;
  bool prefix_caching = true;
  std::vector<RequestId> running_order;
  SchedulerOutput out;
  std::vector<int32_t> sampled;
  std::vector<TokenUpdate> updates;
  RequestId next_id = 1;
  std::map<RequestId, std::vector<int32_t>> prompts, outputs;
  std::map<RequestId, SamplingParams> sampling;
  std::map<RequestId, RequestStatus> finished;
  std::set<RequestId> aborted;
  int64_t steps = 0, scheduled_tokens = 0;
};

SchedulerConfig config(int64_t budget, int64_t max_seqs = 64, int64_t max_model_len = 1 << 16) {
  SchedulerConfig c;
  c.max_num_batched_tokens = budget;
  c.max_num_seqs = max_seqs;
  c.max_model_len = max_model_len;
  c.checkpoint_interval = 512;
  return c;
}

SamplingParams greedy(int64_t max_tokens, bool ignore_eos = true) {
  SamplingParams p;
  p.max_tokens = max_tokens;
  p.ignore_eos = ignore_eos;
  return p;
}

std::vector<std::pair<int64_t, int64_t>> prefill_chunks(FakeEngine& engine, RequestId id) {
  std::vector<std::pair<int64_t, int64_t>> chunks;
  while (engine.scheduler.find(id) && engine.scheduler.find(id)->num_output_tokens() == 0) {
    engine.step();
    for (const auto& chunk : engine.out.scheduled)
      if (chunk.id == id) chunks.emplace_back(chunk.start, chunk.start + chunk.num_tokens);
    if (::testing::Test::HasFailure()) break;
  }
  return chunks;
}

using Chunks = std::vector<std::pair<int64_t, int64_t>>;

TEST(Scheduler, PrefillChunksEndOnCheckpointThenBlockBoundaries) {
  std::mt19937 rng(1);
  {  // interval 512, budget 1000: [0,512) [512,1024), then the rest split at its last full block 1792.
    FakeEngine engine(tiny_layout(), int64_t{64} << 20, {true, 512, ""}, config(1000));
    const RequestId id = engine.add(random_tokens(2000, rng), greedy(2));
    EXPECT_EQ(prefill_chunks(engine, id), (Chunks{{0, 512}, {512, 1024}, {1024, 1792}, {1792, 2000}}));
  }
  {  // the same without checkpoint_last_full_block: the final chunk ends at the prompt end.
    SchedulerConfig c = config(1000);
    c.checkpoint_last_full_block = false;
    FakeEngine engine(tiny_layout(), int64_t{64} << 20, {true, 512, ""}, c);
    const RequestId id = engine.add(random_tokens(2000, rng), greedy(2));
    EXPECT_EQ(prefill_chunks(engine, id), (Chunks{{0, 512}, {512, 1024}, {1024, 2000}}));
  }
  {  // a prompt that fits one chunk still stops at its last full block.
    FakeEngine engine(tiny_layout(), int64_t{64} << 20, {true, 512, ""}, config(4096));
    const RequestId id = engine.add(random_tokens(600, rng), greedy(2));
    EXPECT_EQ(prefill_chunks(engine, id), (Chunks{{0, 512}, {512, 600}}));
    const RequestId exact = engine.add(random_tokens(512, rng), greedy(2));
    EXPECT_EQ(prefill_chunks(engine, exact), (Chunks{{0, 512}}));
  }
  {  // budget 700: the interval multiple 512 when it keeps tokens, else the 256 boundary.
    FakeEngine engine(tiny_layout(), int64_t{64} << 20, {true, 512, ""}, config(700));
    const RequestId id = engine.add(random_tokens(1500, rng), greedy(2));
    EXPECT_EQ(prefill_chunks(engine, id), (Chunks{{0, 512}, {512, 1024}, {1024, 1280}, {1280, 1500}}));
  }
  {  // budget 300 < interval: 256-aligned ends.
    FakeEngine engine(tiny_layout(), int64_t{64} << 20, {true, 512, ""}, config(300));
    const RequestId id = engine.add(random_tokens(700, rng), greedy(2));
    EXPECT_EQ(prefill_chunks(engine, id), (Chunks{{0, 256}, {256, 512}, {512, 700}}));
  }
  {  // budget 200 < 256: an unaligned chunk, then one back on the boundary; the last ends at the prompt end.
    FakeEngine engine(tiny_layout(), int64_t{64} << 20, {true, 512, ""}, config(200));
    const RequestId id = engine.add(random_tokens(600, rng), greedy(2));
    EXPECT_EQ(prefill_chunks(engine, id), (Chunks{{0, 200}, {200, 256}, {256, 456}, {456, 512}, {512, 600}}));
  }
  {  // long_prefill_token_threshold caps a chunk below the budget.
    SchedulerConfig c = config(4096);
    c.long_prefill_token_threshold = 300;
    FakeEngine engine(tiny_layout(), int64_t{64} << 20, {true, 512, ""}, c);
    const RequestId id = engine.add(random_tokens(800, rng), greedy(2));
    EXPECT_EQ(prefill_chunks(engine, id), (Chunks{{0, 256}, {256, 512}, {512, 768}, {768, 800}}));
  }
  {  // alignment off: chunks end where the budget does.
    SchedulerConfig c = config(300);
    c.align_prefill_chunks = false;
    FakeEngine engine(tiny_layout(), int64_t{64} << 20, {false, 512, ""}, c);
    const RequestId id = engine.add(random_tokens(700, rng), greedy(2));
    EXPECT_EQ(prefill_chunks(engine, id), (Chunks{{0, 300}, {300, 600}, {600, 700}}));
  }
}

TEST(Scheduler, RunningRequestsComeFirstAndShareTheBudget) {
  std::mt19937 rng(2);
  FakeEngine engine(tiny_layout(), int64_t{64} << 20, {true, 512, ""}, config(600, 3));
  const RequestId a = engine.add(random_tokens(100, rng), greedy(50));
  const RequestId b = engine.add(random_tokens(100, rng), greedy(50));
  engine.step();  // both prefills in one step
  ASSERT_EQ(engine.out.scheduled.size(), 2u);
  const RequestId c = engine.add(random_tokens(2000, rng), greedy(50));
  const RequestId d = engine.add(random_tokens(10, rng), greedy(50));
  engine.step();  // two decodes, then c gets what is left (598 → aligned to 512); d waits for max_num_seqs
  ASSERT_EQ(engine.out.scheduled.size(), 3u);
  EXPECT_EQ(engine.out.scheduled[0].id, a);
  EXPECT_EQ(engine.out.scheduled[0].num_tokens, 1);
  EXPECT_EQ(engine.out.scheduled[1].id, b);
  EXPECT_EQ(engine.out.scheduled[2].id, c);
  EXPECT_EQ(engine.out.scheduled[2].num_tokens, 512);
  EXPECT_TRUE(engine.out.scheduled[2].first_chunk);
  EXPECT_EQ(engine.scheduler.find(d)->status, RequestStatus::kWaiting);
  ASSERT_TRUE(engine.drain(10000));
  engine.expect_reference_outputs();
}

TEST(Scheduler, PreemptsTheNewestAndResumesItFirstWithItsOutput) {
  std::mt19937 rng(3);
  const CacheLayout layout = tiny_layout();
  // 8 pages: 7 for one page per group, and one more that two requests of 2300 tokens fill but three do not.
  const int64_t page = page_bytes(layout);
  FakeEngine engine(layout, 8 * page, {false, 512, ""}, config(4096));
  std::vector<RequestId> ids;
  for (int i = 0; i < 3; ++i) ids.push_back(engine.add(random_tokens(1900, rng), greedy(400)));
  std::vector<RequestId> preempted;
  for (int i = 0; i < 2000 && engine.scheduler.has_unfinished(); ++i) {
    engine.step();
    ASSERT_FALSE(::testing::Test::HasFailure());
    for (const RequestId id : engine.out.preempted_ids) {
      preempted.push_back(id);
      // The newest running request is the victim; it waits at the front of the queue with its output kept.
      const Request* request = engine.scheduler.find(id);
      EXPECT_EQ(request->num_computed_tokens, 0);
      EXPECT_EQ(request->num_output_tokens(), static_cast<int64_t>(engine.outputs[id].size()));
    }
  }
  ASSERT_FALSE(preempted.empty()) << "the pool never ran short; make it smaller";
  EXPECT_NE(preempted.front(), ids.front()) << "the oldest request is never the first victim";
  EXPECT_GT(engine.scheduler.num_preemptions(), 0);
  engine.expect_reference_outputs();
  EXPECT_EQ(engine.manager.pool().usage().free_page_bytes, engine.manager.pool().usage().pool_bytes);
}

TEST(Scheduler, RejectsRequestsThatCanNeverRunNamingTheNumbers) {
  std::mt19937 rng(4);
  const CacheLayout layout = tiny_layout();
  FakeEngine engine(layout, 8 * page_bytes(layout), {true, 512, ""}, config(512, 8, 5000));
  try {
    engine.add(random_tokens(4000, rng), greedy(1001));
    FAIL() << "a request longer than max_model_len was accepted";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("4000"));
    EXPECT_THAT(e.what(), HasSubstr("1001"));
    EXPECT_THAT(e.what(), HasSubstr("max_model_len 5000"));
  }
  // Fits max_model_len but not the pool.
  int64_t too_big = 256;
  while (engine.manager.fits_in_pool(too_big)) too_big *= 2;
  SchedulerConfig roomy = config(512, 8, int64_t{1} << 30);
  FakeEngine small(layout, 8 * page_bytes(layout), {true, 512, ""}, roomy);
  try {
    small.add(random_tokens(static_cast<size_t>(too_big - 10), rng), greedy(10));
    FAIL() << "a request larger than the pool was accepted";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr(std::to_string(too_big - 10)));
    EXPECT_THAT(e.what(), HasSubstr(std::to_string(too_big)));
    EXPECT_THAT(e.what(), HasSubstr("pool"));
  }
  EXPECT_THROW(engine.add({}, greedy(1)), Error);
  EXPECT_THROW(engine.add(random_tokens(5, rng), greedy(0)), Error);
  EXPECT_NO_THROW(engine.scheduler.add_request(1000, random_tokens(5, rng), greedy(1)));
  EXPECT_THROW(engine.scheduler.add_request(1000, random_tokens(5, rng), greedy(1)), Error) << "duplicate id";
  EXPECT_FALSE(engine.scheduler.abort(12345));
}

TEST(Scheduler, StopConditions) {
  std::mt19937 rng(5);
  FakeEngine engine(tiny_layout(), int64_t{64} << 20, {true, 512, ""}, config(4096, 64, 300));
  // Find prompts whose first generated tokens are known, then stop on them.
  const auto prompt = random_tokens(50, rng);
  RequestStatus status;
  const auto free_run = reference_output(prompt, greedy(20), 1 << 20, &status);
  SamplingParams stop = greedy(20);
  stop.stop_token_ids = {free_run[3]};
  const RequestId stopped = engine.add(prompt, stop);
  const RequestId length = engine.add(prompt, greedy(5));
  const RequestId model_len = engine.add(random_tokens(290, rng), greedy(10));  // 300 = max_model_len
  ASSERT_TRUE(engine.drain(1000));
  engine.expect_reference_outputs();
  EXPECT_EQ(engine.finished[stopped], RequestStatus::kFinishedStopped);
  EXPECT_EQ(engine.outputs[stopped].back(), free_run[3]);
  EXPECT_LE(engine.outputs[stopped].size(), 4u);
  EXPECT_EQ(engine.finished[length], RequestStatus::kFinishedLength);
  EXPECT_EQ(engine.outputs[length].size(), 5u);
  EXPECT_EQ(engine.outputs[model_len].size(), 10u);
  // eos stops unless ignore_eos: search for a prompt that samples eos within a few tokens.
  for (int trial = 0; trial < 100000; ++trial) {
    auto p = random_tokens(8, rng);
    if (fake_token(p) != kEos) continue;
    const RequestId with_eos = engine.add(p, greedy(4, /*ignore_eos=*/false));
    const RequestId without = engine.add(p, greedy(4, /*ignore_eos=*/true));
    ASSERT_TRUE(engine.drain(100));
    EXPECT_EQ(engine.finished[with_eos], RequestStatus::kFinishedStopped);
    EXPECT_EQ(engine.outputs[with_eos], std::vector<int32_t>{kEos});
    EXPECT_EQ(engine.finished[without], RequestStatus::kFinishedLength);
    EXPECT_EQ(engine.outputs[without].size(), 4u);
    return;
  }
  FAIL() << "no prompt samples eos";
}

TEST(Scheduler, AbortFreesBlocksWhetherWaitingRunningOrMidStep) {
  std::mt19937 rng(6);
  FakeEngine engine(tiny_layout(), int64_t{64} << 20, {false, 512, ""}, config(300, 2));
  const RequestId a = engine.add(random_tokens(1000, rng), greedy(100));
  const RequestId b = engine.add(random_tokens(1000, rng), greedy(100));
  const RequestId c = engine.add(random_tokens(100, rng), greedy(100));
  engine.step();  // a mid-prefill
  EXPECT_TRUE(engine.manager.has_request(a));
  EXPECT_GT(engine.manager.pool().usage().used_block_bytes, 0);
  EXPECT_TRUE(engine.abort(a));
  EXPECT_FALSE(engine.manager.has_request(a));
  EXPECT_FALSE(engine.scheduler.abort(a)) << "already finished";
  EXPECT_TRUE(engine.abort(c));  // waiting: held nothing
  engine.step();
  EXPECT_THAT(engine.out.finished_ids, ::testing::ElementsAre(a, c));
  engine.step(&rng);  // aborts b between schedule and update
  EXPECT_EQ(engine.aborted.count(b), 1u);
  EXPECT_FALSE(engine.scheduler.has_unfinished());
  const auto usage = engine.manager.pool().usage();
  EXPECT_EQ(usage.used_block_bytes, 0);
  EXPECT_EQ(usage.free_page_bytes, usage.pool_bytes);
}

struct WorkloadCase {
  const char* name;
  const char* preset;
  KvStorage kv;
  IndexStorage index;
  bool prefix_caching;
  int64_t pool_pages;
  int64_t budget, max_seqs, threshold, interval;
};

class SchedulerWorkload : public ::testing::TestWithParam<WorkloadCase> {};

// Random arrivals (shared prefixes, repeats, some too long to accept), random aborts (also mid-step), a pool small
// enough to preempt often: every invariant after every step, every surviving request's output equal to its
// undisturbed run, and the pool back to empty at the end.
TEST_P(SchedulerWorkload, RandomArrivalsAbortsAndPreemption) {
  const WorkloadCase& p = GetParam();
  const CacheLayout layout = CacheLayout::for_model(ModelConfig::preset(p.preset), p.kv, p.index);
  SchedulerConfig c = config(p.budget, p.max_seqs, 6000);
  c.long_prefill_token_threshold = p.threshold;
  c.checkpoint_interval = p.interval;
  c.align_prefill_chunks = p.prefix_caching;
  FakeEngine engine(layout, p.pool_pages * page_bytes(layout), {p.prefix_caching, p.interval, "test"}, c);
  std::mt19937 rng(static_cast<uint32_t>(p.pool_pages * 7 + p.budget));
  std::vector<std::vector<int32_t>> prefixes;
  for (const size_t length : {256, 512 + 17, 1024, 1500}) prefixes.push_back(random_tokens(length, rng));
  std::vector<std::vector<int32_t>> history;
  int64_t rejected = 0, accepted = 0;
  const int kArrivalSteps = 2500;
  for (int step = 0; step < kArrivalSteps; ++step) {
    if (rng() % 100 < 25) {
      const int arrivals = 1 + static_cast<int>(rng() % 3);
      for (int k = 0; k < arrivals; ++k) {
        std::vector<int32_t> prompt;
        const int kind = static_cast<int>(rng() % 100);
        if (kind < 10 && !history.empty()) {
          prompt = history[rng() % history.size()];  // a repeat: hits all but its tail
        } else if (kind < 55) {
          prompt = prefixes[rng() % prefixes.size()];
          const auto tail = random_tokens(1 + rng() % 600, rng);
          prompt.insert(prompt.end(), tail.begin(), tail.end());
        } else if (kind < 58) {
          prompt = random_tokens(3000 + rng() % 8000, rng);  // often over max_model_len or the pool
        } else {
          prompt = random_tokens(1 + rng() % 900, rng);
        }
        SamplingParams params = greedy(1 + static_cast<int64_t>(rng() % 120), rng() % 3 == 0);
        if (rng() % 4 == 0) params.stop_token_ids = {static_cast<int32_t>(rng() % kFakeVocab)};
        try {
          engine.add(prompt, params);
          ++accepted;
          if (history.size() < 64) history.push_back(prompt);
        } catch (const Error& e) {
          ++rejected;
          const int64_t total = static_cast<int64_t>(prompt.size()) + params.max_tokens;
          EXPECT_TRUE(total > c.max_model_len || !engine.manager.fits_in_pool(total)) << e.what();
          EXPECT_THAT(e.what(), HasSubstr(std::to_string(prompt.size())));
        }
      }
    }
    if (rng() % 100 < 2 && !engine.prompts.empty()) {  // abort a random live request
      auto it = engine.prompts.begin();
      std::advance(it, rng() % engine.prompts.size());
      engine.abort(it->first);
    }
    engine.step(rng() % 200 == 0 ? &rng : nullptr);
    ASSERT_FALSE(HasFailure()) << "step " << step;
  }
  ASSERT_TRUE(engine.drain(200000)) << "requests left after draining: " << engine.scheduler.num_waiting()
                                    << " waiting, " << engine.scheduler.num_running() << " running";
  engine.expect_reference_outputs();
  const auto usage = engine.manager.pool().usage();
  EXPECT_EQ(usage.used_block_bytes, 0);
  if (!p.prefix_caching) {
    EXPECT_EQ(usage.cached_block_bytes, 0);
    EXPECT_EQ(usage.free_page_bytes, usage.pool_bytes);
    EXPECT_EQ(engine.manager.num_checkpoints(), 0);
  }
  EXPECT_GT(rejected, 0);
  EXPECT_GT(engine.scheduler.num_preemptions(), 0) << "the pool never ran short";
  EXPECT_GT(engine.aborted.size(), 0u);
  if (p.prefix_caching) {
    EXPECT_GT(engine.manager.stats().prefix_hit_tokens, 0);
  }
  std::cout << "[ " << p.name << " ] " << engine.steps << " steps, " << accepted << " accepted, " << rejected
            << " rejected, " << engine.aborted.size() << " aborted, " << engine.scheduler.num_preemptions()
            << " preemptions, " << engine.scheduled_tokens << " tokens scheduled, prefix hits "
            << engine.manager.stats().prefix_hit_tokens << " tokens, evicted " << engine.manager.stats().blocks_evicted
            << " blocks\n";
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, SchedulerWorkload,
    ::testing::Values(
        WorkloadCase{.name = "tiny_f32_prefix", .preset = "tiny", .kv = KvStorage::kF32, .index = IndexStorage::kF32,
                     .prefix_caching = true, .pool_pages = 12, .budget = 512, .max_seqs = 32, .threshold = 0,
                     .interval = 512},
        WorkloadCase{.name = "tiny_f32_noprefix", .preset = "tiny", .kv = KvStorage::kF32, .index = IndexStorage::kF32,
                     .prefix_caching = false, .pool_pages = 12, .budget = 512, .max_seqs = 32, .threshold = 0,
                     .interval = 512},
        WorkloadCase{.name = "tiny_f32_threshold", .preset = "tiny", .kv = KvStorage::kF32, .index = IndexStorage::kF32,
                     .prefix_caching = true, .pool_pages = 16, .budget = 1024, .max_seqs = 16, .threshold = 200,
                     .interval = 256},
        WorkloadCase{.name = "flash_fp8_fp4_prefix", .preset = "v4-flash", .kv = KvStorage::kFp8,
                     .index = IndexStorage::kFp4, .prefix_caching = true, .pool_pages = 9, .budget = 768,
                     .max_seqs = 48, .threshold = 0, .interval = 1024}),
    [](const ::testing::TestParamInfo<WorkloadCase>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace dsv4
