// A fixed pool of worker threads for data-parallel loops of the CPU backend (attention heads, experts,
// compressor windows). GEMMs use OpenBLAS's own threads; this pool covers the loops around them.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace dsv4 {

class ThreadPool {
 public:
  // num_threads <= 0: one per hardware thread.
  explicit ThreadPool(int num_threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls body(begin, end) over disjoint ranges covering [0, count); the calling thread takes part.
  // Ranges are at least `grain` long. Blocks until every range is done; rethrows the first exception.
  void parallel_for(int64_t count, const std::function<void(int64_t, int64_t)>& body, int64_t grain = 1);

  // The process-wide pool (sized by DSV4_NUM_THREADS or the hardware).
  static ThreadPool& global();

 private:
  void worker_loop();

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  const std::function<void(int64_t, int64_t)>* body_ = nullptr;
  int64_t count_ = 0, grain_ = 1, next_ = 0;
  int active_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

}  // namespace dsv4
