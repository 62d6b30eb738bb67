// One layer's view of one cache group in the KV arena, as kernels address it (docs/cache.md): the GPU model's
// equivalent of engine/paged_sequence_state.cpp's at(). Block ids are global (cache/block_pool.h):
//   id = page · max_blocks_per_page + slot,  bytes at page · page_bytes + slot · block_bytes,
// and a block holds entries_per_block entries of every layer of the group, layer-major, so entry e of the layer
// with index `layer_index` in the group lives at
//   block_start(table[row][e / entries_per_block]) + (layer_index · entries_per_block + e % entries_per_block) · entry_bytes.
// For the fixed-size state groups (compressor state) the whole layer slot is entry 0.
#pragma once
#include <cstddef>
#include <cstdint>

#include "core/host_device.h"

namespace dsv4 {

struct PagedGroupView {
  std::byte* arena = nullptr;
  int64_t page_bytes = 0;
  int64_t max_blocks_per_page = 1;
  int64_t block_bytes = 0;
  int64_t entry_bytes = 0;
  int64_t entries_per_block = 0;
  int64_t layer_index = 0;                // the layer's position in the group's layer list
  const int32_t* block_table = nullptr;  // [rows, block_table_stride] block ids; < 0: no block
  int64_t block_table_stride = 0;
};

// Entry `entry` of table row `row`; nullptr when its block is not allocated.
DSV4_HOST_DEVICE inline std::byte* paged_entry(const PagedGroupView& g, int64_t row, int64_t entry) {
  const int32_t block = g.block_table[row * g.block_table_stride + entry / g.entries_per_block];
  if (block < 0) return nullptr;
  return g.arena + (block / g.max_blocks_per_page) * g.page_bytes + (block % g.max_blocks_per_page) * g.block_bytes +
         (g.layer_index * g.entries_per_block + entry % g.entries_per_block) * g.entry_bytes;
}

}  // namespace dsv4
