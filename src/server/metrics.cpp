#include "server/metrics.h"

#include <algorithm>
#include <cstdio>

namespace dsv4::server {

namespace {

std::string number(double value) {
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, "%.9g", value);
  return buffer;
}

void header(std::string& out, const std::string& name, const char* type, const std::string& help) {
  out += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
}

void sample(std::string& out, const std::string& name, const std::string& labels, double value) {
  out += name;
  if (!labels.empty()) out += "{" + labels + "}";
  out += " " + number(value) + "\n";
}

// vLLM's bucket edges (seconds) for the request-latency histograms.
const std::vector<double> kTtftBuckets = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                                          0.75,  1.0,   2.5,  5.0,  7.5,  10.0, 20.0, 40.0, 80.0};
const std::vector<double> kItlBuckets = {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                                         0.5,  0.75,  1.0,  2.5,   5.0, 7.5,  10.0, 20.0, 40.0};
const std::vector<double> kE2eBuckets = {0.3,  0.5,  0.8,  1.0,  1.5,  2.0,  2.5,   5.0,   10.0, 15.0,
                                         20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0};

}  // namespace

Histogram::Histogram(std::vector<double> upper_bounds)
    : bounds_(std::move(upper_bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double value) {
  const size_t bucket = std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin();
  std::lock_guard lock(mutex_);
  ++counts_[bucket];
  sum_ += value;
  ++total_;
}

uint64_t Histogram::count() const {
  std::lock_guard lock(mutex_);
  return total_;
}

void Histogram::render(const std::string& name, const std::string& help, std::string& out) const {
  std::lock_guard lock(mutex_);
  header(out, name, "histogram", help);
  uint64_t cumulative = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cumulative += counts_[i];
    sample(out, name + "_bucket", "le=\"" + number(bounds_[i]) + "\"", static_cast<double>(cumulative));
  }
  sample(out, name + "_bucket", "le=\"+Inf\"", static_cast<double>(total_));
  sample(out, name + "_sum", "", sum_);
  sample(out, name + "_count", "", static_cast<double>(total_));
}

ServerMetrics::ServerMetrics()
    : time_to_first_token(kTtftBuckets), inter_token_latency(kItlBuckets), e2e_request_latency(kE2eBuckets) {}

void ServerMetrics::count_finished(const std::string& finish_reason) {
  std::lock_guard lock(mutex_);
  ++finished_[finish_reason];
}

void ServerMetrics::count_http(int status) {
  std::lock_guard lock(mutex_);
  ++http_[status];
}

void ServerMetrics::set_engine(const EngineGauges& gauges) {
  std::lock_guard lock(mutex_);
  engine_ = gauges;
}

EngineGauges ServerMetrics::engine() const {
  std::lock_guard lock(mutex_);
  return engine_;
}

std::string ServerMetrics::render() const {
  std::string out;
  EngineGauges engine;
  std::map<std::string, int64_t> finished;
  std::map<int, int64_t> http;
  {
    std::lock_guard lock(mutex_);
    engine = engine_;
    finished = finished_;
    http = http_;
  }
  header(out, "dsv4:num_requests_running", "gauge", "Requests in the running batch.");
  sample(out, "dsv4:num_requests_running", "", static_cast<double>(engine.running));
  header(out, "dsv4:num_requests_waiting", "gauge", "Requests waiting to be admitted (preempted ones included).");
  sample(out, "dsv4:num_requests_waiting", "", static_cast<double>(engine.waiting));

  header(out, "dsv4:kv_cache_usage_perc", "gauge",
         "Fraction of the KV-cache pool held by blocks in use (evictable prefix-cache blocks not counted).");
  sample(out, "dsv4:kv_cache_usage_perc", "",
         engine.pool_bytes ? static_cast<double>(engine.used_bytes) / static_cast<double>(engine.pool_bytes) : 0.0);
  header(out, "dsv4:kv_cache_group_used_blocks", "gauge", "Blocks in use per cache group (SWA, CSA, HCA, state).");
  for (const auto& group : engine.groups)
    sample(out, "dsv4:kv_cache_group_used_blocks", "group=\"" + group.name + "\"",
           static_cast<double>(group.used_blocks));
  header(out, "dsv4:kv_cache_group_cached_blocks", "gauge", "Evictable prefix-cache blocks per cache group.");
  for (const auto& group : engine.groups)
    sample(out, "dsv4:kv_cache_group_cached_blocks", "group=\"" + group.name + "\"",
           static_cast<double>(group.cached_blocks));
  header(out, "dsv4:kv_cache_group_usage_perc", "gauge",
         "Fraction of the pool a group could hold that its blocks in use take.");
  for (const auto& group : engine.groups)
    sample(out, "dsv4:kv_cache_group_usage_perc", "group=\"" + group.name + "\"",
           group.capacity_blocks ? static_cast<double>(group.used_blocks) / static_cast<double>(group.capacity_blocks)
                                 : 0.0);

  header(out, "dsv4:prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.");
  sample(out, "dsv4:prefix_cache_queries_total", "", static_cast<double>(engine.prefix_query_tokens));
  header(out, "dsv4:prefix_cache_hits_total", "counter", "Prompt tokens served from the prefix cache.");
  sample(out, "dsv4:prefix_cache_hits_total", "", static_cast<double>(engine.prefix_hit_tokens));
  header(out, "dsv4:prefix_cache_hit_rate", "gauge", "prefix_cache_hits_total / prefix_cache_queries_total.");
  sample(out, "dsv4:prefix_cache_hit_rate", "",
         engine.prefix_query_tokens
             ? static_cast<double>(engine.prefix_hit_tokens) / static_cast<double>(engine.prefix_query_tokens)
             : 0.0);
  header(out, "dsv4:num_preemptions_total", "counter", "Requests preempted (recomputed later) for lack of blocks.");
  sample(out, "dsv4:num_preemptions_total", "", static_cast<double>(engine.preemptions));

  header(out, "dsv4:prompt_tokens_total", "counter", "Prompt tokens of admitted requests.");
  sample(out, "dsv4:prompt_tokens_total", "", static_cast<double>(prompt_tokens.load()));
  header(out, "dsv4:generation_tokens_total", "counter", "Generated tokens.");
  sample(out, "dsv4:generation_tokens_total", "", static_cast<double>(generation_tokens.load()));
  header(out, "dsv4:request_success_total", "counter", "Finished requests (engine requests, one per choice).");
  for (const char* reason : {"stop", "length", "abort", "error"})
    sample(out, "dsv4:request_success_total", std::string("finished_reason=\"") + reason + "\"",
           static_cast<double>(finished.count(reason) ? finished.at(reason) : 0));
  header(out, "dsv4:http_requests_total", "counter", "HTTP responses by status code.");
  for (const auto& [status, count] : http)
    sample(out, "dsv4:http_requests_total", "status=\"" + std::to_string(status) + "\"", static_cast<double>(count));

  time_to_first_token.render("dsv4:time_to_first_token_seconds", "Time to first token.", out);
  inter_token_latency.render("dsv4:inter_token_latency_seconds", "Time between consecutive output tokens.", out);
  e2e_request_latency.render("dsv4:e2e_request_latency_seconds", "Arrival to last token.", out);
  return out;
}

}  // namespace dsv4::server
