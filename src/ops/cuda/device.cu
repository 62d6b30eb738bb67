#include "ops/cuda/device.h"

#include <cuda_runtime.h>

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

}  // namespace dsv4::ops::cuda
