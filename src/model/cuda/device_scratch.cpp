#include "model/cuda/device_scratch.h"

#include "core/error.h"

namespace dsv4 {

void check_load_cuda(cudaError_t status, const char* context, const char* what) {
  if (status != cudaSuccess)
    throw Error(std::string("CUDA (") + context + "): " + what + ": " + cudaGetErrorString(status));
}

DeviceScratch::~DeviceScratch() {
  cudaSetDevice(device_);
  for (auto& [name, buffer] : buffers_) cudaFree(buffer.data);
}

void* DeviceScratch::get(const std::string& which, size_t bytes) {
  Buffer& buffer = buffers_[which];
  if (buffer.bytes < bytes) {
    check_load_cuda(cudaFree(buffer.data), "device scratch", "cudaFree");
    buffer = {};
    check_load_cuda(cudaMalloc(&buffer.data, bytes), "device scratch", ("cudaMalloc of " + which).c_str());
    buffer.bytes = bytes;
  }
  return buffer.data;
}

void* DeviceScratch::existing(const std::string& which) const {
  const auto it = buffers_.find(which);
  return it == buffers_.end() ? nullptr : it->second.data;
}

}  // namespace dsv4
