// A data-parallel rank in a worker process of its own (issue 9: one process per GPU). The front's rank thread
// drives a RemoteRankEngine exactly as it drives a LocalRankEngine; each call is one request / reply over a
// connected stream socket (engine/rank_protocol.h), and the worker answers it by calling the same method of its
// LocalRankEngine (serve_rank). A worker that dies closes the socket, so the rank thread's next call throws
// and the rank fails at once, its requests finished with the error; nothing waits for a deadline.
#pragma once
#include <sys/types.h>

#include <unordered_set>

#include "engine/rank_engine.h"

namespace dsv4 {

class RemoteRankEngine final : public RankEngine {
 public:
  // `fd`: the connected socket (owned: closed by the destructor); `worker_pid` the worker process (ended by
  // abort_collectives and the destructor when it has not stopped), or 0 for a worker this process does not own
  // (a thread, in tests); `max_model_len` and `stats` as the worker reported them once its engine was built.
  RemoteRankEngine(int fd, pid_t worker_pid, int64_t max_model_len, EngineStats stats);
  // Asks the worker to stop, waits for it (a few seconds, then SIGKILL) and closes the socket.
  ~RemoteRankEngine() override;
  RemoteRankEngine(const RemoteRankEngine&) = delete;
  RemoteRankEngine& operator=(const RemoteRankEngine&) = delete;

  void check_request(RequestId id, std::span<const int32_t> prompt, const SamplingParams& params) const override;
  int64_t max_model_len() const override { return max_model_len_; }
  void set_request_checker(const RankEngine* twin) override { twin_ = twin; }
  bool apply(std::deque<RankCommand> commands, RankReport& report) override;
  void step(bool forward, RankReport& report) override;
  void apply_and_step(std::deque<RankCommand> commands, RankReport& report) override;
  bool has_unfinished() const override { return has_work_; }
  bool connection_lost() const override;  // the worker closed its end (poll, no read)
  EngineStats stats() const override { return stats_; }
  // Finishes the requests the worker held (as the front knows them) and ends the worker.
  void fail(const std::string& error, RankReport& report) override;
  // Ends the worker process (SIGKILL): it may be waiting in a collective for a rank that failed.
  void abort_collectives(const std::string& reason) override;

 private:
  // Sends `message`, reads the reply into `report`; throws dsv4::Error when the worker failed or is gone.
  void call(const nlohmann::json& message, RankReport& report);
  nlohmann::json encode_commands(const std::deque<RankCommand>& commands);

  int fd_ = -1;
  pid_t worker_pid_ = 0;
  int64_t max_model_len_ = 0;
  EngineStats stats_;
  bool has_work_ = false;
  const RankEngine* twin_ = nullptr;
  std::unordered_set<RequestId> held_;  // front ids added to the worker and not finished there
};

// The worker's side: answers the front's requests on `fd` with `engine` until the front says stop or closes
// the connection. A failing step is replied as an error, then the worker returns (its process ends; in lockstep
// its backend's collectives are aborted first, so peers in this process are not left waiting).
void serve_rank(int fd, int rank, RankEngine& engine);

}  // namespace dsv4
