#include "engine/paged_sequence_state.h"

#include <sys/mman.h>

#include <cstring>

#include "core/error.h"

namespace dsv4 {

KvArena::KvArena(int64_t bytes) : size_(bytes) {
  void* mapping = mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  DSV4_CHECK(mapping != MAP_FAILED, "cannot reserve a KV cache arena of " + std::to_string(bytes) + " bytes");
  data_ = static_cast<std::byte*>(mapping);
}

KvArena::~KvArena() { munmap(data_, static_cast<size_t>(size_)); }

void KvArena::execute(std::span<const BlockCopy> copies) {
  for (const BlockCopy& copy : copies) {
    DSV4_CHECK(copy.src_offset >= 0 && copy.dst_offset >= 0 && copy.src_offset + copy.bytes <= size_ &&
              copy.dst_offset + copy.bytes <= size_,
          "block copy outside the KV arena");
    std::memmove(data_ + copy.dst_offset, data_ + copy.src_offset, static_cast<size_t>(copy.bytes));
  }
}

PagedSequenceState::PagedSequenceState(const ModelConfig& config, const HybridKvCacheManager& manager, KvArena& arena,
                                       RequestId id)
    : config_(config), manager_(manager), arena_(arena), num_tokens_(manager.num_computed(id)) {
  DSV4_CHECK(manager.layout().kv_storage == KvStorage::kF32 && manager.layout().index_storage == IndexStorage::kF32,
        "the CPU backend stores its cache in fp32");
  auto make = [&](CacheGroupKind kind) {
    GroupView group;
    group.spec = manager.layout().find(kind);
    if (!group.spec) return group;
    group.table = &manager.block_table(id, kind);
    group.layer_index.assign(static_cast<size_t>(config.num_hidden_layers), -1);
    for (size_t i = 0; i < group.spec->layers.size(); ++i) group.layer_index[group.spec->layers[i]] = static_cast<int64_t>(i);
    return group;
  };
  swa_ = make(CacheGroupKind::kSwaKv);
  c4_main_ = make(CacheGroupKind::kC4Main);
  c4_index_ = make(CacheGroupKind::kC4Index);
  c128_main_ = make(CacheGroupKind::kC128Main);
  c4_main_state_ = make(CacheGroupKind::kC4MainState);
  c4_index_state_ = make(CacheGroupKind::kC4IndexState);
  c128_state_ = make(CacheGroupKind::kC128State);
  entries_.resize(static_cast<size_t>(config.num_hidden_layers), {0, 0});
  for (int64_t layer = 0; layer < config.num_hidden_layers; ++layer) {
    const int64_t ratio = config.compress_rate(layer);
    if (ratio > 0) entries_[layer] = {num_tokens_ / ratio, num_tokens_ / ratio};
  }
}

float* PagedSequenceState::at(const GroupView& group, int64_t layer, int64_t entry) const {
  const int64_t per_block = group.spec->entries_per_block;
  const int64_t block_index = entry / per_block;
  DSV4_CHECK(block_index < static_cast<int64_t>(group.table->size()) && (*group.table)[block_index] != kNoBlock,
        std::string("no ") + cache_group_name(group.spec->kind) + " block holds entry " + std::to_string(entry) +
            " of layer " + std::to_string(layer));
  const int64_t slot = group.layer_index[layer] * per_block + entry % per_block;
  return reinterpret_cast<float*>(arena_.data() + manager_.block_offset((*group.table)[block_index]) +
                                  slot * group.spec->entry_bytes);
}

float* PagedSequenceState::window_kv(int64_t layer, int64_t position) { return at(swa_, layer, position); }

const PagedSequenceState::GroupView& PagedSequenceState::history(EntryKind kind, int64_t layer) const {
  if (kind == EntryKind::kIndex) return c4_index_;
  return config_.layer_types[layer] == AttentionType::kCompressedSparse ? c4_main_ : c128_main_;
}

const PagedSequenceState::GroupView& PagedSequenceState::state(EntryKind kind, int64_t layer) const {
  if (kind == EntryKind::kIndex) return c4_index_state_;
  return config_.layer_types[layer] == AttentionType::kCompressedSparse ? c4_main_state_ : c128_state_;
}

// A state block holds, per layer, the kv half then the gate half of ops/cpu/compressor.h's state.
float* PagedSequenceState::compressor_kv_state(int64_t layer, EntryKind kind) { return at(state(kind, layer), layer, 0); }

float* PagedSequenceState::compressor_gate_state(int64_t layer, EntryKind kind) {
  const GroupView& group = state(kind, layer);
  return at(group, layer, 0) + group.spec->entry_bytes / 2 / static_cast<int64_t>(sizeof(float));
}

int64_t PagedSequenceState::num_entries(int64_t layer, EntryKind kind) const {
  return entries_[layer][kind == EntryKind::kIndex ? 1 : 0];
}

const float* PagedSequenceState::entry(int64_t layer, EntryKind kind, int64_t index) const {
  return at(history(kind, layer), layer, index);
}

float* PagedSequenceState::append_entry(int64_t layer, EntryKind kind) {
  return at(history(kind, layer), layer, entries_[layer][kind == EntryKind::kIndex ? 1 : 0]++);
}

}  // namespace dsv4
