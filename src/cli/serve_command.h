// `dsv4 serve`: the OpenAI-compatible server (docs/server.md), with vLLM's flag names.
#pragma once
#include <cstdint>
#include <optional>
#include <string>

namespace CLI {
class App;
}

namespace dsv4::cli {

struct ServeOptions {
  std::string model_dir;  // empty: the embedded default model
  std::string tokenizer_path;
  std::string host = "127.0.0.1";
  int port = 8000;
  std::string api_key;  // also DSV4_API_KEY
  std::string served_model_name;
  int64_t max_model_len = 0;
  int64_t max_num_seqs = 256;
  int64_t max_num_batched_tokens = 2048;
  std::string device = "auto", dtype = "auto";  // cli/model_loading.h BackendOptions
  std::string numerics = "hf";                   // BackendOptions::numerics
  std::string kv_cache_dtype = "auto";  // cli/model_loading.h BackendOptions::kv_cache_dtype
  double gpu_memory_utilization = 0.9;
  std::string load_format = "auto";  // auto or dummy (random weights of the config, seed 0)
  std::string expert_bits = "auto";  // cli/model_loading.h BackendOptions::expert_bits
  double kv_cache_gib = 1.0;
  bool kv_cache_gib_given = false;  // sizes the cache on CUDA too when given
  bool enable_prefix_caching = true;
  int64_t prefix_checkpoint_interval = 1024;
  int64_t max_queued_requests = 4096;
  int64_t max_body_mib = 32;
  int io_threads = 2;
  int data_parallel_size = 1;  // ranks of data-parallel attention (engine/data_parallel_engine.h)
  std::string data_parallel_backend = "auto";  // mp / threads / auto (cli/rank_processes.h)
  bool enable_expert_parallel = false;  // the routed experts split over those ranks (docs/parallel.md)
  double dist_timeout = 600;            // seconds a rank's collective may wait (parallel/deadline_communicator.h)
};

// Adds the `serve` subcommand to `app`; the returned options are filled when it is parsed.
CLI::App* add_serve_command(CLI::App& app, ServeOptions& options);
int serve(const ServeOptions& options);

}  // namespace dsv4::cli
