// DataParallelRouter (engine/dp_router.h): prefix affinity, the balance override, eviction, load reports, and
// random workloads against a brute-force reference written here (every rank's match found by testing every
// prefix length against a plain list of hashes, every load recounted from a plain list of requests).
#include "engine/dp_router.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <random>
#include <vector>

#include "cache/block_hash.h"
#include "cache/cache_spec.h"
#include "core/error.h"

namespace dsv4 {
namespace {

constexpr int64_t kBlock = kLogicalBlockTokens;

// `blocks` logical blocks of document `doc` (the same doc always gives the same tokens), then `tail` more tokens
// drawn from `tail_seed`.
std::vector<int32_t> prompt_of(int doc, int64_t blocks, int64_t tail, uint32_t tail_seed = 1) {
  std::vector<int32_t> tokens;
  std::mt19937 doc_rng(static_cast<uint32_t>(1000 + doc));
  for (int64_t i = 0; i < blocks * kBlock; ++i) tokens.push_back(static_cast<int32_t>(doc_rng() % 129280));
  std::mt19937 tail_rng(tail_seed);
  for (int64_t i = 0; i < tail; ++i) tokens.push_back(static_cast<int32_t>(tail_rng() % 129280));
  return tokens;
}

// What a rank's cache manager names the full blocks of `tokens` (all of them, as commit() hashes them).
std::vector<uint64_t> cached_hashes(const std::vector<int32_t>& tokens, const std::string& salt = "") {
  return logical_block_hashes(prefix_root_hash(salt), tokens, static_cast<int64_t>(tokens.size()) / kBlock);
}

DataParallelRouterConfig config_for(int ranks) {
  DataParallelRouterConfig config;
  config.num_ranks = ranks;
  return config;
}

TEST(DataParallelRouter, BlockHashesChainAsTheCacheManagerNamesThem) {
  const std::vector<int32_t> tokens = prompt_of(3, 3, 10);
  const std::vector<uint64_t> hashes = cached_hashes(tokens, "model-a");
  ASSERT_EQ(hashes.size(), 3u);
  uint64_t parent = prefix_root_hash("model-a");
  for (size_t b = 0; b < hashes.size(); ++b) {
    parent = chain_block_hash(parent, std::span<const int32_t>(tokens).subspan(b * kBlock, kBlock));
    EXPECT_EQ(hashes[b], parent);
  }
  EXPECT_NE(cached_hashes(tokens, "model-b")[0], hashes[0]);  // the salt separates models / tenants
}

TEST(DataParallelRouter, OneRankAlwaysRoutesToZero) {
  DataParallelRouter router(config_for(1));
  std::mt19937 rng(7);
  for (int i = 0; i < 200; ++i) {
    const std::vector<int32_t> prompt = prompt_of(static_cast<int>(rng() % 3), rng() % 5, 1 + rng() % 300, rng());
    if (i % 3 == 0) router.on_blocks_cached(0, cached_hashes(prompt));
    const RankChoice choice = router.route(prompt);
    EXPECT_EQ(choice.rank, 0);
    EXPECT_FALSE(choice.affinity_broken);
    router.on_admitted(0, static_cast<RequestId>(i), static_cast<int64_t>(prompt.size()), choice.matched_prefix_tokens);
  }
}

TEST(DataParallelRouter, SamePrefixGoesToTheRankThatHoldsIt) {
  DataParallelRouter router(config_for(4));
  router.on_blocks_cached(2, cached_hashes(prompt_of(5, 4, 0)));
  router.on_blocks_cached(1, cached_hashes(prompt_of(5, 1, 0)));  // a shorter holder of the same prefix
  for (uint32_t turn = 0; turn < 5; ++turn) {
    const RankChoice choice = router.route(prompt_of(5, 4, 20 + turn * 50, turn));
    EXPECT_EQ(choice.rank, 2);
    EXPECT_EQ(choice.matched_prefix_tokens, 4 * kBlock);
    EXPECT_FALSE(choice.affinity_broken);
  }
  // A moderate queue on the holder (within the balance threshold) keeps the affinity.
  router.on_admitted(2, 1, 700, 0);
  const RankChoice loaded = router.route(prompt_of(5, 4, 100));
  EXPECT_EQ(loaded.rank, 2);
  EXPECT_DOUBLE_EQ(loaded.cost, 700.0 + 100.0);
  // A prompt that is exactly the cached blocks matches one block less: a hit leaves a token to compute.
  EXPECT_EQ(router.route(prompt_of(5, 4, 0)).matched_prefix_tokens, 3 * kBlock);
  // Nobody holds a prefix: the cheapest rank, the lowest among equals.
  EXPECT_EQ(router.route(prompt_of(6, 4, 100)).rank, 0);
}

TEST(DataParallelRouter, ALongQueueLosesToAnIdleRankWhenRecomputingIsCheaper) {
  DataParallelRouter router(config_for(2));
  const std::vector<int32_t> prompt = prompt_of(1, 4, 276);  // 1300 tokens, 1024 cached on rank 1
  router.on_blocks_cached(1, cached_hashes(prompt_of(1, 4, 0)));

  router.on_admitted(1, 10, 300, 0);  // a short queue: 300 + 276 uncached < 1300 on the idle rank
  RankChoice choice = router.route(prompt);
  EXPECT_EQ(choice.rank, 1);
  EXPECT_EQ(choice.matched_prefix_tokens, 1024);

  router.on_admitted(1, 11, 20000, 0);  // now 20,300 queued ahead of a 276-token suffix: recomputing wins
  choice = router.route(prompt);
  EXPECT_EQ(choice.rank, 0);
  EXPECT_EQ(choice.matched_prefix_tokens, 0);
  EXPECT_TRUE(choice.affinity_broken);
  EXPECT_DOUBLE_EQ(choice.cost, 1300.0);

  // Running decodes count too: 64 decodes at 128K context each on the holder, no queue.
  ASSERT_TRUE(router.on_finished(10));
  ASSERT_TRUE(router.on_finished(11));
  for (RequestId id = 100; id < 164; ++id) {
    router.on_admitted(1, id, 1000, 0);
    router.on_progress(id, 1000, 131072);
  }
  EXPECT_EQ(router.load(1).running_decode_requests, 64);
  EXPECT_EQ(router.load(1).decode_context_tokens, 64 * 131072);
  // 276 + 1 step × (64 × 8 + 64 × 131072 / 262144) = 276 + 544 = 820 < 1300: still the holder.
  EXPECT_DOUBLE_EQ(router.cost(1, 1300, 1024), 820.0);
  EXPECT_EQ(router.route(prompt).rank, 1);
  // With a long suffix the decodes run alongside for several steps: 1024 cached of 9216 → 8192 uncached, 4 steps.
  const std::vector<int32_t> long_prompt = prompt_of(1, 4, 8192);
  EXPECT_DOUBLE_EQ(router.cost(1, 9216, 1024), 8192.0 + 4 * 544.0);
  EXPECT_DOUBLE_EQ(router.cost(0, 9216, 0), 9216.0);
  // 10,368 − 9,216 = 1,152 > 256, but 10,368 < 1.25 × 9,216: the relative threshold keeps the affinity.
  EXPECT_EQ(router.route(long_prompt).rank, 1);
  DataParallelRouterConfig strict = config_for(2);
  strict.balance_rel_threshold = 1.1;  // 10,368 > 1.1 × 9,216: now the queue cost wins
  DataParallelRouter strict_router(strict);
  strict_router.on_blocks_cached(1, cached_hashes(prompt_of(1, 4, 0)));
  for (RequestId id = 100; id < 164; ++id) {
    strict_router.on_admitted(1, id, 1000, 0);
    strict_router.on_progress(id, 1000, 131072);
  }
  const RankChoice broken = strict_router.route(long_prompt);
  EXPECT_EQ(broken.rank, 0);
  EXPECT_TRUE(broken.affinity_broken);
}

TEST(DataParallelRouter, EvictedBlocksStopMatchingFromTheFirstMissingOne) {
  DataParallelRouter router(config_for(3));
  const std::vector<uint64_t> hashes = cached_hashes(prompt_of(2, 6, 0));
  router.on_blocks_cached(1, hashes);
  router.on_blocks_cached(1, hashes);  // reported twice: idempotent
  EXPECT_EQ(router.num_cached_blocks(1), 6);
  const std::vector<int32_t> prompt = prompt_of(2, 6, 40);
  EXPECT_EQ(router.route(prompt).matched_prefix_tokens, 6 * kBlock);

  router.on_blocks_evicted(1, std::vector<uint64_t>{hashes[3]});  // a middle block: blocks 4, 5 are unreachable
  RankChoice choice = router.route(prompt);
  EXPECT_EQ(choice.rank, 1);
  EXPECT_EQ(choice.matched_prefix_tokens, 3 * kBlock);

  router.on_blocks_cached(2, std::vector<uint64_t>(hashes.begin(), hashes.begin() + 5));  // rank 2 has 5 now
  choice = router.route(prompt);
  EXPECT_EQ(choice.rank, 2);
  EXPECT_EQ(choice.matched_prefix_tokens, 5 * kBlock);

  router.on_blocks_evicted(2, hashes);
  router.on_blocks_evicted(1, std::vector<uint64_t>{hashes[0]});  // the first block: nothing matches
  EXPECT_EQ(router.num_cached_blocks(2), 0);
  EXPECT_EQ(router.num_cached_blocks(1), 4);
  choice = router.route(prompt);
  EXPECT_EQ(choice.rank, 0);
  EXPECT_EQ(choice.matched_prefix_tokens, 0);
}

TEST(DataParallelRouter, LoadFollowsAdmissionProgressPreemptionAndFinish) {
  DataParallelRouter router(config_for(2));
  router.on_admitted(1, 5, 1000, 256);
  EXPECT_EQ(router.load(1).queued_prefill_tokens, 744);
  router.on_progress(5, 512, 1000);  // a chunk done
  EXPECT_EQ(router.load(1).queued_prefill_tokens, 488);
  router.on_progress(5, 1000, 1001);  // the prompt is done, the first token sampled: decoding
  EXPECT_EQ(router.load(1).queued_prefill_tokens, 0);
  EXPECT_EQ(router.load(1).running_decode_requests, 1);
  EXPECT_EQ(router.load(1).decode_context_tokens, 1001);
  router.on_progress(5, 0, 1001);  // preempted by recompute: the whole prompt is queued again
  EXPECT_EQ(router.load(1).queued_prefill_tokens, 1000);
  EXPECT_EQ(router.load(1).running_decode_requests, 0);
  EXPECT_EQ(router.load(0).queued_prefill_tokens, 0);
  EXPECT_TRUE(router.on_finished(5));
  EXPECT_FALSE(router.on_finished(5));
  EXPECT_EQ(router.load(1).queued_prefill_tokens, 0);
  EXPECT_EQ(router.num_tracked_requests(), 0);

  EXPECT_THROW(router.on_progress(5, 1, 2), Error);       // unknown id
  EXPECT_THROW(router.on_admitted(2, 6, 10, 0), Error);   // unknown rank
  EXPECT_THROW(router.on_admitted(0, 6, 10, 10), Error);  // a hit must leave a token
  router.on_admitted(0, 6, 10, 0);
  EXPECT_THROW(router.on_admitted(1, 6, 10, 0), Error);  // duplicate id
  EXPECT_THROW(router.on_progress(6, 5, 9), Error);      // fewer tokens than the prompt
  DataParallelRouterConfig bad = config_for(0);
  EXPECT_THROW(DataParallelRouter{bad}, Error);
  bad = config_for(2);
  bad.balance_rel_threshold = 0.5;
  EXPECT_THROW(DataParallelRouter{bad}, Error);
}

// The brute-force reference: plain lists, every quantity recomputed from scratch on every query.
class NaiveRouter {
 public:
  explicit NaiveRouter(DataParallelRouterConfig config) : config_(config), cached_(static_cast<size_t>(config.num_ranks)) {}

