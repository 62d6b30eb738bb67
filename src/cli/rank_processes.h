// One process per data-parallel rank (issue 9, `--data-parallel-backend mp`, vLLM's name): the serving process is
// rank 0 (its HTTP front, its router, its own engine) and starts ranks 1..N-1 as worker processes of the same
// binary (`dsv4 data-parallel-worker`, hidden), each connected to it by a socketpair. Over that connection
// (engine/rank_protocol.h framing) the front sends a worker its load options, then its engine config; the worker
// answers "ready" and from then on serves its rank (engine/remote_rank_engine.h serve_rank).
//
// Expert parallelism across the processes runs on NCCL: the front calls ncclGetUniqueId and hands the id to every
// worker with its load options; each process then joins the communicator as its rank (NCCL's own bootstrap over
// loopback connects them) and keeps only its partition of the routed experts.
//
// Lifetimes: a worker dies with the front (PR_SET_PDEATHSIG) and returns when its connection closes; a worker
// that dies fails its rank's requests at once (DataParallelEngine). Which GPU: rank r takes cuda:(base + r) when
// that many devices are visible, else every rank shares the base device, each process with 1/N of the memory
// that --gpu-memory-utilization gives (a test setup; NCCL refuses two ranks on one device, so expert parallelism
// needs a GPU per rank).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "cli/model_loading.h"
#include "engine/rank_engine.h"

namespace dsv4::cli {

// --data-parallel-backend: "threads" (every rank in this process), "mp" (a process per rank) or "auto": mp on CUDA
// when it can run there (plain data parallelism, or expert parallelism with a GPU per rank), threads otherwise.
bool use_rank_processes(const std::string& backend, const BackendOptions& options, int data_parallel_size,
                        bool expert_parallel);

class RankProcesses {
 public:
  // Starts ranks 1..size-1 and sends each its load options (so they load while this process loads rank 0).
  // With expert parallelism, sets `options` up for rank 0 of the NCCL group (the id the workers got). Throws
  // dsv4::Error for what cannot run as processes (expert parallelism on the CPU or on a shared GPU).
  RankProcesses(const std::string& model_dir, BackendOptions& options, int size, bool expert_parallel);
  // Ends the workers that are still owned here (before make_engine hands them over).
  ~RankProcesses();
  RankProcesses(const RankProcesses&) = delete;
  RankProcesses& operator=(const RankProcesses&) = delete;

  // Sends every worker its engine config (`config` as rank 0 runs it; a worker whose cache this process sized by
  // --gpu-memory-utilization sizes its own) and waits for each to be ready. Throws dsv4::Error naming the rank
  // when a worker failed to load or start. The returned engines own the workers.
  std::vector<std::unique_ptr<RankEngine>> connect(const EngineConfig& config, bool cache_from_utilization,
                                                   bool lockstep);
  int size() const { return size_; }

 private:
  struct Worker {
    int fd = -1;
    int pid = 0;
  };
  // Closes, kills and reaps the workers still owned here.
  void end_workers();
  int size_ = 1;
  std::vector<Worker> workers_;  // ranks 1..size-1
};

// `dsv4 data-parallel-worker --control-fd FD`: a worker's main (the front starts it; not for users).
int data_parallel_worker(int control_fd);

}  // namespace dsv4::cli
