#include "bench/benchmark_report.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <map>

namespace dsv4::bench {

namespace {

using nlohmann::json;

std::string percentile_label(double p) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", p);
  return text;
}

std::string rate_text(double rate) { return std::isinf(rate) ? "inf" : percentile_label(rate); }

void add_line(std::string& out, const std::string& label, const std::string& value) {
  char line[128];
  std::snprintf(line, sizeof line, "%-40s %s\n", label.c_str(), value.c_str());
  out += line;
}

std::string fixed2(double value) {
  char text[64];
  std::snprintf(text, sizeof text, "%.2f", value);
  return text;
}

void add_heading(std::string& out, const std::string& title, char fill) {
  constexpr size_t kWidth = 50;
  const std::string padded = title.empty() ? "" : title;
  const size_t left = (kWidth - std::min(kWidth, padded.size())) / 2;
  const size_t right = kWidth - std::min(kWidth, padded.size()) - left;
  out += std::string(left, fill) + padded + std::string(right, fill) + "\n";
}

void add_latency_block(std::string& out, const std::string& title, const std::string& name,
                       const LatencySummary& summary, std::span<const double> percentiles) {
  add_heading(out, title, '-');
  add_line(out, "Mean " + name + " (ms):", fixed2(summary.mean));
  add_line(out, "Median " + name + " (ms):", fixed2(summary.median));
  for (size_t i = 0; i < percentiles.size(); ++i)
    add_line(out, std::string("P").append(percentile_label(percentiles[i])).append(" ").append(name).append(" (ms):"),
             fixed2(summary.percentiles[i]));
}

void add_summary_json(json& out, const std::string& name, const LatencySummary& summary,
                      std::span<const double> percentiles) {
  out["mean_" + name + "_ms"] = summary.mean;
  out["median_" + name + "_ms"] = summary.median;
  out["std_" + name + "_ms"] = summary.stddev;
  for (size_t i = 0; i < percentiles.size(); ++i)
    // (append, not operator+: GCC 12 warns falsely about "literal" + std::string temporaries, -Wrestrict)
    out[std::string("p").append(percentile_label(percentiles[i])).append("_").append(name).append("_ms")] =
        summary.percentiles[i];
}

std::string utc_timestamp() {
  const std::time_t now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm utc{};
  gmtime_r(&now, &utc);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%SZ", &utc);
  return text;
}

}  // namespace

BenchmarkMetrics compute_metrics(const ServeBenchmarkRun& run, std::span<const double> percentiles) {
  BenchmarkMetrics metrics;
  metrics.duration_s = run.duration_s;
  metrics.percentiles.assign(percentiles.begin(), percentiles.end());
  std::vector<double> ttfts, tpots, itls, e2els;
  for (const RequestResult& result : run.results) {
    if (!result.success) {
      ++metrics.failed;
      continue;
    }
    ++metrics.completed;
    metrics.total_input_tokens += result.prompt_len;
    metrics.total_output_tokens += result.output_tokens;
    ttfts.push_back(result.ttft_s * 1e3);
    e2els.push_back(result.e2e_s * 1e3);
    if (result.output_tokens > 1)
      tpots.push_back((result.e2e_s - result.ttft_s) * 1e3 / static_cast<double>(result.output_tokens - 1));
    for (const double gap : result.itl_s) itls.push_back(gap * 1e3);
  }
  if (run.duration_s > 0) {
    metrics.request_throughput = static_cast<double>(metrics.completed) / run.duration_s;
    metrics.output_throughput = static_cast<double>(metrics.total_output_tokens) / run.duration_s;
    metrics.total_token_throughput =
        static_cast<double>(metrics.total_input_tokens + metrics.total_output_tokens) / run.duration_s;
  }
  metrics.ttft_ms = summarize(ttfts, percentiles);
  metrics.tpot_ms = summarize(tpots, percentiles);
  metrics.itl_ms = summarize(itls, percentiles);
  metrics.e2el_ms = summarize(e2els, percentiles);
  return metrics;
}

