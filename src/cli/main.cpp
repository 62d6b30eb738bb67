// `dsv4`: the command-line entry point. Subcommands live in cli/commands.cpp.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <memory>

#include "cli/bench_command.h"
#include "cli/bench_offline.h"
#include "cli/commands.h"
#include "cli/parallel_options.h"
#include "cli/rank_processes.h"
#include "cli/serve_command.h"
#include "core/error.h"
#include "tokenizer/tokenize_command.h"
#ifdef DSV4_HAVE_CUDA
#include "ops/cuda/kernel_trace.h"
#endif

int main(int argc, char** argv) {
#ifdef DSV4_HAVE_CUDA
  // DSV4_KERNEL_TRACE=FILE: every GPU kernel of this run, as it ran, into FILE (ops/cuda/kernel_trace.h).
  std::unique_ptr<dsv4::ops::cuda::KernelTrace> kernel_trace;
  try {
    kernel_trace = dsv4::ops::cuda::KernelTrace::start_from_env();
  } catch (const dsv4::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
#endif
  CLI::App app{"dsv4: a serving engine for DeepSeek-V4 hybrid-attention models"};
  app.require_subcommand(1);

  dsv4::cli::InitRandomOptions init;
  auto* init_cmd = app.add_subcommand("init-random", "Write a random-weight HF model directory");
  init_cmd->add_option("--preset", init.preset, "v4-flash, v4-pro or tiny");
  init_cmd->add_option("--config", init.config_path, "config.json to use instead of a preset");
  init_cmd->add_option("--out", init.out_dir, "output directory")->required();
  init_cmd->add_option("--seed", init.seed, "random seed");
  init_cmd->add_option("--dtype", init.dtype, "f32 or bf16 (storage dtype)");
  init_cmd->add_option("--tokenizer", init.tokenizer_path, "tokenizer.json (or its directory) to copy in");

  dsv4::cli::ForwardOptions fwd;
  auto* forward_cmd = app.add_subcommand("forward", "Logits of every position for a list of token ids");
  forward_cmd->add_option("--model", fwd.model_dir, "HF model directory (default: the embedded tiny model)");
  forward_cmd->add_option("--ids", fwd.ids, "comma-separated token ids")->required();
  forward_cmd->add_option("--chunks", fwd.chunks, "comma-separated chunk lengths fed through the cache in turn");
  forward_cmd->add_option("--dump-logits", fwd.dump_logits, "write float32 [T, vocab] logits as .npy");
  forward_cmd->add_option("--numerics", fwd.numerics, "hf (exact fp32, default) or deepseek (DeepSeek's FP8/bf16 recipe)");

  dsv4::cli::GenerateOptions gen;
  auto* generate_cmd = app.add_subcommand("generate", "Greedy generation from token ids");
  generate_cmd->add_option("--model", gen.model_dir,
                           "HF model directory, or a config .json with --load-format dummy (default: the embedded "
                           "tiny model)");
  generate_cmd->add_option("--load-format", gen.load_format,
                           "auto (read the checkpoint) or dummy (random weights of the config, seeded by --seed)");
  generate_cmd->add_option(
      "--expert-bits", gen.expert_bits,
      "routed experts: auto (as stored) or requantized at load to 3.5 / 2.5 bits per parameter");
  auto* ids_option = generate_cmd->add_option("--ids", gen.ids, "comma-separated prompt token ids");
  generate_cmd->add_option("--prompt", gen.prompt, "prompt text (the user message with --chat)")->excludes(ids_option);
  generate_cmd->add_option("--tokenizer", gen.tokenizer_path, "tokenizer.json or its directory");
  generate_cmd->add_option("--numerics", gen.numerics, "hf (exact fp32, default) or deepseek (DeepSeek's FP8/bf16 recipe)");
  generate_cmd->add_flag("--chat", gen.chat, "wrap --prompt in the DeepSeek-V4 chat format");
  generate_cmd->add_flag("--thinking", gen.thinking, "chat in thinking mode (<think> … </think>)");
  generate_cmd->add_option("--temperature", gen.temperature, "0 = greedy");
  generate_cmd->add_option("--top-p", gen.top_p, "nucleus sampling mass");
  generate_cmd->add_option("--top-k", gen.top_k, "keep the k most likely tokens (-1: all)");
  generate_cmd->add_option("--min-p", gen.min_p, "drop tokens below min_p x the top probability");
  generate_cmd->add_option("--seed", gen.seed,
                           "per-request seed (reproducible sampling); with --load-format dummy also the weights'");
  generate_cmd->add_option("-n,--n", gen.n, "parallel samples of the prompt (seed + i each)");
  generate_cmd->add_option("--stop", gen.stop, "stop string, not emitted (repeatable; with --prompt)");
  generate_cmd->add_option("--max-tokens", gen.max_tokens, "tokens to generate");
  generate_cmd->add_flag("--ignore-eos", gen.ignore_eos, "keep going past the end-of-sequence token");
  generate_cmd->add_option("--max-num-batched-tokens", gen.max_num_batched_tokens, "token budget of one step");
  generate_cmd->add_option("--kv-cache-gib", gen.kv_cache_gib, "KV cache pool size in GiB")
      ->each([&gen](const std::string&) { gen.kv_cache_gib_given = true; });
  generate_cmd->add_option("--device", gen.device, "auto (CUDA when a GPU is visible), cpu, cuda or cuda:N");
  generate_cmd->add_option("--dtype", gen.dtype, "CUDA precision: auto/bf16 (serving) or f32 (exact)");
  generate_cmd->add_option("--kv-cache-dtype", gen.kv_cache_dtype,
                           "main K=V cache entries: auto/bf16, or fp8 (DeepSeek's 584-byte FP8 entry; CUDA bf16 mode)");
  generate_cmd->add_option("--gpu-memory-utilization", gen.gpu_memory_utilization,
                           "CUDA: share of device memory for weights + KV cache (the cache takes the rest)");
  generate_cmd->add_flag("--no-prefix-caching", gen.no_prefix_caching, "disable prefix caching");
  generate_cmd->add_option("--prefix-checkpoint-interval", gen.prefix_checkpoint_interval,
                           "tokens between kept prefix-cache checkpoints (a multiple of 256)");
  generate_cmd
      ->add_option(
          "--data-parallel-size", gen.data_parallel_size,
          "data-parallel attention ranks, each with its own KV cache; the -n samples spread over them (where "
          "they run: --data-parallel-backend)")
      ->check(CLI::Range(1, 64));
  generate_cmd->add_flag("--enable-expert-parallel", gen.enable_expert_parallel,
                         "split the routed experts over the data-parallel ranks, which then step in lockstep "
                         "(CPU; CUDA: a GPU per rank through NCCL, else ranks sharing one GPU; docs/parallel.md)");
  dsv4::cli::add_dist_timeout_option(generate_cmd, gen.dist_timeout);
  dsv4::cli::add_data_parallel_backend_option(generate_cmd, gen.data_parallel_backend);

  dsv4::cli::PlanOptions plan;
  auto* plan_cmd = app.add_subcommand("plan", "KV-cache bytes per request and how many requests fit");
  plan_cmd->add_option("--preset", plan.preset, "v4-flash, v4-pro or tiny");
  plan_cmd->add_option("--model", plan.model_dir, "HF model directory (reads its config.json)");
  plan_cmd->add_option("--context", plan.context, "tokens per request (K = 2^10, M = 2^20 suffixes)")->required();
  plan_cmd->add_option("--kv-dtype", plan.kv_dtype, "main K=V storage: bf16 or fp8 (f32: the CPU reference)");
  plan_cmd->add_option("--index-dtype", plan.index_dtype, "indexer key storage: bf16, fp8 or fp4 (f32: CPU)");
  auto* kv_cache_dtype = plan_cmd->add_option(
      "--kv-cache-dtype", plan.kv_cache_dtype,
      "what serve's --kv-cache-dtype stores: auto/bf16 (bf16 entries and keys) or fp8 (FP8 entries and keys)");
  kv_cache_dtype->excludes(plan_cmd->get_option("--kv-dtype"));
  kv_cache_dtype->excludes(plan_cmd->get_option("--index-dtype"));
  plan_cmd->add_option_function<double>(
      "--gpu-memory", [&plan](const double& gib) { plan.gpu_memory_gib = gib; },
      "GiB of memory for the KV cache (weights not counted): how many requests fit");
  plan_cmd->add_option_function<int64_t>(
      "--requests", [&plan](const int64_t& count) { plan.requests = count; }, "memory for this many requests");
  plan_cmd->add_flag("--json", plan.json, "machine-readable output");
  auto* device_memory = plan_cmd->add_option_function<double>(
      "--device-memory", [&plan](const double& gib) { plan.device_memory_gib = gib; },
      "GiB of the whole device (H200: 140.4): weights and --reserve-gib come off, the KV cache gets the rest");
  device_memory->excludes(plan_cmd->get_option("--gpu-memory"));
  plan_cmd->add_option("--expert-bits", plan.expert_bits,
                       "routed-expert storage: fp4 (MXFP4, 4.25 bits, as released), fp8, bf16 or bits/param (e.g. 2.5)");
  plan_cmd->add_option("--dense-dtype", plan.dense_dtype, "the release's FP8 linears: fp8 or bf16");
  plan_cmd->add_option("--reserve-gib", plan.reserve_gib, "with --device-memory: activations, workspace, context");
  plan_cmd
      ->add_option("--decode-batch", plan.decode_batch,
                   "also the decode roofline: bytes one step of this many requests at --context reads (weights "
                   "at --expert-bits / --dense-dtype, KV)")
      ->check(CLI::PositiveNumber);
  plan_cmd->add_option("--bandwidth", plan.bandwidth_gbps, "with --decode-batch: GB/s, for the step's floor in ms")
      ->check(CLI::PositiveNumber);

  std::string tokenizer_path, text_file, detok_ids;
  bool add_bos = false;
  auto* tokenize_cmd = app.add_subcommand("tokenize", "Token ids of a text file, as one JSON array");
  tokenize_cmd->add_option("--tokenizer", tokenizer_path, "tokenizer.json or a model directory")->required();
  tokenize_cmd->add_option("--file", text_file, "UTF-8 text file")->required();
  tokenize_cmd->add_flag("--add-bos", add_bos, "prepend the beginning-of-sentence token");
  auto* detokenize_cmd = app.add_subcommand("detokenize", "Text of a list of token ids");
  detokenize_cmd->add_option("--tokenizer", tokenizer_path, "tokenizer.json or a model directory")->required();
  detokenize_cmd->add_option("--ids", detok_ids, "token ids, separated by commas or spaces")->required();

  dsv4::cli::BenchServeOptions bench_serve_options;
  auto* bench_serve_cmd = dsv4::cli::add_bench_command(app, bench_serve_options);
  dsv4::cli::BenchOfflineOptions bench_latency_options, bench_throughput_options;
  const auto [bench_latency_cmd, bench_throughput_cmd] = dsv4::cli::add_bench_offline_commands(
      *app.get_subcommand("bench"), bench_latency_options, bench_throughput_options);

  dsv4::cli::ServeOptions serve_options;
  auto* serve_cmd = dsv4::cli::add_serve_command(app, serve_options);

  // A data-parallel rank's process, started by the serving process (cli/rank_processes.h); hidden from --help.
  int worker_control_fd = -1;
  auto* worker_cmd = app.add_subcommand("data-parallel-worker", "")->group("");
  worker_cmd->add_option("--control-fd", worker_control_fd, "the connection to the serving process")->required();

  CLI11_PARSE(app, argc, argv);
  try {
    if (*worker_cmd) return dsv4::cli::data_parallel_worker(worker_control_fd);
    if (*init_cmd) return dsv4::cli::init_random(init);
    if (*forward_cmd) return dsv4::cli::forward(fwd);
    if (*generate_cmd) return dsv4::cli::generate(gen);
    if (*tokenize_cmd) return dsv4::tokenize_command(tokenizer_path, text_file, add_bos);
    if (*detokenize_cmd) return dsv4::detokenize_command(tokenizer_path, detok_ids);
    if (*plan_cmd) return dsv4::cli::plan(plan);
    if (*serve_cmd) return dsv4::cli::serve(serve_options);
    if (*bench_serve_cmd) return dsv4::cli::bench_serve(bench_serve_options);
    if (*bench_latency_cmd) return dsv4::cli::bench_latency(bench_latency_options);
    if (*bench_throughput_cmd) return dsv4::cli::bench_throughput(bench_throughput_options);
  } catch (const dsv4::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 2;
}
