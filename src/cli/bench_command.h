// `dsv4 bench serve`: the serving benchmark client (docs/bench.md) on the command line.
#pragma once
#include <CLI/CLI.hpp>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace dsv4::cli {

struct BenchServeOptions {
  std::string base_url = "http://127.0.0.1:8000";
  std::string endpoint = "/v1/completions";
  std::string model;  // default: the first model GET /v1/models lists
  std::string api_key;
  std::string tokenizer_path;  // default: found as `dsv4 generate` finds it
  std::string result_file;
  std::string request_rate = "inf";  // requests per second, or inf
  double burstiness = 1.0;
  int64_t num_prompts = 1000, input_len = 1024, output_len = 128;
  std::optional<int64_t> max_concurrency;
  uint64_t seed = 0;
  bool ignore_eos = true;
  double temperature = 0.0;
  double timeout_s = 600.0;
  std::vector<double> percentiles{99.0};
};

// Adds `bench` with its `serve` subcommand to `app`; returns `serve` (true after parsing when it was chosen).
CLI::App* add_bench_command(CLI::App& app, BenchServeOptions& options);

int bench_serve(const BenchServeOptions& options);

}  // namespace dsv4::cli
