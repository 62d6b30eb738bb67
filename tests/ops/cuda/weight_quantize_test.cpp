// The GPU-side dummy weights' kernels against their host twins: ops/cuda/random_fill.h against
// model/random_init.h random_tensor (one fp32 ulp at most, on the rare element where glibc's and CUDA's double
// log / cos round differently; uniform fills exact), and ops/cuda/weight_quantize.h against LinearWeight's
// quantizers bit for bit, at the V4-Flash expert shape and on groups chosen to hit the corners: all zero,
// subnormal, huge, exact ties between grid points, one outlier. Outputs are poisoned first. Skips without a GPU.
#include "ops/cuda/weight_quantize.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/linear_weight.h"
#include "model/random_init.h"
#include "ops/cuda/device.h"
#include "ops/cuda/random_fill.h"

namespace dsv4::ops::cuda {
namespace {

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

class CudaWeightInit : public ::testing::Test {
 protected:
  void SetUp() override {
    if (list_devices().empty()) GTEST_SKIP() << "no CUDA device";
  }
};

template <typename T>
struct DeviceArray {
  T* data = nullptr;
  size_t count = 0;
  explicit DeviceArray(size_t n, const T* host = nullptr) : count(n) {
    EXPECT_EQ(cudaMalloc(&data, n * sizeof(T)), cudaSuccess);
    if (host) EXPECT_EQ(cudaMemcpy(data, host, n * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    else EXPECT_EQ(cudaMemset(data, 0xa5, n * sizeof(T)), cudaSuccess);  // poison
  }
  ~DeviceArray() { cudaFree(data); }
  std::vector<T> host() const {
    std::vector<T> out(count);
    EXPECT_EQ(cudaMemcpy(out.data(), data, count * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }
};

uint32_t bits_of(float v) {
  uint32_t b;
  std::memcpy(&b, &v, 4);
  return b;
}

// A matrix whose groups of 32 span the quantizers' cases.
Tensor corner_matrix(int64_t rows, int64_t cols, uint32_t seed) {
  Tensor m({rows, cols});
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> kind(0, 9), exponent(-30, 30), level(-6, 6);
  for (int64_t g = 0; g < rows * cols / 32; ++g) {
    float* x = m.ptr() + g * 32;
    const int k = kind(rng);
    const float scale = std::ldexp(1.0f, exponent(rng));
    for (int i = 0; i < 32; ++i) {
      switch (k) {
        case 0: x[i] = 0.0f; break;                                       // an all-zero group
        case 1: x[i] = normal(rng) * 0x1p-140f; break;                    // subnormal values
        case 2: x[i] = normal(rng) * 0x1p100f; break;                     // huge values
        case 3: x[i] = static_cast<float>(level(rng)) * 0.25f * scale; break;  // ties between grid points
        case 4: x[i] = (i == 7 ? 50.0f : normal(rng) * 0.01f) * scale; break;  // one outlier
        default: x[i] = normal(rng) * scale * 0.02f; break;               // the bulk: N(0, σ)
      }
    }
  }
  return m;
}

TEST_F(CudaWeightInit, RandomFillMatchesTheHostGenerator) {
  struct Case {
    TensorSpec spec;
    bool exact;  // no log / cos involved
  };
  const ModelConfig config = ModelConfig::preset("tiny");
  for (const Case& c : {Case{{"model.layers.0.ffn.experts.0.w1.weight", {2048, 4096}, TensorRole::kLinear}, false},
                        Case{{"model.layers.3.attn.attn_sink", {64}, TensorRole::kSink}, false},
                        Case{{"model.layers.1.hc_attn_scale", {1000, 3}, TensorRole::kHcScale}, true}}) {
    SCOPED_TRACE(c.spec.name);
    const Tensor host = random_tensor(config, c.spec, 11);
    const std::optional<RandomFill> fill = random_fill(c.spec, 11);
    ASSERT_TRUE(fill.has_value());
    DeviceArray<float> device(host.data.size());
    CUDA_OK(fill_random(*fill, device.data, static_cast<int64_t>(host.data.size()), nullptr));
    const std::vector<float> drawn = device.host();
    int64_t differing = 0;
    for (size_t i = 0; i < drawn.size(); ++i) {
      if (bits_of(drawn[i]) == bits_of(host.data[i])) continue;
      ++differing;
      ASSERT_FALSE(c.exact) << "element " << i;
      ASSERT_EQ(std::nextafter(host.data[i], drawn[i]), drawn[i]) << "element " << i << " is more than an ulp off";
    }
    std::printf("%s: %lld of %zu elements one ulp off the host's\n", c.spec.name.c_str(),
                static_cast<long long>(differing), drawn.size());
    EXPECT_LE(differing, 8);  // expected ~0.1 at 8.4M elements
  }
  EXPECT_EQ(fill_random(RandomFill{}, nullptr, -1, nullptr), cudaErrorInvalidValue);
}

TEST_F(CudaWeightInit, Mxfp4QuantizeAndDequantizeMatchTheHost) {
  for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{2048, 4096}, {3, 96}}) {
    SCOPED_TRACE(std::to_string(rows) + " x " + std::to_string(cols));
    const Tensor dense = corner_matrix(rows, cols, 21);
    const LinearWeight expected = LinearWeight::quantize_mxfp4_groups(dense);
    DeviceArray<float> values(dense.data.size(), dense.ptr());
    DeviceArray<uint8_t> packed(static_cast<size_t>(rows * cols / 2));
    DeviceArray<float> scales(static_cast<size_t>(rows * cols / 32));
    CUDA_OK(quantize_mxfp4_groups(values.data, rows, cols, packed.data, scales.data, nullptr));
    const LinearWeight actual = LinearWeight::fp4_group_scaled(rows, cols, packed.host(), scales.host());
    EXPECT_EQ(actual.codes(), expected.codes());
    EXPECT_EQ(actual.fp4_exponents(), expected.fp4_exponents());

    DeviceArray<float> decoded(dense.data.size());
    CUDA_OK(dequantize_mxfp4_groups(packed.data, scales.data, rows, cols, decoded.data, nullptr));
    const std::vector<float> device_decoded = decoded.host();
    const Tensor host_decoded = expected.dequantized();
    ASSERT_EQ(device_decoded.size(), host_decoded.data.size());
    EXPECT_EQ(0, std::memcmp(device_decoded.data(), host_decoded.ptr(), device_decoded.size() * sizeof(float)));
  }
  EXPECT_EQ(quantize_mxfp4_groups(nullptr, 4, 40, nullptr, nullptr, nullptr), cudaErrorInvalidValue);
}

TEST_F(CudaWeightInit, LowBitGroupsMatchTheHostRequantization) {
  const int64_t rows = 4096, cols = 2048;  // a V4-Flash w2
  const Tensor dense = corner_matrix(rows, cols, 22);
  DeviceArray<float> values(dense.data.size(), dense.ptr());
  for (const auto& [encoding, bits] : {std::pair{WeightEncoding::kQ3G32, 3}, std::pair{WeightEncoding::kQ2G32, 2}}) {
    SCOPED_TRACE(bits);
    const LinearWeight expected = LinearWeight(dense).requantized(encoding);
    const int64_t groups = rows * cols / 32;
    DeviceArray<uint8_t> codes(static_cast<size_t>(groups * 4 * bits));
    DeviceArray<uint16_t> scales(static_cast<size_t>(groups));
    CUDA_OK(quantize_low_bit_groups(values.data, rows, cols, bits, codes.data, scales.data, nullptr));
    const std::vector<uint8_t> device_codes = codes.host();
    const std::vector<uint16_t> device_scales = scales.host();
    int64_t differing_groups = 0;
    for (int64_t g = 0; g < groups; ++g)
      differing_groups += device_scales[g] != expected.group_scales()[g] ||
                          std::memcmp(&device_codes[g * 4 * bits], &expected.codes()[g * 4 * bits], 4 * bits) != 0;
    EXPECT_EQ(differing_groups, 0) << "of " << groups;
  }
  EXPECT_EQ(quantize_low_bit_groups(nullptr, 1, 32, 4, nullptr, nullptr, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace dsv4::ops::cuda
