// DataParallelRouter: picks the data-parallel attention rank for a new request (issue 9). With DP attention each
// rank owns its requests end to end, with its own HybridKvCacheManager and therefore its own prefix cache, so
// where a request lands decides both how much of its prompt is already cached and whose queue it waits in.
//
// Policy (reading kit §04a/04b "DP Attention 的负载均衡必须理解 cache ownership"): find the ranks holding a
// useful prefix, choose the least-loaded holder, break affinity if queue cost wins, with
//     cost(rank) ≈ queue delay + uncached prefill + active index-scan load
// ("request count alone is not enough": uncached suffix and current context matter). The kit gives no threshold
// for "wins"; as SGLang's cache-aware load balancer (sgl-router CacheAwarePolicy) does, affinity is broken only
// when the imbalance is both absolute and relative (balance_abs_threshold, balance_rel_threshold), so small
// load differences do not scatter a conversation's turns over ranks and lose their cache.
//
// Cost unit: prefill-token equivalents — the time one prompt token takes in a prefill chunk. Per rank r and a
// prompt of P tokens of which r holds M:
//     queue delay     Q = prefill tokens r still has to compute for requests it already admitted
//     uncached prefill U = P − M
//     index-scan load  S = steps × (running decodes × decode_request_step_cost
//                                   + their total context × index_scan_step_cost_per_context_token)
//                      steps = max(1, ceil((Q + U) / prefill_tokens_per_step)): the scheduler steps until the new
//                      request's first token, in each of which every running decode also runs (one unified
//                      token budget, engine/scheduler.h) and rescans its L/4 index (kit 01 "the CSA growth term
//                      is the index scan")
//     cost = Q + U + S
//
// The prefix view: each rank reports the chain hashes (cache/block_hash.h, the very function its cache manager
// names blocks with) of the 256-token logical blocks it caches and evicts; the match is the longest run of the
// prompt's block hashes from the first one that the rank holds (a walk stops at the first missing block, as the
// manager's own), capped to leave one prompt token to compute. It is the router's estimate: the rank's real hit
// also needs a checkpoint at the boundary (docs/cache.md), which may sit up to checkpoint_interval tokens lower.
//
// Not thread-safe: one router thread owns it; ranks' reports are applied on that thread.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "cache/hybrid_kv_cache_manager.h"

namespace dsv4 {

struct DataParallelRouterConfig {
  int num_ranks = 1;
  std::string prefix_cache_salt;  // must equal every rank's PrefixCacheOptions::salt, or no hash ever matches

  // Tokens a rank's step computes (its SchedulerConfig::max_num_batched_tokens, default 2048): converts the
  // queued + uncached prefill into steps during which the running decodes share the GPU.
  int64_t prefill_tokens_per_step = 2048;
  // One running decode's share of a step, in prefill tokens. docs/PERF.md (one H200, 4-layer V4-Flash): a decode
  // step is 1.31 ms at batch 1 and 1.79 ms at batch 8, ≈ 0.07 ms per extra request, against ≈ 0.01 ms per
  // prefill token at 98K tok/s: ≈ 7, rounded to 8.
  double decode_request_step_cost = 8.0;
  // One context token of one running decode, per step. Kit 01 (V4-Flash CSA layer): the index QK is 4.30 GF per
  // generated token at 1M context (≈ 4.3 KFLOP and 16 B of FP4 index keys per context token) against ≈ 0.25 GF
  // fixed projection/compressor work plus the MoE per prefill token and layer; compute- and bandwidth-wise a
  // 1M-context decode step costs ≈ 4–5 prefill tokens: 4 / 2^20 = 1 / 262144 per context token.
  double index_scan_step_cost_per_context_token = 1.0 / 262144.0;
  // Affinity is broken only when cost(affinity) − cost(best) > balance_abs_threshold and cost(affinity) >
  // balance_rel_threshold × cost(best) (SGLang's two-sided imbalance test). 256: one logical block — breaking
  // affinity must save more than the smallest prefix unit it can forfeit; 1.25: a 25 % margin, so near-equal
  // ranks keep their conversations.
  double balance_abs_threshold = 256.0;
  double balance_rel_threshold = 1.25;

