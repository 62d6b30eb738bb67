#include "cli/rank_processes.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "engine/data_parallel_engine.h"
#include "engine/rank_protocol.h"
#include "engine/remote_rank_engine.h"
#ifdef DSV4_HAVE_CUDA
#include <cuda_runtime.h>

#include "model/cuda/deepseek_v4_cuda.h"
#ifdef DSV4_HAVE_NCCL
#include "parallel/nccl_communicator.h"
#endif
#endif

namespace dsv4::cli {
namespace {

using nlohmann::json;

int visible_cuda_devices() {
#ifdef DSV4_HAVE_CUDA
  int count = 0;
  if (cudaGetDeviceCount(&count) == cudaSuccess) return count;
#endif
  return 0;
}

constexpr bool kHaveNccl =
#ifdef DSV4_HAVE_NCCL
    true;
#else
    false;
#endif

std::string to_hex(const std::string& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (const unsigned char byte : bytes) {
    out.push_back(digits[byte >> 4]);
    out.push_back(digits[byte & 15]);
  }
  return out;
}

std::string from_hex(const std::string& hex) {
  DSV4_CHECK(hex.size() % 2 == 0, "an odd-length hex string");
  auto value = [](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    throw Error("a hex string with a non-hex character");
  };
  std::string out;
  for (size_t i = 0; i < hex.size(); i += 2) out.push_back(static_cast<char>(value(hex[i]) * 16 + value(hex[i + 1])));
  return out;
}

json encode_backend_options(const BackendOptions& o) {
  return {{"device", o.device},
          {"dtype", o.dtype},
          {"numerics", o.numerics},
          {"gpu_memory_utilization", o.gpu_memory_utilization},
          {"load_format", o.load_format},
          {"dummy_seed", o.dummy_seed},
          {"expert_bits", o.expert_bits},
          {"kv_cache_dtype", o.kv_cache_dtype},
          {"expert_parallel_ranks", o.expert_parallel_ranks},
          {"dist_timeout_seconds", o.dist_timeout_seconds},
          {"expert_parallel_rank", o.expert_parallel_rank},
          {"nccl_unique_id", to_hex(o.nccl_unique_id)},
          {"processes_per_device", o.processes_per_device}};
}

BackendOptions decode_backend_options(const json& in) {
  BackendOptions o;
  o.device = in.at("device").get<std::string>();
  o.dtype = in.at("dtype").get<std::string>();
  o.numerics = in.at("numerics").get<std::string>();
  o.gpu_memory_utilization = in.at("gpu_memory_utilization").get<double>();
  o.load_format = in.at("load_format").get<std::string>();
  o.dummy_seed = in.at("dummy_seed").get<uint64_t>();
  o.expert_bits = in.at("expert_bits").get<std::string>();
  o.kv_cache_dtype = in.at("kv_cache_dtype").get<std::string>();
  o.expert_parallel_ranks = in.at("expert_parallel_ranks").get<int>();
  o.dist_timeout_seconds = in.at("dist_timeout_seconds").get<double>();
  o.expert_parallel_rank = in.at("expert_parallel_rank").get<int>();
  o.nccl_unique_id = from_hex(in.at("nccl_unique_id").get<std::string>());
  o.processes_per_device = in.at("processes_per_device").get<int>();
  return o;
}

json encode_engine_config(const EngineConfig& c) {
  return {{"max_num_seqs", c.max_num_seqs},
          {"max_num_batched_tokens", c.max_num_batched_tokens},
          {"max_model_len", c.max_model_len},
          {"long_prefill_token_threshold", c.long_prefill_token_threshold},
          {"kv_cache_bytes", c.kv_cache_bytes},
          {"enable_prefix_caching", c.enable_prefix_caching},
          {"checkpoint_interval", c.checkpoint_interval}};
}

EngineConfig decode_engine_config(const json& in) {
  EngineConfig c;
  c.max_num_seqs = in.at("max_num_seqs").get<int64_t>();
  c.max_num_batched_tokens = in.at("max_num_batched_tokens").get<int64_t>();
  c.max_model_len = in.at("max_model_len").get<int64_t>();
  c.long_prefill_token_threshold = in.at("long_prefill_token_threshold").get<int64_t>();
  c.kv_cache_bytes = in.at("kv_cache_bytes").get<int64_t>();
  c.enable_prefix_caching = in.at("enable_prefix_caching").get<bool>();
  c.checkpoint_interval = in.at("checkpoint_interval").get<int64_t>();
  return c;
}

// Starts `dsv4 data-parallel-worker --control-fd N` on the far end of a new socketpair; returns the near end and
// the pid.
std::pair<int, pid_t> spawn_worker() {
  int fds[2];
  DSV4_CHECK(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) == 0,
             "cannot create a socketpair for a data-parallel worker");
  const pid_t parent = ::getpid();
  const std::string fd_text = std::to_string(fds[1]);
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(fds[0]);
    ::close(fds[1]);
    throw Error("cannot fork a data-parallel worker");
  }
  if (pid == 0) {  // the child: async-signal-safe calls only until exec
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // dies with the front
    if (::getppid() != parent) ::_exit(1);
    ::fcntl(fds[1], F_SETFD, 0);  // the worker's end survives exec; every other descriptor here is CLOEXEC
    const char* argv[] = {"dsv4", "data-parallel-worker", "--control-fd", fd_text.c_str(), nullptr};
    ::execv("/proc/self/exe", const_cast<char* const*>(argv));
    ::_exit(127);
  }
  ::close(fds[1]);
  return {fds[0], pid};
}

}  // namespace

