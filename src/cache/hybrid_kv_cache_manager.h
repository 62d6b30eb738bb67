// HybridKvCacheManager: per-request block tables for every cache group of DeepSeek-V4, drawn from one
// BlockPool, with prefix caching that restores exactly the state a cold run has at the hit boundary
// (docs/cache.md).
//
// Groups (cache/cache_spec.h): history groups (C4 main, C4 index, C128 main) grow one block per 256-token
// logical block; the window group (SWA raw K=V) holds blocks of 64 tokens and frees those that slide out of
// the window while the request runs — and allocates only the blocks a step's *last* `window` tokens land in,
// so a long prefill chunk never reserves window blocks for tokens that are gone by the end of the chunk; the
// compressor-state groups hold one block per request.
//
// Prefix caching: every full logical block is hashed (xxHash3 of the parent hash, its 256 token ids and the
// model/salt key). A hit at boundary H needs (a) the history blocks of every logical block below H and (b) a
// *checkpoint* at H: the SWA blocks covering [H − window, H) and a snapshot of the CSA compressor states
// (C128 state is empty at multiples of 128, so it is never stored). Checkpoints are taken when a step ends on
// a 256-token boundary that is a multiple of `checkpoint_interval`, and on every boundary reached while
// decoding (only the latest such one is kept per request, so a finished request always leaves one at its last
// full block). The scheduler aligns prefill chunk ends to those boundaries.
//
// The manager never touches bytes: snapshots and restores are returned as BlockCopy lists for the model
// runner to execute (memcpy on the CPU backend, a device copy on CUDA).
//
// Prefix-cache events (PrefixCacheOptions::record_events): the chain hashes of the logical blocks the manager
// registers in its prefix cache and evicts from it, for DataParallelRouter, which mirrors every rank's cached
// names to route a prompt to the rank holding its longest prefix (engine/dp_router.h on_blocks_cached /
// on_blocks_evicted). drain_prefix_cache_events() returns the net change since the previous drain.
#pragma once
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "cache/block_pool.h"
#include "cache/cache_spec.h"

namespace dsv4 {

using RequestId = uint64_t;

struct PrefixCacheOptions {
  bool enabled = true;
  int64_t checkpoint_interval = 1024;  // tokens; a multiple of 256
  std::string salt;                    // mixed into every block hash (model identity, tenant)
  // Record PrefixCacheEvents for drain_prefix_cache_events(). Off by default: a single engine has no reader,
  // and the record of evictions would grow without bound.
  bool record_events = false;
};

// The net change of a manager's prefix cache since the previous drain: logical blocks (by chain hash,
// cache/block_hash.h) now cached that were not, and blocks gone that were there. A hash is in at most one
// list (its final state: registered then evicted within one drain is reported as evicted, the reverse as
// cached), so a reader may apply the two lists in either order; each list keeps the order the changes
// happened in.
struct PrefixCacheEvents {
  std::vector<uint64_t> cached;
  std::vector<uint64_t> evicted;
  bool empty() const { return cached.empty() && evicted.empty(); }
};

// Copy `bytes` from the block at arena offset `src_offset` to `dst_offset`.
struct BlockCopy {
  int64_t src_offset = 0, dst_offset = 0, bytes = 0;
};

class HybridKvCacheManager {
 public:
  HybridKvCacheManager(CacheLayout layout, int64_t pool_bytes, PrefixCacheOptions options = {});

  const CacheLayout& layout() const { return layout_; }
  const PrefixCacheOptions& options() const { return options_; }
  const BlockPool& pool() const { return pool_; }

  // Blocks a new request of `prompt_tokens` tokens needs for its whole prompt, cold (no prefix hit).
  int64_t blocks_for_prompt(int64_t prompt_tokens) const;
  // Whether a request of this many tokens could ever fit in an otherwise empty pool.
  bool fits_in_pool(int64_t total_tokens) const;

  // Starts tracking a request: takes the longest usable prefix hit (a boundary H < prompt length with a
  // checkpoint), references its blocks, allocates the request's state blocks and queues the restore copies.
  // Returns H (tokens that need no compute), or nullopt if the pool cannot hold the state blocks (nothing held).
  std::optional<int64_t> admit(RequestId id, std::span<const int32_t> prompt);

  // Reserves blocks for the next `new_tokens` tokens of a request (which must be admitted). False if the pool
  // is short; then nothing is held beyond what was held before.
  bool allocate(RequestId id, int64_t new_tokens);

