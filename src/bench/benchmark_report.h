// The figures of a finished run, as `vllm bench serve` defines them (docs/bench.md), its printed summary and
// its JSON result file.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "bench/latency_stats.h"
#include "bench/serve_benchmark.h"

namespace dsv4::bench {

struct BenchmarkMetrics {
  int64_t completed = 0, failed = 0;
  double duration_s = 0;
  int64_t total_input_tokens = 0, total_output_tokens = 0;  // over the successful requests
  double request_throughput = 0, output_throughput = 0, total_token_throughput = 0;  // per second of duration
  std::vector<double> percentiles;                         // which percentiles the summaries hold
  LatencySummary ttft_ms, tpot_ms, itl_ms, e2el_ms;        // over the successful requests, in milliseconds
};

// TPOT of one request is (E2E - TTFT) / (output_tokens - 1), defined for output_tokens > 1 only; ITL pools every
// gap of every successful request.
BenchmarkMetrics compute_metrics(const ServeBenchmarkRun& run, std::span<const double> percentiles);

// The human-readable summary (vLLM's layout), then up to a few distinct failure messages with their counts.
std::string format_summary(const ServeBenchmarkConfig& config, const BenchmarkMetrics& metrics,
                           const ServeBenchmarkRun& run);

// The result file: the configuration, every figure of `metrics`, and the per-request lists (docs/bench.md).
nlohmann::json result_json(const ServeBenchmarkConfig& config, const BenchmarkMetrics& metrics,
                           const ServeBenchmarkRun& run);

}  // namespace dsv4::bench
