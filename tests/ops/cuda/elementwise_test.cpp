// The CUDA elementwise ops against their CPU twins (core/dtype.h casts, ops/cpu/quantize.h round_to_bf16, plain
// loops for add / scale / the row gather); bitwise where the twin's arithmetic is one rounded operation.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "ops/cpu/quantize.h"
#include "ops/cuda/elementwise.h"
#include "small_ops_util.h"

namespace dsv4::ops::cuda {
namespace {

using testing::small_ops::bitwise_equal;
using testing::small_ops::DeviceArray;

class CudaElementwise : public testing::small_ops::GpuTest {};

float from_bits(uint32_t bits) {
  float v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// Random normals of several magnitudes plus the cases rounding cares about: ties (low half 0x8000) with even and
// odd kept bits, NaN payloads, ±inf, ±0, subnormals, values that round up to inf.
std::vector<float> cast_inputs(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<uint32_t> bits;
  std::vector<float> x;
  for (size_t i = 0; i < n; ++i) {
    switch (i % 4) {
      case 0: x.push_back(normal(rng)); break;
      case 1: x.push_back(normal(rng) * 1e4f); break;
      case 2: x.push_back(from_bits(bits(rng))); break;
      default: x.push_back(from_bits((bits(rng) & 0xffff0000u) | 0x8000u)); break;  // exact tie
    }
  }
  for (const uint32_t special : {0x7fc00000u, 0xffc00001u, 0x7f800001u, 0x7f800000u, 0xff800000u, 0x00000000u,
                                 0x80000000u, 0x00000001u, 0x807fffffu, 0x7f7fffffu, 0xff7fffffu, 0x7f7f8000u,
                                 0x3f808000u, 0x3f818000u, 0x3f80ffffu})
    x.push_back(from_bits(special));
  return x;
}

TEST_F(CudaElementwise, Fp32ToBf16IsBitwiseTheCpuCast) {
  for (const size_t n : {size_t{1}, size_t{37}, size_t{1} << 20}) {
    const std::vector<float> x = cast_inputs(n, static_cast<uint32_t>(n));
    std::vector<uint16_t> expected(x.size());
    for (size_t i = 0; i < x.size(); ++i) expected[i] = dsv4::f32_to_bf16(x[i]);
    DeviceArray<float> d_x(x);
    DeviceArray<uint16_t> d_y(x.size());
    ASSERT_EQ(cuda::f32_to_bf16(d_x.get(), d_y.get(), static_cast<int64_t>(x.size()), nullptr), cudaSuccess);
    const std::vector<uint16_t> actual = d_y.download();
    EXPECT_EQ(actual, expected) << n;
    ASSERT_EQ(cuda::f32_to_bf16(d_x.get(), d_y.get(), static_cast<int64_t>(x.size()), nullptr), cudaSuccess);
    EXPECT_EQ(d_y.download(), actual) << "not bitwise repeatable";
  }
}

TEST_F(CudaElementwise, Bf16ToFp32IsBitwiseTheCpuCastForEveryPattern) {
  std::vector<uint16_t> x(65536);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<uint16_t>(i);
  std::vector<float> expected(x.size());
  for (size_t i = 0; i < x.size(); ++i) expected[i] = dsv4::bf16_to_f32(x[i]);
  DeviceArray<uint16_t> d_x(x);
  DeviceArray<float> d_y(x.size());
  ASSERT_EQ(cuda::bf16_to_f32(d_x.get(), d_y.get(), static_cast<int64_t>(x.size()), nullptr), cudaSuccess);
  EXPECT_TRUE(bitwise_equal(d_y.download(), expected));
}

TEST_F(CudaElementwise, RoundToBf16IsBitwiseTheCpuTwin) {
  std::vector<float> x = cast_inputs(100003, 7);
  std::vector<float> expected = x;
  cpu::round_to_bf16(expected.data(), static_cast<int64_t>(expected.size()));
  DeviceArray<float> d_x(x);
  ASSERT_EQ(cuda::round_to_bf16(d_x.get(), static_cast<int64_t>(x.size()), nullptr), cudaSuccess);
  const std::vector<float> actual = d_x.download();
  EXPECT_TRUE(bitwise_equal(actual, expected));
  // Idempotent: a second rounding changes nothing (and is the same kernel run again).
  ASSERT_EQ(cuda::round_to_bf16(d_x.get(), static_cast<int64_t>(x.size()), nullptr), cudaSuccess);
  EXPECT_TRUE(bitwise_equal(d_x.download(), actual));
}

TEST_F(CudaElementwise, AddAndScaleMatchCpuBitwise) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  for (const size_t n : {size_t{3}, size_t{4096 * 37 + 5}}) {
    std::vector<float> x(n), y(n);
    for (auto& v : x) v = normal(rng);
    for (auto& v : y) v = normal(rng);
    std::vector<float> sum(n), scaled(n);
    for (size_t i = 0; i < n; ++i) sum[i] = y[i] + x[i];
    for (size_t i = 0; i < n; ++i) scaled[i] = sum[i] * 0.37f;
    DeviceArray<float> d_x(x), d_y(y);
    ASSERT_EQ(add_inplace(d_y.get(), d_x.get(), static_cast<int64_t>(n), nullptr), cudaSuccess);
    EXPECT_TRUE(bitwise_equal(d_y.download(), sum)) << n;
    ASSERT_EQ(scale_inplace(d_y.get(), 0.37f, static_cast<int64_t>(n), nullptr), cudaSuccess);
    EXPECT_TRUE(bitwise_equal(d_y.download(), scaled)) << n;
  }
  EXPECT_EQ(add_inplace(nullptr, nullptr, 0, nullptr), cudaSuccess);
}

TEST_F(CudaElementwise, GatherRowsSelectsRows) {
  // [N, hc·D] streams at V4-Flash (hc 4, D 4096) and an odd tiny width (scalar path).
  for (const auto& [rows_in, row_elems, count] :
       {std::tuple<int64_t, int64_t, int64_t>{37, 4 * 4096, 9}, {11, 7, 20}, {1, 4 * 256, 1}}) {
    std::mt19937 rng(static_cast<uint32_t>(rows_in * 131 + row_elems));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(rows_in - 1));
    std::vector<float> in(static_cast<size_t>(rows_in * row_elems));
    for (auto& v : in) v = normal(rng);
    std::vector<int32_t> rows(static_cast<size_t>(count));
    for (auto& r : rows) r = pick(rng);
    rows.back() = static_cast<int32_t>(rows_in - 1);  // the last row (the last token) is always reachable
    std::vector<float> expected(static_cast<size_t>(count * row_elems));
    for (int64_t i = 0; i < count; ++i)
      std::memcpy(&expected[i * row_elems], &in[rows[i] * row_elems], row_elems * sizeof(float));
    DeviceArray<float> d_in(in), d_out(expected.size());
    DeviceArray<int32_t> d_rows(rows);
    ASSERT_EQ(gather_rows({count, row_elems}, d_in.get(), d_rows.get(), d_out.get(), nullptr), cudaSuccess);
    EXPECT_TRUE(bitwise_equal(d_out.download(), expected)) << rows_in << "x" << row_elems;
  }
}

}  // namespace
}  // namespace dsv4::ops::cuda