  // After a step computed tokens up to `num_computed` (tokens holds at least that many ids): hashes newly full
  // blocks, takes checkpoints, frees window blocks that slid out.
  void commit(RequestId id, std::span<const int32_t> tokens, int64_t num_computed);

  // Drops a request (finished, aborted or preempted). Its hashed blocks stay cached until evicted.
  void release(RequestId id);

  bool has_request(RequestId id) const { return requests_.count(id) != 0; }
  int64_t num_computed(RequestId id) const { return requests_.at(id).num_computed; }
  // Block table of a request for a group: history groups by logical block; the window group by 64-token block
  // (kNoBlock where freed); state groups one block.
  const std::vector<BlockId>& block_table(RequestId id, CacheGroupKind kind) const;
  int64_t block_offset(BlockId id) const { return pool_.byte_offset(id); }

  // Copies the runner must execute before the next step's compute (restores) and right after it (snapshots).
  std::vector<BlockCopy> take_pending_copies();

  struct Stats {
    int64_t prefix_queries = 0, prefix_query_tokens = 0, prefix_hit_tokens = 0;
    int64_t checkpoints_taken = 0, checkpoints_evicted = 0, blocks_evicted = 0;
  };
  const Stats& stats() const { return stats_; }
  int64_t num_checkpoints() const { return static_cast<int64_t>(checkpoints_.size()); }
  int64_t num_cached_prefix_blocks() const { return static_cast<int64_t>(prefix_blocks_.size()); }
  // Chain hashes of every logical block in the prefix cache (a prefix walk can use it), ascending.
  std::vector<uint64_t> cached_block_hashes() const;
  // The events recorded since the previous call (record_events), and clears them.
  PrefixCacheEvents drain_prefix_cache_events();

  // Verifies ownership and reference counts against the requests and caches; throws dsv4::Error on violation.
  void check_invariants() const;

 private:
  struct Request {
    int64_t num_computed = 0;
    std::vector<uint64_t> block_hashes;             // chain hash of each full logical block
    std::vector<std::vector<BlockId>> tables;       // per group index
    std::optional<uint64_t> rolling_checkpoint;     // this request's latest non-interval checkpoint
    int64_t window_released = 0;                    // window blocks below this index are released
    int64_t history_covered = -1;                   // largest end the history tables hold blocks for
  };
  struct Checkpoint {
    int64_t boundary = 0;
    std::vector<BlockId> window_blocks;  // SWA blocks covering [boundary − window, boundary)
    std::vector<BlockId> state_blocks;   // per snapshot group, in snapshot_groups_ order
    bool interval = false;               // on a checkpoint_interval multiple: never dropped by the rolling rule
  };

  int group_index(CacheGroupKind kind) const;
  std::optional<BlockId> new_block(int group);
  void on_evict(BlockId id);
  void release_block(BlockId id);  // drops a reference; cacheable iff a prefix entry or checkpoint holds it
  void forget_block_key(BlockId block, uint64_t key);
  void record_event(uint64_t hash, bool cached);
  void drop_checkpoint(uint64_t key);
  void take_checkpoint(Request& request, int64_t boundary, bool interval);
  int64_t window_first_block(int64_t end_position) const;  // first SWA block that [end − window, end) touches
  int64_t history_blocks_needed(const CacheGroupSpec& group, int64_t tokens) const;

  CacheLayout layout_;
  PrefixCacheOptions options_;
  BlockPool pool_;
  int swa_group_ = -1;
  std::vector<int> history_groups_, state_groups_, snapshot_groups_;
  std::unordered_map<RequestId, Request> requests_;
  // Prefix blocks: chain hash -> the history blocks of that logical block (one per history group).
  std::unordered_map<uint64_t, std::vector<BlockId>> prefix_blocks_;
  std::unordered_map<uint64_t, Checkpoint> checkpoints_;  // keyed by the chain hash of the block ending there
  // Which cache entry a cached-or-shared block belongs to (prefix hash or checkpoint key), for eviction.
  std::unordered_map<BlockId, uint64_t> block_prefix_key_;
  std::unordered_map<BlockId, std::vector<uint64_t>> block_checkpoint_keys_;
  std::vector<BlockCopy> pending_copies_;
  std::vector<BlockId> pending_releases_;  // copy sources/targets held until take_pending_copies()
  uint64_t root_hash_ = 0;
  Stats stats_;
  // Net events since the last drain: hash -> (cached now?, order of its first change), see PrefixCacheEvents.
  std::unordered_map<uint64_t, std::pair<bool, uint64_t>> pending_events_;
  uint64_t event_clock_ = 0;
};

}  // namespace dsv4
