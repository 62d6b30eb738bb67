// dsv4_kbench: named kernel cases timed on the device and set against ceilings measured in the same run
// (docs/PERF.md). Each `*_cases.cu` file in this folder registers one suite; kbench_main.cu measures the
// ceilings, runs every suite (or those named with --suite) and prints one table.
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace dsv4::kbench {

// Measured at start-up on the device in hand: device-to-device copy bandwidth and a large bf16 GEMM rate.
struct Ceilings {
  double copy_bytes_per_second = 0;
  double bf16_flops_per_second = 0;
};

// One timed case. `flops` and `bytes` are per call (bytes = unique bytes read + written); the table derives
// TFLOP/s, GB/s and the fraction of the binding ceiling from them.
struct CaseResult {
  std::string name;
  double microseconds = 0;
  double flops = 0;
  double bytes = 0;
  std::string note;  // e.g. the published FlashMLA / DeepGEMM figure it is compared to
  // The math ceiling of this case in FLOP/s; 0: the bf16 GEMM rate measured at start-up. FP8 cases pass the
  // H200's dense FP8 tensor rate (kH200Fp8FlopsPerSecond: the datasheet's, not measured).
  double math_flops_per_second = 0;
};

inline constexpr double kH200Fp8FlopsPerSecond = 1979e12;

struct Options {
  bool quick = false;  // fewer iterations and the smaller contexts only (a smoke run)
  // --case NAME (repeatable): run only the cases of these exact names (e.g. to profile one under ncu); suites
  // that support it skip the others before allocating or timing anything.
  std::vector<std::string> cases;
  bool wants(const std::string& name) const {
    if (cases.empty()) return true;
    for (const std::string& c : cases)
      if (c == name) return true;
    return false;
  }
};

using Suite = std::function<std::vector<CaseResult>(const Ceilings&, const Options&)>;

// Called from a static initialiser in each *_cases.cu: `static const bool registered = register_suite(...)`.
bool register_suite(const std::string& name, Suite suite);

// Median time in microseconds of `launch` over `iterations` calls, timed with CUDA events after a warm-up, with
// the L2 flushed before each timed call when `flush_l2` (so bytes are read from HBM, as at serving time).
double time_kernel_us(const std::function<void()>& launch, int iterations, bool flush_l2 = true);

}  // namespace dsv4::kbench
