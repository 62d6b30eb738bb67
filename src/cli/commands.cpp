#include "cli/commands.h"
#include "cli/model_loading.h"
#include "cli/rank_processes.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <map>
#include <numeric>

#include <nlohmann/json.hpp>

#include "cache/decode_roofline.h"
#include "cache/planner.h"
#include "cache/weight_plan.h"
#include "core/error.h"
#include "core/npy.h"
#include "engine/engine.h"
#include "tokenizer/chat_encoding.h"
#include "tokenizer/incremental_detokenizer.h"
#include "tokenizer/stop_strings.h"
#include "tokenizer/tokenizer.h"
#include "model/deepseek_v4.h"
#include "model/random_init.h"

namespace dsv4::cli {
namespace {

std::vector<int32_t> to_token_ids(const std::vector<int64_t>& values, int64_t vocab_size) {
  std::vector<int32_t> ids;
  for (const int64_t value : values) {
    DSV4_CHECK(value >= 0 && value < vocab_size,
          "token id " + std::to_string(value) + " is outside the vocabulary [0, " + std::to_string(vocab_size) + ")");
    ids.push_back(static_cast<int32_t>(value));
  }
  return ids;
}

}  // namespace

std::vector<int64_t> parse_int_list(const std::string& text, const std::string& what) {
  std::vector<int64_t> values;
  size_t pos = 0;
  while (pos <= text.size()) {
    const size_t comma = std::min(text.find(',', pos), text.size());
    const std::string item = text.substr(pos, comma - pos);
    size_t used = 0;
    int64_t value = 0;
    try {
      value = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    DSV4_CHECK(!item.empty() && used == item.size(), what + ": '" + item + "' is not an integer (in \"" + text + "\")");
    values.push_back(value);
    pos = comma + 1;
  }
  return values;
}

int init_random(const InitRandomOptions& options) {
  DSV4_CHECK(options.preset.empty() != options.config_path.empty(), "init-random: give exactly one of --preset or --config");
  const ModelConfig config =
      options.preset.empty() ? ModelConfig::from_file(options.config_path) : ModelConfig::preset(options.preset);
  DSV4_CHECK(options.dtype == "f32" || options.dtype == "bf16", "--dtype '" + options.dtype + "': must be f32 or bf16");
  const StorageDType dtype = options.dtype == "f32" ? StorageDType::kF32 : StorageDType::kBF16;
  int64_t params = 0;
  for (const auto& spec : checkpoint_tensors(config)) params += Tensor::count(spec.shape);
  // The writer holds the checkpoint in memory; full-size presets need a config with fewer experts or layers.
  const double gib = static_cast<double>(params) * (dtype == StorageDType::kF32 ? 4 : 2) / (1 << 30);
  DSV4_CHECK(gib <= 16.0, "init-random: " + std::to_string(params) + " parameters (" + std::to_string(gib) +
                         " GiB) is more than this writer handles (16 GiB); use --config with fewer experts or layers");
  write_random_model(config, options.seed, dtype, options.out_dir, options.tokenizer_path);
  std::printf("wrote %s: %lld parameters, %s, seed %llu\n", options.out_dir.c_str(), static_cast<long long>(params),
              options.dtype.c_str(), static_cast<unsigned long long>(options.seed));
  return 0;
}

int forward(const ForwardOptions& options) {
  DeepseekV4Model model = load_model(options.model_dir, options.numerics);
  const std::vector<int32_t> ids = to_token_ids(parse_int_list(options.ids, "--ids"), model.config().vocab_size);
  std::vector<int64_t> chunks = {static_cast<int64_t>(ids.size())};
  if (!options.chunks.empty()) chunks = parse_int_list(options.chunks, "--chunks");
  for (const int64_t length : chunks) DSV4_CHECK(length > 0, "--chunks: every chunk must be positive");
  const int64_t total = std::accumulate(chunks.begin(), chunks.end(), int64_t{0});
  DSV4_CHECK(total == static_cast<int64_t>(ids.size()), "--chunks sum to " + std::to_string(total) + " but --ids has " +
                                                       std::to_string(ids.size()) + " tokens");
  // Successive chunks through one sequence state, as HF does with a DynamicCache.
  auto state = model.new_sequence_state();
  const int64_t vocab = model.config().vocab_size;
  std::vector<float> logits;
  logits.reserve(ids.size() * static_cast<size_t>(vocab));
  int64_t offset = 0;
  for (const int64_t length : chunks) {
    const SequenceChunk chunk{state.get(), std::span<const int32_t>(ids).subspan(offset, length)};
    const Tensor step = model.forward(std::span(&chunk, 1), LogitsMode::kAllPositions);
    logits.insert(logits.end(), step.data.begin(), step.data.end());
    offset += length;
  }
  if (!options.dump_logits.empty())
    write_npy_f32(options.dump_logits, logits.data(), {static_cast<int64_t>(ids.size()), vocab});
  // A short summary: the greedy next token at every position.
  std::printf("forward: %zu tokens in %zu chunks; argmax:", ids.size(), chunks.size());
  for (size_t t = 0; t < ids.size(); ++t) {
    const float* row = logits.data() + t * static_cast<size_t>(vocab);
    std::printf("%s%ld", t ? "," : " ", static_cast<long>(std::max_element(row, row + vocab) - row));
  }
  std::printf("\n");
  return 0;
}


// n > 1: the samples run batched in one engine; each completion is printed when it finishes.
int generate_parallel(ServingEngine& engine, const std::vector<int32_t>& prompt, const SamplingParams& params,
                      const GenerateOptions& options, const Tokenizer* tokenizer) {
  // Child i gets seed + i, as Engine::add_parallel_requests (and vLLM's child requests) do; with
  // --data-parallel-size the children spread over the ranks.
  DSV4_CHECK(options.n >= 1 && options.n <= 128,
             "n = " + std::to_string(options.n) + ": must be in [1, 128]");
  validate(params);
  std::vector<RequestId> ids;
  for (int64_t i = 0; i < options.n; ++i) {
    SamplingParams child = params;
    if (child.seed) child.seed = *child.seed + static_cast<uint64_t>(i);
    ids.push_back(engine.add_request(prompt, child));
  }
  std::map<RequestId, std::vector<int32_t>> tokens;
  const auto start = std::chrono::steady_clock::now();
  size_t generated = 0;
  std::printf("prompt: %zu tokens, %lld samples\n", prompt.size(), static_cast<long long>(options.n));
  while (engine.has_unfinished())
    for (const RequestOutput& output : engine.step()) {
      auto& sample = tokens[output.id];
      sample.insert(sample.end(), output.new_token_ids.begin(), output.new_token_ids.end());
      generated += output.new_token_ids.size();
      if (!output.finished) continue;
      DSV4_CHECK(output.error.empty(), output.error);
      const auto index = std::find(ids.begin(), ids.end(), output.id) - ids.begin();
      std::string text;
      if (tokenizer) {
        std::vector<int32_t> known;
        for (const int32_t token : sample)
          if (token < tokenizer->vocab_size() && tokenizer->id_to_token(token)) known.push_back(token);
        StopStringMatcher stop(options.stop);
        text = stop.push(tokenizer->decode(known)) + stop.flush();
      } else {
        for (const int32_t token : sample) {
          if (!text.empty()) text += ' ';
          text += std::to_string(token);
        }
      }
      std::printf("[%lld] %s\n", static_cast<long long>(index), text.c_str());
    }
  const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("%zu tokens in %.1f ms, %.1f tokens/s\n", generated, total * 1e3, generated / total);
  return 0;
}

int generate(const GenerateOptions& options) {
  BackendOptions backend_options;
  backend_options.device = options.device;
  backend_options.dtype = options.dtype;
  backend_options.kv_cache_dtype = options.kv_cache_dtype;
  backend_options.numerics = options.numerics;
  backend_options.gpu_memory_utilization = options.gpu_memory_utilization;
  backend_options.load_format = options.load_format;
  backend_options.expert_bits = options.expert_bits;
  backend_options.dummy_seed = options.seed.value_or(0);
  backend_options.expert_parallel_ranks = options.enable_expert_parallel ? options.data_parallel_size : 1;
  backend_options.dist_timeout_seconds = options.dist_timeout;
  std::unique_ptr<RankProcesses> processes;  // ranks 1.. in worker processes, loading while this one loads
  if (use_rank_processes(options.data_parallel_backend, backend_options, options.data_parallel_size,
                         options.enable_expert_parallel))
    processes = std::make_unique<RankProcesses>(options.model_dir, backend_options, options.data_parallel_size,
                                                options.enable_expert_parallel);
  LoadedBackend loaded = load_backend(options.model_dir, backend_options);
  ModelBackend& model = *loaded.backend;
  DSV4_CHECK(options.ids.empty() != options.prompt.empty(), "generate: give exactly one of --ids or --prompt");
  DSV4_CHECK(!options.chat || !options.prompt.empty(), "--chat needs --prompt");
  std::optional<Tokenizer> tokenizer;
  std::vector<int32_t> prompt;
  if (!options.prompt.empty()) {
    tokenizer.emplace(load_tokenizer(options.tokenizer_path, options.model_dir));
    std::string text = options.prompt;
    if (options.chat) {
      ChatEncodingOptions chat;
      chat.thinking_mode = options.thinking ? ThinkingMode::kThinking : ThinkingMode::kChat;
      text = encode_messages(nlohmann::ordered_json::array({{{"role", "user"}, {"content", options.prompt}}}), chat);
    }
    prompt = tokenizer->encode(text, /*add_special_tokens=*/false);
  } else {
    prompt = to_token_ids(parse_int_list(options.ids, "--ids"), model.config().vocab_size);
  }
  DSV4_CHECK(options.max_tokens >= 1, "--max-tokens must be >= 1");
  // The serving path: scheduler, hybrid KV cache manager, paged state, the sampler.
  EngineConfig engine_config;
  engine_config.max_num_batched_tokens = options.max_num_batched_tokens;
  engine_config.kv_cache_bytes = loaded.cache_bytes(static_cast<int64_t>(options.kv_cache_gib * (1 << 30)),
                                                    options.kv_cache_gib_given, options.max_num_batched_tokens);
  engine_config.enable_prefix_caching = !options.no_prefix_caching;
  engine_config.checkpoint_interval = options.prefix_checkpoint_interval;
  const std::unique_ptr<ServingEngine> serving =
      make_serving_engine(loaded, engine_config, options.data_parallel_size, options.enable_expert_parallel,
                          options.dist_timeout, processes.get());
  ServingEngine& engine = *serving;

  SamplingParams params;
  params.max_tokens = options.max_tokens;
  params.ignore_eos = options.ignore_eos;
  params.temperature = options.temperature;
  params.top_p = options.top_p;
  params.top_k = options.top_k;
  params.min_p = options.min_p;
  params.seed = options.seed;
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  DSV4_CHECK(options.stop.empty() || tokenizer, "--stop needs --prompt (stop strings match text)");
  if (options.n > 1) return generate_parallel(engine, prompt, params, options, tokenizer ? &*tokenizer : nullptr);
  const RequestId request = engine.add_request(prompt, params);
  StopStringMatcher stop_matcher(options.stop);
  std::optional<IncrementalDetokenizer> detokenizer;
  if (tokenizer) detokenizer.emplace(*tokenizer);
  double first_token_seconds = 0;
  size_t generated = 0, undecodable = 0;
  std::string stopped = "length";
  if (tokenizer) std::printf("prompt: %zu tokens\n", prompt.size());
  else std::printf("prompt: %zu tokens\ngenerated:", prompt.size());
  std::fflush(stdout);
  while (engine.has_unfinished()) {
    for (const RequestOutput& output : engine.step()) {
      for (const int32_t token : output.new_token_ids) {
        if (generated++ == 0) first_token_seconds = std::chrono::duration<double>(Clock::now() - start).count();
        if (!detokenizer) {
          std::printf(" %d", token);
        } else if (token < tokenizer->vocab_size() && tokenizer->id_to_token(token)) {
          const std::string piece = stop_matcher.push(detokenizer->push(token));
          std::fwrite(piece.data(), 1, piece.size(), stdout);
          if (stop_matcher.stopped()) {
            engine.abort(request);  // the stop string ends the request; its blocks are freed now
            stopped = "stop string";
            break;
          }
        } else {
          ++undecodable;  // the model's embedding rows past the tokenizer's vocabulary have no text (HF drops them)
        }
        std::fflush(stdout);
      }
      if (output.finished && !stop_matcher.stopped()) {
        DSV4_CHECK(output.error.empty(), output.error);
        stopped = output.status == RequestStatus::kFinishedLength ? "length" : "stop";
      }
    }
  }
  if (detokenizer && !stop_matcher.stopped()) {
    const std::string rest = stop_matcher.push(detokenizer->flush()) + stop_matcher.flush();
    std::fwrite(rest.data(), 1, rest.size(), stdout);
  }
  const double total = std::chrono::duration<double>(Clock::now() - start).count();
  const double decode_rate = generated > 1 ? (generated - 1) / (total - first_token_seconds) : 0.0;
  std::printf("\nTTFT %.1f ms, %zu tokens (finished: %s%s), decode %.1f tokens/s on %s\n", first_token_seconds * 1e3,
              generated, stopped.c_str(),
              undecodable ? (", " + std::to_string(undecodable) + " ids without text").c_str() : "", decode_rate,
              model.device_name());
  return 0;
}

int plan(const PlanOptions& options) {
  DSV4_CHECK(options.preset.empty() != options.model_dir.empty(), "plan: give exactly one of --preset or --model");
  ModelConfig config;
  if (!options.preset.empty()) {
    config = ModelConfig::preset(options.preset);
  } else {
    namespace fs = std::filesystem;
    DSV4_CHECK(fs::is_directory(options.model_dir), "--model '" + options.model_dir + "': not a directory");
    config = ModelConfig::from_file((fs::path(options.model_dir) / "config.json").string());
  }
  const int64_t context = parse_token_count(options.context, "--context");
  std::string kv_dtype = options.kv_dtype, index_dtype = options.index_dtype;
  if (!options.kv_cache_dtype.empty())  // the GPU's --kv-cache-dtype: fp8 stores main entries and index keys FP8
    kv_dtype = index_dtype = parse_fp8_kv_cache(options.kv_cache_dtype) ? "fp8" : "bf16";
  const KvStorage kv = parse_kv_storage(kv_dtype, "--kv-dtype");
  const IndexStorage index = parse_index_storage(index_dtype, "--index-dtype");
  if (options.gpu_memory_gib)
    DSV4_CHECK(std::isfinite(*options.gpu_memory_gib) && *options.gpu_memory_gib > 0,
          "--gpu-memory " + std::to_string(*options.gpu_memory_gib) + ": must be a positive number of GiB");
  if (options.requests)
    DSV4_CHECK(*options.requests > 0, "--requests " + std::to_string(*options.requests) + ": must be positive");
  DSV4_CHECK(options.dense_dtype == "fp8" || options.dense_dtype == "bf16",
             "--dense-dtype '" + options.dense_dtype + "': must be fp8 or bf16");
  const WeightPlan weights =
      plan_weights(config, {parse_expert_bits(options.expert_bits, "--expert-bits"), options.dense_dtype == "fp8"});
  std::optional<double> kv_budget_gib = options.gpu_memory_gib;
  double left_gib = 0;
  if (options.device_memory_gib) {
    DSV4_CHECK(std::isfinite(*options.device_memory_gib) && *options.device_memory_gib > 0,
               "--device-memory must be a positive number of GiB");
    DSV4_CHECK(std::isfinite(options.reserve_gib) && options.reserve_gib >= 0, "--reserve-gib must be >= 0");
    left_gib = *options.device_memory_gib - static_cast<double>(weights.bytes) / double(int64_t{1} << 30) -
               options.reserve_gib;
    if (left_gib > 0) kv_budget_gib = left_gib;
  }
  DSV4_CHECK(!options.bandwidth_gbps || options.decode_batch, "--bandwidth needs --decode-batch");
  std::optional<DecodeRoofline> roofline;
  if (options.decode_batch)
    roofline = decode_roofline(config, weights.format, kv, index, *options.decode_batch, context);
  CapacityPlan result = plan_capacity(config, kv, index, context, kv_budget_gib, options.requests);
  result.model = options.preset.empty() ? options.model_dir : options.preset;
  if (options.device_memory_gib && left_gib <= 0) result.requests_fit = 0;
  if (options.json) {
    nlohmann::json out = capacity_plan_to_json(result);
    out["weights"] = weight_plan_to_json(weights);
    if (options.device_memory_gib) {
      out["device_memory_gib"] = *options.device_memory_gib;
      out["reserve_gib"] = options.reserve_gib;
      out["kv_budget_gib"] = std::max(left_gib, 0.0);
      out["requests_fit"] = result.requests_fit.value_or(0);
    }
    if (roofline) {
      out["decode_roofline"] = {{"batch", *options.decode_batch}, {"bytes", roofline->bytes()},
                                {"weight_bytes", roofline->weight_bytes},
                                {"routed_expert_bytes", roofline->routed_expert_bytes},
                                {"kv_bytes", roofline->kv_bytes}};
      if (options.bandwidth_gbps)
        out["decode_roofline"]["floor_s"] = roofline->seconds_at(*options.bandwidth_gbps * 1e9);
    }
    std::printf("%s\n", out.dump(2).c_str());
    return 0;
  }
  std::printf("%s", format_capacity_plan(result).c_str());
  std::printf("%s", format_weight_plan(weights).c_str());
  if (options.device_memory_gib) {
    const double weights_gib = static_cast<double>(weights.bytes) / double(int64_t{1} << 30);
    if (left_gib <= 0)
      std::printf("\ndevice %.2f GiB - weights %.2f GiB - reserve %.2f GiB = %.2f GiB: the weights do not fit, "
                  "0 requests\n",
                  *options.device_memory_gib, weights_gib, options.reserve_gib, left_gib);
    else
      std::printf("\ndevice %.2f GiB - weights %.2f GiB - reserve %.2f GiB = %.2f GiB of KV cache: %lld requests of "
                  "%lld tokens\n",
                  *options.device_memory_gib, weights_gib, options.reserve_gib, left_gib,
                  static_cast<long long>(result.requests_fit.value_or(0)), static_cast<long long>(context));
  }
  if (roofline) {
    std::printf("\ndecode roofline, batch %lld at %lld tokens: %s", static_cast<long long>(*options.decode_batch),
                static_cast<long long>(context), format_decode_roofline(*roofline).c_str());
    if (options.bandwidth_gbps)
      std::printf(" / %.0f GB/s = %.3f ms a step at best", *options.bandwidth_gbps,
                  roofline->seconds_at(*options.bandwidth_gbps * 1e9) * 1e3);
    std::printf("\n");
  }
  return 0;
}

}  // namespace dsv4::cli
