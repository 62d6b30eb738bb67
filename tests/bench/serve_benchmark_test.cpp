// The client end to end against tests/bench/fake_openai_server.h: what the client counts and times must be what
// the fake server did.
#include "bench/serve_benchmark.h"

#include <gtest/gtest.h>

#include <boost/asio/ip/tcp.hpp>
#include <cmath>
#include <numeric>

#include "bench/benchmark_report.h"
#include "core/error.h"
#include "fake_openai_server.h"

namespace dsv4::bench {
namespace {

using testing::FakeOpenAiServer;
using testing::FakeReply;

// How far the client's clock may run behind the server's facts on a loaded machine (sanitizer builds, ctest -j).
constexpr double kSlackS = 0.08;

std::vector<BenchmarkRequest> numbered_requests(int count, int64_t max_tokens = 16) {
  std::vector<BenchmarkRequest> requests;
  for (int i = 0; i < count; ++i) requests.push_back({"request " + std::to_string(i), 10 + i, max_tokens});
  return requests;
}

int request_number(const nlohmann::json& body) {
  const std::string prompt =
      body.contains("prompt") ? body["prompt"].get<std::string>() : body["messages"][0]["content"].get<std::string>();
  return std::stoi(prompt.substr(prompt.find(' ') + 1));
}

std::string expected_text(int tokens) {
  std::string text;
  for (int i = 0; i < tokens; ++i) text += "tok" + std::to_string(i) + " ";
  return text;
}

ServeBenchmarkConfig config_for(const FakeOpenAiServer& server) {
  ServeBenchmarkConfig config;
  config.base_url = server.base_url();
  config.model = "fake-model";
  config.idle_timeout_s = 10;
  return config;
}

TEST(BenchServeClient, TimesEveryTokenAsTheServerSentIt) {
  // Request i: first token after 0.1 + 0.04 i s, then 3 + i more tokens 0.03 s apart; odd ones report usage
  // (with a count that differs from the chunks, as when a chunk carries several tokens).
  FakeOpenAiServer server([](const nlohmann::json& body) {
    const int i = request_number(body);
    FakeReply reply;
    reply.tokens = 4 + i;
    reply.first_token_delay_s = 0.1 + 0.04 * i;
    reply.token_gap_s = 0.03;
    if (i % 2 == 1) reply.usage_tokens = 2 * reply.tokens;
    return reply;
  });
  ServeBenchmarkConfig config = config_for(server);
  config.api_key = "secret";
  const std::vector<BenchmarkRequest> requests = numbered_requests(6);
  int64_t progress_calls = 0;
  const ServeBenchmarkRun run = run_serve_benchmark(config, requests, [&](int64_t finished, int64_t failed, int64_t total) {
    ++progress_calls;
    EXPECT_EQ(finished, progress_calls);
    EXPECT_EQ(failed, 0);
    EXPECT_EQ(total, 6);
  });
  EXPECT_EQ(progress_calls, 6);
  ASSERT_EQ(run.results.size(), 6u);
  const auto served = server.served();
  double sum_of_latencies = 0;
  for (int i = 0; i < 6; ++i) {
    const RequestResult& result = run.results[i];
    SCOPED_TRACE("request " + std::to_string(i));
    ASSERT_TRUE(result.success) << result.error;
    const int tokens = 4 + i;
    EXPECT_EQ(result.token_events, tokens);
    EXPECT_EQ(result.usage_reported, i % 2 == 1);
    EXPECT_EQ(result.output_tokens, i % 2 == 1 ? 2 * tokens : tokens);
    EXPECT_EQ(result.generated_text, expected_text(tokens));
    EXPECT_EQ(result.prompt_len, 10 + i);
    const auto& record = served.at("request " + std::to_string(i));
    // The client's TTFT includes connecting, so it is at least the server's accept -> first token time.
    EXPECT_GE(result.ttft_s, record.first_token_after_accept_s - 1e-3);
    EXPECT_LE(result.ttft_s, record.first_token_after_accept_s + kSlackS);
    EXPECT_GE(record.first_token_after_accept_s, 0.1 + 0.04 * i - 1e-3);
    ASSERT_EQ(result.itl_s.size(), static_cast<size_t>(tokens - 1));
    const double itl_sum = std::accumulate(result.itl_s.begin(), result.itl_s.end(), 0.0);
    EXPECT_NEAR(itl_sum / (tokens - 1), 0.03, 0.02);
    EXPECT_NEAR(result.e2e_s, result.ttft_s + itl_sum, 1e-9);
    sum_of_latencies += result.e2e_s;
    // What went over the wire.
    EXPECT_EQ(record.target, "/v1/completions");
    EXPECT_EQ(record.authorization, "Bearer secret");
    EXPECT_EQ(record.body["model"], "fake-model");
    EXPECT_EQ(record.body["max_tokens"], 16);
    EXPECT_EQ(record.body["stream"], true);
    EXPECT_EQ(record.body["stream_options"]["include_usage"], true);
    EXPECT_EQ(record.body["ignore_eos"], true);
  }
  // All six ran at once (rate inf, no limit): the run took about the longest request, not their sum.
  EXPECT_EQ(server.peak_open_streams(), 6);
  EXPECT_LT(run.duration_s, 0.6 * sum_of_latencies);

  const std::vector<double> ps = {50.0, 99.0};
  const BenchmarkMetrics metrics = compute_metrics(run, ps);
  EXPECT_EQ(metrics.completed, 6);
  EXPECT_EQ(metrics.failed, 0);
  EXPECT_EQ(metrics.total_input_tokens, 10 + 11 + 12 + 13 + 14 + 15);
  EXPECT_EQ(metrics.total_output_tokens, 4 + 2 * 5 + 6 + 2 * 7 + 8 + 2 * 9);
}

TEST(BenchServeClient, FailuresAreCountedWithTheirMessageAndNeverStopTheRun) {
  // 0..2 succeed; 3, 4: HTTP 500; 5: connection closed after 2 tokens; 6: malformed JSON event; 7: an error
  // event; 8: a body that ends without [DONE].
  FakeOpenAiServer server([](const nlohmann::json& body) {
    FakeReply reply;
    reply.tokens = 5;
    reply.token_gap_s = 0.01;
    switch (request_number(body)) {
      case 3: case 4: reply.status = 500; break;
      case 5: reply.close_after_tokens = 2; break;
      case 6: reply.malformed_after_first = true; break;
      case 7: reply.error_event_after_first = true; break;
      case 8: reply.send_done = false; break;
      default: break;
    }
    return reply;
  });
  const ServeBenchmarkRun run = run_serve_benchmark(config_for(server), numbered_requests(9));
  ASSERT_EQ(run.results.size(), 9u);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(run.results[i].success) << run.results[i].error;
  const auto expect_failure = [&](int i, const std::string& words) {
    EXPECT_FALSE(run.results[i].success) << "request " << i;
    EXPECT_NE(run.results[i].error.find(words), std::string::npos) << "request " << i << ": " << run.results[i].error;
  };
  expect_failure(3, "HTTP 500");
  expect_failure(4, "scripted failure");  // the server's error body is in the message
  expect_failure(5, "stream cut off after 2 token events");
  expect_failure(6, "not a JSON object");
  expect_failure(7, "scripted stream error");
  expect_failure(8, "without data: [DONE]");
  EXPECT_EQ(run.results[5].token_events, 2);  // what arrived before the cut is still recorded

  const std::vector<double> ps = {99.0};
  const BenchmarkMetrics metrics = compute_metrics(run, ps);
  EXPECT_EQ(metrics.completed, 3);
  EXPECT_EQ(metrics.failed, 6);
  EXPECT_EQ(metrics.total_output_tokens, 15);
  const std::string summary = format_summary(config_for(server), metrics, run);
  EXPECT_NE(summary.find("Failed requests:                         6"), std::string::npos) << summary;
  EXPECT_NE(summary.find("2 x HTTP 500"), std::string::npos) << summary;
}

TEST(BenchServeClient, MaxConcurrencyBoundsTheOpenStreams) {
  FakeOpenAiServer server([](const nlohmann::json&) {
    FakeReply reply;
    reply.tokens = 3;
    reply.first_token_delay_s = 0.05;
    reply.token_gap_s = 0.02;
    return reply;
  });
  ServeBenchmarkConfig config = config_for(server);
  config.max_concurrency = 2;
  const ServeBenchmarkRun run = run_serve_benchmark(config, numbered_requests(8));
  for (const RequestResult& result : run.results) EXPECT_TRUE(result.success) << result.error;
  EXPECT_EQ(server.peak_open_streams(), 2);
  // Four rounds of two, each at least 0.09 s of server time.
  EXPECT_GE(run.duration_s, 4 * 0.09);
}

TEST(BenchServeClient, RequestsStartAtTheirPoissonArrivalTimes) {
  FakeOpenAiServer server([](const nlohmann::json&) {
    FakeReply reply;
    reply.tokens = 2;
    return reply;
  });
  ServeBenchmarkConfig config = config_for(server);
  config.request_rate = 20.0;
  config.seed = 77;
  const ServeBenchmarkRun run = run_serve_benchmark(config, numbered_requests(12));
  const std::vector<double> arrivals = arrival_offsets(12, 20.0, 1.0, 77);
  for (size_t i = 0; i < arrivals.size(); ++i) {
    EXPECT_TRUE(run.results[i].success) << run.results[i].error;
    EXPECT_GE(run.results[i].start_s, arrivals[i] - 1e-6) << i;
    EXPECT_LE(run.results[i].start_s, arrivals[i] + kSlackS) << i;
  }
  EXPECT_GE(run.duration_s, arrivals.back());
}

TEST(BenchServeClient, ChatEndpointSkipsTheRoleChunk) {
  FakeOpenAiServer server([](const nlohmann::json&) {
    FakeReply reply;
    reply.chat = true;
    reply.tokens = 3;
    reply.first_token_delay_s = 0.15;  // the role chunk goes out at once; TTFT must wait for real text
    reply.usage_tokens = 3;
    return reply;
  });
  ServeBenchmarkConfig config = config_for(server);
  config.endpoint = "/v1/chat/completions";
  config.ignore_eos = false;
  const ServeBenchmarkRun run = run_serve_benchmark(config, numbered_requests(2, 9));
  const auto served = server.served();
  for (int i = 0; i < 2; ++i) {
    const RequestResult& result = run.results[i];
    ASSERT_TRUE(result.success) << result.error;
    EXPECT_EQ(result.generated_text, expected_text(3));
    EXPECT_EQ(result.token_events, 3);
    EXPECT_GE(result.ttft_s, 0.15 - 1e-3);
    const auto& record = served.at("request " + std::to_string(i));
    EXPECT_EQ(record.target, "/v1/chat/completions");
    EXPECT_EQ(record.body["messages"][0]["role"], "user");
    EXPECT_EQ(record.body["max_completion_tokens"], 9);
    EXPECT_FALSE(record.body.contains("ignore_eos"));
    EXPECT_FALSE(record.body.contains("prompt"));
  }
}

TEST(BenchServeClient, SilentServerTimesOut) {
  FakeOpenAiServer server([](const nlohmann::json&) {
    FakeReply reply;
    reply.stall_after_first = true;
    return reply;
  });
  ServeBenchmarkConfig config = config_for(server);
  config.idle_timeout_s = 0.3;
  const ServeBenchmarkRun run = run_serve_benchmark(config, numbered_requests(2));
  for (const RequestResult& result : run.results) {
    EXPECT_FALSE(result.success);
    EXPECT_NE(result.error.find("timeout"), std::string::npos) << result.error;
    EXPECT_EQ(result.token_events, 1);
  }
  EXPECT_GE(run.duration_s, 0.3);
  EXPECT_LT(run.duration_s, 3.0);
}

TEST(BenchServeClient, RefusedConnectionsAreFailures) {
  // A port that was just free: nothing listens there.
  uint16_t port = 0;
  {
    boost::asio::io_context io;
    boost::asio::ip::tcp::acceptor probe(io, {boost::asio::ip::make_address("127.0.0.1"), 0});
    port = probe.local_endpoint().port();
  }
  ServeBenchmarkConfig config;
  config.base_url = "http://127.0.0.1:" + std::to_string(port);
  config.model = "m";
  const ServeBenchmarkRun run = run_serve_benchmark(config, numbered_requests(3));
  for (const RequestResult& result : run.results) {
    EXPECT_FALSE(result.success);
    EXPECT_NE(result.error.find("connection error"), std::string::npos) << result.error;
  }
  const std::vector<double> ps = {99.0};
  EXPECT_EQ(compute_metrics(run, ps).failed, 3);
}

TEST(BenchServeClient, ModelDefaultsToTheFirstListed) {
  FakeOpenAiServer server([](const nlohmann::json&) { return FakeReply{}; });
  ServeBenchmarkConfig config;
  config.base_url = server.base_url();
  EXPECT_EQ(fetch_first_model_id(config), "fake-model");
}

TEST(BenchServeClient, BaseUrlParsing) {
  const HttpUrl a = parse_base_url("http://localhost:8000");
  EXPECT_EQ(a.host, "localhost");
  EXPECT_EQ(a.port, 8000);
  EXPECT_EQ(a.path_prefix, "");
  const HttpUrl b = parse_base_url("http://10.0.0.2/proxy/dsv4/");
  EXPECT_EQ(b.host, "10.0.0.2");
  EXPECT_EQ(b.port, 80);
  EXPECT_EQ(b.path_prefix, "/proxy/dsv4");
  const HttpUrl c = parse_base_url("http://[::1]:9000");
  EXPECT_EQ(c.host, "::1");
  EXPECT_EQ(c.port, 9000);
  for (const char* bad : {"https://x", "localhost:8000", "http://", "http://h:0", "http://h:99999", "http://h:8x",
                          "http://[::1"})
    EXPECT_THROW(parse_base_url(bad), Error) << bad;
}

}  // namespace
}  // namespace dsv4::bench
