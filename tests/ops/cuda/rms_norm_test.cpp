// The CUDA RMSNorm against its CPU twin (ops/cpu/norm.h) on random inputs; skips without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include <cuda_runtime.h>

#include "ops/cpu/norm.h"
#include "ops/cuda/device.h"
#include "ops/cuda/rms_norm.h"

namespace dsv4::ops::cuda {
namespace {

class CudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (list_devices().empty()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_F(CudaTest, RmsNormMatchesCpuTwin) {
  for (const auto& [rows, dim] : {std::pair<int64_t, int64_t>{1, 7}, {33, 512}, {128, 4096}, {5, 7168}}) {
    std::mt19937 rng(static_cast<uint32_t>(rows * 31 + dim));
    std::normal_distribution<float> normal(0.0f, 3.0f);
    std::vector<float> x(rows * dim), weight(dim);
    for (auto& v : x) v = normal(rng);
    for (auto& v : weight) v = 1.0f + 0.1f * normal(rng);
    for (const bool weighted : {true, false}) {
      std::vector<float> expected(x.size());
      cpu::rms_norm(x.data(), rows, dim, dim, weighted ? weight.data() : nullptr, 1e-6f, expected.data());
      float *d_x, *d_w, *d_y;
      ASSERT_EQ(cudaMalloc(&d_x, x.size() * 4), cudaSuccess);
      ASSERT_EQ(cudaMalloc(&d_w, weight.size() * 4), cudaSuccess);
      ASSERT_EQ(cudaMalloc(&d_y, x.size() * 4), cudaSuccess);
      cudaMemcpy(d_x, x.data(), x.size() * 4, cudaMemcpyHostToDevice);
      cudaMemcpy(d_w, weight.data(), weight.size() * 4, cudaMemcpyHostToDevice);
      cudaMemset(d_y, 0xff, x.size() * 4);  // poison: NaN everywhere the kernel fails to write
      ASSERT_EQ(rms_norm({rows, dim, 1e-6f}, d_x, weighted ? d_w : nullptr, d_y, nullptr), cudaSuccess);
      std::vector<float> actual(x.size()), repeat(x.size());
      ASSERT_EQ(cudaMemcpy(actual.data(), d_y, x.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
      ASSERT_EQ(rms_norm({rows, dim, 1e-6f}, d_x, weighted ? d_w : nullptr, d_y, nullptr), cudaSuccess);
      cudaMemcpy(repeat.data(), d_y, x.size() * 4, cudaMemcpyDeviceToHost);
      cudaFree(d_x);
      cudaFree(d_w);
      cudaFree(d_y);
      double err = 0, norm = 0;
      for (size_t i = 0; i < x.size(); ++i) {
        ASSERT_FALSE(std::isnan(actual[i])) << i;
        err += (actual[i] - expected[i]) * double(actual[i] - expected[i]);
        norm += double(expected[i]) * expected[i];
      }
      EXPECT_LE(std::sqrt(err / norm), 1e-6) << rows << "x" << dim;
      EXPECT_EQ(actual, repeat) << "not bitwise repeatable";
    }
  }
}

}  // namespace
}  // namespace dsv4::ops::cuda
