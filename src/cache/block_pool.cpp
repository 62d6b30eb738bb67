#include "cache/block_pool.h"

#include <algorithm>

#include "core/error.h"

namespace dsv4 {
namespace {

// The smallest page (a multiple of 4 KiB, at least 8x the largest block) whose tail padding stays under 1 % for
// every group; past 64x the largest block, the best one seen.
int64_t choose_page_bytes(const std::vector<int64_t>& block_bytes) {
  const int64_t largest = *std::max_element(block_bytes.begin(), block_bytes.end());
  const int64_t step = 4096;
  int64_t best = 0;
  double best_waste = 2.0;
  for (int64_t page = (8 * largest + step - 1) / step * step; page <= 64 * largest + step; page += step) {
    double waste = 0;
    for (const int64_t bytes : block_bytes) waste = std::max(waste, static_cast<double>(page % bytes) / page);
    if (waste < best_waste) best_waste = waste, best = page;
    if (waste <= 0.01) return page;
  }
  return best;
}

}  // namespace

BlockPool::BlockPool(std::vector<int64_t> group_block_bytes, int64_t pool_bytes)
    : group_block_bytes_(std::move(group_block_bytes)) {
  DSV4_CHECK(!group_block_bytes_.empty(), "block pool needs at least one cache group");
  for (const int64_t bytes : group_block_bytes_) DSV4_CHECK(bytes > 0, "cache group block size must be positive");
  page_bytes_ = choose_page_bytes(group_block_bytes_);
  for (const int64_t bytes : group_block_bytes_) blocks_per_page_.push_back(page_bytes_ / bytes);
  max_blocks_per_page_ = *std::max_element(blocks_per_page_.begin(), blocks_per_page_.end());
  const int64_t num_pages = pool_bytes / page_bytes_;
  DSV4_CHECK(num_pages > 0, "KV cache pool of " + std::to_string(pool_bytes) + " bytes holds no page of " +
                           std::to_string(page_bytes_) + " bytes");
  DSV4_CHECK(num_pages * max_blocks_per_page_ < (int64_t{1} << 31), "KV cache pool has too many blocks for 32-bit ids");
  pages_.resize(static_cast<size_t>(num_pages));
  for (int64_t page = num_pages - 1; page >= 0; --page) free_pages_.push_back(page);
  partial_pages_.resize(group_block_bytes_.size());
  lru_.resize(group_block_bytes_.size());
  blocks_.resize(static_cast<size_t>(num_pages * max_blocks_per_page_));
}

int64_t BlockPool::byte_offset(BlockId id) const {
  const Page& page = pages_[page_of(id)];
  return page_of(id) * page_bytes_ + slot_of(id) * group_block_bytes_[page.group];
}

std::optional<BlockId> BlockPool::take_free_slot(int group) {
  auto& partial = partial_pages_[group];
  // Fill the fullest page first, so lightly used pages drain and return to the shared list.
  int64_t best = -1;
  for (const int64_t page : partial)
    if (best < 0 || pages_[page].used > pages_[best].used) best = page;
  if (best < 0) {
    if (free_pages_.empty()) return std::nullopt;
    best = free_pages_.back();
    free_pages_.pop_back();
    Page& page = pages_[best];
    page.group = group;
    page.used = 0;
    page.free_slots.clear();
    for (int64_t slot = blocks_per_page_[group] - 1; slot >= 0; --slot) page.free_slots.push_back(static_cast<int32_t>(slot));
    partial.insert(best);
  }
  Page& page = pages_[best];
  const int32_t slot = page.free_slots.back();
  page.free_slots.pop_back();
  ++page.used;
  if (page.free_slots.empty()) partial.erase(best);
  return static_cast<BlockId>(best * max_blocks_per_page_ + slot);
}

void BlockPool::return_slot(BlockId id) {
  const int64_t page_index = page_of(id);
  Page& page = pages_[page_index];
  const int group = page.group;
  page.free_slots.push_back(static_cast<int32_t>(slot_of(id)));
  partial_pages_[group].insert(page_index);
  blocks_[id] = Block{};
  if (--page.used == 0) {  // the whole page is free: back to the shared list for any group
    page.group = -1;
    page.free_slots.clear();
    partial_pages_[group].erase(page_index);
    free_pages_.push_back(page_index);
  }
}

bool BlockPool::evict_one(int preferred_group, const std::function<void(BlockId)>& on_evict) {
  int group = preferred_group;
  if (lru_[group].empty()) {  // the least recently cached block of any group
    group = -1;
    for (size_t g = 0; g < lru_.size(); ++g)
      if (!lru_[g].empty() && (group < 0 || blocks_[lru_[g].front()].cached_at < blocks_[lru_[group].front()].cached_at))
        group = static_cast<int>(g);
    if (group < 0) return false;
  }
  const BlockId victim = lru_[group].front();
  lru_[group].pop_front();
  on_evict(victim);
  return_slot(victim);
  return true;
}

std::optional<BlockId> BlockPool::allocate(int group, const std::function<void(BlockId)>& on_evict) {
  std::optional<BlockId> id = take_free_slot(group);
  while (!id) {
    if (!evict_one(group, on_evict)) return std::nullopt;
    id = take_free_slot(group);
  }
  Block& block = blocks_[*id];
  block.refs = 1;
  block.allocated = true;
  block.cached = false;
  return id;
}

void BlockPool::add_ref(BlockId id) {
  Block& block = blocks_[id];
  DSV4_CHECK(block.allocated && block.refs > 0, "add_ref on block " + std::to_string(id) + " that is not in use");
  ++block.refs;
}

void BlockPool::revive(BlockId id) {
  Block& block = blocks_[id];
  DSV4_CHECK(block.allocated && block.cached && block.refs == 0, "revive on block " + std::to_string(id) + " that is not cached");
  lru_[pages_[page_of(id)].group].erase(block.lru);
  block.cached = false;
  block.refs = 1;
}

void BlockPool::discard(BlockId id) {
  Block& block = blocks_[id];
  DSV4_CHECK(block.allocated && block.cached, "discard of block " + std::to_string(id) + " that is not cached");
  lru_[pages_[page_of(id)].group].erase(block.lru);
  return_slot(id);
}

void BlockPool::release(BlockId id, bool cacheable) {
  Block& block = blocks_[id];
  DSV4_CHECK(block.allocated && block.refs > 0, "release of block " + std::to_string(id) + " that is not in use");
  if (--block.refs > 0) return;
  if (cacheable) {
    block.cached = true;
    block.cached_at = ++clock_;
    auto& lru = lru_[pages_[page_of(id)].group];
    block.lru = lru.insert(lru.end(), id);
  } else {
    return_slot(id);
  }
}

BlockPool::Usage BlockPool::usage() const {
  Usage u;
  u.pool_bytes = num_pages() * page_bytes_;
  u.used_blocks_per_group.assign(group_block_bytes_.size(), 0);
  u.cached_blocks_per_group.assign(group_block_bytes_.size(), 0);
  for (int64_t p = 0; p < num_pages(); ++p) {
    const Page& page = pages_[p];
    if (page.group < 0) {
      u.free_page_bytes += page_bytes_;
      continue;
    }
    const int64_t bytes = group_block_bytes_[page.group];
    u.padding_bytes += page_bytes_ - blocks_per_page_[page.group] * bytes;
    u.free_slot_bytes += static_cast<int64_t>(page.free_slots.size()) * bytes;
    for (int64_t slot = 0; slot < blocks_per_page_[page.group]; ++slot) {
      const Block& block = blocks_[p * max_blocks_per_page_ + slot];
      if (!block.allocated) continue;
      if (block.cached) {
        u.cached_block_bytes += bytes;
        ++u.cached_blocks_per_group[page.group];
      } else {
        u.used_block_bytes += bytes;
        ++u.used_blocks_per_group[page.group];
      }
    }
  }
  return u;
}

void BlockPool::check_invariants() const {
  std::vector<bool> page_free(pages_.size(), false);
  for (const int64_t page : free_pages_) {
    DSV4_CHECK(!page_free[page], "page " + std::to_string(page) + " twice in the free list");
    DSV4_CHECK(pages_[page].group == -1, "free page " + std::to_string(page) + " still owned");
    page_free[page] = true;
  }
  std::vector<int64_t> lru_count(pages_.size(), 0);
  for (size_t g = 0; g < lru_.size(); ++g)
    for (const BlockId id : lru_[g]) {
      DSV4_CHECK(blocks_[id].cached && blocks_[id].refs == 0, "LRU block " + std::to_string(id) + " is not cached");
      DSV4_CHECK(pages_[page_of(id)].group == static_cast<int>(g), "LRU block " + std::to_string(id) + " in the wrong group");
    }
  for (int64_t p = 0; p < num_pages(); ++p) {
    const Page& page = pages_[p];
    DSV4_CHECK(page_free[p] == (page.group == -1), "page " + std::to_string(p) + " ownership disagrees with the free list");
    if (page.group < 0) continue;
    int64_t used = 0;
    std::vector<bool> slot_free(static_cast<size_t>(max_blocks_per_page_), false);
    for (const int32_t slot : page.free_slots) {
      DSV4_CHECK(!slot_free[slot], "slot listed twice as free in page " + std::to_string(p));
      slot_free[slot] = true;
    }
    for (int64_t slot = 0; slot < blocks_per_page_[page.group]; ++slot) {
      const Block& block = blocks_[p * max_blocks_per_page_ + slot];
      DSV4_CHECK(block.allocated != slot_free[slot], "block " + std::to_string(p * max_blocks_per_page_ + slot) +
                                                    " is both free and allocated, or neither");
      if (block.allocated) {
        ++used;
        DSV4_CHECK(block.cached == (block.refs == 0), "block " + std::to_string(p * max_blocks_per_page_ + slot) +
                                                     " has refs " + std::to_string(block.refs) + " and cached " +
                                                     std::to_string(block.cached));
      }
    }
    DSV4_CHECK(used == page.used, "page " + std::to_string(p) + " counts " + std::to_string(page.used) + " used, holds " +
                                 std::to_string(used));
    DSV4_CHECK(used > 0, "an empty page " + std::to_string(p) + " is still owned by group " + std::to_string(page.group));
  }
}

}  // namespace dsv4
