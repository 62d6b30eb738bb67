// Every kernel the process runs on the GPU, as it ran: CUPTI's concurrent-kernel activity records (launches inside
// CUDA graphs included, nothing serialised), written as CSV when the trace stops. The columns are those of
// `nsys stats --report cuda_gpu_trace` that tools/reference/kernel_step_timeline.py reads (Start (ns), Duration (ns),
// GrdX, Strm, Name), so one decode step can be split over its kernels where nsys cannot run: the lent machines'
// nsys cannot import its own reports (session 31), and ncu times kernels one at a time, serialised.
//
// Enabled by DSV4_KERNEL_TRACE=FILE (the `dsv4` command reads it at start). CUPTI is loaded at run time
// (dlopen: DSV4_CUPTI_LIBRARY, else libcupti.so / .so.13 / .so.12), so nothing links against it.
#pragma once
#include <memory>
#include <string>

namespace dsv4::ops::cuda {

class KernelTrace {
 public:
  // Starts recording into `path`; throws dsv4::Error when CUPTI cannot be loaded or refuses.
  explicit KernelTrace(std::string path);
  // Flushes CUPTI's buffers and writes the CSV (kernels sorted by start).
  ~KernelTrace();
  KernelTrace(const KernelTrace&) = delete;
  KernelTrace& operator=(const KernelTrace&) = delete;

  // A trace into $DSV4_KERNEL_TRACE, or nullptr when it is unset or empty.
  static std::unique_ptr<KernelTrace> start_from_env();

 private:
  std::string path_;
};

}  // namespace dsv4::ops::cuda
