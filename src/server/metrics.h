// Prometheus metrics of the server (GET /metrics, text exposition format 0.0.4), named after vLLM's
// (`vllm:num_requests_running` -> `dsv4:num_requests_running`) so existing dashboards map one to one.
// Counters and histograms are updated from the engine thread and the HTTP threads; a mutex per histogram keeps
// it simple: an update costs ~50 ns against an engine step of milliseconds.
#pragma once
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace dsv4::server {

class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);
  void observe(double value);
  // Appends the _bucket / _sum / _count lines of `name`.
  void render(const std::string& name, const std::string& help, std::string& out) const;
  uint64_t count() const;

 private:
  std::vector<double> bounds_;
  mutable std::mutex mutex_;
  std::vector<uint64_t> counts_;  // per bucket, not cumulative
  double sum_ = 0;
  uint64_t total_ = 0;
};

// Engine state sampled by the engine thread after each step (the engine itself is single-threaded).
struct EngineGauges {
  int64_t running = 0, waiting = 0;
  struct Group {
    std::string name;
    int64_t used_blocks = 0, cached_blocks = 0, capacity_blocks = 0;
  };
  std::vector<Group> groups;
  int64_t pool_bytes = 0, used_bytes = 0, cached_bytes = 0;
  int64_t prefix_queries = 0, prefix_query_tokens = 0, prefix_hit_tokens = 0;
  int64_t preemptions = 0;
};

class ServerMetrics {
 public:
  ServerMetrics();

  Histogram time_to_first_token, inter_token_latency, e2e_request_latency;
  std::atomic<int64_t> prompt_tokens{0}, generation_tokens{0};

  void count_finished(const std::string& finish_reason);  // "stop", "length", "abort", "error"
  void count_http(int status);
  void set_engine(const EngineGauges& gauges);
  EngineGauges engine() const;

  std::string render() const;

 private:
  mutable std::mutex mutex_;
  std::map<std::string, int64_t> finished_;
  std::map<int, int64_t> http_;
  EngineGauges engine_;
};

}  // namespace dsv4::server
