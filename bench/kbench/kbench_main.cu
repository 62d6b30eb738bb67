// dsv4_kbench: measures the device's ceilings (D2D copy bandwidth, cuBLAS bf16 GEMM rate), runs the registered
// suites (bench/kbench/*_cases.cu) and prints one table: every case against the ceiling that binds it.
//   dsv4_kbench [--quick] [--suite NAME]... [--case NAME]...
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "kbench.h"
#include "ops/cuda/device.h"

namespace dsv4::kbench {
namespace {

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    std::fprintf(stderr, "kbench: %s: %s\n", what, cudaGetErrorString(status));
    std::exit(1);
  }
}

std::vector<std::pair<std::string, Suite>>& registry() {
  static std::vector<std::pair<std::string, Suite>> suites;
  return suites;
}

// Bigger than the 60 MB L2 several times over; a memset through it evicts the case's inputs.
constexpr size_t kFlushBytes = size_t{256} << 20;

// Random bf16 in [-1, 1): an integer hash per element, no host round trip.
__global__ void fill_random_bf16(__nv_bfloat16* out, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 0x9E3779B1u ^ seed;
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    out[i] = __float2bfloat16(static_cast<float>(h) * 0x1p-31f - 1.0f);
  }
}

double measure_bf16_gemm() {
  const int n = 8192;
  __nv_bfloat16 *a, *b, *c;
  const size_t elems = size_t{n} * n;
  check(cudaMalloc(&a, elems * 2), "gemm a");
  check(cudaMalloc(&b, elems * 2), "gemm b");
  check(cudaMalloc(&c, elems * 2), "gemm c");
  fill_random_bf16<<<1024, 256>>>(a, elems, 1);
  fill_random_bf16<<<1024, 256>>>(b, elems, 2);
  check(cudaGetLastError(), "fill");
  cublasHandle_t handle;
  if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "kbench: cublasCreate failed\n");
    std::exit(1);
  }
  const float alpha = 1.0f, beta = 0.0f;
  cublasStatus_t status = CUBLAS_STATUS_SUCCESS;
  const double us = time_kernel_us(
      [&] {
        status = cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a, CUDA_R_16BF, n, b, CUDA_R_16BF, n,
                              &beta, c, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
      },
      10, false);
  if (status != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "kbench: cublasGemmEx failed (%d)\n", static_cast<int>(status));
    std::exit(1);
  }
  cublasDestroy(handle);
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
  return 2.0 * n * double(n) * n / (us * 1e-6);
}

}  // namespace

bool register_suite(const std::string& name, Suite suite) {
  registry().emplace_back(name, std::move(suite));
  return true;
}

double time_kernel_us(const std::function<void()>& launch, int iterations, bool flush_l2) {
  static void* flush = nullptr;
  if (flush_l2 && !flush) check(cudaMalloc(&flush, kFlushBytes), "L2 flush buffer");
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "event");
  check(cudaEventCreate(&stop), "event");
  for (int i = 0; i < 2; ++i) launch();  // warm-up: module load, first-touch, handle set-up
  check(cudaDeviceSynchronize(), "warm-up");
  std::vector<float> times;
  for (int i = 0; i < iterations; ++i) {
    if (flush_l2) cudaMemsetAsync(flush, i & 0xff, kFlushBytes);
    cudaEventRecord(start);
    launch();
    cudaEventRecord(stop);
    check(cudaEventSynchronize(stop), "timed launch");
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    times.push_back(ms);
  }
  check(cudaGetLastError(), "timed launch");
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
  return 1000.0 * times[times.size() / 2];
}

}  // namespace dsv4::kbench

int main(int argc, char** argv) {
  using namespace dsv4::kbench;
  Options options;
  std::vector<std::string> wanted;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick")) {
      options.quick = true;
    } else if (!std::strcmp(argv[i], "--suite") && i + 1 < argc) {
      wanted.push_back(argv[++i]);
    } else if (!std::strcmp(argv[i], "--case") && i + 1 < argc) {
      options.cases.push_back(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: dsv4_kbench [--quick] [--suite NAME]... [--case NAME]...\n");
      return 2;
    }
  }
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "no CUDA device");
  Ceilings ceilings;
  ceilings.copy_bytes_per_second = dsv4::ops::cuda::measure_copy_bandwidth(size_t{2} << 30);
  ceilings.bf16_flops_per_second = measure_bf16_gemm();
  std::printf("device: %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
  std::printf("ceilings: D2D copy %.0f GB/s (2 GiB cudaMemcpy, read + write), bf16 GEMM %.0f TFLOP/s (cuBLAS "
              "8192^3)\n",
              ceilings.copy_bytes_per_second / 1e9, ceilings.bf16_flops_per_second / 1e12);
  std::fflush(stdout);
  std::vector<std::pair<std::string, CaseResult>> rows;
  for (const auto& [name, suite] : registry()) {
    if (!wanted.empty() && std::find(wanted.begin(), wanted.end(), name) == wanted.end()) continue;
    for (const CaseResult& r : suite(ceilings, options)) {
      rows.emplace_back(name, r);
      std::printf("  %-44s %10.2f us\n", r.name.c_str(), r.microseconds);  // progress, in case a later one fails
      std::fflush(stdout);
    }
  }
  std::printf("\n%-46s %10s %9s %9s %8s  %s\n", "case", "us", "TFLOP/s", "GB/s", "% ceil", "note");
  for (const auto& [suite, r] : rows) {
    const double seconds = r.microseconds * 1e-6;
    const double memory_floor = r.bytes / ceilings.copy_bytes_per_second;
    const double math_floor =
        r.flops / (r.math_flops_per_second > 0 ? r.math_flops_per_second : ceilings.bf16_flops_per_second);
    const bool memory_bound = memory_floor >= math_floor;
    const double percent = 100.0 * std::max(memory_floor, math_floor) / seconds;
    std::printf("%-46s %10.2f %9.1f %9.0f %6.1f%% %s  %s\n", r.name.c_str(), r.microseconds, r.flops / seconds / 1e12,
                r.bytes / seconds / 1e9, percent, memory_bound ? "mem" : "mma", r.note.c_str());
  }
  return 0;
}
