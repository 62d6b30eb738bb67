// Workload simulation of the hybrid KV cache manager alone (no model): V4-Flash, FP8 main + FP4 index entries.
//   mix 1: one 1M-token request, then as many 2K-token requests as the pool admits;
//   mix 2: 4000 short chat requests (8 shared 512-token system prompts + 50..500 user tokens, 32 decoded
//          tokens), 256 in flight, prefix caching on.
// Prints pool utilisation, padding and stranded space (the fragmentation), hit rate, and vLLM's cost for the
// same requests derived from its published layout (docs/research/kvcache_scheduler.md §1.2, §1.6).
// Run: build/bench/dsv4_cache_sim [pool GiB, default 64]
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <random>
#include <vector>

#include "cache/hybrid_kv_cache_manager.h"

namespace dsv4 {
namespace {

void print_usage(const char* label, const HybridKvCacheManager& manager) {
  const BlockPool::Usage u = manager.pool().usage();
  const double pool = static_cast<double>(u.pool_bytes);
  std::printf("  %-26s used %6.2f%%  cached %5.2f%%  free pages %6.2f%%  padding %5.3f%%  stranded slots %5.3f%%  "
              "=> fragmentation %5.3f%%\n",
              label, 100 * u.used_block_bytes / pool, 100 * u.cached_block_bytes / pool, 100 * u.free_page_bytes / pool,
              100 * u.padding_bytes / pool, 100 * u.free_slot_bytes / pool,
              100 * (u.padding_bytes + u.free_slot_bytes) / pool);
}

std::vector<int32_t> random_tokens(size_t n, std::mt19937& rng) {
  std::vector<int32_t> tokens(n);
  for (auto& t : tokens) t = static_cast<int32_t>(rng() % 129280);
  return tokens;
}

// Prefill in chunks ending on 256-token boundaries (as the scheduler aligns them), then `decode` tokens.
bool run(HybridKvCacheManager& manager, RequestId id, std::vector<int32_t>& tokens, int decode, std::mt19937& rng) {
  int64_t done = manager.num_computed(id);
  const auto prompt = static_cast<int64_t>(tokens.size());
  while (done < prompt) {
    int64_t end = std::min<int64_t>(done + 8192, prompt);
    if (end / 256 * 256 > done) end = end / 256 * 256;  // a checkpoint at the last full block
    if (!manager.allocate(id, end - done)) return false;
    manager.commit(id, tokens, end);
    manager.take_pending_copies();
    done = end;
  }
  for (int i = 0; i < decode; ++i) {
    tokens.push_back(static_cast<int32_t>(rng() % 129280));
    if (!manager.allocate(id, 1)) return false;
    manager.commit(id, tokens, static_cast<int64_t>(tokens.size()));
  }
  manager.take_pending_copies();
  return true;
}

}  // namespace
}  // namespace dsv4

int main(int argc, char** argv) {
  using namespace dsv4;
  const double pool_gib = argc > 1 ? std::atof(argv[1]) : 64.0;
  const ModelConfig config = ModelConfig::preset("v4-flash");
  const CacheLayout layout = CacheLayout::for_model(config, KvStorage::kFp8, IndexStorage::kFp4);
  std::mt19937 rng(1);
  std::printf("V4-Flash cache, FP8 main / FP4 index, pool %.1f GiB\n", pool_gib);
  {
    HybridKvCacheManager manager(layout, static_cast<int64_t>(pool_gib * (1 << 30)), {false, 1024, ""});
    std::printf("mix 1: one 1M-token request, then 2K-token requests until the pool is full (page %.1f MB)\n",
                manager.pool().page_bytes() / 1e6);
    std::vector<int32_t> long_prompt = random_tokens(size_t{1} << 20, rng);
    if (!manager.admit(1, long_prompt) || !run(manager, 1, long_prompt, 0, rng)) {
      std::printf("  the 1M request does not fit\n");
      return 1;
    }
    print_usage("after the 1M request", manager);
    int64_t admitted = 0;
    for (RequestId id = 2;; ++id) {
      std::vector<int32_t> prompt = random_tokens(2048, rng);
      if (!manager.admit(id, prompt)) break;
      if (!run(manager, id, prompt, 0, rng)) {
        manager.release(id);
        break;
      }
      ++admitted;
    }
    print_usage("+ 2K requests", manager);
    const double ours = (static_cast<double>(manager.pool().usage().used_block_bytes) -
                         3514.25 * (1 << 20) - 3214336.0 - 12206080.0) / admitted;
    // vLLM (derived): 8 history block ids + 26 steady-state SWA/state block ids per 2K request, at the
    // 1,002,240-byte block stride of its packed V4-Flash layout.
    const double vllm = (8 + 26) * 1002240.0;
    std::printf("  2K requests admitted next to the 1M one: %lld; bytes per 2K request %.1f MB (vLLM layout, "
                "derived: %.1f MB, so %.2fx as many fit here)\n",
                static_cast<long long>(admitted), ours / 1e6, vllm / 1e6, vllm / ours);
    manager.check_invariants();
  }
  {
    HybridKvCacheManager manager(layout, static_cast<int64_t>(pool_gib * (1 << 30)), {true, 1024, "sim"});
    std::printf("mix 2: 4000 short chat requests, 256 in flight, 8 shared 512-token system prompts\n");
    std::vector<std::vector<int32_t>> system_prompts;
    for (int i = 0; i < 8; ++i) system_prompts.push_back(random_tokens(512, rng));
    std::deque<RequestId> in_flight;
    int64_t refused = 0, peak_used = 0;
    BlockPool::Usage at_peak;
    for (RequestId id = 1; id <= 4000; ++id) {
      std::vector<int32_t> prompt = system_prompts[rng() % 8];
      const auto user = random_tokens(50 + rng() % 451, rng);
      prompt.insert(prompt.end(), user.begin(), user.end());
      if (in_flight.size() >= 256) {
        manager.release(in_flight.front());
        in_flight.pop_front();
      }
      if (!manager.admit(id, prompt) || !run(manager, id, prompt, 32, rng)) {
        if (manager.has_request(id)) manager.release(id);
        ++refused;
        continue;
      }
      in_flight.push_back(id);
      const BlockPool::Usage usage = manager.pool().usage();
      if (usage.used_block_bytes > peak_used) peak_used = usage.used_block_bytes, at_peak = usage;
    }
    print_usage("at the end", manager);
    const double pool = static_cast<double>(at_peak.pool_bytes);
    std::printf("  at peak: used %.2f%%, padding %.3f%%, stranded %.3f%%\n", 100 * at_peak.used_block_bytes / pool,
                100 * at_peak.padding_bytes / pool, 100 * at_peak.free_slot_bytes / pool);
    const auto& stats = manager.stats();
    std::printf("  prefix hit rate %.1f%% of prompt tokens (%lld of %lld); %lld checkpoints taken, %lld blocks "
                "evicted; %lld refused\n",
                100.0 * stats.prefix_hit_tokens / stats.prefix_query_tokens,
                static_cast<long long>(stats.prefix_hit_tokens), static_cast<long long>(stats.prefix_query_tokens),
                static_cast<long long>(stats.checkpoints_taken), static_cast<long long>(stats.blocks_evicted),
                static_cast<long long>(refused));
    for (const RequestId id : in_flight) manager.release(id);
    manager.check_invariants();
  }
  return 0;
}
