// Shared pieces of the small-op GPU tests (embedding, rope, mHC, MoE routing, elementwise): device arrays,
// error measures and a fixture base that skips cleanly without a GPU.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <cuda_runtime.h>

namespace dsv4::testing::small_ops {

class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) GTEST_SKIP() << "no CUDA device";
  }
};

// A device copy of a host vector (or `count` elements poisoned with 0xff bytes: NaN for floats, −1 for ints).
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(const std::vector<T>& host) : count_(host.size()) {
    EXPECT_EQ(cudaMalloc(&ptr_, std::max<size_t>(1, count_) * sizeof(T)), cudaSuccess);
    if (count_) {
      EXPECT_EQ(cudaMemcpy(ptr_, host.data(), count_ * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    }
  }
  explicit DeviceArray(size_t count) : count_(count) {
    EXPECT_EQ(cudaMalloc(&ptr_, std::max<size_t>(1, count_) * sizeof(T)), cudaSuccess);
    poison();
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  ~DeviceArray() { cudaFree(ptr_); }
  T* get() const { return ptr_; }
  size_t size() const { return count_; }
  void poison() { EXPECT_EQ(cudaMemset(ptr_, 0xff, std::max<size_t>(1, count_) * sizeof(T)), cudaSuccess); }
  void upload(const std::vector<T>& host) {
    EXPECT_EQ(host.size(), count_);
    EXPECT_EQ(cudaMemcpy(ptr_, host.data(), count_ * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::vector<T> download() const {
    std::vector<T> host(count_);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    if (count_) {
      EXPECT_EQ(cudaMemcpy(host.data(), ptr_, count_ * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    }
    return host;
  }

 private:
  T* ptr_ = nullptr;
  size_t count_ = 0;
};

// ‖actual − expected‖₂ / ‖expected‖₂ (NaN anywhere in actual makes it NaN, which fails every bound).
inline double rel_l2(const std::vector<float>& actual, const std::vector<float>& expected) {
  double err = 0, norm = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    const double d = static_cast<double>(actual[i]) - expected[i];
    err += d * d;
    norm += static_cast<double>(expected[i]) * expected[i];
  }
  return norm == 0 ? std::sqrt(err) : std::sqrt(err / norm);
}

// max_i |actual − expected| / max(|expected|, floor).
inline double max_rel(const std::vector<float>& actual, const std::vector<float>& expected, double floor = 1e-3) {
  double worst = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    const double d = std::abs(static_cast<double>(actual[i]) - expected[i]) /
                     std::max<double>(std::abs(expected[i]), floor);
    if (std::isnan(d)) return d;
    worst = std::max(worst, d);
  }
  return worst;
}

template <typename T>
bool bitwise_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

inline bool any_nan(const std::vector<float>& x) {
  return std::any_of(x.begin(), x.end(), [](float v) { return std::isnan(v); });
}

}  // namespace dsv4::testing::small_ops
