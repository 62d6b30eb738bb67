// `dsv4 bench latency` and `dsv4 bench throughput`: offline benchmarks of the engine in this process, as vLLM's
// `vllm bench latency` / `vllm bench throughput` (docs/bench.md): random prompts of --input-len token ids, each
// generating exactly --output-len tokens (ignore_eos), through the real scheduler, cache manager and backend.
#pragma once
#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>

namespace dsv4::cli {

struct BenchOfflineOptions {
  std::string model_dir;  // empty: the embedded default model
  std::string device = "auto", dtype = "auto";
  std::string numerics = "hf";  // cli/model_loading.h BackendOptions::numerics
  std::string kv_cache_dtype = "auto";  // cli/model_loading.h BackendOptions::kv_cache_dtype
  double gpu_memory_utilization = 0.9;
  std::string load_format = "auto";  // auto or dummy (random weights of the config, seeded by --seed)
  std::string expert_bits = "auto";  // cli/model_loading.h BackendOptions::expert_bits
  double kv_cache_gib = 0;  // 0: the backend's default (CPU 4 GiB; CUDA from --gpu-memory-utilization)
  int64_t input_len = 1024, output_len = 128;
  std::string batch_sizes = "8";  // latency: requests per iteration; a comma list runs each in turn (one load)
  int64_t num_prompts = 256;  // throughput: requests in total
  int data_parallel_size = 1;  // throughput: ranks (cli/model_loading.h make_serving_engine)
  bool enable_expert_parallel = false;  // throughput: the routed experts split over those ranks
  double dist_timeout = 600;            // throughput: seconds a rank's collective may wait
  std::string data_parallel_backend = "auto";  // throughput: mp / threads / auto (cli/rank_processes.h)
  int64_t warmup_iters = 1, iters = 3;
  int64_t max_num_seqs = 256, max_num_batched_tokens = 8192;
  bool enable_prefix_caching = false;  // random prompts share nothing; off keeps checkpoints out of the timing
  uint64_t seed = 0;
  std::string output_json;
  // latency: each batch's decode step against its bandwidth roofline (cache/decode_roofline.h), at the copy
  // bandwidth measured on the CUDA device or at roofline_bandwidth_gbps when given (> 0).
  bool roofline = false;
  double roofline_bandwidth_gbps = 0;
};

// Adds `latency` and `throughput` under the `bench` subcommand; returns them.
std::pair<CLI::App*, CLI::App*> add_bench_offline_commands(CLI::App& bench, BenchOfflineOptions& latency,
                                                           BenchOfflineOptions& throughput);
int bench_latency(const BenchOfflineOptions& options);
int bench_throughput(const BenchOfflineOptions& options);

}  // namespace dsv4::cli
