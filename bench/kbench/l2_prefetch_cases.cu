// kbench suite "l2_prefetch": what the decode step's L2 prefetch (ops/cuda/l2_prefetch.h) buys one projection. A
// decode GEMV (Gemm::linear, the skinny kernel at one row) runs after an idle gap on its stream — an L2-flushed
// stand-in for the mHC hand-over or the attention core, a spinning one-thread kernel of kGapMicroseconds — while
// a side stream forked before the gap prefetches the first N MB of its weight. Time = gap + GEMM; the note gives
// the GEMM's share (time − the gap alone). Bytes = the weight's.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "../../tests/ops/cuda/device_problem.h"
#include "kbench.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/l2_prefetch.h"

namespace dsv4::kbench {
namespace {

constexpr double kGapMicroseconds = 15.0;  // about one mHC hand-over at batch 1 (docs/PERF.md)

__global__ void idle_gap_kernel(uint64_t nanoseconds) {
  uint64_t start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < nanoseconds);
}

__global__ void fill_weights(__nv_bfloat16* out, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 0x9E3779B1u;
    h ^= h >> 15;
    h *= 0x2C1B3C6Du;
    out[i] = __float2bfloat16((static_cast<float>(h >> 8) * 0x1p-24f - 0.5f) * 0.1f);
  }
}

std::vector<CaseResult> l2_prefetch_suite(const Ceilings&, const Options& options) {
  struct Shape {
    const char* name;
    int64_t in, out;
  };
  const std::vector<Shape> shapes = {{"wq_b", 1024, 32768}, {"wq_a", 4096, 1024}, {"wo_b", 8192, 4096}};
  const std::vector<int> megabytes = options.quick ? std::vector<int>{0, 16} : std::vector<int>{0, 8, 16, 24, 32};
  const int iterations = options.quick ? 5 : 30;
  const size_t max_weight = size_t{32768} * 1024;
  __nv_bfloat16 *w = nullptr, *x = nullptr;
  float* y = nullptr;
  DSV4_CUDA_OK(cudaMalloc(&w, max_weight * 2));
  DSV4_CUDA_OK(cudaMalloc(&x, 8192 * 2));
  DSV4_CUDA_OK(cudaMalloc(&y, 32768 * 4));
  fill_weights<<<2048, 256>>>(w, max_weight);
  fill_weights<<<8, 256>>>(x, 8192);
  DSV4_CUDA_OK(cudaDeviceSynchronize());
  cudaStream_t side = nullptr;
  cudaEvent_t fork = nullptr, join = nullptr;
  DSV4_CUDA_OK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  DSV4_CUDA_OK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  DSV4_CUDA_OK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  const auto gap_ns = static_cast<uint64_t>(kGapMicroseconds * 1000);
  auto gap = [&] { idle_gap_kernel<<<1, 1>>>(gap_ns); };
  const double gap_us = time_kernel_us(gap, iterations);
  std::vector<CaseResult> results;
  ops::cuda::Gemm gemm;
  for (const Shape& s : shapes) {
    const ops::cuda::GemmWeight weight{w, ops::cuda::GemmDtype::kBf16, s.out, s.in, 0};
    const size_t weight_bytes = static_cast<size_t>(s.out * s.in) * 2;
    for (const int mb : megabytes) {
      char name[128];
      std::snprintf(name, sizeof name, "%s %lld->%lld r1 after a %.0f us gap, %d MB prefetched", s.name,
                    static_cast<long long>(s.in), static_cast<long long>(s.out), kGapMicroseconds, mb);
      if (!options.wants(name)) continue;
      ops::cuda::L2PrefetchParams ranges;
      size_t budget = size_t(mb) << 20;
      ranges.add(w, weight_bytes, budget);
      auto call = [&] {
        DSV4_CUDA_OK(cudaEventRecord(fork, nullptr));
        DSV4_CUDA_OK(cudaStreamWaitEvent(side, fork));
        DSV4_CUDA_OK(ops::cuda::prefetch_to_l2(ranges, side));
        DSV4_CUDA_OK(cudaEventRecord(join, side));
        gap();
        gemm.linear(weight, x, 1, y, nullptr);
        DSV4_CUDA_OK(cudaStreamWaitEvent(nullptr, join));
      };
      const double us = time_kernel_us(call, iterations);
      char note[160];
      std::snprintf(note, sizeof note, "GEMM after the gap %.2f us (gap alone %.2f); %.1f of %.1f MB prefetched",
                    us - gap_us, gap_us, static_cast<double>(std::min(size_t(mb) << 20, weight_bytes)) / (1 << 20),
                    static_cast<double>(weight_bytes) / (1 << 20));
      results.push_back({name, us, 2.0 * s.in * s.out, static_cast<double>(weight_bytes), note});
    }
  }
  cudaEventDestroy(fork);
  cudaEventDestroy(join);
  cudaStreamDestroy(side);
  cudaFree(w);
  cudaFree(x);
  cudaFree(y);
  return results;
}

const bool registered = register_suite("l2_prefetch", l2_prefetch_suite);

}  // namespace
}  // namespace dsv4::kbench
