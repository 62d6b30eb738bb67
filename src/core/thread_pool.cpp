#include "core/thread_pool.h"

#include <algorithm>
#include <cstdlib>
#include <exception>

namespace dsv4 {

ThreadPool::ThreadPool(int num_threads) {
  if (num_threads <= 0) num_threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  for (int i = 1; i < num_threads; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& worker : workers_) worker.join();
}

ThreadPool& ThreadPool::global() {
  static ThreadPool pool([] {
    const char* env = std::getenv("DSV4_NUM_THREADS");
    return env ? std::atoi(env) : 0;
  }());
  return pool;
}

void ThreadPool::parallel_for(int64_t count, const std::function<void(int64_t, int64_t)>& body, int64_t grain) {
  if (count <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  // Small loops, or a call from inside a worker's body, run inline: no nesting, no deadlock.
  if (workers_.empty() || count <= grain) {
    body(0, count);
    return;
  }
  std::unique_lock lock(mutex_);
  if (body_ != nullptr) {  // nested call from the calling thread's own range
    lock.unlock();
    body(0, count);
    return;
  }
  // Chunks of ~count/(4*threads) balance uneven work (attention rows of different lengths).
  const int64_t chunk = std::max(grain, count / (4 * static_cast<int64_t>(num_threads())) + 1);
  body_ = &body;
  count_ = count;
  grain_ = chunk;
  next_ = 0;
  error_ = nullptr;
  active_ = static_cast<int>(workers_.size());
  ++generation_;
  wake_.notify_all();
  // The calling thread works too.
  while (true) {
    if (next_ >= count_) break;
    const int64_t begin = next_, end = std::min(count_, begin + grain_);
    next_ = end;
    lock.unlock();
    try {
      body(begin, end);
    } catch (...) {
      lock.lock();
      if (!error_) error_ = std::current_exception();
      continue;
    }
    lock.lock();
  }
  done_.wait(lock, [this] { return active_ == 0; });
  body_ = nullptr;
  if (error_) std::rethrow_exception(error_);
}

void ThreadPool::worker_loop() {
  uint64_t seen = 0;
  std::unique_lock lock(mutex_);
  while (true) {
    wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
    if (stop_) return;
    seen = generation_;
    while (next_ < count_) {
      const int64_t begin = next_, end = std::min(count_, begin + grain_);
      next_ = end;
      const auto* body = body_;
      lock.unlock();
      try {
        (*body)(begin, end);
      } catch (...) {
        lock.lock();
        if (!error_) error_ = std::current_exception();
        continue;
      }
      lock.lock();
    }
    if (--active_ == 0) done_.notify_all();
  }
}

}  // namespace dsv4
