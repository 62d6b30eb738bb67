// Phase timestamps inside a kernel, for measurement builds only (cmake -DDSV4_CUDA_PHASE_PROBE=ON; docs/testing.md).
// The CUPTI trace (kernel_trace.h) gives each kernel's start and end, and under PDL the start is the early launch,
// not the moment its inputs are ready: it cannot say whether a 7 µs kernel waits, loads, reduces or syncs. Here one
// chosen thread of one chosen CTA reads the SM clock and the global nanosecond timer at named points and prints
// them (device printf, also inside a CUDA graph) for a window of calls of that probe, e.g. one decode step's
// mHC hand-over in steady state. Without the option every call below compiles to nothing.
#pragma once
#include <cstdint>
#ifdef DSV4_CUDA_PHASE_PROBE
#include <cstdio>
#endif

#ifndef DSV4_CUDA_PHASE_PROBE_FIRST
#define DSV4_CUDA_PHASE_PROBE_FIRST 700  // the first call printed, per probe
#endif
#ifndef DSV4_CUDA_PHASE_PROBE_CALLS
#define DSV4_CUDA_PHASE_PROBE_CALLS 200  // calls printed from there
#endif

namespace dsv4::ops::cuda {

// One counter per probe id; the ids of a translation unit are its own (the counters are per-TU statics).
enum PhaseProbeId : int {
  kProbeHcPost = 0,
  kProbeHcMix = 1,
  kProbeHcFinishHead = 2,    // finish_kernel's thread 0: staging, split sums, pre, Sinkhorn
  kProbeHcFinishCollapse = 3,  // its first collapsing thread: collapse, norm
  kProbeHcHandover = 4,        // the one-launch hand-over's CTA (0, 0)
  kProbeIds = 8,
};

#ifdef DSV4_CUDA_PHASE_PROBE
static __device__ unsigned phase_probe_calls[kProbeIds];

class PhaseProbe {
 public:
  static constexpr int kMarks = 10;
  // `recorder`: whether the calling thread is the one that records (true in exactly one thread of the grid).
  __device__ PhaseProbe(PhaseProbeId id, bool recorder) : id_(id), on_(recorder) {
    if (!on_) return;
    call_ = atomicAdd(&phase_probe_calls[id_], 1u);
    on_ = call_ >= DSV4_CUDA_PHASE_PROBE_FIRST && call_ < DSV4_CUDA_PHASE_PROBE_FIRST + DSV4_CUDA_PHASE_PROBE_CALLS;
    if (on_) start_ns_ = global_ns(), start_clock_ = clock64();
  }
  __device__ void mark() {
    if (on_ && marks_ < kMarks) cycles_[marks_++] = clock64() - start_clock_;
  }
  // One line: probe, call, grid, start and end (global ns), then each mark in SM cycles from the start.
  __device__ void report(const char* name) {
    if (!on_) return;
    const unsigned long long end_ns = global_ns();
    char text[160];
    int length = 0;
    for (int i = 0; i < marks_ && length < 140; ++i) length += format_cycles(text + length, cycles_[i]);
    text[length] = '\0';
    printf("phase_probe %s call=%u grid=%u,%u block=%u start_ns=%llu end_ns=%llu cycles=%s\n", name, call_, gridDim.x,
           gridDim.y, blockDim.x, start_ns_, end_ns, text);
  }

 private:
  static __device__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
  }
  // " 1234" into text (device code has no snprintf); returns the characters written.
  static __device__ int format_cycles(char* text, long long value) {
    char digits[20];
    int n = 0;
    unsigned long long v = value < 0 ? 0 : static_cast<unsigned long long>(value);
    do digits[n++] = static_cast<char>('0' + v % 10), v /= 10;
    while (v != 0 && n < 19);
    text[0] = ' ';
    for (int i = 0; i < n; ++i) text[1 + i] = digits[n - 1 - i];
    return n + 1;
  }
  int id_;
  bool on_;
  unsigned call_ = 0;
  int marks_ = 0;
  unsigned long long start_ns_ = 0;
  long long start_clock_ = 0;
  long long cycles_[kMarks] = {};
};
#else
class PhaseProbe {
 public:
  __device__ PhaseProbe(PhaseProbeId, bool) {}
  __device__ void mark() {}
  __device__ void report(const char*) {}
};
#endif

}  // namespace dsv4::ops::cuda
