#include "cli/serve_command.h"

#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>

#include "cli/model_loading.h"
#include "cli/parallel_options.h"
#include "cli/rank_processes.h"
#include "core/error.h"
#include "server/engine_service.h"
#include "server/http_server.h"

namespace dsv4::cli {

CLI::App* add_serve_command(CLI::App& app, ServeOptions& o) {
  auto* cmd = app.add_subcommand("serve", "OpenAI-compatible HTTP server (vLLM's flags)");
  cmd->add_option("model", o.model_dir,
                  "HF model directory, or a config .json with --load-format dummy (default: the embedded tiny model)");
  cmd->add_option("--load-format", o.load_format,
                  "auto (read the checkpoint) or dummy (random weights of the config, seed 0; no safetensors read)");
  cmd->add_option("--expert-bits", o.expert_bits,
                  "routed experts: auto (as stored) or requantized at load to 3.5 / 2.5 bits per parameter");
  cmd->add_option("--tokenizer", o.tokenizer_path, "tokenizer.json or its directory");
  cmd->add_option("--host", o.host, "address to bind (loopback unless told otherwise)");
  cmd->add_option("--port", o.port, "TCP port (0: any free port, printed at start)")->check(CLI::Range(0, 65535));
  cmd->add_option("--api-key", o.api_key, "require 'Authorization: Bearer KEY' on /v1 routes (or DSV4_API_KEY)");
  cmd->add_option("--served-model-name", o.served_model_name, "model name clients use (default: the model path)");
  cmd->add_option("--max-model-len", o.max_model_len, "prompt + completion tokens per request (0: the model's)");
  cmd->add_option("--max-num-seqs", o.max_num_seqs, "requests in one batch");
  cmd->add_option("--max-num-batched-tokens", o.max_num_batched_tokens, "token budget of one engine step");
  cmd->add_option("--gpu-memory-utilization", o.gpu_memory_utilization,
                  "fraction of GPU memory for weights + KV cache (GPU backend; the CPU backend uses --kv-cache-gib)")
      ->check(CLI::Range(0.01, 1.0));
  cmd->add_option("--kv-cache-gib", o.kv_cache_gib,
                  "KV cache pool, GiB (the CPU backend's size; on CUDA it overrides --gpu-memory-utilization)")
      ->each([&o](const std::string&) { o.kv_cache_gib_given = true; });
  cmd->add_option("--device", o.device, "auto (CUDA when a GPU is visible), cpu, cuda or cuda:N");
  cmd->add_option("--dtype", o.dtype, "CUDA precision: auto/bf16 (serving) or f32 (exact)");
  cmd->add_option("--numerics", o.numerics,
                  "hf (transformers' math, default) or deepseek (DeepSeek's FP8/FP4 recipe; CUDA: bf16 mode)");
  cmd->add_option("--kv-cache-dtype", o.kv_cache_dtype,
                  "main K=V cache entries: auto/bf16, or fp8 (DeepSeek's 584-byte FP8 entry; CUDA bf16 mode)");
  cmd->add_flag("--enable-prefix-caching,!--no-enable-prefix-caching", o.enable_prefix_caching,
                "prefix caching (on by default, as in vLLM v1)");
  cmd->add_option("--prefix-checkpoint-interval", o.prefix_checkpoint_interval,
                  "tokens between kept prefix-cache checkpoints (a multiple of 256)");
  cmd->add_option("--max-queued-requests", o.max_queued_requests,
                  "unfinished requests beyond which new ones get 503");
  cmd->add_option("--max-body-mib", o.max_body_mib, "request bodies above this get 413");
  cmd->add_option("--io-threads", o.io_threads, "HTTP threads (parsing, tokenization)")->check(CLI::Range(1, 64));
  cmd->add_option(
         "--data-parallel-size", o.data_parallel_size,
         "data-parallel attention ranks, each with its own scheduler and KV cache, requests routed by "
         "prefix-cache affinity and load (where they run: --data-parallel-backend)")
      ->check(CLI::Range(1, 64));
  cmd->add_flag("--enable-expert-parallel", o.enable_expert_parallel,
                "split the routed experts over the data-parallel ranks, which then step in lockstep (CPU; "
                "CUDA: a GPU per rank through NCCL, else ranks sharing one GPU; docs/parallel.md)");
  add_dist_timeout_option(cmd, o.dist_timeout);
  add_data_parallel_backend_option(cmd, o.data_parallel_backend);
  return cmd;
}

int serve(const ServeOptions& options) {
  BackendOptions backend_options;
  backend_options.device = options.device;
  backend_options.dtype = options.dtype;
  backend_options.numerics = options.numerics;
  backend_options.kv_cache_dtype = options.kv_cache_dtype;
  backend_options.gpu_memory_utilization = options.gpu_memory_utilization;
  backend_options.load_format = options.load_format;
  backend_options.expert_bits = options.expert_bits;
  backend_options.expert_parallel_ranks = options.enable_expert_parallel ? options.data_parallel_size : 1;
  backend_options.dist_timeout_seconds = options.dist_timeout;
  std::unique_ptr<RankProcesses> processes;  // ranks 1.. in worker processes, loading while this one loads
  if (use_rank_processes(options.data_parallel_backend, backend_options, options.data_parallel_size,
                         options.enable_expert_parallel))
    processes = std::make_unique<RankProcesses>(options.model_dir, backend_options, options.data_parallel_size,
                                                options.enable_expert_parallel);
  LoadedBackend loaded = load_backend(options.model_dir, backend_options);
  ModelBackend& model = *loaded.backend;
  const Tokenizer tokenizer = load_tokenizer(options.tokenizer_path, options.model_dir);
  EngineConfig engine;
  engine.max_num_seqs = options.max_num_seqs;
  engine.max_num_batched_tokens = options.max_num_batched_tokens;
  engine.max_model_len = options.max_model_len;
  DSV4_CHECK(options.kv_cache_gib > 0, "--kv-cache-gib must be positive");
  engine.kv_cache_bytes = loaded.cache_bytes(static_cast<int64_t>(options.kv_cache_gib * double(int64_t{1} << 30)),
                                             options.kv_cache_gib_given, options.max_num_batched_tokens);
  engine.enable_prefix_caching = options.enable_prefix_caching;
  engine.checkpoint_interval = options.prefix_checkpoint_interval;
  server::ServerMetrics metrics;
  server::ServiceOptions service_options;
  service_options.max_queued_jobs = options.max_queued_requests;
  server::EngineService service(make_serving_engine(loaded, engine, options.data_parallel_size,
                                                   options.enable_expert_parallel, options.dist_timeout,
                                                   processes.get()),
                                tokenizer,
                                service_options, metrics);

  server::HttpServerOptions http;
  http.host = options.host;
  http.port = static_cast<uint16_t>(options.port);
  if (!options.api_key.empty()) http.api_key = options.api_key;
  else if (const char* key = std::getenv("DSV4_API_KEY"); key && *key) http.api_key = key;
  http.served_model_name = !options.served_model_name.empty() ? options.served_model_name
                           : options.model_dir.empty()        ? "dsv4-tiny-random"
                                                              : options.model_dir;
  DSV4_CHECK(options.max_body_mib >= 1, "--max-body-mib must be at least 1");
  http.max_body_bytes = options.max_body_mib << 20;
  http.io_threads = options.io_threads;
  server::HttpServer server(http, service, tokenizer, metrics);
  std::printf(
      "dsv4 serve: model %s (max_model_len %lld) on http://%s:%u (%s backend, %d data-parallel rank%s, KV "
      "cache %.2f "
      "GiB each)\n",
      http.served_model_name.c_str(), static_cast<long long>(service.max_model_len()), options.host.c_str(),
      static_cast<unsigned>(server.port()), model.device_name(), options.data_parallel_size,
      options.data_parallel_size == 1 ? "" : "s",
      static_cast<double>(engine.kv_cache_bytes) / double(int64_t{1} << 30));
  std::fflush(stdout);
  server.run();
  // The jobs' listeners hold connections of the server's I/O context: drop them while it still exists.
  service.stop();
  std::printf("dsv4 serve: stopped\n");
  return 0;
}

}  // namespace dsv4::cli
