// Summary statistics of latency samples, computed as numpy computes them (vLLM reports np.mean, np.median,
// np.std and np.percentile), so figures compare one to one with `vllm bench serve`.
#pragma once
#include <span>
#include <vector>

namespace dsv4::bench {

// The p-th percentile (0 <= p <= 100) with linear interpolation between the two closest ranks, numpy's
// default: rank = p/100 * (n - 1). Empty input gives 0 (a run with no samples reports zeros, as vLLM does).
double percentile(std::span<const double> values, double p);

struct LatencySummary {
  double mean = 0, median = 0, stddev = 0;  // stddev: the population one (numpy's ddof = 0)
  std::vector<double> percentiles;          // one per requested percentile, in the order requested
};

LatencySummary summarize(std::span<const double> values, std::span<const double> percentiles);

}  // namespace dsv4::bench
