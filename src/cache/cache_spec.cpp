#include "cache/cache_spec.h"

#include "cache/kv_entry_format.h"
#include "core/error.h"

namespace dsv4 {

const char* cache_group_name(CacheGroupKind kind) {
  switch (kind) {
    case CacheGroupKind::kSwaKv: return "swa_kv";
    case CacheGroupKind::kC4Main: return "c4_main";
    case CacheGroupKind::kC4Index: return "c4_index";
    case CacheGroupKind::kC128Main: return "c128_main";
    case CacheGroupKind::kC4MainState: return "c4_main_state";
    case CacheGroupKind::kC4IndexState: return "c4_index_state";
    case CacheGroupKind::kC128State: return "c128_state";
  }
  return "?";
}

double CacheGroupSpec::bytes_per_token() const {
  if (growth != GroupGrowth::kHistory) return 0.0;
  return static_cast<double>(entry_bytes) * static_cast<double>(layers.size()) / static_cast<double>(tokens_per_entry);
}

int64_t main_entry_bytes(int64_t head_dim, int64_t rope_dim, KvStorage storage) {
  switch (storage) {
    case KvStorage::kF32: return 4 * head_dim;
    case KvStorage::kBf16: return 2 * head_dim;
    case KvStorage::kFp8: {
      const int64_t nope = head_dim - rope_dim;
      const int64_t raw = nope + 2 * rope_dim + (nope + 63) / 64;
      return (raw + 7) / 8 * 8;
    }
  }
  return 0;
}

int64_t index_entry_bytes(int64_t index_head_dim, IndexStorage storage) {
  switch (storage) {
    case IndexStorage::kF32: return 4 * index_head_dim;
    case IndexStorage::kBf16: return 2 * index_head_dim;
    case IndexStorage::kFp8: return index_head_dim + 4;
    case IndexStorage::kFp4: return index_head_dim / 2 + (index_head_dim + 31) / 32;
  }
  return 0;
}

CacheLayout CacheLayout::for_model(const ModelConfig& config, KvStorage kv, IndexStorage index) {
  CacheLayout layout;
  layout.kv_storage = kv;
  layout.index_storage = index;
  std::vector<int64_t> all, csa, hca;
  for (int64_t layer = 0; layer < config.num_hidden_layers; ++layer) {
    all.push_back(layer);
    const AttentionType type = config.layer_types[static_cast<size_t>(layer)];
    if (type == AttentionType::kCompressedSparse) csa.push_back(layer);
    if (type == AttentionType::kHeavilyCompressed) hca.push_back(layer);
  }
  const int64_t d = config.head_dim, rope = config.qk_rope_head_dim, main_bytes = main_entry_bytes(d, rope, kv);
  const int64_t m4 = config.compress_rate_csa, m128 = config.compress_rate_hca;
  DSV4_CHECK(kLogicalBlockTokens % m4 == 0 || csa.empty(),
        "compress_rate_csa = " + std::to_string(m4) + " must divide the 256-token logical block");
  DSV4_CHECK(kLogicalBlockTokens % m128 == 0 || hca.empty(),
        "compress_rate_hca = " + std::to_string(m128) + " must divide the 256-token logical block");
  // SWA: window blocks of swa_block_tokens raw entries.
  layout.swa_block_tokens = std::min<int64_t>(64, std::max<int64_t>(1, config.sliding_window));
  layout.groups.push_back({CacheGroupKind::kSwaKv, GroupGrowth::kWindow, all, main_bytes, 1,
                           layout.swa_block_tokens, config.sliding_window});
  if (!csa.empty()) {
    layout.groups.push_back({CacheGroupKind::kC4Main, GroupGrowth::kHistory, csa, main_bytes, m4,
                             kLogicalBlockTokens / m4, 0});
    layout.groups.push_back({CacheGroupKind::kC4Index, GroupGrowth::kHistory, csa,
                             index_entry_bytes(config.index_head_dim, index), m4, kLogicalBlockTokens / m4, 0});
  }
  if (!hca.empty())
    layout.groups.push_back({CacheGroupKind::kC128Main, GroupGrowth::kHistory, hca, main_bytes, m128,
                             kLogicalBlockTokens / m128, 0});
  // FP8 main entries of the V4 shape are laid out as the device kernels read them (data rows, then the scale
  // groups, the region padded to 576 B): a block must hold every layer's padded region, not layers · 584 · epb.
  if (kv == KvStorage::kFp8 && d == kKvHeadDim && rope == kKvRopeDim)
    for (CacheGroupSpec& group : layout.groups)
      if (group.kind == CacheGroupKind::kSwaKv || group.kind == CacheGroupKind::kC4Main ||
          group.kind == CacheGroupKind::kC128Main)
        group.layer_region_bytes = kv_region_bytes(KvEntryFormat::kFp8, group.entries_per_block);
  // Compressor state (ops/cpu/compressor.h): coff·ratio slots of coff·width fp32 values, for kv and gate.
  auto state_bytes = [](int64_t ratio, int64_t width, bool overlap) {
    const int64_t coff = overlap ? 2 : 1;
    return coff * ratio * coff * width * 2 * static_cast<int64_t>(sizeof(float));
  };
  if (!csa.empty()) {
    layout.groups.push_back({CacheGroupKind::kC4MainState, GroupGrowth::kFixed, csa, state_bytes(m4, d, true), 1, 1, 0});
    layout.groups.push_back({CacheGroupKind::kC4IndexState, GroupGrowth::kFixed, csa,
                             state_bytes(m4, config.index_head_dim, true), 1, 1, 0});
  }
  if (!hca.empty())
    layout.groups.push_back({CacheGroupKind::kC128State, GroupGrowth::kFixed, hca, state_bytes(m128, d, false), 1, 1, 0});
  return layout;
}

const CacheGroupSpec* CacheLayout::find(CacheGroupKind kind) const {
  for (const auto& group : groups)
    if (group.kind == kind) return &group;
  return nullptr;
}

}  // namespace dsv4
