#include "cache/hybrid_kv_cache_manager.h"

#include <algorithm>
#include <cstring>
#include <map>

#include "cache/block_hash.h"
#include "core/error.h"

namespace dsv4 {
namespace {

std::vector<int64_t> block_sizes(const CacheLayout& layout) {
  std::vector<int64_t> sizes;
  for (const auto& group : layout.groups) sizes.push_back(group.block_bytes());
  return sizes;
}

}  // namespace

HybridKvCacheManager::HybridKvCacheManager(CacheLayout layout, int64_t pool_bytes, PrefixCacheOptions options)
    : layout_(std::move(layout)), options_(std::move(options)), pool_(block_sizes(layout_), pool_bytes) {
  DSV4_CHECK(options_.checkpoint_interval > 0 && options_.checkpoint_interval % kLogicalBlockTokens == 0,
        "prefix checkpoint interval " + std::to_string(options_.checkpoint_interval) + " must be a positive multiple of " +
            std::to_string(kLogicalBlockTokens));
  for (size_t g = 0; g < layout_.groups.size(); ++g) {
    const CacheGroupSpec& group = layout_.groups[g];
    switch (group.growth) {
      case GroupGrowth::kHistory: history_groups_.push_back(static_cast<int>(g)); break;
      case GroupGrowth::kWindow: swa_group_ = static_cast<int>(g); break;
      case GroupGrowth::kFixed:
        state_groups_.push_back(static_cast<int>(g));
        // At a 256-token boundary the C128 open window is empty (128 | 256): nothing of it to keep.
        if (group.kind != CacheGroupKind::kC128State) snapshot_groups_.push_back(static_cast<int>(g));
        break;
    }
  }
  DSV4_CHECK(swa_group_ >= 0, "cache layout has no sliding-window group");
  root_hash_ = prefix_root_hash(options_.salt);
}

int HybridKvCacheManager::group_index(CacheGroupKind kind) const {
  for (size_t g = 0; g < layout_.groups.size(); ++g)
    if (layout_.groups[g].kind == kind) return static_cast<int>(g);
  throw Error(std::string("this model has no cache group ") + cache_group_name(kind));
}

int64_t HybridKvCacheManager::history_blocks_needed(const CacheGroupSpec& group, int64_t tokens) const {
  const int64_t entries = tokens / group.tokens_per_entry;  // an entry exists once its window is complete
  return (entries + group.entries_per_block - 1) / group.entries_per_block;
}

int64_t HybridKvCacheManager::window_first_block(int64_t end_position) const {
  const int64_t first_position = std::max<int64_t>(0, end_position - layout_.groups[swa_group_].window_tokens);
  return first_position / layout_.swa_block_tokens;
}

int64_t HybridKvCacheManager::blocks_for_prompt(int64_t prompt_tokens) const {
  int64_t blocks = static_cast<int64_t>(state_groups_.size());
  for (const int g : history_groups_) blocks += history_blocks_needed(layout_.groups[g], prompt_tokens);
  if (prompt_tokens > 0) blocks += (prompt_tokens - 1) / layout_.swa_block_tokens - window_first_block(prompt_tokens) + 1;
  return blocks;
}

bool HybridKvCacheManager::fits_in_pool(int64_t total_tokens) const {
  // Pages per group: each page holds blocks of one group only.
  auto pages = [&](int g, int64_t blocks) { return (blocks + pool_.blocks_per_page(g) - 1) / pool_.blocks_per_page(g); };
  int64_t needed = 0;
  for (const int g : state_groups_) needed += pages(g, 1);
  for (const int g : history_groups_) needed += pages(g, history_blocks_needed(layout_.groups[g], total_tokens));
  const int64_t window_blocks =
      total_tokens > 0 ? (total_tokens - 1) / layout_.swa_block_tokens - window_first_block(total_tokens) + 1 : 0;
  needed += pages(swa_group_, window_blocks + 1);  // +1: a step may straddle the window's first block
  return needed <= pool_.num_pages();
}

std::optional<BlockId> HybridKvCacheManager::new_block(int group) {
  return pool_.allocate(group, [this](BlockId id) { on_evict(id); });
}

void HybridKvCacheManager::release_block(BlockId id) {
  const auto prefix = block_prefix_key_.find(id);
  const auto checkpoint = block_checkpoint_keys_.find(id);
  const bool cacheable = prefix != block_prefix_key_.end() || checkpoint != block_checkpoint_keys_.end();
  pool_.release(id, cacheable);
}

std::optional<int64_t> HybridKvCacheManager::admit(RequestId id, std::span<const int32_t> prompt) {
  DSV4_CHECK(!requests_.count(id), "request " + std::to_string(id) + " is already admitted");
  DSV4_CHECK(!prompt.empty(), "request " + std::to_string(id) + " has an empty prompt");
  Request request;
  request.tables.resize(layout_.groups.size());
  // Longest hit: consecutive cached logical blocks from the start, ending where a checkpoint exists, and
  // leaving at least one prompt token to compute (its logits are the first output).
  std::vector<uint64_t> hashes;
  int64_t hit_blocks = 0;
  if (options_.enabled) {
    ++stats_.prefix_queries;
    stats_.prefix_query_tokens += static_cast<int64_t>(prompt.size());
    const int64_t max_blocks = (static_cast<int64_t>(prompt.size()) - 1) / kLogicalBlockTokens;
    uint64_t parent = root_hash_;
    for (int64_t b = 0; b < max_blocks; ++b) {
      const uint64_t h = chain_block_hash(parent, prompt.subspan(b * kLogicalBlockTokens, kLogicalBlockTokens));
      if (!prefix_blocks_.count(h)) break;
      hashes.push_back(h);
      parent = h;
      if (checkpoints_.count(h)) hit_blocks = b + 1;
    }
    hashes.resize(static_cast<size_t>(hit_blocks));
  }
  const int64_t hit = hit_blocks * kLogicalBlockTokens;
  // Reference the hit first, so allocating the state blocks cannot evict it.
  auto hold = [&](BlockId block) {
    if (pool_.is_cached(block)) pool_.revive(block);
    else pool_.add_ref(block);
  };
  for (int64_t b = 0; b < hit_blocks; ++b) {
    const auto& blocks = prefix_blocks_.at(hashes[b]);
    for (size_t i = 0; i < history_groups_.size(); ++i) {
      hold(blocks[i]);
      request.tables[history_groups_[i]].push_back(blocks[i]);
    }
  }
  const Checkpoint* checkpoint = hit_blocks > 0 ? &checkpoints_.at(hashes.back()) : nullptr;
  if (checkpoint) {
    auto& window = request.tables[swa_group_];
    window.assign(static_cast<size_t>((hit - 1) / layout_.swa_block_tokens + 1), kNoBlock);
    const int64_t first = window_first_block(hit);
    for (size_t i = 0; i < checkpoint->window_blocks.size(); ++i) {
      hold(checkpoint->window_blocks[i]);
      window[first + static_cast<int64_t>(i)] = checkpoint->window_blocks[i];
    }
  }
  // Keep the snapshot blocks alive until their restore copies are handed out.
  std::vector<BlockId> snapshot_sources;
  if (checkpoint)
    for (const BlockId block : checkpoint->state_blocks) {
      hold(block);
      snapshot_sources.push_back(block);
    }
  for (const int g : state_groups_) {
    const auto block = new_block(g);
    if (!block) {  // roll back everything this call took
      for (auto& table : request.tables)
        for (const BlockId held : table)
          if (held != kNoBlock) release_block(held);
      for (const BlockId source : snapshot_sources) release_block(source);
      return std::nullopt;
    }
    request.tables[g].push_back(*block);
  }
  if (checkpoint) {
    for (size_t i = 0; i < snapshot_groups_.size(); ++i) {
      const int g = snapshot_groups_[i];
      pending_copies_.push_back({pool_.byte_offset(checkpoint->state_blocks[i]),
                                 pool_.byte_offset(request.tables[g][0]), pool_.block_bytes(g)});
    }
    pending_releases_.insert(pending_releases_.end(), snapshot_sources.begin(), snapshot_sources.end());
  }
  request.num_computed = hit;
  request.block_hashes = std::move(hashes);
  stats_.prefix_hit_tokens += hit;
  requests_.emplace(id, std::move(request));
  return hit;
}

bool HybridKvCacheManager::allocate(RequestId id, int64_t new_tokens) {
  Request& request = requests_.at(id);
  const int64_t end = request.num_computed + new_tokens;
  if (new_tokens == 1 && end <= request.history_covered) {  // a decode step usually needs no new block
    const auto& window = request.tables[swa_group_];
    const int64_t last = (end - 1) / layout_.swa_block_tokens;
    if (last < static_cast<int64_t>(window.size()) && window[last] != kNoBlock) return true;
  }
  std::vector<std::pair<int, int64_t>> taken;  // (group, table index) allocated by this call
  auto undo = [&] {
    for (auto it = taken.rbegin(); it != taken.rend(); ++it) {
      auto& table = request.tables[it->first];
      pool_.release(table[it->second], /*cacheable=*/false);
      if (it->first == swa_group_) table[it->second] = kNoBlock;
      else table.pop_back();
    }
  };
  for (const int g : history_groups_) {
    auto& table = request.tables[g];
    const int64_t needed = history_blocks_needed(layout_.groups[g], end);
    while (static_cast<int64_t>(table.size()) < needed) {
      const auto block = new_block(g);
      if (!block) return undo(), false;
      table.push_back(*block);
      taken.emplace_back(g, static_cast<int64_t>(table.size()) - 1);
    }
  }
  if (new_tokens > 0) {
    // Only the blocks the step's last `window` tokens land in: earlier tokens of a long chunk are never stored.
    auto& window = request.tables[swa_group_];
    const int64_t last = (end - 1) / layout_.swa_block_tokens;
    if (static_cast<int64_t>(window.size()) < last + 1) window.resize(static_cast<size_t>(last + 1), kNoBlock);
    for (int64_t b = window_first_block(end); b <= last; ++b) {
      if (window[b] != kNoBlock) continue;
      const auto block = new_block(swa_group_);
      if (!block) return undo(), false;
      window[b] = *block;
      taken.emplace_back(swa_group_, b);
    }
  }
  // The largest end the history tables now cover: n blocks hold entries < n·epb, i.e. tokens < (n·epb + 1)·ratio.
  request.history_covered = INT64_MAX;
  for (const int g : history_groups_) {
    const CacheGroupSpec& group = layout_.groups[g];
    const int64_t blocks = static_cast<int64_t>(request.tables[g].size());
    request.history_covered =
        std::min(request.history_covered, (blocks * group.entries_per_block + 1) * group.tokens_per_entry - 1);
  }
  return true;
}

void HybridKvCacheManager::commit(RequestId id, std::span<const int32_t> tokens, int64_t num_computed) {
  Request& request = requests_.at(id);
  DSV4_CHECK(num_computed >= request.num_computed && static_cast<int64_t>(tokens.size()) >= num_computed,
        "commit of request " + std::to_string(id) + " to " + std::to_string(num_computed) + " tokens");
  request.num_computed = num_computed;
  // Window blocks wholly before [num_computed − window, num_computed) slid out.
  auto& window = request.tables[swa_group_];
  const int64_t first = std::min<int64_t>(window_first_block(num_computed), static_cast<int64_t>(window.size()));
  for (int64_t b = request.window_released; b < first; ++b)
    if (window[b] != kNoBlock) {
      release_block(window[b]);
      window[b] = kNoBlock;
    }
  request.window_released = std::max(request.window_released, first);
  if (!options_.enabled) return;
  // Hash newly full logical blocks; the first request to complete a block registers it.
  while (static_cast<int64_t>(request.block_hashes.size() + 1) * kLogicalBlockTokens <= num_computed) {
    const int64_t b = static_cast<int64_t>(request.block_hashes.size());
    const uint64_t parent = b == 0 ? root_hash_ : request.block_hashes.back();
    const uint64_t h = chain_block_hash(parent, tokens.subspan(b * kLogicalBlockTokens, kLogicalBlockTokens));
    request.block_hashes.push_back(h);
    if (prefix_blocks_.count(h)) continue;
    std::vector<BlockId> blocks;
    for (const int g : history_groups_) {
      blocks.push_back(request.tables[g][b]);
      block_prefix_key_[request.tables[g][b]] = h;
    }
    prefix_blocks_.emplace(h, std::move(blocks));
    record_event(h, /*cached=*/true);
  }
  if (num_computed > 0 && num_computed % kLogicalBlockTokens == 0)
    take_checkpoint(request, num_computed, num_computed % options_.checkpoint_interval == 0);
}

void HybridKvCacheManager::take_checkpoint(Request& request, int64_t boundary, bool interval) {
  const uint64_t key = request.block_hashes[boundary / kLogicalBlockTokens - 1];
  // The rolling rule: a request keeps only its latest non-interval checkpoint.
  if (request.rolling_checkpoint && *request.rolling_checkpoint != key) {
    const auto previous = checkpoints_.find(*request.rolling_checkpoint);
    if (previous != checkpoints_.end() && !previous->second.interval) drop_checkpoint(*request.rolling_checkpoint);
    request.rolling_checkpoint.reset();
  }
  if (const auto existing = checkpoints_.find(key); existing != checkpoints_.end()) {
    existing->second.interval |= interval;
    return;
  }
  Checkpoint checkpoint;
  checkpoint.boundary = boundary;
  checkpoint.interval = interval;
  const auto& window = request.tables[swa_group_];
  for (int64_t b = window_first_block(boundary); b <= (boundary - 1) / layout_.swa_block_tokens; ++b)
    checkpoint.window_blocks.push_back(window[b]);
  std::vector<BlockCopy> copies;
  for (const int g : snapshot_groups_) {
    const auto block = new_block(g);
    if (!block) {  // no room for the snapshot: skip this checkpoint
      for (const BlockId taken : checkpoint.state_blocks) pool_.release(taken, false);
      return;
    }
    checkpoint.state_blocks.push_back(*block);
    copies.push_back({pool_.byte_offset(request.tables[g][0]), pool_.byte_offset(*block), pool_.block_bytes(g)});
  }
  for (const BlockId block : checkpoint.window_blocks) block_checkpoint_keys_[block].push_back(key);
  for (const BlockId block : checkpoint.state_blocks) {
    block_checkpoint_keys_[block].push_back(key);
    pending_releases_.push_back(block);  // held until the snapshot copy is handed out
  }
  pending_copies_.insert(pending_copies_.end(), copies.begin(), copies.end());
  checkpoints_.emplace(key, std::move(checkpoint));
  if (!interval) request.rolling_checkpoint = key;
  ++stats_.checkpoints_taken;
}

void HybridKvCacheManager::forget_block_key(BlockId block, uint64_t key) {
  const auto it = block_checkpoint_keys_.find(block);
  if (it == block_checkpoint_keys_.end()) return;
  auto& keys = it->second;
  keys.erase(std::remove(keys.begin(), keys.end(), key), keys.end());
  if (!keys.empty()) return;
  block_checkpoint_keys_.erase(it);
  // A cached block that no cache entry needs any more goes back to the pool now.
  if (pool_.is_cached(block) && !block_prefix_key_.count(block)) pool_.discard(block);
}

void HybridKvCacheManager::drop_checkpoint(uint64_t key) {
  const auto it = checkpoints_.find(key);
  if (it == checkpoints_.end()) return;
  const Checkpoint checkpoint = std::move(it->second);
  checkpoints_.erase(it);
  for (const BlockId block : checkpoint.window_blocks) forget_block_key(block, key);
  for (const BlockId block : checkpoint.state_blocks) forget_block_key(block, key);
}

void HybridKvCacheManager::on_evict(BlockId id) {
  ++stats_.blocks_evicted;
  if (const auto prefix = block_prefix_key_.find(id); prefix != block_prefix_key_.end()) {
    const uint64_t key = prefix->second;
    block_prefix_key_.erase(prefix);
    // The logical block's other history blocks are no use without this one.
    if (const auto entry = prefix_blocks_.find(key); entry != prefix_blocks_.end()) {
      const std::vector<BlockId> siblings = entry->second;
      prefix_blocks_.erase(entry);
      record_event(key, /*cached=*/false);
      for (const BlockId sibling : siblings) {
        if (sibling == id) continue;
        block_prefix_key_.erase(sibling);
        if (pool_.is_cached(sibling) && !block_checkpoint_keys_.count(sibling)) pool_.discard(sibling);
      }
    }
  }
  if (const auto keys = block_checkpoint_keys_.find(id); keys != block_checkpoint_keys_.end()) {
    const std::vector<uint64_t> affected = keys->second;
    block_checkpoint_keys_.erase(keys);
    for (const uint64_t key : affected) {
      ++stats_.checkpoints_evicted;
      drop_checkpoint(key);
    }
  }
}

void HybridKvCacheManager::release(RequestId id) {
  const auto it = requests_.find(id);
  DSV4_CHECK(it != requests_.end(), "release of unknown request " + std::to_string(id));
  // Restore copies still pending for this request's state blocks would land in freed memory: drop them.
  for (const int g : state_groups_)
    for (const BlockId block : it->second.tables[g]) {
      const int64_t target = pool_.byte_offset(block);
      std::erase_if(pending_copies_, [&](const BlockCopy& copy) { return copy.dst_offset == target; });
    }
  for (const auto& table : it->second.tables)
    for (const BlockId block : table)
      if (block != kNoBlock) release_block(block);
  requests_.erase(it);
}

const std::vector<BlockId>& HybridKvCacheManager::block_table(RequestId id, CacheGroupKind kind) const {
  return requests_.at(id).tables[group_index(kind)];
}

void HybridKvCacheManager::record_event(uint64_t hash, bool cached) {
  if (!options_.record_events) return;
  const auto [it, inserted] = pending_events_.try_emplace(hash, cached, event_clock_);
  if (inserted) {
    ++event_clock_;
    return;
  }
  // Cached then evicted (or the reverse) within one drain: the reader sees only the final state. A block that
  // went back to where it was still reports that state: the reader may have missed nothing, and applying a
  // state it already has is a no-op for it (the router's reports are idempotent).
  it->second.first = cached;
}

PrefixCacheEvents HybridKvCacheManager::drain_prefix_cache_events() {
  std::vector<std::pair<uint64_t, std::pair<uint64_t, bool>>> ordered;  // (order, (hash, cached))
  ordered.reserve(pending_events_.size());
  for (const auto& [hash, state] : pending_events_) ordered.push_back({state.second, {hash, state.first}});
  std::sort(ordered.begin(), ordered.end());
  PrefixCacheEvents events;
  for (const auto& [order, change] : ordered)
    (change.second ? events.cached : events.evicted).push_back(change.first);
  pending_events_.clear();
  event_clock_ = 0;
  return events;
}

std::vector<uint64_t> HybridKvCacheManager::cached_block_hashes() const {
  std::vector<uint64_t> hashes;
  hashes.reserve(prefix_blocks_.size());
  for (const auto& [hash, blocks] : prefix_blocks_) hashes.push_back(hash);
  std::sort(hashes.begin(), hashes.end());
  return hashes;
}

std::vector<BlockCopy> HybridKvCacheManager::take_pending_copies() {
  std::vector<BlockCopy> copies;
  copies.swap(pending_copies_);
  // The copies run before anything else allocates, so their sources and targets may become evictable now.
  for (const BlockId block : pending_releases_) release_block(block);
  pending_releases_.clear();
  return copies;
}

void HybridKvCacheManager::check_invariants() const {
  pool_.check_invariants();
  std::map<BlockId, int32_t> expected;
  for (const auto& [id, request] : requests_)
    for (const auto& table : request.tables)
      for (const BlockId block : table)
        if (block != kNoBlock) ++expected[block];
  for (const BlockId block : pending_releases_) ++expected[block];
  for (const auto& [block, refs] : expected)
    DSV4_CHECK(pool_.ref_count(block) == refs, "block " + std::to_string(block) + " has " +
                                              std::to_string(pool_.ref_count(block)) + " references, owners hold " +
                                              std::to_string(refs));
  int64_t referenced = 0, cached = 0;
  for (const auto& [block, refs] : expected) referenced += pool_.block_bytes(pool_.group_of(block));
  const BlockPool::Usage usage = pool_.usage();
  DSV4_CHECK(usage.used_block_bytes == referenced, "pool counts " + std::to_string(usage.used_block_bytes) +
                                                  " referenced bytes, owners " + std::to_string(referenced));
  // Every cached block belongs to a prefix entry or a checkpoint.
  for (const auto& [key, blocks] : prefix_blocks_)
    for (const BlockId block : blocks) {
      DSV4_CHECK(block_prefix_key_.count(block) && block_prefix_key_.at(block) == key,
            "prefix block " + std::to_string(block) + " lost its key");
      if (pool_.is_cached(block)) cached += pool_.block_bytes(pool_.group_of(block));
    }
  for (const auto& [key, checkpoint] : checkpoints_)
    for (const auto* list : {&checkpoint.window_blocks, &checkpoint.state_blocks})
      for (const BlockId block : *list) {
        const auto keys = block_checkpoint_keys_.find(block);
        DSV4_CHECK(keys != block_checkpoint_keys_.end() && std::count(keys->second.begin(), keys->second.end(), key) == 1,
              "checkpoint block " + std::to_string(block) + " lost its key");
        DSV4_CHECK(pool_.ref_count(block) > 0 || pool_.is_cached(block), "checkpoint block " + std::to_string(block) +
                                                                        " was freed under its checkpoint");
      }
  int64_t owned_cached = 0;
  for (size_t g = 0; g < usage.cached_blocks_per_group.size(); ++g)
    owned_cached += usage.cached_blocks_per_group[g] * pool_.block_bytes(static_cast<int>(g));
  int64_t keyed_cached = 0;
  std::map<BlockId, bool> seen;
  for (const auto& [block, key] : block_prefix_key_)
    if (pool_.is_cached(block) && !seen[block]) seen[block] = true, keyed_cached += pool_.block_bytes(pool_.group_of(block));
  for (const auto& [block, keys] : block_checkpoint_keys_)
    if (pool_.is_cached(block) && !seen[block]) seen[block] = true, keyed_cached += pool_.block_bytes(pool_.group_of(block));
  DSV4_CHECK(owned_cached == keyed_cached, "pool holds " + std::to_string(owned_cached) + " cached bytes, cache entries " +
                                          std::to_string(keyed_cached));
  (void)cached;
}

}  // namespace dsv4
