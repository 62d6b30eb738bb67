// The subcommands of the `dsv4` binary (docs/CLI.md). Each returns the process exit code.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace dsv4::cli {

struct InitRandomOptions {
  std::string preset, config_path, out_dir, tokenizer_path, dtype = "bf16";
  uint64_t seed = 0;
};
int init_random(const InitRandomOptions& options);

struct ForwardOptions {
  std::string model_dir, ids, chunks, dump_logits;
  std::string numerics = "hf";  // "hf" or "deepseek" (docs/numerics.md)
};
int forward(const ForwardOptions& options);

struct GenerateOptions {
  std::string model_dir, ids;
  std::string numerics = "hf";  // "hf" or "deepseek" (docs/numerics.md)
  std::string device = "auto", dtype = "auto";  // cli/model_loading.h BackendOptions
  std::string kv_cache_dtype = "auto";  // cli/model_loading.h BackendOptions::kv_cache_dtype
  double gpu_memory_utilization = 0.9;
  std::string load_format = "auto";  // auto or dummy (random weights of the config; --seed seeds them, else 0)
  std::string expert_bits = "auto";  // cli/model_loading.h BackendOptions::expert_bits
  bool kv_cache_gib_given = false;  // --kv-cache-gib given: it sizes the cache on CUDA too
  // Text in, text out: --prompt (a raw prompt, or the user message with --chat), --tokenizer (default: the
  // model directory's tokenizer.json, else the DeepSeek one that scripts/setup.sh installs).
  std::string prompt, tokenizer_path;
  bool chat = false, thinking = false;
  double temperature = 0.0, top_p = 1.0, min_p = 0.0;
  int64_t top_k = -1;
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;  // stop strings (text mode)
  int64_t n = 1;                   // parallel samples; n > 1 prints each completion when it finishes
  int64_t max_tokens = 16;
  bool ignore_eos = false;
  // Engine knobs (the names `dsv4 serve` will take, as vLLM's).
  int64_t max_num_batched_tokens = 512;
  double kv_cache_gib = 0.5;
  bool no_prefix_caching = false;
  int64_t prefix_checkpoint_interval = 1024;
  int data_parallel_size = 1;  // DataParallelEngine ranks; the n samples spread over them
  bool enable_expert_parallel = false;  // the routed experts split over the data-parallel ranks (CPU)
  double dist_timeout = 600;            // seconds a rank's collective may wait (parallel/deadline_communicator.h)
  std::string data_parallel_backend = "auto";  // mp / threads / auto (cli/rank_processes.h)
};
int generate(const GenerateOptions& options);

// `dsv4 plan`: KV-cache bytes per request and how many requests fit (docs/planner.md).
struct PlanOptions {
  std::string preset, model_dir, context, kv_dtype = "bf16", index_dtype = "bf16";
  std::string kv_cache_dtype;  // serve's --kv-cache-dtype: sets both storages (empty: --kv-dtype / --index-dtype)
  std::optional<double> gpu_memory_gib;
  std::optional<int64_t> requests;
  bool json = false;
  // The whole device: weights at --expert-bits / --dense-dtype and --reserve-gib (activations, workspace, CUDA
  // context) come off first, the KV cache gets the rest (cache/weight_plan.h).
  std::optional<double> device_memory_gib;
  std::string expert_bits = "fp4", dense_dtype = "fp8";
  double reserve_gib = 6.0;
  // The decode roofline of `decode_batch` requests at the context (cache/decode_roofline.h), and its floor at
  // `bandwidth_gbps` when given.
  std::optional<int64_t> decode_batch;
  std::optional<double> bandwidth_gbps;
};
int plan(const PlanOptions& options);

// "5,17,3" -> {5, 17, 3}; throws dsv4::Error naming `what` on a malformed list.
std::vector<int64_t> parse_int_list(const std::string& text, const std::string& what);

}  // namespace dsv4::cli
