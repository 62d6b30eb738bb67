#include "parallel/deadline_communicator.h"

#include <utility>

#include "core/error.h"

namespace dsv4::parallel {

DeadlineCommunicator::DeadlineCommunicator(std::unique_ptr<Communicator> inner, std::chrono::milliseconds deadline)
    : inner_(std::move(inner)), deadline_(deadline) {
  DSV4_CHECK(inner_ != nullptr, "DeadlineCommunicator needs a transport");
  DSV4_CHECK(deadline_.count() > 0, "a collective deadline must be positive");
  watchdog_ = std::thread([this] { watch(); });
}

DeadlineCommunicator::~DeadlineCommunicator() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  watchdog_.join();
}

template <typename Call>
auto DeadlineCommunicator::guarded(Call&& call) -> decltype(call()) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    running_ = true;
    ++started_;
    began_ = std::chrono::steady_clock::now();
  }
  wake_.notify_all();
  struct Done {
    DeadlineCommunicator& self;
    ~Done() {
      std::lock_guard<std::mutex> lock(self.mutex_);
      self.running_ = false;
    }
  } done{*this};
  return call();
}

void DeadlineCommunicator::watch() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stopping_) {
    if (!running_) {
      wake_.wait(lock, [&] { return stopping_ || running_; });
      continue;
    }
    const uint64_t timed = started_;
    const auto expires = began_ + deadline_;
    if (wake_.wait_until(lock, expires, [&] { return stopping_ || !running_ || started_ != timed; })) continue;
    // The same collective is still running past its deadline: a peer died or hangs. Abort outside the lock (the
    // transport's abort wakes this rank's blocked call, which then takes the lock on its way out).
    const std::string reason = "a collective waited more than " + std::to_string(deadline_.count()) +
                               " ms for the other ranks (--dist-timeout): a peer rank died or hangs";
    lock.unlock();
    inner_->abort(reason);
    lock.lock();
    // Aborted for good: every later collective throws at once, so nothing is left to time.
    wake_.wait(lock, [&] { return stopping_; });
  }
}

void DeadlineCommunicator::all_to_all_v(const void* send, std::span<const int64_t> send_bytes, void* recv,
                                        std::span<const int64_t> recv_bytes) {
  guarded([&] { inner_->all_to_all_v(send, send_bytes, recv, recv_bytes); });
}

std::vector<int64_t> DeadlineCommunicator::exchange_counts(std::span<const int64_t> send_counts) {
  return guarded([&] { return inner_->exchange_counts(send_counts); });
}

void DeadlineCommunicator::synchronize() {
  guarded([&] { inner_->synchronize(); });
}

}  // namespace dsv4::parallel
