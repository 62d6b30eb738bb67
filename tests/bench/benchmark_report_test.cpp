#include "bench/benchmark_report.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

namespace dsv4::bench {
namespace {

RequestResult success(int64_t prompt_len, int64_t output_tokens, double ttft, std::vector<double> itls) {
  RequestResult r;
  r.success = true;
  r.prompt_len = prompt_len;
  r.output_tokens = output_tokens;
  r.token_events = static_cast<int64_t>(itls.size()) + 1;
  r.ttft_s = ttft;
  r.e2e_s = ttft;
  for (const double gap : itls) r.e2e_s += gap;
  r.itl_s = std::move(itls);
  return r;
}

ServeBenchmarkRun sample_run() {
  ServeBenchmarkRun run;
  run.duration_s = 2.0;
  run.results.push_back(success(100, 5, 0.2, {0.1, 0.1, 0.1, 0.1}));  // E2E 0.6, TPOT 0.1
  run.results.push_back(success(50, 3, 0.4, {0.3, 0.5}));             // E2E 1.2, TPOT 0.4
  run.results.push_back(success(10, 1, 0.3, {}));                     // one token: no TPOT
  RequestResult failed;
  failed.prompt_len = 1000;
  failed.error = "HTTP 503: busy";
  failed.ttft_s = 9;  // measured before failing; must not count
  run.results.push_back(failed);
  return run;
}

TEST(BenchMetrics, FollowVllmDefinitions) {
  const std::vector<double> ps = {50.0, 100.0};
  const BenchmarkMetrics m = compute_metrics(sample_run(), ps);
  EXPECT_EQ(m.completed, 3);
  EXPECT_EQ(m.failed, 1);
  EXPECT_EQ(m.total_input_tokens, 160);  // the failed request's prompt is not counted
  EXPECT_EQ(m.total_output_tokens, 9);
  EXPECT_DOUBLE_EQ(m.request_throughput, 1.5);
  EXPECT_DOUBLE_EQ(m.output_throughput, 4.5);
  EXPECT_DOUBLE_EQ(m.total_token_throughput, 84.5);
  EXPECT_NEAR(m.ttft_ms.mean, 300.0, 1e-9);
  EXPECT_NEAR(m.ttft_ms.percentiles[1], 400.0, 1e-9);  // max over successes: the failed 9 s is ignored
  EXPECT_NEAR(m.tpot_ms.mean, 250.0, 1e-9);            // (100 + 400) / 2
  EXPECT_NEAR(m.itl_ms.mean, (0.4 + 0.8) / 6 * 1e3, 1e-9);
  EXPECT_NEAR(m.itl_ms.median, 100.0, 1e-9);
  EXPECT_NEAR(m.e2el_ms.mean, (600.0 + 1200.0 + 300.0) / 3, 1e-9);
}

TEST(BenchMetrics, JsonHoldsFiguresAndPerRequestLists) {
  ServeBenchmarkConfig config;
  config.model = "m";
  config.max_concurrency = 4;
  const ServeBenchmarkRun run = sample_run();
  const std::vector<double> ps = {99.0};
  const BenchmarkMetrics metrics = compute_metrics(run, ps);
  const nlohmann::json j = result_json(config, metrics, run);
  EXPECT_EQ(j["request_rate"], "inf");
  EXPECT_EQ(j["max_concurrency"], 4);
  EXPECT_EQ(j["completed"], 3);
  EXPECT_EQ(j["failed"], 1);
  EXPECT_EQ(j["num_prompts"], 4);
  for (const char* key : {"mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
                          "p99_itl_ms", "median_e2el_ms", "request_throughput", "output_throughput",
                          "total_token_throughput", "duration"})
    EXPECT_TRUE(j.contains(key) && j[key].is_number()) << key;
  EXPECT_DOUBLE_EQ(j["mean_tpot_ms"].get<double>(), metrics.tpot_ms.mean);
  for (const char* key : {"successes", "input_lens", "output_lens", "ttfts", "itls", "e2els", "start_times",
                          "generated_texts", "errors", "usage_reported"}) {
    ASSERT_TRUE(j[key].is_array()) << key;
    EXPECT_EQ(j[key].size(), 4u) << key;
  }
  EXPECT_TRUE(j["ttfts"][3].is_null());
  EXPECT_EQ(j["errors"][3], "HTTP 503: busy");
  EXPECT_EQ(j["itls"][1].size(), 2u);
  EXPECT_EQ(j["output_lens"][0], 5);

  config.request_rate = 2.5;
  EXPECT_EQ(result_json(config, metrics, run)["request_rate"], 2.5);
}

TEST(BenchMetrics, SummaryHasVllmSections) {
  ServeBenchmarkConfig config;
  const ServeBenchmarkRun run = sample_run();
  const std::vector<double> ps = {90.0, 99.0};
  const std::string text = format_summary(config, compute_metrics(run, ps), run);
  for (const char* line : {"Successful requests:                     3", "Failed requests:                         1",
                           "Request throughput (req/s):              1.50", "Mean TTFT (ms):                          300.00",
                           "P90 TPOT (ms):", "P99 ITL (ms):", "Median E2EL (ms):", "1 x HTTP 503: busy"})
    EXPECT_NE(text.find(line), std::string::npos) << line << "\n" << text;
}

}  // namespace
}  // namespace dsv4::bench
