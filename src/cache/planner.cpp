#include "cache/planner.h"

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <limits>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace dsv4 {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;
constexpr double kGiB = 1024.0 * kMiB;

int64_t ceil_div(int64_t a, int64_t b) { return a / b + (a % b != 0); }  // a >= 0, b > 0

// a · b, throwing instead of overflowing (a 2^62-token context must fail with a message, not wrap).
int64_t checked_mul(int64_t a, int64_t b, const std::string& what) {
  int64_t out = 0;
  DSV4_CHECK(!__builtin_mul_overflow(a, b, &out),
        what + ": " + std::to_string(a) + " × " + std::to_string(b) + " overflows 64-bit byte counts");
  return out;
}

int64_t checked_add(int64_t a, int64_t b, const std::string& what) {
  int64_t out = 0;
  DSV4_CHECK(!__builtin_add_overflow(a, b, &out), what + ": the byte count overflows 64 bits");
  return out;
}

std::string printf_string(const char* format, ...) __attribute__((format(printf, 1, 2)));
std::string printf_string(const char* format, ...) {
  char buffer[512];
  va_list args;
  va_start(args, format);
  std::vsnprintf(buffer, sizeof(buffer), format, args);
  va_end(args);
  return buffer;
}

// 2 decimals in the largest binary unit that keeps the value >= 1: "584 B", "3.07 MiB", "9.62 GiB".
std::string human_bytes(double bytes) {
  if (bytes < 1024.0) return printf_string("%.0f B", bytes);
  if (bytes < kMiB) return printf_string("%.2f KiB", bytes / 1024.0);
  if (bytes < kGiB) return printf_string("%.2f MiB", bytes / kMiB);
  return printf_string("%.2f GiB", bytes / kGiB);
}

GroupPlan plan_group(const CacheGroupSpec& spec, int64_t context, int64_t swa_block_tokens) {
  GroupPlan group;
  group.kind = spec.kind;
  group.growth = spec.growth;
  group.layers = static_cast<int64_t>(spec.layers.size());
  group.entry_bytes = spec.entry_bytes;
  group.tokens_per_entry = spec.tokens_per_entry;
  group.block_bytes = spec.block_bytes();
  switch (spec.growth) {
    case GroupGrowth::kHistory:
      group.layer_bytes_per_token =
          static_cast<double>(spec.entry_bytes) / static_cast<double>(spec.tokens_per_entry);
      group.bytes_per_token = spec.bytes_per_token();
      group.entries = context / spec.tokens_per_entry;  // only complete compression windows have an entry
      group.blocks = ceil_div(group.entries, spec.entries_per_block);
      break;
    case GroupGrowth::kWindow: {
      // Positions [context - window, context) are held; blocks are aligned to swa_block_tokens positions.
      group.entries = std::min(context, spec.window_tokens);
      const int64_t first = context - group.entries;
      group.blocks = ceil_div(context, swa_block_tokens) - first / swa_block_tokens;
      break;
    }
    case GroupGrowth::kFixed:
      group.entries = 1;
      group.blocks = 1;
      break;
  }
  const std::string what =
      std::string(cache_group_name(spec.kind)) + " at context = " + std::to_string(context);
  group.data_bytes = checked_mul(checked_mul(group.entries, spec.entry_bytes, what), group.layers, what);
  checked_mul(group.blocks, group.block_bytes, what);
  return group;
}

}  // namespace

const char* kv_storage_name(KvStorage storage) {
  switch (storage) {
    case KvStorage::kF32:
      return "f32";
    case KvStorage::kBf16:
      return "bf16";
    case KvStorage::kFp8:
      return "fp8";
  }
  return "?";
}

const char* index_storage_name(IndexStorage storage) {
  switch (storage) {
    case IndexStorage::kF32:
      return "f32";
    case IndexStorage::kBf16:
      return "bf16";
    case IndexStorage::kFp8:
      return "fp8";
    case IndexStorage::kFp4:
      return "fp4";
  }
  return "?";
}

const char* group_growth_name(GroupGrowth growth) {
  switch (growth) {
    case GroupGrowth::kHistory:
      return "history";
    case GroupGrowth::kWindow:
      return "window";
    case GroupGrowth::kFixed:
      return "fixed";
  }
  return "?";
}

KvStorage parse_kv_storage(const std::string& name, const std::string& what) {
  for (const KvStorage storage : {KvStorage::kBf16, KvStorage::kFp8, KvStorage::kF32})
    if (name == kv_storage_name(storage)) return storage;
  throw Error(what + " '" + name + "': must be one of bf16, fp8, f32");
}

IndexStorage parse_index_storage(const std::string& name, const std::string& what) {
  for (const IndexStorage storage :
       {IndexStorage::kBf16, IndexStorage::kFp8, IndexStorage::kFp4, IndexStorage::kF32})
    if (name == index_storage_name(storage)) return storage;
  throw Error(what + " '" + name + "': must be one of bf16, fp8, fp4, f32");
}

