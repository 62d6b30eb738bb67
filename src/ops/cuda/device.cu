#include "ops/cuda/device.h"

#include <cuda_runtime.h>

#include <algorithm>

namespace dsv4::ops::cuda {

std::vector<DeviceInfo> list_devices() {
  std::vector<DeviceInfo> devices;
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return devices;
  }
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    devices.push_back({i, prop.name, prop.major, prop.minor, prop.totalGlobalMem, prop.multiProcessorCount});
  }
  return devices;
}

int current_device_multiprocessors() {
  int device = 0, count = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    return 0;
  return count;
}

double measure_copy_bandwidth(size_t bytes, int repeats) {
  void *src = nullptr, *dst = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  std::vector<float> ms;
  bool ok = cudaMalloc(&src, bytes) == cudaSuccess && cudaMalloc(&dst, bytes) == cudaSuccess &&
            cudaMemset(src, 0x3c, bytes) == cudaSuccess && cudaEventCreate(&start) == cudaSuccess &&
            cudaEventCreate(&stop) == cudaSuccess;
  for (int i = 0; ok && i <= repeats; ++i) {
    float elapsed = 0;
    ok = cudaEventRecord(start) == cudaSuccess &&
         cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice) == cudaSuccess &&
         cudaEventRecord(stop) == cudaSuccess && cudaEventSynchronize(stop) == cudaSuccess &&
         cudaEventElapsedTime(&elapsed, start, stop) == cudaSuccess;
    if (ok && i > 0) ms.push_back(elapsed);  // the first copy warms up
  }
  cudaFree(src);
  cudaFree(dst);
  if (start) cudaEventDestroy(start);
  if (stop) cudaEventDestroy(stop);
  if (!ok || ms.empty()) {
    cudaGetLastError();  // leave no sticky error behind
    return 0.0;
  }
  std::nth_element(ms.begin(), ms.begin() + ms.size() / 2, ms.end());
  return 2.0 * static_cast<double>(bytes) / (ms[ms.size() / 2] * 1e-3);
}

}  // namespace dsv4::ops::cuda
