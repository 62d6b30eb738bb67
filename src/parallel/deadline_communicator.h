// Abort on a deadline (docs/parallel.md "Failure across processes"): a rank whose peer died or hangs waits in a
// collective for ever — NCCL's kernels spin, the in-process group's barrier never fills. DeadlineCommunicator
// wraps a rank's transport and runs a watchdog thread: a collective (all_to_all_v, exchange_counts,
// synchronize) still waiting `deadline` after it began aborts the rank's transport with an error that says so.
// The in-process group then releases every waiting rank with that error; NCCL's abort (ncclCommAbort from the
// watchdog thread, as torch's NCCL watchdog does) ends this rank's kernels, so the blocked call returns and
// throws. The engine above fails the rank's requests with the message (engine/data_parallel_engine.h). vLLM and
// SGLang run the same watchdog around their collectives (SGLang's `--dist-timeout`, dsv4's flag too).
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "parallel/communicator.h"

namespace dsv4::parallel {

class DeadlineCommunicator final : public Communicator {
 public:
  // Throws dsv4::Error for a null transport or a deadline that is not positive.
  DeadlineCommunicator(std::unique_ptr<Communicator> inner, std::chrono::milliseconds deadline);
  ~DeadlineCommunicator() override;  // stops the watchdog
  DeadlineCommunicator(const DeadlineCommunicator&) = delete;
  DeadlineCommunicator& operator=(const DeadlineCommunicator&) = delete;

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  void all_to_all_v(const void* send, std::span<const int64_t> send_bytes, void* recv,
                    std::span<const int64_t> recv_bytes) override;
  std::vector<int64_t> exchange_counts(std::span<const int64_t> send_counts) override;
  void synchronize() override;
  void abort(const std::string& reason) override { inner_->abort(reason); }

  std::chrono::milliseconds deadline() const { return deadline_; }

 private:
  // Marks a collective as running for the watchdog while `call` runs.
  template <typename Call>
  auto guarded(Call&& call) -> decltype(call());
  void watch();

  std::unique_ptr<Communicator> inner_;
  std::chrono::milliseconds deadline_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool running_ = false, stopping_ = false;
  uint64_t started_ = 0;  // collectives begun: tells the watchdog a new one from the one it timed
  std::chrono::steady_clock::time_point began_;
  std::thread watchdog_;
};

}  // namespace dsv4::parallel
