#include "bench/workload.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "../tokenizer/deepseek_tokenizer.h"
#include "core/error.h"
#include "tokenizer/tokenizer.h"

namespace dsv4::bench {
namespace {

struct GapStats {
  double mean = 0, variance = 0;
};

GapStats gap_stats(const std::vector<double>& offsets) {
  GapStats stats;
  std::vector<double> gaps;
  double previous = 0;
  for (const double t : offsets) {
    gaps.push_back(t - previous);
    previous = t;
  }
  for (const double g : gaps) stats.mean += g;
  stats.mean /= gaps.size();
  for (const double g : gaps) stats.variance += (g - stats.mean) * (g - stats.mean);
  stats.variance /= gaps.size();
  return stats;
}

TEST(BenchArrivals, PoissonScheduleHasTheRequestedMeanRate) {
  constexpr int64_t kCount = 200000;
  for (const double rate : {0.5, 4.0, 250.0}) {
    const std::vector<double> offsets = arrival_offsets(kCount, rate, 1.0, 42);
    ASSERT_EQ(offsets.size(), static_cast<size_t>(kCount));
    EXPECT_TRUE(std::is_sorted(offsets.begin(), offsets.end()));
    const GapStats stats = gap_stats(offsets);
    // The mean of 200k exponential gaps has a relative standard error of 1/sqrt(200k) = 0.22%; 1.5% is ~7 sigma.
    EXPECT_NEAR(stats.mean * rate, 1.0, 0.015) << "rate " << rate;
    EXPECT_NEAR(offsets.back() / kCount * rate, 1.0, 0.015);
    // Exponential gaps: the standard deviation equals the mean (coefficient of variation 1).
    EXPECT_NEAR(std::sqrt(stats.variance) / stats.mean, 1.0, 0.03) << "rate " << rate;
  }
}

TEST(BenchArrivals, BurstinessChangesTheSpreadNotTheRate) {
  // Gamma gaps of shape k: squared coefficient of variation 1/k.
  for (const double burstiness : {0.25, 4.0}) {
    const GapStats stats = gap_stats(arrival_offsets(200000, 10.0, burstiness, 3));
    EXPECT_NEAR(stats.mean * 10.0, 1.0, 0.02);
    EXPECT_NEAR(stats.variance / (stats.mean * stats.mean), 1.0 / burstiness, 0.06 / burstiness);
  }
}

TEST(BenchArrivals, InfiniteRateSendsAllAtOnceAndSeedsRepeat) {
  const std::vector<double> all_at_once = arrival_offsets(5, std::numeric_limits<double>::infinity(), 1.0, 0);
  EXPECT_EQ(all_at_once, std::vector<double>(5, 0.0));
  EXPECT_EQ(arrival_offsets(100, 3.0, 1.0, 9), arrival_offsets(100, 3.0, 1.0, 9));
  EXPECT_NE(arrival_offsets(100, 3.0, 1.0, 9), arrival_offsets(100, 3.0, 1.0, 10));
  EXPECT_THROW(arrival_offsets(3, 0.0, 1.0, 0), Error);
  EXPECT_THROW(arrival_offsets(3, -2.0, 1.0, 0), Error);
  EXPECT_THROW(arrival_offsets(3, 1.0, 0.0, 0), Error);
}

TEST(BenchRandomPrompts, EncodeToTheRequestedLengthWithoutSpecialTokens) {
  REQUIRE_DEEPSEEK();
  for (const int64_t input_len : {1, 7, 256}) {
    const std::vector<BenchmarkRequest> requests = random_requests(*tok, 12, input_len, 33, 5);
    ASSERT_EQ(requests.size(), 12u);
    for (const BenchmarkRequest& request : requests) {
      const std::vector<int32_t> ids = tok->encode(request.prompt);
      EXPECT_EQ(static_cast<int64_t>(ids.size()), request.prompt_len);
      EXPECT_EQ(request.prompt_len, input_len) << request.prompt;
      EXPECT_EQ(request.max_tokens, 33);
      for (const int32_t id : ids) EXPECT_FALSE(tok->is_special(id)) << id;
    }
  }
}

TEST(BenchRandomPrompts, SeedDecidesThePrompts) {
  REQUIRE_DEEPSEEK();
  const auto a = random_requests(*tok, 4, 64, 1, 1), b = random_requests(*tok, 4, 64, 1, 1),
             c = random_requests(*tok, 4, 64, 1, 2);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].prompt, b[i].prompt);
    EXPECT_NE(a[i].prompt, c[i].prompt);
    if (i > 0) {
      EXPECT_NE(a[i].prompt, a[i - 1].prompt);
    }
  }
  EXPECT_THROW(random_requests(*tok, 1, 0, 1, 0), Error);
  EXPECT_THROW(random_requests(*tok, 1, 1, 0, 0), Error);
}

}  // namespace
}  // namespace dsv4::bench
