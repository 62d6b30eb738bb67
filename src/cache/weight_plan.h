// Weight memory of a model at a storage precision (docs/planner.md "Weights and what is left for the cache"):
// the other half of "how many requests fit on this GPU". Tensors are counted from the config's tensor list
// (model/weights.h checkpoint_tensors; the MTP layer is not loaded, so not counted) in five classes:
//   routed experts      --expert-bits: 4.25 = MXFP4 as released (e2m1 + one UE8M0 per 32), 8.0 = FP8 with
//                       128×128 block scales, 16 = bf16, or any requantized width (2.5–3.5 bits/param fit
//                       V4-Flash on one H200: perf_anchors.md §6.2);
//   dense FP8 linears   the linears the release stores as F8_E4M3 + 128×128 UE8M0 scales (wq_a, wq_b, wkv,
//                       wo_a, wo_b, indexer wq_b, shared experts): 8 + 8/16384 bits, or 16 with dense bf16;
//   bf16 tensors        embedding, LM head, compressor and router projections, indexer head weights, norms;
//   fp32 tensors        mHC mixes, compressor position biases, attention sinks, router biases;
//   hash tables         tid2eid, int32.
#pragma once
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "model/model_config.h"

namespace dsv4 {

struct WeightFormat {
  double expert_bits = 4.25;
  bool dense_fp8 = true;  // false: the FP8 linears held in the dense dtype
  // The dense dtype's bits: the "bf16 tensors" class (embedding, LM head, compressor and indexer projections,
  // norms) and the FP8 linears when dense_fp8 is false. 16 (bf16), or 32 for a device holding everything fp32.
  double dense_bits = 16.0;
};

struct WeightClass {
  std::string name;
  int64_t params = 0;
  double bits = 0;    // per parameter, scales included
  int64_t bytes = 0;  // ceil(params · bits / 8)
};

struct WeightPlan {
  WeightFormat format;
  std::vector<WeightClass> classes;  // routed experts, dense FP8 linears, bf16, fp32, hash tables
  int64_t params = 0, bytes = 0;
};

WeightPlan plan_weights(const ModelConfig& config, const WeightFormat& format);

// "fp4" / "mxfp4" (4.25), "fp8" (8 + 8/16384), "bf16" (16), or a number of bits per parameter in [1, 16];
// throws dsv4::Error naming `what` otherwise.
double parse_expert_bits(const std::string& text, const std::string& what);

std::string format_weight_plan(const WeightPlan& plan);
nlohmann::json weight_plan_to_json(const WeightPlan& plan);

}  // namespace dsv4