bool use_rank_processes(const std::string& backend, const BackendOptions& options, int data_parallel_size,
                        bool expert_parallel) {
  DSV4_CHECK(backend == "auto" || backend == "mp" || backend == "threads",
             "--data-parallel-backend '" + backend + "': expected auto, mp or threads");
  if (data_parallel_size <= 1 || backend == "threads") return false;
  if (backend == "mp") return true;
  const int base = cuda_device_index(options);
  if (base < 0) return false;  // the CPU's ranks share weights in one process
  if (!expert_parallel) return true;
  return kHaveNccl && visible_cuda_devices() - base >= data_parallel_size;
}

RankProcesses::RankProcesses(const std::string& model_dir, BackendOptions& options, int size, bool expert_parallel)
    : size_(size) {
  DSV4_CHECK(size >= 1, "--data-parallel-size " + std::to_string(size) + ": must be >= 1");
  const int base = cuda_device_index(options);
  const bool gpu_per_rank = base >= 0 && visible_cuda_devices() - base >= size;
  if (expert_parallel && size > 1) {
    DSV4_CHECK(base >= 0 && kHaveNccl,
               "--enable-expert-parallel with --data-parallel-backend mp needs CUDA and NCCL: the CPU backend's "
               "ranks exchange rows in one process (--data-parallel-backend threads)");
    DSV4_CHECK(gpu_per_rank, "--enable-expert-parallel with --data-parallel-backend mp needs a GPU per rank (" +
                                 std::to_string(visible_cuda_devices() - base) + " visible from cuda:" +
                                 std::to_string(base) +
                                 "); NCCL refuses two ranks on one device: use --data-parallel-backend threads");
#ifdef DSV4_HAVE_NCCL
    options.nccl_unique_id = parallel::NcclCommunicator::new_unique_id();
#endif
    options.expert_parallel_ranks = size;
    options.expert_parallel_rank = 0;
  }
  if (base >= 0 && !gpu_per_rank) {
    options.processes_per_device = size;
    std::fprintf(stderr,
                 "dsv4: %d data-parallel rank processes share cuda:%d (%d device(s) visible from it): a test "
                 "setup, each with 1/%d of the memory --gpu-memory-utilization gives\n",
                 size, base, visible_cuda_devices() - base, size);
  }
  if (base >= 0) options.device = "cuda:" + std::to_string(base);
  try {
    for (int r = 1; r < size; ++r) {
      const auto [fd, pid] = spawn_worker();
      workers_.push_back({fd, pid});
      BackendOptions rank_options = options;
      if (base >= 0) rank_options.device = "cuda:" + std::to_string(gpu_per_rank ? base + r : base);
      if (expert_parallel && size > 1) rank_options.expert_parallel_rank = r;
      rank_protocol::send_message(fd, {{"rank", r}, {"model_dir", model_dir},
                                       {"backend", encode_backend_options(rank_options)}});
    }
  } catch (...) {
    end_workers();
    throw;
  }
}