int64_t parse_token_count(const std::string& text, const std::string& what) {
  std::string digits = text;
  int64_t scale = 1;
  if (!digits.empty() && (digits.back() == 'K' || digits.back() == 'k')) scale = int64_t{1} << 10;
  if (!digits.empty() && (digits.back() == 'M' || digits.back() == 'm')) scale = int64_t{1} << 20;
  if (scale != 1) digits.pop_back();
  const bool all_digits =
      !digits.empty() && digits.size() <= 18 &&
      std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; });
  DSV4_CHECK(all_digits,
        what + " '" + text + "': must be a positive token count (digits, optionally K = 2^10 or M = 2^20)");
  int64_t value = 0;
  DSV4_CHECK(!__builtin_mul_overflow(std::stoll(digits), scale, &value), what + " '" + text + "': too large");
  DSV4_CHECK(value > 0, what + " '" + text + "': must be positive");
  return value;
}

const GroupPlan* CapacityPlan::find(CacheGroupKind kind) const {
  for (const auto& group : groups)
    if (group.kind == kind) return &group;
  return nullptr;
}

CapacityPlan plan_capacity(const ModelConfig& config, KvStorage kv, IndexStorage index,
                           int64_t context_tokens, std::optional<double> gpu_memory_gib,
                           std::optional<int64_t> requests) {
  DSV4_CHECK(context_tokens > 0, "context = " + std::to_string(context_tokens) + ": must be positive");
  if (gpu_memory_gib)
    DSV4_CHECK(std::isfinite(*gpu_memory_gib) && *gpu_memory_gib > 0 && *gpu_memory_gib < 1e9,
          "gpu memory = " + std::to_string(*gpu_memory_gib) + " GiB: must be positive (and under 1e9 GiB)");
  if (requests) DSV4_CHECK(*requests > 0, "requests = " + std::to_string(*requests) + ": must be positive");

  const CacheLayout layout = CacheLayout::for_model(config, kv, index);
  CapacityPlan plan;
  plan.kv_storage = kv;
  plan.index_storage = index;
  plan.context_tokens = context_tokens;
  plan.sliding_window = config.sliding_window;
  for (const auto& spec : layout.groups) {
    const GroupPlan group = plan_group(spec, context_tokens, layout.swa_block_tokens);
    PlanBytes* subtotal = nullptr;
    switch (group.growth) {
      case GroupGrowth::kHistory:
        subtotal = &plan.history;
        break;
      case GroupGrowth::kWindow:
        subtotal = &plan.window;
        break;
      case GroupGrowth::kFixed:
        subtotal = &plan.state;
        break;
    }
    subtotal->data =
        checked_add(subtotal->data, group.data_bytes, "context = " + std::to_string(context_tokens));
    subtotal->reserved = checked_add(subtotal->reserved, group.reserved_bytes(),
                                     "context = " + std::to_string(context_tokens));
    plan.history_bytes_per_token += group.bytes_per_token;
    plan.groups.push_back(group);
  }
  // total() sums the three subtotals; make sure that cannot wrap either.
  const std::string what = "context = " + std::to_string(context_tokens);
  checked_add(checked_add(plan.history.reserved, plan.window.reserved, what), plan.state.reserved, what);
  checked_add(checked_add(plan.history.data, plan.window.data, what), plan.state.data, what);
  const int64_t per_request = plan.total().reserved;
  if (gpu_memory_gib) {
    plan.memory_gib = *gpu_memory_gib;
    plan.memory_bytes = static_cast<int64_t>(std::floor(*gpu_memory_gib * kGiB));
    plan.requests_fit = *plan.memory_bytes / per_request;
  }
  if (requests) {
    plan.requests = *requests;
    plan.requests_bytes = checked_mul(*requests, per_request, "requests = " + std::to_string(*requests));
  }
  return plan;
}