  void cache(int rank, const std::vector<uint64_t>& hashes) {
    for (const uint64_t h : hashes) {
      auto& list = cached_[static_cast<size_t>(rank)];
      if (std::find(list.begin(), list.end(), h) == list.end()) list.push_back(h);
    }
  }
  void evict(int rank, const std::vector<uint64_t>& hashes) {
    auto& list = cached_[static_cast<size_t>(rank)];
    for (const uint64_t h : hashes) list.erase(std::remove(list.begin(), list.end(), h), list.end());
  }
  void admit(int rank, RequestId id, int64_t prompt, int64_t cached) {
    requests_.push_back({id, rank, prompt, cached});
  }
  void progress(RequestId id, int64_t computed, int64_t tokens) {
    for (Req& r : requests_)
      if (r.id == id) r.progressed = true, r.computed = computed, r.tokens = tokens;
  }
  void finish(RequestId id) {
    requests_.erase(std::remove_if(requests_.begin(), requests_.end(), [&](const Req& r) { return r.id == id; }),
                    requests_.end());
  }

  RankChoice route(const std::vector<int32_t>& prompt) const {
    const int64_t p = static_cast<int64_t>(prompt.size());
    const std::vector<uint64_t> hashes = cached_hashes(prompt, config_.prefix_cache_salt);
    std::vector<int64_t> matched(static_cast<size_t>(config_.num_ranks), 0);
    std::vector<double> costs(static_cast<size_t>(config_.num_ranks));
    for (int rank = 0; rank < config_.num_ranks; ++rank) {
      const auto& list = cached_[static_cast<size_t>(rank)];
      // The largest k < P / 256 (strictly below the prompt length) whose first k blocks are all held.
      for (int64_t k = 0; k * kBlock < p && k <= static_cast<int64_t>(hashes.size()); ++k) {
        bool all = true;
        for (int64_t b = 0; b < k; ++b) all = all && std::find(list.begin(), list.end(), hashes[b]) != list.end();
        if (all) matched[rank] = k * kBlock;
      }
      int64_t queued = 0, decodes = 0, context = 0;
      for (const Req& r : requests_) {
        if (r.rank != rank) continue;
        if (!r.progressed) {
          queued += r.prompt - r.cached;  // admitted, nothing reported yet: the prefix hit is not computed
        } else if (r.computed >= r.prompt) {
          ++decodes;
          context += r.tokens;
        } else {
          queued += r.prompt - r.computed;
        }
      }
      const int64_t ahead = queued + p - matched[rank];
      int64_t steps = 1;
      while (steps * config_.prefill_tokens_per_step < ahead) ++steps;
      costs[rank] = static_cast<double>(ahead) +
                    static_cast<double>(steps) * (static_cast<double>(decodes) * config_.decode_request_step_cost +
                                                  static_cast<double>(context) *
                                                      config_.index_scan_step_cost_per_context_token);
    }
    int holder = 0, cheapest = 0;
    for (int rank = 1; rank < config_.num_ranks; ++rank) {
      if (matched[rank] > matched[holder] || (matched[rank] == matched[holder] && costs[rank] < costs[holder]))
        holder = rank;
      if (costs[rank] < costs[cheapest]) cheapest = rank;
    }
    const bool breaks = costs[holder] - costs[cheapest] > config_.balance_abs_threshold &&
                        costs[holder] > config_.balance_rel_threshold * costs[cheapest];
    const int chosen = breaks ? cheapest : holder;
    return {chosen, matched[chosen], costs[chosen], breaks && matched[cheapest] < matched[holder]};
  }