std::string format_summary(const ServeBenchmarkConfig& config, const BenchmarkMetrics& metrics,
                           const ServeBenchmarkRun& run) {
  std::string out;
  add_heading(out, " Serving Benchmark Result ", '=');
  add_line(out, "Successful requests:", std::to_string(metrics.completed));
  add_line(out, "Failed requests:", std::to_string(metrics.failed));
  add_line(out, "Request rate configured (RPS):", rate_text(config.request_rate));
  add_line(out, "Maximum request concurrency:",
           config.max_concurrency ? std::to_string(*config.max_concurrency) : "unlimited");
  add_line(out, "Benchmark duration (s):", fixed2(metrics.duration_s));
  add_line(out, "Total input tokens:", std::to_string(metrics.total_input_tokens));
  add_line(out, "Total generated tokens:", std::to_string(metrics.total_output_tokens));
  add_line(out, "Request throughput (req/s):", fixed2(metrics.request_throughput));
  add_line(out, "Output token throughput (tok/s):", fixed2(metrics.output_throughput));
  add_line(out, "Total token throughput (tok/s):", fixed2(metrics.total_token_throughput));
  add_latency_block(out, "Time to First Token", "TTFT", metrics.ttft_ms, metrics.percentiles);
  add_latency_block(out, "Time per Output Token (excl. 1st token)", "TPOT", metrics.tpot_ms, metrics.percentiles);
  add_latency_block(out, "Inter-token Latency", "ITL", metrics.itl_ms, metrics.percentiles);
  add_latency_block(out, "End-to-end Latency", "E2EL", metrics.e2el_ms, metrics.percentiles);
  add_heading(out, "", '=');
  if (metrics.failed > 0) {
    std::map<std::string, int64_t> counts;
    for (const RequestResult& result : run.results)
      if (!result.success) ++counts[result.error];
    constexpr size_t kShown = 5;
    out += "Failures (" + std::to_string(counts.size()) + " distinct):\n";
    size_t shown = 0;
    for (const auto& [message, count] : counts) {
      if (shown++ == kShown) {
        out += "  ... (all of them are in the result file's \"errors\")\n";
        break;
      }
      out += "  " + std::to_string(count) + " x " + message + "\n";
    }
  }
  return out;
}

json result_json(const ServeBenchmarkConfig& config, const BenchmarkMetrics& metrics, const ServeBenchmarkRun& run) {
  json out;
  out["date"] = utc_timestamp();
  out["base_url"] = config.base_url;
  out["endpoint"] = config.endpoint;
  out["model_id"] = config.model;
  out["num_prompts"] = run.results.size();
  // JSON has no infinity: an unlimited rate is the string "inf", as vLLM's result files have it.
  out["request_rate"] = std::isinf(config.request_rate) ? json("inf") : json(config.request_rate);
  out["burstiness"] = config.burstiness;
  out["max_concurrency"] = config.max_concurrency ? json(*config.max_concurrency) : json(nullptr);
  out["seed"] = config.seed;
  out["ignore_eos"] = config.ignore_eos;
  out["duration"] = metrics.duration_s;
  out["completed"] = metrics.completed;
  out["failed"] = metrics.failed;
  out["total_input_tokens"] = metrics.total_input_tokens;
  out["total_output_tokens"] = metrics.total_output_tokens;
  out["request_throughput"] = metrics.request_throughput;
  out["output_throughput"] = metrics.output_throughput;
  out["total_token_throughput"] = metrics.total_token_throughput;
  out["percentiles"] = metrics.percentiles;
  add_summary_json(out, "ttft", metrics.ttft_ms, metrics.percentiles);
  add_summary_json(out, "tpot", metrics.tpot_ms, metrics.percentiles);
  add_summary_json(out, "itl", metrics.itl_ms, metrics.percentiles);
  add_summary_json(out, "e2el", metrics.e2el_ms, metrics.percentiles);
  // Per request, in request order; a failed request has null timings and its message in "errors".
  json successes = json::array(), input_lens = json::array(), output_lens = json::array(), ttfts = json::array(),
       e2els = json::array(), itls = json::array(), start_times = json::array(), usage = json::array(),
       texts = json::array(), errors = json::array();
  for (const RequestResult& result : run.results) {
    successes.push_back(result.success);
    input_lens.push_back(result.prompt_len);
    output_lens.push_back(result.success ? json(result.output_tokens) : json(nullptr));
    ttfts.push_back(result.success ? json(result.ttft_s) : json(nullptr));
    e2els.push_back(result.success ? json(result.e2e_s) : json(nullptr));
    itls.push_back(result.success ? json(result.itl_s) : json::array());
    start_times.push_back(result.start_s);
    usage.push_back(result.usage_reported);
    texts.push_back(result.generated_text);
    errors.push_back(result.error);
  }
  out["successes"] = std::move(successes);
  out["input_lens"] = std::move(input_lens);
  out["output_lens"] = std::move(output_lens);
  out["ttfts"] = std::move(ttfts);
  out["itls"] = std::move(itls);
  out["e2els"] = std::move(e2els);
  out["start_times"] = std::move(start_times);
  out["usage_reported"] = std::move(usage);
  out["generated_texts"] = std::move(texts);
  out["errors"] = std::move(errors);
  return out;
}

}  // namespace dsv4::bench