std::string format_capacity_plan(const CapacityPlan& plan) {
  std::string out;
  out += printf_string("KV cache plan: %s, context %lld tokens, kv %s, index %s, sliding window %lld\n",
                       plan.model.empty() ? "model" : plan.model.c_str(),
                       static_cast<long long>(plan.context_tokens), kv_storage_name(plan.kv_storage),
                       index_storage_name(plan.index_storage), static_cast<long long>(plan.sliding_window));
  out +=
      printf_string("\n%-15s %-8s %6s %8s %10s %11s %10s %15s %11s %8s %11s\n", "group", "growth", "layers",
                    "entry B", "B/tok/lyr", "B/token", "entries", "data bytes", "data", "blocks", "reserved");
  for (const auto& g : plan.groups) {
    const bool history = g.growth == GroupGrowth::kHistory;
    out += printf_string(
        "%-15s %-8s %6lld %8lld %10s %11s %10lld %15lld %11s %8lld %11s\n", cache_group_name(g.kind),
        group_growth_name(g.growth), static_cast<long long>(g.layers), static_cast<long long>(g.entry_bytes),
        history ? printf_string("%.2f", g.layer_bytes_per_token).c_str() : "-",
        history ? printf_string("%.2f", g.bytes_per_token).c_str() : "-", static_cast<long long>(g.entries),
        static_cast<long long>(g.data_bytes), human_bytes(static_cast<double>(g.data_bytes)).c_str(),
        static_cast<long long>(g.blocks), human_bytes(static_cast<double>(g.reserved_bytes())).c_str());
  }
  out +=
      "\n(entries: per layer; history groups hold one entry per complete compression window, the window "
      "group "
      "the last tokens)\n";

  out += printf_string("\n%-34s %15s %11s %11s\n", "per request", "data bytes", "data", "reserved");
  auto line = [&](const char* name, const PlanBytes& bytes, const std::string& note) {
    out += printf_string("%-34s %15lld %11s %11s%s\n", name, static_cast<long long>(bytes.data),
                         human_bytes(static_cast<double>(bytes.data)).c_str(),
                         human_bytes(static_cast<double>(bytes.reserved)).c_str(), note.c_str());
  };
  line("growing history (c4/c128 entries)", plan.history,
       printf_string("   %.2f B/token", plan.history_bytes_per_token));
  line("window rings (swa_kv)", plan.window, "");
  line("history + rings", plan.history_and_window(), "");
  line("compressor state (fixed)", plan.state, "");
  line("total per request", plan.total(), "");

  // Per layer and token: the C4A (main + index) and C128A figures of the source material.
  const GroupPlan* c4_main = plan.find(CacheGroupKind::kC4Main);
  const GroupPlan* c4_index = plan.find(CacheGroupKind::kC4Index);
  const GroupPlan* c128 = plan.find(CacheGroupKind::kC128Main);
  if (c4_main || c128) out += "\nper layer and token:";
  if (c4_main && c4_index)
    out += printf_string(" CSA (C4A) %.2f B = main %.2f + index %.2f",
                         c4_main->layer_bytes_per_token + c4_index->layer_bytes_per_token,
                         c4_main->layer_bytes_per_token, c4_index->layer_bytes_per_token);
  if (c4_main && c128) out += ";";
  if (c128) out += printf_string(" HCA (C128A) %.2f B", c128->layer_bytes_per_token);
  if (c4_main || c128) out += "\n";

  if (plan.memory_bytes) {
    out += printf_string(
        "\nKV-cache budget %.2f GiB (memory given to the cache; weights and activations not "
        "counted): %lld requests of %lld tokens fit (%s reserved each)\n",
        *plan.memory_gib, static_cast<long long>(*plan.requests_fit),
        static_cast<long long>(plan.context_tokens),
        human_bytes(static_cast<double>(plan.total().reserved)).c_str());
  }
  if (plan.requests_bytes) {
    out += printf_string("%s%lld requests of %lld tokens reserve %lld bytes = %s of KV cache\n",
                         plan.memory_bytes ? "" : "\n", static_cast<long long>(*plan.requests),
                         static_cast<long long>(plan.context_tokens),
                         static_cast<long long>(*plan.requests_bytes),
                         human_bytes(static_cast<double>(*plan.requests_bytes)).c_str());
  }
  return out;
}

nlohmann::json capacity_plan_to_json(const CapacityPlan& plan) {
  using nlohmann::json;
  auto bytes_json = [](const PlanBytes& bytes) {
    return json{{"data_bytes", bytes.data}, {"reserved_bytes", bytes.reserved}};
  };
  json groups = json::array();
  for (const auto& g : plan.groups) {
    groups.push_back({{"name", cache_group_name(g.kind)},
                      {"growth", group_growth_name(g.growth)},
                      {"layers", g.layers},
                      {"entry_bytes", g.entry_bytes},
                      {"tokens_per_entry", g.tokens_per_entry},
                      {"layer_bytes_per_token", g.layer_bytes_per_token},
                      {"bytes_per_token", g.bytes_per_token},
                      {"entries_per_layer", g.entries},
                      {"data_bytes", g.data_bytes},
                      {"block_bytes", g.block_bytes},
                      {"blocks", g.blocks},
                      {"reserved_bytes", g.reserved_bytes()}});
  }
  json out = {{"model", plan.model},
              {"context_tokens", plan.context_tokens},
              {"kv_dtype", kv_storage_name(plan.kv_storage)},
              {"index_dtype", index_storage_name(plan.index_storage)},
              {"sliding_window", plan.sliding_window},
              {"groups", groups},
              {"history_bytes_per_token", plan.history_bytes_per_token},
              {"growing_history", bytes_json(plan.history)},
              {"window_rings", bytes_json(plan.window)},
              {"history_and_rings", bytes_json(plan.history_and_window())},
              {"compressor_state", bytes_json(plan.state)},
              {"total_per_request", bytes_json(plan.total())}};
  if (plan.memory_bytes) {
    out["kv_cache_budget_gib"] = *plan.memory_gib;
    out["kv_cache_budget_bytes"] = *plan.memory_bytes;
    out["requests_fit"] = *plan.requests_fit;
  }
  if (plan.requests_bytes) {
    out["requests"] = *plan.requests;
    out["requests_reserved_bytes"] = *plan.requests_bytes;
  }
  return out;
}

}  // namespace dsv4
