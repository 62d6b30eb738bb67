// BlockPool: one memory budget shared by every cache group (docs/cache.md).
//
// The arena is cut into equal pages. A page is handed to one group at a time and holds
// floor(page_bytes / block_bytes) of that group's blocks; when all of its blocks are free the page returns to
// the shared free list, so memory flows to whichever group the workload needs (one 1M-token request grows the
// history groups, thousands of short requests the window and state groups). The page size is chosen so that
// the tail padding of every group stays under ~1 % of a page.
//
// Block ids are global: id = page * max_blocks_per_page + slot, and a block's bytes start at
// page * page_bytes + slot * block_bytes(group) — kernels take block tables of ids plus this formula.
//
// Each block has a reference count. A block whose count drops to zero either goes back to its page's free
// slots or, if it carries a prefix hash, becomes *cached*: still addressable by its hash, evictable in LRU
// order when memory is needed.
#pragma once
#include <cstdint>
#include <functional>
#include <list>
#include <optional>
#include <set>
#include <vector>

namespace dsv4 {

using BlockId = int32_t;
inline constexpr BlockId kNoBlock = -1;

class BlockPool {
 public:
  // group_block_bytes[g]: bytes of one block of group g. The arena holds `pool_bytes` (rounded down to pages).
  BlockPool(std::vector<int64_t> group_block_bytes, int64_t pool_bytes);

  int64_t page_bytes() const { return page_bytes_; }
  int64_t num_pages() const { return static_cast<int64_t>(pages_.size()); }
  int64_t blocks_per_page(int group) const { return blocks_per_page_[group]; }
  int64_t max_blocks_per_page() const { return max_blocks_per_page_; }
  int64_t block_bytes(int group) const { return group_block_bytes_[group]; }
  int64_t byte_offset(BlockId id) const;  // of the block in the arena
  int group_of(BlockId id) const { return pages_[page_of(id)].group; }

  // A new block with reference count 1, evicting cached blocks if needed; nullopt when nothing is left.
  // `on_evict(id)` is called for every cached block evicted (the owner drops its hash entry).
  std::optional<BlockId> allocate(int group, const std::function<void(BlockId)>& on_evict);
  void add_ref(BlockId id);
  // Drops a reference. At zero: `cacheable` blocks become cached (LRU, most recent last), others free.
  void release(BlockId id, bool cacheable);
  // A cached (reference 0) block taken back into use by a prefix hit.
  void revive(BlockId id);
  // Frees a cached block at once (its cache entry is gone).
  void discard(BlockId id);
  int32_t ref_count(BlockId id) const { return blocks_[id].refs; }
  bool is_cached(BlockId id) const { return blocks_[id].cached; }

  struct Usage {
    int64_t pool_bytes = 0;
    int64_t used_block_bytes = 0;     // blocks with references
    int64_t cached_block_bytes = 0;   // evictable prefix-cache blocks
    int64_t free_slot_bytes = 0;      // free slots inside pages held by a group (usable by that group only)
    int64_t free_page_bytes = 0;      // pages in the shared free list
    int64_t padding_bytes = 0;        // page tails no block of the owning group fits in
    std::vector<int64_t> used_blocks_per_group, cached_blocks_per_group;
  };
  Usage usage() const;

  // Checks every internal invariant (page ownership, free lists, counts); throws dsv4::Error on violation.
  void check_invariants() const;

 private:
  struct Page {
    int group = -1;              // -1: in the shared free list
    int64_t used = 0;            // slots with references or cached
    std::vector<int32_t> free_slots;
  };
  struct Block {
    int32_t refs = 0;
    bool allocated = false;
    bool cached = false;
    std::list<BlockId>::iterator lru;
    uint64_t cached_at = 0;  // LRU clock when it became cached
  };
  int64_t page_of(BlockId id) const { return id / max_blocks_per_page_; }
  int64_t slot_of(BlockId id) const { return id % max_blocks_per_page_; }
  std::optional<BlockId> take_free_slot(int group);
  void return_slot(BlockId id);
  bool evict_one(int preferred_group, const std::function<void(BlockId)>& on_evict);

  std::vector<int64_t> group_block_bytes_, blocks_per_page_;
  int64_t page_bytes_ = 0, max_blocks_per_page_ = 0;
  std::vector<Page> pages_;
  std::vector<int64_t> free_pages_;                 // page indices
  std::vector<std::set<int64_t>> partial_pages_;    // per group: its pages with free slots
  std::vector<Block> blocks_;
  std::vector<std::list<BlockId>> lru_;             // per group: cached blocks, least recently used first
  uint64_t clock_ = 0;
};

}  // namespace dsv4
