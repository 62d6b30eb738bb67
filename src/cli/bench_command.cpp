#include "cli/bench_command.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>

#include "bench/benchmark_report.h"
#include "bench/serve_benchmark.h"
#include "bench/workload.h"
#include "cli/model_loading.h"
#include "core/error.h"
#include "tokenizer/tokenizer.h"

namespace dsv4::cli {

namespace {

double parse_request_rate(const std::string& text) {
  if (text == "inf") return std::numeric_limits<double>::infinity();
  size_t used = 0;
  double rate = 0;
  try {
    rate = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  DSV4_CHECK(used == text.size() && rate > 0 && std::isfinite(rate),
             "--request-rate must be a positive number of requests per second or inf, got '" + text + "'");
  return rate;
}

// One line on stderr redrawn in place on a terminal; a line per tenth of the run otherwise (logs stay short).
class ProgressBar {
 public:
  explicit ProgressBar(int64_t total) : total_(total), interactive_(isatty(STDERR_FILENO) != 0) {}

  void update(int64_t finished, int64_t failed) {
    const auto now = std::chrono::steady_clock::now();
    const bool last = finished == total_;
    if (interactive_) {
      if (!last && now - last_draw_ < std::chrono::milliseconds(100)) return;
    } else if (!last && finished * 10 / total_ == last_tenth_) {
      return;
    }
    last_draw_ = now;
    last_tenth_ = finished * 10 / total_;
    constexpr int kWidth = 40;
    const int filled = static_cast<int>(kWidth * finished / total_);
    const double elapsed = std::chrono::duration<double>(now - start_).count();
    std::fprintf(stderr, "%s[%s%s] %ld/%ld requests, %ld failed, %.1f s%s", interactive_ ? "\r" : "",
                 std::string(filled, '#').c_str(), std::string(kWidth - filled, ' ').c_str(),
                 static_cast<long>(finished), static_cast<long>(total_), static_cast<long>(failed), elapsed,
                 interactive_ && !last ? "" : "\n");
    std::fflush(stderr);
  }

 private:
  int64_t total_;
  bool interactive_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now(), last_draw_{};
  int64_t last_tenth_ = 0;
};

}  // namespace

CLI::App* add_bench_command(CLI::App& app, BenchServeOptions& options) {
  auto* bench = app.add_subcommand("bench", "Benchmarks: a running server (serve) or the engine in this process (latency, throughput)");
  bench->require_subcommand(1);
  auto* serve = bench->add_subcommand("serve", "Load an OpenAI-compatible server with streaming requests; "
                                               "report TTFT, TPOT, ITL, E2E latency and throughput");
  serve->add_option("--base-url", options.base_url, "server, http://host:port[/prefix]")->capture_default_str();
  serve->add_option("--endpoint", options.endpoint, "/v1/completions or /v1/chat/completions")
      ->capture_default_str();
  serve->add_option("--model", options.model, "model name sent (default: the first of GET /v1/models)");
  serve->add_option("--api-key", options.api_key, "sent as Authorization: Bearer KEY");
  serve->add_option("--tokenizer", options.tokenizer_path,
                    "tokenizer.json or its directory, for the random prompts (default: the DeepSeek one)");
  serve->add_option("--num-prompts", options.num_prompts, "requests to send")->capture_default_str();
  serve->add_option("--request-rate", options.request_rate, "requests per second (Poisson arrivals), or inf")
      ->capture_default_str();
  serve->add_option("--burstiness", options.burstiness, "gamma shape of the arrival gaps; 1 = Poisson")
      ->capture_default_str();
  serve->add_option_function<int64_t>(
      "--max-concurrency", [&options](const int64_t& limit) { options.max_concurrency = limit; },
      "requests in flight at most (default: unlimited)");
  serve->add_option("--input-len", options.input_len, "prompt tokens per request")->capture_default_str();
  serve->add_option("--output-len", options.output_len, "max_tokens per request")->capture_default_str();
  serve->add_option("--seed", options.seed, "seed of the prompts and the arrival times")->capture_default_str();
  serve->add_flag("--ignore-eos,!--no-ignore-eos", options.ignore_eos,
                  "ask the server to generate all output-len tokens (default on)");
  serve->add_option("--temperature", options.temperature, "sampling temperature sent")->capture_default_str();
  serve->add_option("--timeout", options.timeout_s, "seconds of silence after which a request fails")
      ->capture_default_str();
  serve->add_option("--metric-percentiles", options.percentiles, "percentiles to report, e.g. 50,90,99")
      ->delimiter(',');
  serve->add_option("--result-file", options.result_file, "write the JSON result here");
  return serve;
}

int bench_serve(const BenchServeOptions& options) {
  DSV4_CHECK(options.num_prompts >= 1, "--num-prompts must be >= 1, got " + std::to_string(options.num_prompts));
  bench::ServeBenchmarkConfig config;
  config.base_url = options.base_url;
  config.endpoint = options.endpoint;
  config.api_key = options.api_key;
  config.request_rate = parse_request_rate(options.request_rate);
  config.burstiness = options.burstiness;
  config.max_concurrency = options.max_concurrency;
  config.seed = options.seed;
  config.ignore_eos = options.ignore_eos;
  config.temperature = options.temperature;
  config.idle_timeout_s = options.timeout_s;
  for (const double p : options.percentiles)
    DSV4_CHECK(p >= 0 && p <= 100, "--metric-percentiles must lie in [0, 100], got " + std::to_string(p));
  bench::parse_base_url(config.base_url);  // a bad URL fails before the prompts are built
  config.model = options.model.empty() ? bench::fetch_first_model_id(config) : options.model;

  const Tokenizer tokenizer = load_tokenizer(options.tokenizer_path, /*model_dir=*/"");
  const std::vector<bench::BenchmarkRequest> requests =
      bench::random_requests(tokenizer, options.num_prompts, options.input_len, options.output_len, options.seed);
  std::fprintf(stderr, "bench serve: %ld requests of %ld prompt tokens, max_tokens %ld, to %s%s (model %s)\n",
               static_cast<long>(options.num_prompts), static_cast<long>(options.input_len),
               static_cast<long>(options.output_len), config.base_url.c_str(), config.endpoint.c_str(),
               config.model.c_str());

  ProgressBar bar(options.num_prompts);
  const bench::ServeBenchmarkRun run =
      bench::run_serve_benchmark(config, requests, [&bar](int64_t finished, int64_t failed, int64_t) {
        bar.update(finished, failed);
      });
  const bench::BenchmarkMetrics metrics = bench::compute_metrics(run, options.percentiles);
  std::fputs(bench::format_summary(config, metrics, run).c_str(), stdout);

  if (!options.result_file.empty()) {
    nlohmann::json result = bench::result_json(config, metrics, run);
    result["tokenizer_id"] = options.tokenizer_path.empty() ? "deepseek (default)" : options.tokenizer_path;
    result["input_len"] = options.input_len;
    result["output_len"] = options.output_len;
    std::ofstream file(options.result_file);
    DSV4_CHECK(file.good(), "cannot write --result-file " + options.result_file);
    file << result.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    DSV4_CHECK(file.good(), "writing --result-file " + options.result_file + " failed");
  }
  // Failed requests are results, not a crash; but a run where nothing succeeded is no benchmark.
  return metrics.completed > 0 ? 0 : 1;
}

}  // namespace dsv4::cli
