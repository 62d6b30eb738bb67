#include "cache/weight_plan.h"

#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/weights.h"

namespace dsv4 {
namespace {

constexpr double kFp8BlockBits = 8.0 + 8.0 / (128.0 * 128.0);  // e4m3 + one UE8M0 byte per 128×128 block

// The linears DeepSeek's release stores as F8_E4M3 with block scales (model_spec.md §2).
bool released_as_fp8(const std::string& name) {
  for (const char* suffix : {".attn.wq_a.weight", ".attn.wq_b.weight", ".attn.wkv.weight", ".attn.wo_a.weight",
                             ".attn.wo_b.weight", ".attn.indexer.wq_b.weight"})
    if (name.ends_with(suffix)) return true;
  return name.find(".ffn.shared_experts.") != std::string::npos;
}

std::string gib(int64_t bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f GiB", static_cast<double>(bytes) / double(int64_t{1} << 30));
  return text;
}

}  // namespace

WeightPlan plan_weights(const ModelConfig& config, const WeightFormat& format) {
  DSV4_CHECK(std::isfinite(format.expert_bits) && format.expert_bits >= 1 && format.expert_bits <= 32,
             "expert bits " + std::to_string(format.expert_bits) + ": must be in [1, 32]");
  WeightPlan plan;
  plan.format = format;
  DSV4_CHECK(format.dense_bits == 16.0 || format.dense_bits == 32.0,
             "dense bits " + std::to_string(format.dense_bits) + ": must be 16 (bf16) or 32 (fp32)");
  const bool bf16 = format.dense_bits == 16.0;
  plan.classes = {{"routed experts", 0, format.expert_bits, 0},
                  {format.dense_fp8 ? "dense FP8 linears" : bf16 ? "dense linears (bf16)" : "dense linears (fp32)", 0,
                   format.dense_fp8 ? kFp8BlockBits : format.dense_bits, 0},
                  {bf16 ? "bf16 tensors" : "dense tensors (fp32)", 0, format.dense_bits, 0},
                  {"fp32 tensors", 0, 32.0, 0},
                  {"hash tables (int32)", 0, 32.0, 0}};
  for (const TensorSpec& spec : checkpoint_tensors(config)) {
    int64_t params = 1;
    for (const int64_t d : spec.shape) params *= d;
    size_t index = 2;
    switch (spec.role) {
      case TensorRole::kLinear:
        if (spec.name.find(".ffn.experts.") != std::string::npos) index = 0;
        else if (spec.name.ends_with(".ffn.gate.weight")) index = 3;  // the router is held in fp32 (model_spec §9.1)
        else if (released_as_fp8(spec.name)) index = 1;
        else index = 2;
        break;
      case TensorRole::kEmbedding:
      case TensorRole::kNormWeight: index = 2; break;
      case TensorRole::kHcFn:
      case TensorRole::kHcBase:
      case TensorRole::kHcScale:
      case TensorRole::kSink:
      case TensorRole::kPositionBias:
      case TensorRole::kRouterBias: index = 3; break;
      case TensorRole::kHashTable: index = 4; break;
    }
    plan.classes[index].params += params;
  }
  for (WeightClass& c : plan.classes) {
    c.bytes = static_cast<int64_t>(std::ceil(static_cast<double>(c.params) * c.bits / 8.0));
    plan.params += c.params;
    plan.bytes += c.bytes;
  }
  return plan;
}

double parse_expert_bits(const std::string& text, const std::string& what) {
  if (text == "fp4" || text == "mxfp4") return 4.25;
  if (text == "fp8") return kFp8BlockBits;
  if (text == "bf16") return 16.0;
  size_t used = 0;
  double bits = 0;
  try {
    bits = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  DSV4_CHECK(used == text.size() && std::isfinite(bits) && bits >= 1 && bits <= 16,
             what + " '" + text + "': expected fp4, fp8, bf16 or a number of bits per parameter in [1, 16]");
  return bits;
}

std::string format_weight_plan(const WeightPlan& plan) {
  std::string out;
  char line[160];
  std::snprintf(line, sizeof line, "\nweights (routed experts %.3g bits/param, dense %s)\n", plan.format.expert_bits,
                plan.format.dense_fp8 ? "fp8" : "bf16");
  out += line;
  std::snprintf(line, sizeof line, "%-28s %16s %8s %14s\n", "class", "params", "bits", "bytes");
  out += line;
  for (const WeightClass& c : plan.classes) {
    std::snprintf(line, sizeof line, "%-28s %16lld %8.3f %14s\n", c.name.c_str(), static_cast<long long>(c.params),
                  c.bits, gib(c.bytes).c_str());
    out += line;
  }
  std::snprintf(line, sizeof line, "%-28s %16lld %8s %14s\n", "total", static_cast<long long>(plan.params), "",
                gib(plan.bytes).c_str());
  out += line;
  return out;
}

nlohmann::json weight_plan_to_json(const WeightPlan& plan) {
  nlohmann::json classes = nlohmann::json::array();
  for (const WeightClass& c : plan.classes)
    classes.push_back({{"name", c.name}, {"params", c.params}, {"bits", c.bits}, {"bytes", c.bytes}});
  return {{"expert_bits", plan.format.expert_bits},
          {"dense", plan.format.dense_fp8 ? "fp8" : "bf16"},
          {"classes", classes},
          {"params", plan.params},
          {"bytes", plan.bytes}};
}

}  // namespace dsv4