  // Throws dsv4::Error naming the field and value.
  void validate() const;
};

// What a rank has on its plate, as its reports describe it.
struct RankLoad {
  int64_t queued_prefill_tokens = 0;    // prompt tokens of admitted requests not computed yet
  int64_t running_decode_requests = 0;  // requests past their prompt
  int64_t decode_context_tokens = 0;    // total context of those: what their index scans read every step
};

struct RankChoice {
  int rank = 0;
  int64_t matched_prefix_tokens = 0;  // prompt tokens the chosen rank is expected to hold (multiple of 256)
  double cost = 0.0;                  // the chosen rank's cost, prefill-token equivalents
  bool affinity_broken = false;       // a rank with a longer match lost on cost
};

class DataParallelRouter {
 public:
  explicit DataParallelRouter(DataParallelRouterConfig config);

  const DataParallelRouterConfig& config() const { return config_; }
  int num_ranks() const { return config_.num_ranks; }

  // The rank for a new request (see the header comment), among the ranks not marked failed. Ties go to the
  // lowest rank. Records nothing: the rank that takes the request reports on_admitted (so a burst routed
  // before any report all sees the same loads). Throws dsv4::Error when every rank has failed.
  RankChoice route(std::span<const int32_t> prompt_tokens) const;

  // A rank that stopped serving (its step threw: engine/data_parallel_engine.h). route() never picks it
  // again; its cached blocks and tracked requests are forgotten (their load with them). Its late block
  // reports are ignored (they may still be in flight), on_finished of its requests returns false, on_admitted
  // to it throws. Idempotent.
  void mark_rank_failed(int rank);
  bool rank_failed(int rank) const;
  int num_live_ranks() const;

  // The chain hashes route() matches a prompt with: its full logical blocks, leaving one token to compute.
  std::vector<uint64_t> prompt_block_hashes(std::span<const int32_t> prompt_tokens) const;
  // Tokens of the prompt (given by prompt_block_hashes) that `rank` holds.
  int64_t matched_prefix_tokens(int rank, std::span<const uint64_t> prompt_hashes) const;
  // cost(rank) for a prompt of `prompt_tokens` tokens of which `matched_tokens` are cached there.
  double cost(int rank, int64_t prompt_tokens, int64_t matched_tokens) const;

  // Reports from the ranks. on_admitted: `rank` queued request `id` with `cached_prompt_tokens` of its prompt
  // served from its prefix cache. on_progress: after a step, the request has `num_computed_tokens` computed of
  // `num_tokens` known (a preempted request reports 0 computed: its prefill is queued again). on_finished:
  // finished or aborted; false if the id is unknown. Throws dsv4::Error for an unknown rank or id, a duplicate id,
  // or counts out of range.
  void on_admitted(int rank, RequestId id, int64_t prompt_tokens, int64_t cached_prompt_tokens);
  void on_progress(RequestId id, int64_t num_computed_tokens, int64_t num_tokens);
  bool on_finished(RequestId id);
  // Chain hashes of logical blocks the rank's cache manager registered or evicted (idempotent).
  void on_blocks_cached(int rank, std::span<const uint64_t> block_hashes);
  void on_blocks_evicted(int rank, std::span<const uint64_t> block_hashes);

  const RankLoad& load(int rank) const;
  int64_t num_cached_blocks(int rank) const;
  int64_t num_tracked_requests() const { return static_cast<int64_t>(requests_.size()); }

 private:
  struct TrackedRequest {
    int rank = 0;
    int64_t prompt_tokens = 0;
    int64_t queued_prefill_tokens = 0;  // its contribution to RankLoad
    bool decoding = false;
    int64_t context_tokens = 0;  // while decoding
  };
  void check_rank(int rank) const;
  void add_contribution(const TrackedRequest& request, int sign);

  DataParallelRouterConfig config_;
  uint64_t root_hash_ = 0;
  std::vector<RankLoad> loads_;
  std::vector<std::unordered_set<uint64_t>> cached_blocks_;  // per rank
  std::vector<bool> failed_;                                 // per rank
  std::unordered_map<RequestId, TrackedRequest> requests_;
};

}  // namespace dsv4
