// PagedSequenceState: the model's per-request state (model/sequence_state.h) read and written in the KV-cache
// arena through the cache manager's block tables — the same addressing the CUDA kernels take (block id ->
// arena offset, then [layer][entry] inside the block). Storage is fp32 for the exact CPU backend.
#pragma once
#include <array>
#include <cstddef>
#include <span>
#include <vector>

#include "cache/hybrid_kv_cache_manager.h"
#include "model/model_config.h"
#include "model/sequence_state.h"

namespace dsv4 {

// The arena the pool's offsets point into (host memory for the CPU backend; lazily committed by the OS).
class KvArena {
 public:
  explicit KvArena(int64_t bytes);
  ~KvArena();
  KvArena(const KvArena&) = delete;
  KvArena& operator=(const KvArena&) = delete;
  std::byte* data() { return data_; }
  int64_t size() const { return size_; }
  // Executes the manager's snapshot/restore copies.
  void execute(std::span<const BlockCopy> copies);

 private:
  std::byte* data_ = nullptr;
  int64_t size_ = 0;
};

class PagedSequenceState final : public SequenceState {
 public:
  // The request must be admitted; `num_tokens` is its computed length (the prefix hit).
  PagedSequenceState(const ModelConfig& config, const HybridKvCacheManager& manager, KvArena& arena, RequestId id);

  int64_t num_tokens() const override { return num_tokens_; }
  void set_num_tokens(int64_t tokens) override { num_tokens_ = tokens; }
  float* window_kv(int64_t layer, int64_t position) override;
  float* compressor_kv_state(int64_t layer, EntryKind kind) override;
  float* compressor_gate_state(int64_t layer, EntryKind kind) override;
  int64_t num_entries(int64_t layer, EntryKind kind) const override;
  const float* entry(int64_t layer, EntryKind kind, int64_t index) const override;
  float* append_entry(int64_t layer, EntryKind kind) override;

 private:
  struct GroupView {
    const CacheGroupSpec* spec = nullptr;
    const std::vector<BlockId>* table = nullptr;
    std::vector<int64_t> layer_index;  // model layer -> index inside the group's blocks (-1: not in the group)
  };
  GroupView view(CacheGroupKind kind) const;
  float* at(const GroupView& group, int64_t layer, int64_t entry) const;  // entry `entry` of `layer`
  const GroupView& history(EntryKind kind, int64_t layer) const;
  const GroupView& state(EntryKind kind, int64_t layer) const;

  const ModelConfig& config_;
  const HybridKvCacheManager& manager_;
  KvArena& arena_;
  int64_t num_tokens_ = 0;
  GroupView swa_, c4_main_, c4_index_, c128_main_, c4_main_state_, c4_index_state_, c128_state_;
  std::vector<std::array<int64_t, 2>> entries_;  // per layer: main / index entries written
};

}  // namespace dsv4
