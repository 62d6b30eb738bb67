#include "core/dtype.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

namespace dsv4 {
namespace {

TEST(DType, Bf16RoundTripIsNearestEven) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (int i = 0; i < 10000; ++i) {
    const float value = normal(rng);
    const float rounded = bf16_to_f32(f32_to_bf16(value));
    // bf16 keeps 8 significant bits: the rounding error is at most half an ulp, 2^-8 relative.
    EXPECT_LE(std::fabs(rounded - value), std::ldexp(std::fabs(value), -8)) << value;
    EXPECT_EQ(f32_to_bf16(rounded), f32_to_bf16(value));
  }
  EXPECT_EQ(bf16_to_f32(0x3f80), 1.0f);
  EXPECT_EQ(f32_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);  // exact tie rounds to even
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(NAN))));
}

TEST(DType, Float8E4M3MatchesTheOcpTable) {
  EXPECT_EQ(f8e4m3_to_f32(0x38), 1.0f);
  EXPECT_EQ(f8e4m3_to_f32(0x7e), 448.0f);   // largest finite
  EXPECT_EQ(f8e4m3_to_f32(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(f8e4m3_to_f32(0xb8), -1.0f);
  EXPECT_TRUE(std::isnan(f8e4m3_to_f32(0x7f)));
  // Every finite code: value = (-1)^s 2^(e-7) (1 + m/8), or 2^-6 m/8 when e = 0.
  for (int code = 0; code < 256; ++code) {
    const int s = code >> 7, e = (code >> 3) & 15, m = code & 7;
    if (e == 15 && m == 7) continue;
    const double expected = (s ? -1 : 1) * (e ? std::ldexp(1.0 + m / 8.0, e - 7) : std::ldexp(m / 8.0, -6));
    EXPECT_EQ(f8e4m3_to_f32(static_cast<uint8_t>(code)), static_cast<float>(expected)) << code;
  }
}

TEST(DType, HalfAndScales) {
  EXPECT_EQ(f16_to_f32(0x3c00), 1.0f);
  EXPECT_EQ(f16_to_f32(0xc000), -2.0f);
  EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(e8m0_to_f32(127), 1.0f);
  EXPECT_EQ(e8m0_to_f32(130), 8.0f);
  EXPECT_EQ(*dtype_from_name("F8_E4M3"), DType::kF8E4M3);
  EXPECT_FALSE(dtype_from_name("F4").has_value());
}

}  // namespace
}  // namespace dsv4