 private:
  struct Req {
    RequestId id;
    int rank;
    int64_t prompt = 0, cached = 0;
    bool progressed = false;
    int64_t computed = 0, tokens = 0;  // the last progress report
  };
  DataParallelRouterConfig config_;
  std::vector<std::vector<uint64_t>> cached_;
  std::vector<Req> requests_;
};

TEST(DataParallelRouter, RandomWorkloadsMatchTheBruteForceReference) {
  std::mt19937 rng(2026);
  int64_t routed = 0, routed_with_a_match = 0, affinity_broken = 0;
  for (int trial = 0; trial < 40; ++trial) {
    DataParallelRouterConfig config = config_for(1 + static_cast<int>(rng() % 5));
    config.prefill_tokens_per_step = 256 + static_cast<int64_t>(rng() % 4096);
    config.balance_abs_threshold = static_cast<double>(rng() % 2 ? 0 : rng() % 2000);
    config.balance_rel_threshold = 1.0 + static_cast<double>(rng() % 100) / 100.0;
    config.decode_request_step_cost = static_cast<double>(rng() % 20);
    config.prefix_cache_salt = trial % 2 ? "salted" : "";
    DataParallelRouter router(config);
    NaiveRouter naive(config);
    std::vector<RequestId> live;
    std::vector<std::pair<RequestId, int64_t>> prompts;  // id, prompt length
    RequestId next_id = 0;
    for (int event = 0; event < 400; ++event) {
      const int doc = static_cast<int>(rng() % 4);
      const std::vector<int32_t> prompt =
          prompt_of(doc, rng() % 7, rng() % 3 == 0 ? 0 : 1 + rng() % 700, static_cast<uint32_t>(rng()));
      if (prompt.empty()) continue;
      const int kind = static_cast<int>(rng() % 6);
      const int rank = static_cast<int>(rng() % static_cast<uint32_t>(config.num_ranks));
      if (kind == 0) {  // a rank caches a prompt's blocks, maybe only the first few
        std::vector<uint64_t> hashes = cached_hashes(prompt, config.prefix_cache_salt);
        hashes.resize(rng() % (hashes.size() + 1));
        router.on_blocks_cached(rank, hashes);
        naive.cache(rank, hashes);
      } else if (kind == 1) {  // a rank evicts one block of a prompt
        std::vector<uint64_t> hashes = cached_hashes(prompt, config.prefix_cache_salt);
        if (hashes.empty()) continue;
        const std::vector<uint64_t> one{hashes[rng() % hashes.size()]};
        router.on_blocks_evicted(rank, one);
        naive.evict(rank, one);
      } else if (kind == 2 && !live.empty()) {  // progress of a live request: prefill chunk, decode or preemption
        const size_t i = rng() % live.size();
        const int64_t p = prompts[i].second;
        const int64_t tokens = p + static_cast<int64_t>(rng() % 3000);
        const int64_t computed = rng() % 4 == 0 ? 0 : static_cast<int64_t>(rng() % static_cast<uint32_t>(tokens + 1));
        router.on_progress(live[i], computed, tokens);
        naive.progress(live[i], computed, tokens);
      } else if (kind == 3 && !live.empty()) {
        const size_t i = rng() % live.size();
        EXPECT_TRUE(router.on_finished(live[i]));
        naive.finish(live[i]);
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
        prompts.erase(prompts.begin() + static_cast<std::ptrdiff_t>(i));
      } else {  // a new request: route it, compare, admit it where it was routed
        const RankChoice got = router.route(prompt);
        const RankChoice want = naive.route(prompt);
        ASSERT_EQ(got.rank, want.rank) << "trial " << trial << " event " << event;
        ASSERT_EQ(got.matched_prefix_tokens, want.matched_prefix_tokens) << "trial " << trial << " event " << event;
        ASSERT_DOUBLE_EQ(got.cost, want.cost) << "trial " << trial << " event " << event;
        ASSERT_EQ(got.affinity_broken, want.affinity_broken) << "trial " << trial << " event " << event;
        ++routed;
        routed_with_a_match += got.matched_prefix_tokens > 0;
        affinity_broken += got.affinity_broken;
        // The chosen rank is never beaten by more than the thresholds allow.
        for (int r = 0; r < config.num_ranks; ++r) {
          const double c = router.cost(r, static_cast<int64_t>(prompt.size()),
                                       router.matched_prefix_tokens(r, router.prompt_block_hashes(prompt)));
          EXPECT_FALSE(got.cost - c > config.balance_abs_threshold && got.cost > config.balance_rel_threshold * c);
        }
        router.on_admitted(got.rank, next_id, static_cast<int64_t>(prompt.size()), got.matched_prefix_tokens);
        naive.admit(got.rank, next_id, static_cast<int64_t>(prompt.size()), got.matched_prefix_tokens);
        live.push_back(next_id);
        prompts.emplace_back(next_id, static_cast<int64_t>(prompt.size()));
        ++next_id;
      }
    }
  }
  // The workloads exercise every branch: cache hits, and the balance override.
  EXPECT_GT(routed, 4000);
  EXPECT_GT(routed_with_a_match, routed / 10);
  EXPECT_GT(affinity_broken, 20);
  std::printf("routed %lld, %lld with a prefix match, %lld broke affinity\n", static_cast<long long>(routed),
              static_cast<long long>(routed_with_a_match), static_cast<long long>(affinity_broken));
}

// A failed rank is never routed to again, even when it holds the prompt's whole prefix; its requests and
// cached blocks leave the router's books; its late reports are ignored; with every rank failed, route()
// refuses.
TEST(DataParallelRouter, FailedRankIsNeverPickedAgain) {
  DataParallelRouter router(config_for(3));
  const std::vector<int32_t> prompt = prompt_of(9, 3, 40);
  router.on_blocks_cached(1, cached_hashes(prompt));
  ASSERT_EQ(router.route(prompt).rank, 1);
  router.on_admitted(1, 10, static_cast<int64_t>(prompt.size()), 3 * kBlock);
  router.on_admitted(2, 11, 500, 0);
  router.mark_rank_failed(1);
  router.mark_rank_failed(1);  // idempotent
  EXPECT_TRUE(router.rank_failed(1));
  EXPECT_FALSE(router.rank_failed(0));
  EXPECT_EQ(router.num_live_ranks(), 2);
  EXPECT_EQ(router.num_cached_blocks(1), 0);
  EXPECT_EQ(router.load(1).queued_prefill_tokens, 0);
  EXPECT_EQ(router.num_tracked_requests(), 1);
  EXPECT_FALSE(router.on_finished(10));
  router.on_blocks_cached(1, cached_hashes(prompt));  // a late report
  EXPECT_EQ(router.num_cached_blocks(1), 0);
  EXPECT_THROW(router.on_admitted(1, 12, 10, 0), Error);
  for (uint32_t i = 0; i < 20; ++i) {
    const RankChoice choice = router.route(prompt_of(9, 3, 1 + i, i));
    EXPECT_NE(choice.rank, 1);
    EXPECT_EQ(choice.rank, 0) << "rank 2 has 500 queued tokens, rank 0 none";
  }
  router.mark_rank_failed(0);
  EXPECT_EQ(router.route(prompt).rank, 2);
  router.mark_rank_failed(2);
  EXPECT_EQ(router.num_live_ranks(), 0);
  try {
    router.route(prompt);
    FAIL() << "routed with every rank failed";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("every one of the 3"), std::string::npos) << error.what();
  }
}

}  // namespace
}  // namespace dsv4
