// CUDA device discovery for the backend switch: which GPUs this process can use.
#pragma once
#include <cstddef>
#include <string>
#include <vector>

namespace dsv4::ops::cuda {

struct DeviceInfo {
  int index = 0;
  std::string name;
  int compute_major = 0, compute_minor = 0;
  size_t total_memory = 0;
  int multiprocessors = 0;
};

// Devices visible to this process; empty (not an error) when there is no driver or no GPU.
std::vector<DeviceInfo> list_devices();

// Multiprocessors of the calling thread's current device, asked on every call (a process may drive several
// devices); 0 when the runtime cannot say.
int current_device_multiprocessors();

// The current device's copy bandwidth in bytes/s: `bytes` copied device to device (read + write counted), the
// median of `repeats` timed copies after one untimed. What the decode rooflines divide by (dsv4_kbench's
// ceiling, `dsv4 bench latency --roofline`). Returns 0 when the buffers cannot be allocated or a call fails.
double measure_copy_bandwidth(size_t bytes = size_t{1} << 30, int repeats = 10);

}  // namespace dsv4::ops::cuda
