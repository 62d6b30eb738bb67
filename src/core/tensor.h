// Tensor: a contiguous fp32 host array with a shape. The CPU backend computes in fp32 (docs/MODEL.md);
// device tensors and packed storage dtypes arrive with the CUDA backend and the paged cache.
#pragma once
#include <cstdint>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

namespace dsv4 {

struct Tensor {
  std::vector<int64_t> shape;
  std::vector<float> data;

  Tensor() = default;
  explicit Tensor(std::vector<int64_t> dims, float fill = 0.0f)
      : shape(std::move(dims)), data(static_cast<size_t>(count(shape)), fill) {}

  static int64_t count(const std::vector<int64_t>& dims) {
    return std::accumulate(dims.begin(), dims.end(), int64_t{1}, std::multiplies<>());
  }
  int64_t numel() const { return static_cast<int64_t>(data.size()); }
  int64_t dim(size_t axis) const { return shape.at(axis); }
  bool empty() const { return data.empty(); }
  float* ptr() { return data.data(); }
  const float* ptr() const { return data.data(); }
  std::string shape_string() const {
    std::string out = "[";
    for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
    return out + "]";
  }
};

}  // namespace dsv4
