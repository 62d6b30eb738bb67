// Named device buffers for the load-time weight passes on the GPU (model/cuda/device_random_weights.h,
// device_expert_requantizer.h): each grows to the largest request and is freed with the owner, so drawing or
// requantizing thousands of expert matrices allocates a handful of times.
#pragma once
#include <cstddef>
#include <map>
#include <string>

#include <cuda_runtime.h>

namespace dsv4 {

// Throws dsv4::Error "CUDA (<context>): <what>: <reason>" unless status is cudaSuccess.
void check_load_cuda(cudaError_t status, const char* context, const char* what);

class DeviceScratch {
 public:
  explicit DeviceScratch(int device) : device_(device) {}
  ~DeviceScratch();
  DeviceScratch(const DeviceScratch&) = delete;
  DeviceScratch& operator=(const DeviceScratch&) = delete;

  // The buffer named `which`, at least `bytes` long (its contents are lost when it grows).
  void* get(const std::string& which, size_t bytes);
  // The buffer named `which` as last sized (nullptr if never asked for).
  void* existing(const std::string& which) const;

 private:
  struct Buffer {
    void* data = nullptr;
    size_t bytes = 0;
  };
  int device_;
  std::map<std::string, Buffer> buffers_;
};

}  // namespace dsv4
