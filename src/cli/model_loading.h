// The model and tokenizer every text-serving subcommand loads (generate, serve, bench).
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "cache/weight_plan.h"
#include "engine/engine.h"
#include "engine/model_backend.h"
#include "engine/serving_engine.h"
#include "model/deepseek_v4.h"
#include "parallel/communicator.h"
#include "tokenizer/tokenizer.h"

namespace dsv4::cli {

// The embedded default model (model_dir empty): the tiny preset with seed-0 random weights, built in memory.
inline constexpr uint64_t kDefaultModelSeed = 0;

// A HF model directory (config.json + safetensors), or the embedded default when `model_dir` is empty.
// `numerics`: "hf" (default) or "deepseek" (docs/numerics.md); anything else throws dsv4::Error.
DeepseekV4Model load_model(const std::string& model_dir, const std::string& numerics = "hf");

// Where the engine runs: --device (auto: CUDA when this build has it and a GPU is visible, else the CPU; cpu;
// cuda; cuda:N) and, on CUDA, --dtype (bf16, the default, or f32: the exact mode; auto = bf16).
struct BackendOptions {
  std::string device = "auto";
  std::string dtype = "auto";
  std::string numerics = "hf";
  double gpu_memory_utilization = 0.9;  // CUDA: the share of device memory weights + cache may use
  // vLLM's --load-format: "auto" reads the checkpoint; "dummy" gives random weights (random_init.h, `dummy_seed`)
  // of the config at the model path (a directory holding config.json, or a config .json file) and reads no
  // safetensors: benchmark any shape without writing a checkpoint.
  std::string load_format = "auto";
  uint64_t dummy_seed = 0;
  // --expert-bits: "auto" keeps the routed experts as stored; "3.5" / "2.5" requantizes them at load
  // (model/weights.h RequantizedExpertsSource). The CPU backend holds them so; the GPU backend still decodes
  // every weight to its bf16 / fp32 dtype at upload (a low-bit expert GEMM is issue 7's next step).
  std::string expert_bits = "auto";
  // vLLM's --kv-cache-dtype: "auto" (= "bf16": the backend's entries, bf16 on CUDA, fp32 on the CPU) or "fp8"
  // ("fp8_e4m3"): DeepSeek's FP8 main K=V entries (ModelConfig::fp8_kv_cache; 584 bytes an entry on CUDA
  // against bf16's 1024, simulated in fp32 on the CPU).
  std::string kv_cache_dtype = "auto";
  // CUDA expert parallelism (--data-parallel-size N --enable-expert-parallel on a CUDA device): N models, each
  // holding its partition of the routed experts, connected at load. Rank r runs on device base + r through NCCL
  // (one thread per GPU in this process, NcclCommunicator::for_devices) when that many GPUs are visible, else every
  // rank shares the base device through the device in-process group (a test setup, not a speed-up). Each rank's
  // collectives run under the --dist-timeout deadline.
  int expert_parallel_ranks = 1;
  double dist_timeout_seconds = 600;
  // One process per rank (cli/rank_processes.h): this process loads only rank `expert_parallel_rank` of
  // expert_parallel_ranks and joins the others through NCCL with `nccl_unique_id` (ncclGetUniqueId's bytes, made
  // by rank 0). -1: every rank in this process, as above.
  int expert_parallel_rank = -1;
  std::string nccl_unique_id;
  // Ranks in other processes share this process's device: its KV cache gets 1/processes_per_device of what
  // --gpu-memory-utilization gives, less its own weights (the device's other users are the other ranks).
  int processes_per_device = 1;
};

// The CUDA device --device selects (auto: device 0 when this build has CUDA, a GPU is visible and the numerics are
// hf; cuda: 0; cuda:N: N), or -1 for the CPU. Throws dsv4::Error for a malformed value, or CUDA in a build without it.
int cuda_device_index(const BackendOptions& options);

// --kv-cache-dtype (vLLM's flag): "auto" / "bf16" give false, "fp8" / "fp8_e4m3" true (ModelConfig::fp8_kv_cache:
// FP8 main entries and index keys); anything else throws dsv4::Error naming the flag and the value.
bool parse_fp8_kv_cache(const std::string& kv_cache_dtype);

// A model ready for the engine. `cpu_model` is set (and `backend` wraps it) on the CPU.
struct LoadedBackend {
  std::unique_ptr<DeepseekV4Model> cpu_model;
  std::unique_ptr<ModelBackend> backend;
  bool on_cuda = false;
  // How the CUDA backend holds the weights (bf16 or fp32; routed experts kept MXFP4 or requantized to 3.5 / 2.5
  // bits): the weights of `bench latency --roofline` (cache/decode_roofline.h). The opt-in FP8 projections
  // (DSV4_FP8_WEIGHTS=1) are counted in the dense dtype.
  WeightFormat held_weights{32.0, false, 32.0};
  // KV-cache bytes for the engine: `requested_bytes` on the CPU (or when given explicitly, > 0), else on CUDA
  // what --gpu-memory-utilization leaves after the weights and a step of `max_batched_tokens`.
  // Records in `cache_from_utilization` which of the two it chose.
  int64_t cache_bytes(int64_t requested_bytes, bool explicitly_requested, int64_t max_batched_tokens);
  // Whether the last cache_bytes sized the cache from --gpu-memory-utilization (a worker process then sizes its
  // own the same way; cli/rank_processes.h).
  bool cache_from_utilization = false;
  double gpu_memory_utilization = 0.9;
  int processes_per_device = 1;
  // Data-parallel ranks 1.. (make_serving_engine): their own CPU backends over cpu_model's weights, or with
  // expert parallelism over their own models (each holding its partition of the routed experts) and the group
  // that connects the ranks' MoE sublayers.
  std::vector<std::unique_ptr<ModelBackend>> extra_rank_backends;
  std::vector<std::unique_ptr<DeepseekV4Model>> extra_rank_models;
  // CUDA expert parallelism: device resources of the transport (the device in-process group's streams; declared
  // first so they go last), and how many ranks share one device (their KV caches split its memory).
  std::shared_ptr<void> transport_resources;
  int ranks_per_device = 1;
  std::unique_ptr<parallel::InProcessGroup> expert_group;
  std::vector<std::unique_ptr<parallel::Communicator>> expert_communicators;
};
// On CUDA the weights are streamed (model/weights.h ModelWeightSource): host memory holds one layer at a time,
// so a model whose fp32 copy exceeds host memory loads.
LoadedBackend load_backend(const std::string& model_dir, const BackendOptions& options);

// The engine generate and serve drive: an Engine over loaded.backend, or for data_parallel_size > 1 a
// DataParallelEngine (engine/data_parallel_engine.h) whose rank 0 runs loaded.backend and ranks 1.. CPU
// backends over the same read-only weights, each rank with its own KV cache of config.kv_cache_bytes.
// `loaded` must outlive the engine. Throws dsv4::Error for data_parallel_size > 1 on CUDA without `processes`
// (one process drives several CUDA models only for expert parallelism).
// expert_parallel (vLLM's --enable-expert-parallel): the routed experts split over the ranks
// (DeepseekV4Model::set_expert_parallel over one in-process group, each rank keeping only its partition), the
// ranks stepping in lockstep. CPU backend and hf numerics only. Each rank's collectives run under a deadline of
// dist_timeout_seconds (parallel/deadline_communicator.h, SGLang's --dist-timeout): a rank that hangs makes the
// others fail their requests with that error instead of waiting for ever.
// `processes` (--data-parallel-backend mp, cli/rank_processes.h): ranks 1.. run in the worker processes it started;
// `loaded` is rank 0 alone.
constexpr double kDefaultDistTimeoutSeconds = 600;
class RankProcesses;
std::unique_ptr<ServingEngine> make_serving_engine(LoadedBackend& loaded, const EngineConfig& config,
                                                   int data_parallel_size, bool expert_parallel = false,
                                                   double dist_timeout_seconds = kDefaultDistTimeoutSeconds,
                                                   RankProcesses* processes = nullptr);

// The tokenizer for text in/out: `explicit_path`, else the model directory's tokenizer.json, else the DeepSeek
// tokenizer that scripts/setup.sh installs next to this checkout. Throws dsv4::Error when none is found.
Tokenizer load_tokenizer(const std::string& explicit_path, const std::string& model_dir);

}  // namespace dsv4::cli
