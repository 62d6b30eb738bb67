#include "cli/bench_offline.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <unordered_set>

#include <nlohmann/json.hpp>

#include "bench/latency_stats.h"
#include "cache/decode_roofline.h"
#include "cache/planner.h"
#include "cli/commands.h"
#include "cli/model_loading.h"
#include "cli/rank_processes.h"
#include "cli/parallel_options.h"
#include "core/error.h"
#include "engine/engine.h"
#ifdef DSV4_HAVE_CUDA
#include "model/cuda/deepseek_v4_cuda.h"
#include "ops/cuda/device.h"
#endif

namespace dsv4::cli {
namespace {

using Clock = std::chrono::steady_clock;

void add_common(CLI::App* cmd, BenchOfflineOptions& o) {
  cmd->add_option("--model", o.model_dir,
                  "HF model directory, or a config .json with --load-format dummy (default: the embedded tiny model)");
  cmd->add_option("--load-format", o.load_format,
                  "auto (read the checkpoint) or dummy (random weights of the config, seeded by --seed)")
      ->capture_default_str();
  cmd->add_option("--expert-bits", o.expert_bits,
                  "routed experts: auto (as stored) or requantized at load to 3.5 / 2.5 bits per parameter")
      ->capture_default_str();
  cmd->add_option("--device", o.device, "auto, cpu, cuda or cuda:N")->capture_default_str();
  cmd->add_option("--dtype", o.dtype, "CUDA precision: auto/bf16 or f32")->capture_default_str();
  cmd->add_option("--numerics", o.numerics, "hf (default) or deepseek (DeepSeek's FP8/FP4 recipe)")
      ->capture_default_str();
  cmd->add_option("--kv-cache-dtype", o.kv_cache_dtype, "main K=V cache entries: auto/bf16 or fp8")
      ->capture_default_str();
  cmd->add_option("--gpu-memory-utilization", o.gpu_memory_utilization, "CUDA: share of device memory")
      ->capture_default_str();
  cmd->add_option("--kv-cache-gib", o.kv_cache_gib, "KV cache pool, GiB (0: the backend's default)");
  cmd->add_option("--input-len", o.input_len, "prompt tokens")->capture_default_str();
  cmd->add_option("--output-len", o.output_len, "generated tokens per request")->capture_default_str();
  cmd->add_option("--max-num-seqs", o.max_num_seqs, "requests running at once")->capture_default_str();
  cmd->add_option("--max-num-batched-tokens", o.max_num_batched_tokens, "token budget of one step")
      ->capture_default_str();
  cmd->add_flag("--enable-prefix-caching", o.enable_prefix_caching, "keep prefix caching on");
  cmd->add_option("--seed", o.seed, "seeds the random prompts (and the weights with --load-format dummy)")
      ->capture_default_str();
  cmd->add_option("--output-json", o.output_json, "write the results as JSON");
}

struct Setup {
  std::unique_ptr<RankProcesses> processes;  // throughput with --data-parallel-backend mp: ranks 1..
  LoadedBackend loaded;
  EngineConfig engine;
};

Setup make_setup(const BenchOfflineOptions& o) {
  DSV4_CHECK(o.input_len >= 1 && o.output_len >= 1, "--input-len and --output-len must be >= 1");
  BackendOptions backend;
  backend.device = o.device;
  backend.dtype = o.dtype;
  backend.numerics = o.numerics;
  backend.kv_cache_dtype = o.kv_cache_dtype;
  backend.gpu_memory_utilization = o.gpu_memory_utilization;
  backend.load_format = o.load_format;
  backend.expert_bits = o.expert_bits;
  backend.dummy_seed = o.seed;
  backend.expert_parallel_ranks = o.enable_expert_parallel ? o.data_parallel_size : 1;
  backend.dist_timeout_seconds = o.dist_timeout;
  const auto load_start = std::chrono::steady_clock::now();
  Setup setup;
  if (use_rank_processes(o.data_parallel_backend, backend, o.data_parallel_size, o.enable_expert_parallel))
    setup.processes = std::make_unique<RankProcesses>(o.model_dir, backend, o.data_parallel_size,
                                                      o.enable_expert_parallel);
  setup.loaded = load_backend(o.model_dir, backend);
  // The load time is part of what a dummy-weight run of a large config costs (model/cuda/device_random_weights.h).
  std::printf("Loaded %s in %.1f s\n", o.model_dir.empty() ? "the embedded model" : o.model_dir.c_str(),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count());
  setup.engine.max_num_seqs = o.max_num_seqs;
  setup.engine.max_num_batched_tokens = o.max_num_batched_tokens;
  setup.engine.enable_prefix_caching = o.enable_prefix_caching;
  setup.engine.max_model_len = o.input_len + o.output_len;
  const bool given = o.kv_cache_gib > 0;
  setup.engine.kv_cache_bytes = setup.loaded.cache_bytes(
      static_cast<int64_t>((given ? o.kv_cache_gib : 4.0) * double(int64_t{1} << 30)), given, o.max_num_batched_tokens);
  return setup;
}

std::vector<std::vector<int32_t>> random_prompts(int64_t count, int64_t length, int64_t vocab, std::mt19937_64& rng) {
  std::uniform_int_distribution<int32_t> id(0, static_cast<int32_t>(vocab - 1));
  std::vector<std::vector<int32_t>> prompts(static_cast<size_t>(count), std::vector<int32_t>(static_cast<size_t>(length)));
  for (auto& prompt : prompts)
    for (auto& token : prompt) token = id(rng);
  return prompts;
}

SamplingParams fixed_length(int64_t output_len) {
  SamplingParams params;
  params.max_tokens = output_len;
  params.ignore_eos = true;
  return params;
}

struct BatchTiming {
  double total_s = 0, prefill_s = 0;  // prefill: until every request has its first token
  int64_t decode_steps = 0;
};

BatchTiming run_batch(ServingEngine& engine, const std::vector<std::vector<int32_t>>& prompts, int64_t output_len) {
  for (const auto& prompt : prompts) engine.add_request(prompt, fixed_length(output_len));
  const auto start = Clock::now();
  BatchTiming timing;
  std::unordered_set<RequestId> have_first;
  bool prefilled = false;
  while (engine.has_unfinished()) {
    for (const RequestOutput& output : engine.step()) {
      DSV4_CHECK(output.error.empty(), "request " + std::to_string(output.id) + " failed: " + output.error);
      if (!output.new_token_ids.empty()) have_first.insert(output.id);
    }
    if (prefilled) ++timing.decode_steps;
    if (!prefilled && have_first.size() == prompts.size()) {
      prefilled = true;
      timing.prefill_s = std::chrono::duration<double>(Clock::now() - start).count();
    }
  }
  timing.total_s = std::chrono::duration<double>(Clock::now() - start).count();
  return timing;
}

void write_json(const std::string& path, const nlohmann::json& result) {
  if (path.empty()) return;
  std::ofstream out(path);
  DSV4_CHECK(out.good(), "cannot write " + path);
  out << result.dump(2) << "\n";
}

}  // namespace

std::pair<CLI::App*, CLI::App*> add_bench_offline_commands(CLI::App& bench, BenchOfflineOptions& latency,
                                                           BenchOfflineOptions& throughput) {
  auto* latency_cmd = bench.add_subcommand(
      "latency", "Offline: latency of one batch (prefill, then decode) through the engine in this process");
  add_common(latency_cmd, latency);
  latency_cmd->add_option("--batch-size", latency.batch_sizes, "requests per iteration (a comma list: each in turn)")
      ->capture_default_str();
  latency_cmd->add_option("--num-iters-warmup", latency.warmup_iters, "untimed iterations")->capture_default_str();
  latency_cmd->add_option("--num-iters", latency.iters, "timed iterations")->capture_default_str();
  latency_cmd->add_flag("--roofline", latency.roofline,
                        "print each batch's decode roofline: bytes of the weights one step touches and of the KV it "
                        "reads, over the copy bandwidth measured on the CUDA device (or --roofline-bandwidth)");
  latency_cmd->add_option("--roofline-bandwidth", latency.roofline_bandwidth_gbps,
                          "GB/s for --roofline instead of the measured copy bandwidth")
      ->check(CLI::PositiveNumber);
  auto* throughput_cmd = bench.add_subcommand(
      "throughput", "Offline: requests/s and tokens/s of --num-prompts requests submitted at once");
  add_common(throughput_cmd, throughput);
  throughput_cmd->add_option("--num-prompts", throughput.num_prompts, "requests")->capture_default_str();
  throughput_cmd
      ->add_option("--data-parallel-size", throughput.data_parallel_size,
                   "data-parallel attention ranks (the prompts are routed over them; where they run: "
                   "--data-parallel-backend)")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  throughput_cmd->add_flag("--enable-expert-parallel", throughput.enable_expert_parallel,
                           "split the routed experts over the data-parallel ranks (lockstep; CPU, or CUDA: a "
                           "GPU per rank through NCCL, else ranks sharing one GPU)");
  add_dist_timeout_option(throughput_cmd, throughput.dist_timeout);
  add_data_parallel_backend_option(throughput_cmd, throughput.data_parallel_backend);
  return {latency_cmd, throughput_cmd};
}

int bench_latency(const BenchOfflineOptions& o) {
  const std::vector<int64_t> batch_sizes = parse_int_list(o.batch_sizes, "--batch-size");
  DSV4_CHECK(!batch_sizes.empty() && o.iters >= 1 && o.warmup_iters >= 0,
             "--batch-size needs at least one size and --num-iters must be >= 1");
  for (const int64_t batch : batch_sizes) DSV4_CHECK(batch >= 1, "--batch-size values must be >= 1");
  Setup setup = make_setup(o);
  Engine engine(*setup.loaded.backend, setup.engine);
  std::mt19937_64 rng(o.seed);
  const int64_t vocab = setup.loaded.backend->config().vocab_size;
  nlohmann::json all = nlohmann::json::array();
  // What the cache holds (--kv-cache-dtype fp8 stores 584-byte main entries instead of 1024): the longest single
  // request the empty pool fits, found by bisection on fits_in_pool (monotone in the token count).
  int64_t fits = 0;
  for (int64_t step = int64_t{1} << 40; step > 0; step /= 2)
    if (engine.cache().fits_in_pool(fits + step)) fits += step;
  const KvStorage storage = setup.loaded.backend->kv_storage();
  const bool simulated = storage == KvStorage::kF32 && setup.loaded.backend->config().fp8_kv_cache;
  std::printf("KV cache: %.2f GiB, %s%s main entries; one request fits %lld tokens\n",
              static_cast<double>(setup.engine.kv_cache_bytes) / double(int64_t{1} << 30), kv_storage_name(storage),
              simulated ? " (FP8-simulated)" : "", static_cast<long long>(fits));
#ifdef DSV4_HAVE_CUDA
  auto* cuda_model = setup.loaded.on_cuda ? static_cast<DeepseekV4CudaModel*>(setup.loaded.backend.get()) : nullptr;
#endif
  // The bandwidth a decode step's bytes are divided by: given, or the device's copy rate measured here (1 GiB
  // device to device, after the KV arena is allocated: 2 GiB must still be free).
  double roofline_bytes_per_second = o.roofline_bandwidth_gbps * 1e9;
  if (o.roofline || o.roofline_bandwidth_gbps > 0) {
#ifdef DSV4_HAVE_CUDA
    if (roofline_bytes_per_second <= 0 && cuda_model) roofline_bytes_per_second = ops::cuda::measure_copy_bandwidth();
#endif
    if (roofline_bytes_per_second > 0)
      std::printf("Roofline bandwidth: %.0f GB/s (%s)\n", roofline_bytes_per_second / 1e9,
                  o.roofline_bandwidth_gbps > 0 ? "--roofline-bandwidth" : "device-to-device copy, measured");
    else
      std::printf("Roofline: no bandwidth (give --roofline-bandwidth GB/s off a CUDA device)\n");
  }
  for (const int64_t batch_size : batch_sizes) {
    for (int64_t i = 0; i < o.warmup_iters; ++i)
      run_batch(engine, random_prompts(batch_size, o.input_len, vocab, rng), o.output_len);
#ifdef DSV4_HAVE_CUDA
    if (cuda_model) cuda_model->reset_step_profile();
#endif
    std::vector<double> latencies, prefills, steps;
    for (int64_t i = 0; i < o.iters; ++i) {
      const BatchTiming t = run_batch(engine, random_prompts(batch_size, o.input_len, vocab, rng), o.output_len);
      latencies.push_back(t.total_s);
      prefills.push_back(t.prefill_s);
      if (t.decode_steps > 0) steps.push_back((t.total_s - t.prefill_s) / static_cast<double>(t.decode_steps));
    }
    double mean = 0, prefill = 0, step = 0;
    for (double v : latencies) mean += v / static_cast<double>(latencies.size());
    for (double v : prefills) prefill += v / static_cast<double>(prefills.size());
    for (double v : steps) step += v / static_cast<double>(steps.size());
    std::printf("bench latency on %s: batch %lld, input %lld, output %lld, %lld iterations\n",
                setup.loaded.backend->device_name(), static_cast<long long>(batch_size),
                static_cast<long long>(o.input_len), static_cast<long long>(o.output_len),
                static_cast<long long>(o.iters));
    std::printf("Avg latency: %.4f s   (p50 %.4f, p90 %.4f, p99 %.4f)\n", mean, bench::percentile(latencies, 50),
                bench::percentile(latencies, 90), bench::percentile(latencies, 99));
    std::printf("Prefill: %.2f ms (%.0f tokens/s)   Decode: %.3f ms/step (%.1f tokens/s)\n", prefill * 1e3,
                static_cast<double>(batch_size * o.input_len) / prefill, step * 1e3,
                step > 0 ? static_cast<double>(batch_size) / step : 0.0);
    nlohmann::json roofline_json;
    if (roofline_bytes_per_second > 0 && step > 0) {
      // The step decodes at context input_len … input_len + output_len − 1: the middle one stands for them.
      const DecodeRoofline r = decode_roofline(setup.loaded.backend->config(), setup.loaded.held_weights, storage,
                                               setup.loaded.backend->index_storage(), batch_size,
                                               o.input_len + o.output_len / 2);
      const double floor_s = r.seconds_at(roofline_bytes_per_second);
      std::printf("Decode roofline: %s / %.0f GB/s = %.3f ms; the step runs at %.1f %% of it\n",
                  format_decode_roofline(r).c_str(), roofline_bytes_per_second / 1e9, floor_s * 1e3,
                  100.0 * floor_s / step);
      roofline_json = {{"bytes", r.bytes()}, {"weight_bytes", r.weight_bytes}, {"kv_bytes", r.kv_bytes},
                       {"bandwidth_bytes_per_s", roofline_bytes_per_second}, {"floor_s", floor_s},
                       {"fraction", floor_s / step}};
    }
#ifdef DSV4_HAVE_CUDA
    if (cuda_model) {
      const auto profile = cuda_model->step_profile();
      std::printf("Per step (%lld steps, prefill and decode): host prepare %.3f ms, device forward %.3f ms, device "
                  "sampling %.3f ms; graph replays %lld\n",
                  static_cast<long long>(profile.steps), profile.host_prepare_ms, profile.device_forward_ms,
                  profile.device_sampling_ms, static_cast<long long>(cuda_model->graph_replays()));
    }
#endif
    all.push_back({{"device", setup.loaded.backend->device_name()},
                   {"batch_size", batch_size},
                   {"input_len", o.input_len},
                   {"output_len", o.output_len},
                   {"avg_latency", mean},
                   {"latencies", latencies},
                   {"avg_prefill_s", prefill},
                   {"avg_decode_step_s", step}});
    if (!roofline_json.is_null()) all.back()["decode_roofline"] = roofline_json;
  }
  write_json(o.output_json, all.size() == 1 ? all[0] : all);
  return 0;
}

int bench_throughput(const BenchOfflineOptions& o) {
  DSV4_CHECK(o.num_prompts >= 1, "--num-prompts must be >= 1");
  Setup setup = make_setup(o);
  const std::unique_ptr<ServingEngine> engine =
      make_serving_engine(setup.loaded, setup.engine, o.data_parallel_size, o.enable_expert_parallel, o.dist_timeout,
                          setup.processes.get());
  std::mt19937_64 rng(o.seed);
  const int64_t vocab = setup.loaded.backend->config().vocab_size;
  const auto prompts = random_prompts(o.num_prompts, o.input_len, vocab, rng);
  const BatchTiming t = run_batch(*engine, prompts, o.output_len);
  const double requests = static_cast<double>(o.num_prompts);
  const double total_tokens = requests * static_cast<double>(o.input_len + o.output_len);
  const double output_tokens = requests * static_cast<double>(o.output_len);
  std::printf("bench throughput on %s: %lld prompts, input %lld, output %lld, %d rank%s%s\n",
              setup.loaded.backend->device_name(), static_cast<long long>(o.num_prompts),
              static_cast<long long>(o.input_len), static_cast<long long>(o.output_len), o.data_parallel_size,
              o.data_parallel_size == 1 ? "" : "s", o.enable_expert_parallel ? " (expert parallel)" : "");
  std::printf("Throughput: %.2f requests/s, %.2f total tokens/s, %.2f output tokens/s (%.2f s)\n", requests / t.total_s,
              total_tokens / t.total_s, output_tokens / t.total_s, t.total_s);
  write_json(o.output_json, {{"device", setup.loaded.backend->device_name()},
                             {"num_prompts", o.num_prompts},
                             {"input_len", o.input_len},
                             {"output_len", o.output_len},
                             {"data_parallel_size", o.data_parallel_size},
                             {"expert_parallel", o.enable_expert_parallel},
                             {"elapsed_time", t.total_s},
                             {"requests_per_second", requests / t.total_s},
                             {"tokens_per_second", total_tokens / t.total_s},
                             {"output_tokens_per_second", output_tokens / t.total_s}});
  return 0;
}

}  // namespace dsv4::cli
