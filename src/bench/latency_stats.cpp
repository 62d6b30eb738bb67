#include "bench/latency_stats.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/error.h"

namespace dsv4::bench {

namespace {

// Linear-interpolated percentile of values already sorted ascending.
double sorted_percentile(std::span<const double> sorted, double p) {
  if (sorted.empty()) return 0.0;
  const double rank = p / 100.0 * static_cast<double>(sorted.size() - 1);
  const size_t lower = static_cast<size_t>(std::floor(rank));
  const size_t upper = std::min(lower + 1, sorted.size() - 1);
  const double fraction = rank - static_cast<double>(lower);
  return sorted[lower] + (sorted[upper] - sorted[lower]) * fraction;
}

void check_percentile(double p) {
  DSV4_CHECK(p >= 0.0 && p <= 100.0, "percentile must be in [0, 100], got " + std::to_string(p));
}

}  // namespace

double percentile(std::span<const double> values, double p) {
  check_percentile(p);
  std::vector<double> sorted(values.begin(), values.end());
  std::sort(sorted.begin(), sorted.end());
  return sorted_percentile(sorted, p);
}

LatencySummary summarize(std::span<const double> values, std::span<const double> percentiles) {
  for (const double p : percentiles) check_percentile(p);
  LatencySummary summary;
  summary.percentiles.assign(percentiles.size(), 0.0);
  if (values.empty()) return summary;
  std::vector<double> sorted(values.begin(), values.end());
  std::sort(sorted.begin(), sorted.end());
  double sum = 0.0;
  for (const double v : sorted) sum += v;
  summary.mean = sum / static_cast<double>(sorted.size());
  double squares = 0.0;
  for (const double v : sorted) squares += (v - summary.mean) * (v - summary.mean);
  summary.stddev = std::sqrt(squares / static_cast<double>(sorted.size()));
  summary.median = sorted_percentile(sorted, 50.0);
  for (size_t i = 0; i < percentiles.size(); ++i) summary.percentiles[i] = sorted_percentile(sorted, percentiles[i]);
  return summary;
}

}  // namespace dsv4::bench
