#include "bench/latency_stats.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "core/error.h"

namespace dsv4::bench {
namespace {

// numpy's default ("linear") percentile spelled out the slow way: sort, take the fractional rank
// p/100 * (n-1), and walk from the element below it toward the element above by the fraction.
double naive_percentile(std::vector<double> values, double p) {
  std::sort(values.begin(), values.end());
  const double rank = p / 100.0 * static_cast<double>(values.size() - 1);
  const double below = std::floor(rank), above = std::ceil(rank);
  const double low = values[static_cast<size_t>(below)], high = values[static_cast<size_t>(above)];
  return low + (high - low) * (rank - below);
}

TEST(LatencyStats, PercentilesMatchTheNaiveFormulaOnRandomData) {
  std::mt19937_64 rng(7);
  std::lognormal_distribution<double> latency(3.0, 1.0);
  for (const size_t n : {1, 2, 3, 10, 101, 1000}) {
    std::vector<double> values(n);
    for (double& v : values) v = latency(rng);
    for (const double p : {0.0, 1.0, 25.0, 50.0, 90.0, 99.0, 99.9, 100.0}) {
      EXPECT_NEAR(percentile(values, p), naive_percentile(values, p), 1e-9 * naive_percentile(values, p))
          << "n=" << n << " p=" << p;
    }
  }
}

TEST(LatencyStats, KnownNumpyValues) {
  // np.percentile([15, 20, 35, 40, 50], 40) == 29.0; np.percentile([1, 2, 3, 4], 99) == 3.97
  const std::vector<double> a = {50, 15, 40, 20, 35};
  EXPECT_DOUBLE_EQ(percentile(a, 40), 29.0);
  const std::vector<double> b = {4, 3, 2, 1};
  EXPECT_DOUBLE_EQ(percentile(b, 99), 3.97);
  EXPECT_DOUBLE_EQ(percentile(b, 50), 2.5);
}

TEST(LatencyStats, SummaryIsMeanMedianPopulationStdAndPercentiles) {
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<double> uniform(0.0, 100.0);
  std::vector<double> values(999);
  for (double& v : values) v = uniform(rng);
  const std::vector<double> ps = {50.0, 99.0};
  const LatencySummary s = summarize(values, ps);
  double sum = 0;
  for (const double v : values) sum += v;
  const double mean = sum / values.size();
  double squares = 0;
  for (const double v : values) squares += (v - mean) * (v - mean);
  EXPECT_NEAR(s.mean, mean, 1e-9);
  EXPECT_NEAR(s.stddev, std::sqrt(squares / values.size()), 1e-9);
  EXPECT_DOUBLE_EQ(s.median, naive_percentile(values, 50));
  ASSERT_EQ(s.percentiles.size(), 2u);
  EXPECT_DOUBLE_EQ(s.percentiles[0], s.median);
  EXPECT_DOUBLE_EQ(s.percentiles[1], naive_percentile(values, 99));
}

TEST(LatencyStats, EmptyIsZerosAndBadPercentileThrows) {
  const std::vector<double> none;
  const std::vector<double> ps = {99.0};
  const LatencySummary s = summarize(none, ps);
  EXPECT_EQ(s.mean, 0.0);
  EXPECT_EQ(s.percentiles, std::vector<double>{0.0});
  const std::vector<double> one = {1.0};
  EXPECT_THROW(percentile(one, 101), Error);
  EXPECT_THROW(percentile(one, -1), Error);
}

}  // namespace
}  // namespace dsv4::bench
