// The `dsv4 bench serve` client: sends requests to a running OpenAI-compatible server on a schedule, each a
// streaming (SSE) completion, and times every streamed token. One thread runs one Asio io_context; every request
// is an asynchronous HTTP/1.1 connection of its own, so thousands of concurrent streams cost sockets, not threads.
#pragma once
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "bench/workload.h"

namespace dsv4::bench {

// "http://host[:port][/prefix]" split up; https is not supported (no TLS stack in the build).
struct HttpUrl {
  std::string host;
  uint16_t port = 80;
  std::string path_prefix;  // no trailing '/'; the endpoint path is appended to it
};
HttpUrl parse_base_url(const std::string& base_url);

struct ServeBenchmarkConfig {
  std::string base_url = "http://127.0.0.1:8000";
  std::string endpoint = "/v1/completions";  // or /v1/chat/completions
  std::string model;                         // the "model" field of every request
  std::string api_key;                       // sent as "Authorization: Bearer <key>" when not empty
  double request_rate = std::numeric_limits<double>::infinity();  // requests per second; inf: all at once
  double burstiness = 1.0;                                        // 1: Poisson arrivals (see arrival_offsets)
  std::optional<int64_t> max_concurrency;  // requests in flight at most; later arrivals wait their turn
  uint64_t seed = 0;                       // of the arrival schedule
  bool ignore_eos = true;                  // sent as "ignore_eos" (vLLM's extension) so every request runs O tokens
  double temperature = 0.0;
  double idle_timeout_s = 600.0;  // a request fails when its connection is silent this long
};

// What one request did. Times are seconds; a failed request keeps what was measured before it failed.
struct RequestResult {
  bool success = false;
  std::string error;         // why it failed, for a failed request
  int64_t prompt_len = 0;
  int64_t output_tokens = 0;  // usage.completion_tokens when the server reported it, else token_events
  int64_t token_events = 0;   // SSE chunks that carried generated text
  bool usage_reported = false;
  double start_s = 0;         // when the request was sent (connection attempt), after the benchmark start
  double ttft_s = 0;          // start -> first chunk with generated text
  std::vector<double> itl_s;  // gap between each chunk with generated text and the previous one
  double e2e_s = 0;           // start -> last chunk with generated text
  std::string generated_text;
};

struct ServeBenchmarkRun {
  std::vector<RequestResult> results;  // in the order of the requests given
  double duration_s = 0;               // benchmark start -> the last request finished
};

// Called after each request finishes, on the client thread.
using ProgressCallback = std::function<void(int64_t finished, int64_t failed, int64_t total)>;

// Runs the whole benchmark. Per-request problems (connection refused, an HTTP error status, a stream cut off or
// malformed) become failed results; only a configuration problem (bad URL, unresolvable host) throws
// dsv4::Error.
ServeBenchmarkRun run_serve_benchmark(const ServeBenchmarkConfig& config, const std::vector<BenchmarkRequest>& requests,
                                      const ProgressCallback& progress = {});

// GET <base_url>/v1/models: the id of the first model the server lists (how vLLM picks --model's default).
std::string fetch_first_model_id(const ServeBenchmarkConfig& config);

}  // namespace dsv4::bench
