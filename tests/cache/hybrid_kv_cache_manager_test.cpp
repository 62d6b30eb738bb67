// The hybrid cache manager under random workloads (no leaks, exact reference counts, the pool back to full),
// prefix hits with checkpoints, eviction, window freeing, and 1M-token block counts.
#include "cache/hybrid_kv_cache_manager.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <set>

#include "cache/block_hash.h"
#include "cache/planner.h"
#include "core/error.h"

namespace dsv4 {
namespace {

ModelConfig tiny() { return ModelConfig::preset("tiny"); }  // SWA, CSA, HCA, CSA; window 128

CacheLayout tiny_layout() { return CacheLayout::for_model(tiny(), KvStorage::kF32, IndexStorage::kF32); }

std::vector<int32_t> random_tokens(size_t n, std::mt19937& rng) {
  std::vector<int32_t> tokens(n);
  for (auto& t : tokens) t = static_cast<int32_t>(rng() % 50000);
  return tokens;
}

// Drives one request through the manager the way the scheduler does: chunks ending on 256-token boundaries.
bool run_prefill(HybridKvCacheManager& manager, RequestId id, const std::vector<int32_t>& tokens, int64_t chunk) {
  int64_t done = manager.num_computed(id);
  while (done < static_cast<int64_t>(tokens.size())) {
    int64_t end = std::min<int64_t>(done + chunk, static_cast<int64_t>(tokens.size()));
    if (end / 256 * 256 > done) end = end / 256 * 256;  // a checkpoint at the last full block
    if (!manager.allocate(id, end - done)) return false;
    manager.commit(id, tokens, end);
    manager.take_pending_copies();
    done = end;
  }
  return true;
}

TEST(HybridKvCacheManager, PageSizeKeepsPaddingSmall) {
  for (const auto& preset : {"tiny", "v4-flash", "v4-pro"}) {
    const CacheLayout layout = CacheLayout::for_model(ModelConfig::preset(preset), KvStorage::kFp8, IndexStorage::kFp4);
    HybridKvCacheManager manager(layout, int64_t{4} << 30);
    for (size_t g = 0; g < layout.groups.size(); ++g) {
      const int64_t block = manager.pool().block_bytes(static_cast<int>(g));
      const double waste = static_cast<double>(manager.pool().page_bytes() % block) / manager.pool().page_bytes();
      EXPECT_LE(waste, 0.01) << preset << " " << cache_group_name(layout.groups[g].kind);
    }
  }
}

TEST(HybridKvCacheManager, PrefixHitRestoresAtTheLatestCheckpoint) {
  HybridKvCacheManager manager(tiny_layout(), int64_t{256} << 20, {true, 1024, "test"});
  std::mt19937 rng(1);
  std::vector<int32_t> first = random_tokens(600, rng);
  ASSERT_EQ(manager.admit(1, first), 0);
  ASSERT_TRUE(run_prefill(manager, 1, first, 4096));  // chunks [0, 512) and [512, 600)
  // Decode past 768: the rolling checkpoint moves from 512 to 768.
  while (first.size() < 800) {
    first.push_back(static_cast<int32_t>(rng() % 50000));
    ASSERT_TRUE(manager.allocate(1, 1));
    manager.commit(1, first, static_cast<int64_t>(first.size()));
    manager.take_pending_copies();
    manager.check_invariants();
  }
  EXPECT_EQ(manager.num_checkpoints(), 1);
  manager.release(1);
  manager.check_invariants();
  // A follow-up turn: the whole previous conversation plus a new message hits at 768.
  std::vector<int32_t> second = first;
  for (int i = 0; i < 50; ++i) second.push_back(7);
  const auto hit = manager.admit(2, second);
  ASSERT_TRUE(hit.has_value());
  EXPECT_EQ(*hit, 768);
  const auto copies = manager.take_pending_copies();
  EXPECT_EQ(copies.size(), 2u);  // CSA main and indexer state restored from the snapshot
  manager.check_invariants();
  // A prompt that diverges inside the first block has no hit.
  std::vector<int32_t> other = second;
  other[10] += 1;
  EXPECT_EQ(manager.admit(3, other), 0);
  manager.release(2);
  manager.release(3);
  manager.check_invariants();
  EXPECT_EQ(manager.pool().usage().used_block_bytes, 0);
  EXPECT_GT(manager.stats().prefix_hit_tokens, 0);
}

TEST(HybridKvCacheManager, WindowBlocksAreFreedWhileDecoding) {
  HybridKvCacheManager manager(tiny_layout(), int64_t{256} << 20, {false, 1024, ""});
  std::mt19937 rng(2);
  std::vector<int32_t> tokens = random_tokens(5000, rng);
  ASSERT_EQ(manager.admit(1, tokens), 0);
  ASSERT_TRUE(run_prefill(manager, 1, tokens, 8192));
  auto held = [&] {
    int64_t n = 0;
    for (const BlockId b : manager.block_table(1, CacheGroupKind::kSwaKv)) n += b != kNoBlock;
    return n;
  };
  EXPECT_LE(held(), 3);  // a 5000-token prefill holds only the blocks of its last 128 tokens
  for (int step = 0; step < 500; ++step) {
    tokens.push_back(1);
    ASSERT_TRUE(manager.allocate(1, 1));
    manager.commit(1, tokens, static_cast<int64_t>(tokens.size()));
    EXPECT_LE(held(), 3);
  }
  manager.release(1);
  const auto usage = manager.pool().usage();
  EXPECT_EQ(usage.used_block_bytes + usage.cached_block_bytes, 0);
  EXPECT_EQ(usage.free_page_bytes, usage.pool_bytes);
}

TEST(HybridKvCacheManager, MillionTokenRequestGetsThePlannedBlockCounts) {
  const CacheLayout layout = CacheLayout::for_model(ModelConfig::preset("v4-flash"), KvStorage::kFp8, IndexStorage::kFp4);
  HybridKvCacheManager manager(layout, int64_t{8} << 30, {false, 1024, ""});
  const int64_t n = int64_t{1} << 20;
  std::vector<int32_t> tokens(static_cast<size_t>(n), 5);
  ASSERT_EQ(manager.admit(1, tokens), 0);
  ASSERT_TRUE(manager.allocate(1, n));
  manager.commit(1, tokens, n);
  // Exactly the blocks the planner predicts for every group (dsv4 plan --preset v4-flash --context 1M).
  const CapacityPlan plan = plan_capacity(ModelConfig::preset("v4-flash"), KvStorage::kFp8, IndexStorage::kFp4, n);
  const auto usage = manager.pool().usage();
  for (size_t g = 0; g < layout.groups.size(); ++g) {
    int64_t held = 0;
    for (const BlockId b : manager.block_table(1, layout.groups[g].kind)) held += b != kNoBlock;
    EXPECT_EQ(held, plan.groups[g].blocks) << cache_group_name(layout.groups[g].kind);
    EXPECT_EQ(usage.used_blocks_per_group[g], plan.groups[g].blocks) << cache_group_name(layout.groups[g].kind);
  }
  EXPECT_EQ(manager.block_table(1, CacheGroupKind::kC4Main).size(), static_cast<size_t>(n / 256));
  EXPECT_EQ(plan.total().reserved, usage.used_block_bytes);
  manager.check_invariants();
}

TEST(HybridKvCacheManager, RandomWorkloadKeepsEveryInvariant) {
  for (const bool prefix_caching : {true, false}) {
    // A pool small enough that allocation fails and cached blocks are evicted often.
    HybridKvCacheManager manager(tiny_layout(), int64_t{14} << 20, {prefix_caching, 512, "salt"});
    std::mt19937 rng(prefix_caching ? 3 : 4);
    std::vector<std::vector<int32_t>> shared_prefixes;
    for (int i = 0; i < 4; ++i) shared_prefixes.push_back(random_tokens(300 + 200 * i, rng));
    std::map<RequestId, std::vector<int32_t>> live;  // request -> tokens (prompt + generated)
    std::map<RequestId, int64_t> budget;
    RequestId next_id = 1;
    int64_t failures = 0, hits = 0;
    for (int step = 0; step < 2000; ++step) {
      const int action = static_cast<int>(rng() % 10);
      if (action < 3 && live.size() < 24) {  // arrival, often sharing a prefix
        std::vector<int32_t> prompt;
        if (rng() % 2) prompt = shared_prefixes[rng() % shared_prefixes.size()];
        const auto tail = random_tokens(1 + rng() % 700, rng);
        prompt.insert(prompt.end(), tail.begin(), tail.end());
        const RequestId id = next_id++;
        const auto hit = manager.admit(id, prompt);
        if (!hit) {
          ++failures;
          continue;
        }
        hits += *hit > 0;
        live[id] = prompt;
        budget[id] = 1 + static_cast<int64_t>(rng() % 400);
        if (!run_prefill(manager, id, prompt, 1 + rng() % 1000)) {  // preempted: drop it
          manager.release(id);
          live.erase(id);
          ++failures;
        }
      } else if (action < 4 && !live.empty()) {  // abort a random request
        auto it = live.begin();
        std::advance(it, rng() % live.size());
        manager.release(it->first);
        live.erase(it);
      } else if (!live.empty()) {  // one decode step for everyone; the newest is preempted on failure
        for (auto it = live.begin(); it != live.end();) {
          it->second.push_back(static_cast<int32_t>(rng() % 50000));
          if (!manager.allocate(it->first, 1)) {
            const auto newest = std::prev(live.end());
            manager.release(newest->first);
            ++failures;
            const bool was_self = newest == it;
            live.erase(newest);
            if (was_self) break;
            it->second.pop_back();
            continue;
          }
          manager.commit(it->first, it->second, static_cast<int64_t>(it->second.size()));
          if (--budget[it->first] == 0) {
            manager.release(it->first);
            it = live.erase(it);
          } else {
            ++it;
          }
        }
      }
      manager.take_pending_copies();
      manager.check_invariants();
    }
    for (const auto& [id, tokens] : live) manager.release(id);
    manager.take_pending_copies();
    manager.check_invariants();
    const auto usage = manager.pool().usage();
    EXPECT_EQ(usage.used_block_bytes, 0);
    if (!prefix_caching) {
      EXPECT_EQ(usage.free_page_bytes, usage.pool_bytes);
    }
    EXPECT_GT(failures, 0) << "the pool never ran short: the test did not exercise preemption";
    if (prefix_caching) {
      EXPECT_GT(hits, 0);
      EXPECT_GT(manager.stats().blocks_evicted, 0);
    }
  }
}

// The prefix-cache events a data-parallel router consumes: replaying every drained batch into a set gives
// exactly the manager's own cached block hashes, under random arrivals with shared prefixes, aborts,
// preemption and eviction, whether drained after every step or rarely (so blocks are registered and evicted
// within one drain).
TEST(HybridKvCacheManager, PrefixCacheEventsReplayToTheCachedBlocks) {
  for (const int drain_every : {1, 7, 50}) {
    SCOPED_TRACE("drained every " + std::to_string(drain_every) + " steps");
    PrefixCacheOptions options{true, 512, "salt"};
    options.record_events = true;
    HybridKvCacheManager manager(tiny_layout(), int64_t{14} << 20, options);
    std::mt19937 rng(40 + drain_every);
    std::vector<std::vector<int32_t>> shared_prefixes;
    for (int i = 0; i < 4; ++i) shared_prefixes.push_back(random_tokens(300 + 200 * i, rng));
    std::map<RequestId, std::vector<int32_t>> live;
    std::map<RequestId, int64_t> budget;
    std::set<uint64_t> replayed;
    // evicted_unseen: evictions of blocks registered since the previous drain (reported only as evicted).
    int64_t cached_events = 0, evicted_events = 0, evicted_unseen = 0, hits = 0;
    RequestId next_id = 1;
    auto drain_and_compare = [&] {
      const PrefixCacheEvents events = manager.drain_prefix_cache_events();
      const std::set<uint64_t> cached(events.cached.begin(), events.cached.end());
      for (const uint64_t h : events.evicted)
        ASSERT_FALSE(cached.count(h)) << "a hash both cached and evicted";
      for (const uint64_t h : events.evicted) evicted_unseen += replayed.erase(h) == 0;
      replayed.insert(events.cached.begin(), events.cached.end());
      cached_events += static_cast<int64_t>(events.cached.size());
      evicted_events += static_cast<int64_t>(events.evicted.size());
      const std::vector<uint64_t> actual = manager.cached_block_hashes();
      ASSERT_EQ(std::vector<uint64_t>(replayed.begin(), replayed.end()), actual);
      ASSERT_EQ(static_cast<int64_t>(actual.size()), manager.num_cached_prefix_blocks());
    };
    for (int step = 0; step < 1500; ++step) {
      const int action = static_cast<int>(rng() % 10);
      if (action < 3 && live.size() < 24) {
        std::vector<int32_t> prompt;
        if (rng() % 2) prompt = shared_prefixes[rng() % shared_prefixes.size()];
        const auto tail = random_tokens(1 + rng() % 700, rng);
        prompt.insert(prompt.end(), tail.begin(), tail.end());
        const RequestId id = next_id++;
        const auto hit = manager.admit(id, prompt);
        if (!hit) continue;
        hits += *hit > 0;
        live[id] = prompt;
        budget[id] = 1 + static_cast<int64_t>(rng() % 400);
        if (!run_prefill(manager, id, prompt, 1 + rng() % 1000)) {
          manager.release(id);
          live.erase(id);
        }
      } else if (action < 4 && !live.empty()) {
        auto it = live.begin();
        std::advance(it, rng() % live.size());
        manager.release(it->first);
        live.erase(it);
      } else if (!live.empty()) {
        for (auto it = live.begin(); it != live.end();) {
          it->second.push_back(static_cast<int32_t>(rng() % 50000));
          if (!manager.allocate(it->first, 1)) {
            const auto newest = std::prev(live.end());
            manager.release(newest->first);
            const bool was_self = newest == it;
            live.erase(newest);
            if (was_self) break;
            it->second.pop_back();
            continue;
          }
          manager.commit(it->first, it->second, static_cast<int64_t>(it->second.size()));
          if (--budget[it->first] == 0) {
            manager.release(it->first);
            it = live.erase(it);
          } else {
            ++it;
          }
        }
      }
      manager.take_pending_copies();
      if (step % drain_every == 0) drain_and_compare();
      if (HasFatalFailure()) return;
    }
    drain_and_compare();
    EXPECT_GT(hits, 0);
    EXPECT_GT(evicted_events, 10) << "the pool never evicted: the test did not exercise eviction events";
    EXPECT_GT(cached_events, 10);
    if (drain_every == 50) {
      EXPECT_GT(evicted_unseen, 0) << "no block was registered and evicted within a drain";
    }
    EXPECT_TRUE(manager.drain_prefix_cache_events().empty()) << "a drain clears the events";
  }
}

// The events name blocks exactly as cache/block_hash.h does (what the router hashes prompts with), and a
// manager that does not record them returns none.
TEST(HybridKvCacheManager, PrefixCacheEventsUseTheSharedBlockHashes) {
  std::mt19937 rng(12);
  const auto prompt = random_tokens(600, rng);
  for (const bool record : {true, false}) {
    PrefixCacheOptions options{true, 256, "tenant"};
    options.record_events = record;
    HybridKvCacheManager manager(tiny_layout(), int64_t{64} << 20, options);
    ASSERT_TRUE(manager.admit(1, prompt).has_value());
    ASSERT_TRUE(run_prefill(manager, 1, prompt, 1000));
    const PrefixCacheEvents events = manager.drain_prefix_cache_events();
    if (!record) {
      EXPECT_TRUE(events.empty());
      continue;
    }
    EXPECT_EQ(events.cached, logical_block_hashes(prefix_root_hash("tenant"), prompt, 2));
    EXPECT_TRUE(events.evicted.empty());
    manager.release(1);  // cached, not evicted: no event
    EXPECT_TRUE(manager.drain_prefix_cache_events().empty());
  }
}

TEST(HybridKvCacheManager, MisuseIsAnError) {
  HybridKvCacheManager manager(tiny_layout(), int64_t{64} << 20);
  const std::vector<int32_t> prompt(10, 1);
  ASSERT_TRUE(manager.admit(1, prompt).has_value());
  EXPECT_THROW(manager.admit(1, prompt), Error);
  EXPECT_THROW(manager.admit(2, {}), Error);
  EXPECT_THROW(manager.release(9), Error);
  EXPECT_THROW(HybridKvCacheManager(tiny_layout(), int64_t{64} << 20, {true, 1000, ""}), Error);
}

}  // namespace
}  // namespace dsv4
