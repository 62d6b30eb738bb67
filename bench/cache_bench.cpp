// The CPU cost of one scheduler step with N running decode requests, against the real HybridKvCacheManager and no
// model: schedule() (allocate per request), the pending copies, update() with fake sampled tokens (commit per
// request: window freeing, block hashing, checkpoints at 256-token boundaries). The requests start at lengths
// drawn uniformly from 100..8000 tokens and grow by one token per iteration; the layout is V4-Flash's with FP8
// main entries and FP4 index keys, the pool large enough that nothing is ever preempted.
// Target: <= 50 us per step at 1024 requests. Run: build/bench/dsv4_bench_cache
#include <benchmark/benchmark.h>

#include <random>

#include "cache/hybrid_kv_cache_manager.h"
#include "core/error.h"
#include "engine/scheduler.h"

namespace dsv4 {
namespace {

constexpr int64_t kIterations = 3000;  // fixed, so every run grows the requests by the same amount
constexpr int64_t kMinLength = 100, kMaxLength = 8000;

struct DecodeWorkload {
  DecodeWorkload(int64_t requests, bool prefix_caching)
      : layout(CacheLayout::for_model(ModelConfig::preset("v4-flash"), KvStorage::kFp8, IndexStorage::kFp4)),
        manager(layout, pool_bytes(layout, requests), PrefixCacheOptions{prefix_caching, 1024, "bench"}),
        scheduler(scheduler_config(requests), manager) {
    std::mt19937 rng(1);
    std::uniform_int_distribution<int64_t> length(kMinLength, kMaxLength);
    SamplingParams params;
    params.max_tokens = int64_t{1} << 20;
    params.ignore_eos = true;
    for (int64_t id = 0; id < requests; ++id) {
      std::vector<int32_t> prompt(static_cast<size_t>(length(rng)));
      for (auto& token : prompt) token = static_cast<int32_t>(rng() % 129280);
      scheduler.add_request(static_cast<RequestId>(id), std::move(prompt), params);
    }
    // The prefills, in as many steps as the budget needs, until every request decodes.
    while (scheduler.num_waiting() > 0 || out.scheduled.empty() || out.num_scheduled_tokens != requests) step();
    DSV4_CHECK(scheduler.num_running() == requests && scheduler.num_preemptions() == 0,
          "bench setup: " + std::to_string(scheduler.num_running()) + " of " + std::to_string(requests) +
              " requests running, " + std::to_string(scheduler.num_preemptions()) + " preemptions");
  }

  static int64_t pool_bytes(const CacheLayout& layout, int64_t requests) {
    // Bytes of every group at the longest length a request reaches, plus a page per group of slack.
    const int64_t longest = kMaxLength + 2 * kIterations + 2 * kLogicalBlockTokens;
    int64_t bytes = 0;
    for (const CacheGroupSpec& group : layout.groups) {
      int64_t blocks = 1;
      if (group.growth == GroupGrowth::kHistory)
        blocks = (longest / group.tokens_per_entry) / group.entries_per_block + 1;
      if (group.growth == GroupGrowth::kWindow) blocks = group.window_tokens / group.tokens_per_block() + 2;
      bytes += 2 * blocks * group.block_bytes();  // x2: room for the checkpoint snapshots and the cached blocks
    }
    return requests * bytes + (int64_t{1} << 30);
  }

  static SchedulerConfig scheduler_config(int64_t requests) {
    SchedulerConfig config;
    config.max_num_seqs = requests;
    config.max_num_batched_tokens = 64 * 1024;
    config.max_model_len = int64_t{1} << 21;
    config.eos_token_ids = {1};
    return config;
  }

  void step() {
    scheduler.schedule(out);
    benchmark::DoNotOptimize(manager.take_pending_copies());
    sampled.assign(out.scheduled.size(), 17);
    scheduler.update(out, sampled, updates);
    benchmark::DoNotOptimize(manager.take_pending_copies());
  }

  CacheLayout layout;
  HybridKvCacheManager manager;
  Scheduler scheduler;
  SchedulerOutput out;
  std::vector<int32_t> sampled;
  std::vector<TokenUpdate> updates;
};

void run_decode_steps(benchmark::State& state, bool prefix_caching) {
  const int64_t requests = state.range(0);
  DecodeWorkload workload(requests, prefix_caching);
  for (auto _ : state) {
    workload.step();
    if (workload.out.num_scheduled_tokens != requests) state.SkipWithError("a request was not scheduled");
  }
  state.SetItemsProcessed(state.iterations() * requests);
  state.counters["ns/request"] = benchmark::Counter(
      static_cast<double>(requests), benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
  state.counters["checkpoints"] = static_cast<double>(workload.manager.stats().checkpoints_taken);
  state.counters["pool_GiB"] = static_cast<double>(workload.manager.pool().num_pages() *
                                                   workload.manager.pool().page_bytes()) / (1 << 30);
}

// The manager's share of a step: the same requests, allocate(id, 1) + commit + the copies, no scheduler. The
// difference to BM_SchedulerStepDecode is the scheduler's own cost.
void BM_ManagerOnlyDecode(benchmark::State& state) {
  const int64_t requests = state.range(0);
  DecodeWorkload workload(requests, true);
  std::vector<std::vector<int32_t>> tokens;
  std::vector<int64_t> computed;
  for (int64_t id = 0; id < requests; ++id) {
    const Request* request = workload.scheduler.find(static_cast<RequestId>(id));
    tokens.emplace_back(request->token_ids.begin(), request->token_ids.end());
    tokens.back().reserve(tokens.back().size() + kIterations + 1);
    computed.push_back(request->num_computed_tokens);
  }
  for (auto _ : state) {
    for (int64_t id = 0; id < requests; ++id)
      if (!workload.manager.allocate(static_cast<RequestId>(id), 1)) state.SkipWithError("allocate failed");
    benchmark::DoNotOptimize(workload.manager.take_pending_copies());
    for (int64_t id = 0; id < requests; ++id) {
      auto& t = tokens[static_cast<size_t>(id)];
      t.push_back(17);
      workload.manager.commit(static_cast<RequestId>(id), t, ++computed[static_cast<size_t>(id)]);
    }
    benchmark::DoNotOptimize(workload.manager.take_pending_copies());
  }
  state.SetItemsProcessed(state.iterations() * requests);
  state.counters["ns/request"] = benchmark::Counter(
      static_cast<double>(requests), benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}
BENCHMARK(BM_ManagerOnlyDecode)->Arg(1024)->Iterations(kIterations)->Unit(benchmark::kMicrosecond);

void BM_SchedulerStepDecode(benchmark::State& state) { run_decode_steps(state, true); }
void BM_SchedulerStepDecodeNoPrefixCache(benchmark::State& state) { run_decode_steps(state, false); }

BENCHMARK(BM_SchedulerStepDecode)->Arg(64)->Arg(256)->Arg(1024)->Iterations(kIterations)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_SchedulerStepDecodeNoPrefixCache)->Arg(1024)->Iterations(kIterations)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace dsv4

BENCHMARK_MAIN();