RankProcesses::~RankProcesses() { end_workers(); }

void RankProcesses::end_workers() {
  for (Worker& worker : workers_) {
    if (worker.fd < 0) continue;  // handed over to its RemoteRankEngine
    ::close(worker.fd);
    ::kill(worker.pid, SIGKILL);
    ::waitpid(worker.pid, nullptr, 0);
    worker.fd = -1;
  }
}

std::vector<std::unique_ptr<RankEngine>> RankProcesses::connect(const EngineConfig& config, bool cache_from_utilization,
                                                                bool lockstep) {
  for (const Worker& worker : workers_) {
    try {
      rank_protocol::send_message(worker.fd, {{"config", encode_engine_config(config)},
                                              {"cache_from_utilization", cache_from_utilization},
                                              {"lockstep", lockstep}});
    } catch (const std::exception&) {  // it failed to load and said why: read that below
    }
  }
  std::vector<std::unique_ptr<RankEngine>> engines;
  for (size_t i = 0; i < workers_.size(); ++i) {
    Worker& worker = workers_[i];
    const std::string who = "data-parallel rank " + std::to_string(i + 1) + " (pid " + std::to_string(worker.pid) + ")";
    std::optional<json> reply;
    try {
      reply = rank_protocol::receive_message(worker.fd);
    } catch (const std::exception& error) {
      throw Error(who + " failed to start: " + error.what());
    }
    DSV4_CHECK(reply.has_value(), who + " exited before it was ready");
    if (reply->contains("error")) throw Error(who + " failed to start: " + reply->at("error").get<std::string>());
    DSV4_CHECK(reply->contains("max_model_len") && reply->contains("stats"), who + " sent no ready message");
    engines.push_back(std::make_unique<RemoteRankEngine>(worker.fd, worker.pid,
                                                         reply->at("max_model_len").get<int64_t>(),
                                                         rank_protocol::decode_stats(reply->at("stats"))));
    worker.fd = -1;  // the engine owns the connection and the process now
  }
  return engines;
}

int data_parallel_worker(int control_fd) {
  int rank = 0;
  try {
    const std::optional<json> load = rank_protocol::receive_message(control_fd);
    if (!load) return 1;  // the front is gone
    rank = load->at("rank").get<int>();
    const BackendOptions options = decode_backend_options(load->at("backend"));
    const std::string model_dir = load->at("model_dir").get<std::string>();
    LoadedBackend loaded = load_backend(model_dir, options);
    const std::optional<json> engine_message = rank_protocol::receive_message(control_fd);
    if (!engine_message) return 1;
    EngineConfig config = decode_engine_config(engine_message->at("config"));
    if (engine_message->at("cache_from_utilization").get<bool>())
      config.kv_cache_bytes = loaded.cache_bytes(config.kv_cache_bytes, false, config.max_num_batched_tokens);
    LocalRankEngine engine(*loaded.backend,
                           DataParallelEngine::rank_config(config, engine_message->at("lockstep").get<bool>()));
    rank_protocol::send_message(control_fd, {{"max_model_len", engine.max_model_len()},
                                             {"stats", rank_protocol::encode(engine.stats())}});
    serve_rank(control_fd, rank, engine);
    return 0;
  } catch (const std::exception& error) {
    try {
      rank_protocol::send_message(control_fd, {{"error", error.what()}});
    } catch (const std::exception&) {
    }
    std::fprintf(stderr, "dsv4 data-parallel-worker (rank %d): %s\n", rank, error.what());
    return 1;
  }
}

}  // namespace dsv4::cli
