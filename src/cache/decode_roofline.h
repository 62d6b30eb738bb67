// The bandwidth roofline of one decode step (issue 8, research/perf_anchors.md §6): a decode step of a
// bandwidth-bound model cannot be faster than the bytes it must read divided by the device's bandwidth. Bytes =
// the weights the step touches + the K=V and index entries its attention reads:
//   weights  every projection, compressor, indexer and mHC weight, the LM head and the shared experts once;
//            the routed experts of each MoE layer that at least one of the batch's tokens picks, in expectation
//            E · (1 − (1 − k/E)^batch) of E (uniform routing: the random-weight models' router is close to it);
//            the embedding rows of the batch's tokens;
//   KV       per request and layer: the sliding window (min(context, window) raw entries, every layer); on a
//            CSA layer the top-k compressed entries (min(index_topk, entries)) and every indexer key (the
//            lightning indexer scans them all); on an HCA layer every compressed entry.
// The weights' sizes are the weight planner's (cache/weight_plan.h: the format's bits per class), the entry sizes
// the cache's (cache/cache_spec.h: bf16 1,024 B or FP8 584 B main entries, 256 / 132 B index keys) from the
// capacity planner (cache/planner.h). Activations and the per-step metadata are not counted (≪ 1 % at V4 widths).
#pragma once
#include <cstdint>
#include <string>

#include "cache/cache_spec.h"
#include "cache/weight_plan.h"
#include "model/model_config.h"

namespace dsv4 {

struct DecodeRoofline {
  double weight_bytes = 0;         // touched by one step
  double routed_expert_bytes = 0;  // of weight_bytes: the distinct routed experts
  double kv_bytes = 0;             // read by one step, all requests
  double bytes() const { return weight_bytes + kv_bytes; }
  double seconds_at(double bytes_per_second) const { return bytes() / bytes_per_second; }
};

// One decode token for each of `batch` requests at `context` tokens of history. Throws dsv4::Error when batch
// or context is not positive.
DecodeRoofline decode_roofline(const ModelConfig& config, const WeightFormat& weights, KvStorage kv,
                               IndexStorage index, int64_t batch, int64_t context);

std::string format_decode_roofline(const DecodeRoofline& roofline);

}  // namespace dsv4
