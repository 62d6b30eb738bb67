// The kinds of per-request state DeepSeek-V4 keeps (docs/cache.md) and their byte sizes: one CacheGroupSpec per
// kind, covering every layer that has that kind. The cache manager allocates per group; the planner sums them.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "model/model_config.h"

namespace dsv4 {

// The scheduler's unit: prefix hashing, admission and history growth are counted in 256-token blocks.
inline constexpr int64_t kLogicalBlockTokens = 256;

// kF32 is the CPU reference backend's exact storage; BF16/FP8/FP4 are the serving formats.
enum class KvStorage { kF32, kBf16, kFp8 };          // main K=V entries (raw window and compressed)
enum class IndexStorage { kF32, kBf16, kFp8, kFp4 };  // lightning-indexer keys

enum class CacheGroupKind {
  kSwaKv,         // raw K=V of the last sliding_window tokens, every layer            (window)
  kC4Main,        // compressed K=V entries of CSA layers, one per compress_rate_csa tokens (history)
  kC4Index,       // indexer keys of CSA layers, same count                          (history)
  kC128Main,      // compressed K=V entries of HCA layers, one per compress_rate_hca   (history)
  kC4MainState,   // CSA main compressor state: previous + open window, fp32 kv and gate (fixed per request)
  kC4IndexState,  // CSA indexer compressor state                                    (fixed per request)
  kC128State,     // HCA compressor state: the open window, fp32 kv and gate            (fixed per request)
};
inline constexpr CacheGroupKind kAllCacheGroupKinds[] = {
    CacheGroupKind::kSwaKv,       CacheGroupKind::kC4Main,        CacheGroupKind::kC4Index,
    CacheGroupKind::kC128Main,    CacheGroupKind::kC4MainState,   CacheGroupKind::kC4IndexState,
    CacheGroupKind::kC128State};
const char* cache_group_name(CacheGroupKind kind);

enum class GroupGrowth {
  kHistory,  // grows with the sequence: entries_per_logical_block entries per 256 tokens
  kWindow,   // keeps the last window_tokens tokens; blocks that slide out are freed while the request runs
  kFixed,    // one state block per request, whatever its length
};

struct CacheGroupSpec {
  CacheGroupKind kind;
  GroupGrowth growth;
  std::vector<int64_t> layers;       // model layers holding this kind of state
  int64_t entry_bytes = 0;           // one entry of one layer
  int64_t tokens_per_entry = 1;      // compress ratio (1 for raw K=V)
  int64_t entries_per_block = 0;     // entries of one layer in one physical block of this group
  int64_t window_tokens = 0;         // kWindow: tokens kept
  // Bytes of one layer's entries in a block when the format pads them (the FP8 main entries: their layer region
  // is rounded up to a multiple of 576 B, cache/kv_entry_format.h kv_region_bytes); 0 = entry_bytes · entries.
  int64_t layer_region_bytes = 0;
  // A physical block holds entries_per_block entries of every layer of the group, one region per layer.
  int64_t region_bytes() const { return layer_region_bytes ? layer_region_bytes : entry_bytes * entries_per_block; }
  int64_t block_bytes() const { return region_bytes() * static_cast<int64_t>(layers.size()); }
  int64_t tokens_per_block() const { return entries_per_block * tokens_per_entry; }
  // Bytes per token of sequence, over all layers of the group (history groups; 0 for the others).
  double bytes_per_token() const;
};

struct CacheLayout {
  KvStorage kv_storage = KvStorage::kBf16;
  IndexStorage index_storage = IndexStorage::kBf16;
  int64_t swa_block_tokens = 64;  // window groups free in blocks of this many tokens
  std::vector<CacheGroupSpec> groups;  // only the kinds the model has

  static CacheLayout for_model(const ModelConfig& config, KvStorage kv = KvStorage::kBf16,
                               IndexStorage index = IndexStorage::kBf16);
  const CacheGroupSpec* find(CacheGroupKind kind) const;
};

// Bytes of one main entry of `head_dim` channels (`rope_dim` of them rotated) in a storage format.
// FP8 is DeepSeek's / FlashMLA's layout: e4m3 no-rope part, bf16 rope part, one UE8M0 scale per 64 no-rope
// channels, padded to 8 bytes (448 + 128 + 7 + 1 = 584 for V4).
int64_t main_entry_bytes(int64_t head_dim, int64_t rope_dim, KvStorage storage);
// Bytes of one index key: bf16 2·c; FP8 c + 4 (fp32 scale); FP4 c/2 + c/32 (UE8M0 per 32) = 68 for c = 128.
int64_t index_entry_bytes(int64_t index_head_dim, IndexStorage storage);

}  // namespace dsv4
