// The capacity planner (docs/planner.md): the KV-cache bytes one request of a given length needs, group by
// group (the groups of cache_spec.h), and how many such requests fit in a memory budget.
//
// Per group and request at `context_tokens` tokens:
//   history  entries = floor(context / tokens_per_entry) per layer (only complete windows exist),
//            data = entries · entry_bytes · layers, reserved = ceil(entries / entries_per_block) blocks;
//   window   data = min(context, window_tokens) · entry_bytes · layers, reserved = the swa blocks that cover
//   the
//            last window_tokens positions ending at `context`;
//   fixed    data = entry_bytes · layers, reserved = one block.
// `reserved` is what the block allocator hands out (whole blocks of CacheGroupSpec::block_bytes()); the
// pool's page tail padding (block_pool.h, < ~1 % of a page) and the weights are not counted.
#pragma once
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <vector>

#include "cache/cache_spec.h"
#include "model/model_config.h"

namespace dsv4 {

struct GroupPlan {
  CacheGroupKind kind;
  GroupGrowth growth;
  int64_t layers = 0;
  int64_t entry_bytes = 0;  // one entry of one layer
  int64_t tokens_per_entry = 1;
  double layer_bytes_per_token = 0;  // history: entry_bytes / tokens_per_entry, one layer; 0 otherwise
  double bytes_per_token = 0;  // history: over all layers of the group (CacheGroupSpec::bytes_per_token)
  int64_t entries = 0;         // per layer, at this context (window: tokens held; fixed: 1)
  int64_t data_bytes = 0;      // exact bytes of the entries, all layers
  int64_t block_bytes = 0;     // CacheGroupSpec::block_bytes()
  int64_t blocks = 0;          // physical blocks the allocator reserves for this request
  int64_t reserved_bytes() const { return blocks * block_bytes; }
};

// A data / reserved pair of byte counts.
struct PlanBytes {
  int64_t data = 0, reserved = 0;
};

struct CapacityPlan {
  std::string model;  // a label for the output (preset name or model directory); set by the caller
  KvStorage kv_storage = KvStorage::kBf16;
  IndexStorage index_storage = IndexStorage::kBf16;
  int64_t context_tokens = 0;
  int64_t sliding_window = 0;
  std::vector<GroupPlan> groups;  // in CacheLayout::for_model order

  double history_bytes_per_token = 0;  // the growing part, all history groups and layers
  PlanBytes history;                   // growing history: C4 main + C4 index + C128 main
  PlanBytes window;                    // SWA rings
  PlanBytes state;                     // compressor state (fixed per request)
  PlanBytes history_and_window() const {
    return {history.data + window.data, history.reserved + window.reserved};
  }
  PlanBytes total() const {
    return {history.data + window.data + state.data, history.reserved + window.reserved + state.reserved};
  }

  // --gpu-memory: the KV-cache budget (not the GPU's size: weights and activations are not accounted here).
  std::optional<double> memory_gib;
  std::optional<int64_t> memory_bytes;  // floor(memory_gib · 2^30)
  std::optional<int64_t> requests_fit;  // floor(memory_bytes / total().reserved)
  // --requests K: the memory K requests of this length reserve.
  std::optional<int64_t> requests;
  std::optional<int64_t> requests_bytes;  // K · total().reserved

  const GroupPlan* find(CacheGroupKind kind) const;
};

// Throws dsv4::Error naming the value when context_tokens <= 0, gpu_memory_gib is not positive and finite, or
// requests <= 0.
CapacityPlan plan_capacity(const ModelConfig& config, KvStorage kv, IndexStorage index,
                           int64_t context_tokens, std::optional<double> gpu_memory_gib = std::nullopt,
                           std::optional<int64_t> requests = std::nullopt);

const char* kv_storage_name(KvStorage storage);        // "f32", "bf16", "fp8"
const char* index_storage_name(IndexStorage storage);  // "f32", "bf16", "fp8", "fp4"
const char* group_growth_name(GroupGrowth growth);     // "history", "window", "fixed"
// Parse a storage name; throws dsv4::Error("<what> 'name': must be one of ...") on an unknown one.
KvStorage parse_kv_storage(const std::string& name, const std::string& what);
IndexStorage parse_index_storage(const std::string& name, const std::string& what);
// "1048576", "1M" (2^20), "128K" (2^17); throws dsv4::Error naming `what` on anything else or a value <= 0.
int64_t parse_token_count(const std::string& text, const std::string& what);

// The human-readable table and the machine-readable form of a plan.
std::string format_capacity_plan(const CapacityPlan& plan);
nlohmann::json capacity_plan_to_json(const CapacityPlan& plan);

}  // namespace dsv4
