// The quantizers of the DeepSeek numerics mode (ops/cpu/quantize.h) against naive formulas: exhaustive over the
// e4m3 / e2m1 codes, random vectors for the block quantizers and the Hadamard transform.
#include "ops/cpu/quantize.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <random>
#include <vector>

#include "core/dtype.h"

namespace dsv4::ops::cpu {
namespace {

struct Code {
  float value;
  int code;
};

// Finite non-negative e4m3 values with their codes (0x00 … 0x7e), decoded by core/dtype.
std::vector<Code> e4m3_grid() {
  std::vector<Code> grid;
  for (int code = 0; code < 0x7f; ++code) grid.push_back({f8e4m3_to_f32(static_cast<uint8_t>(code)), code});
  return grid;
}

// e2m1 codes 0..7: exponent bits 2, mantissa bit 1, bias 1 (value = 2^(e−1)·(1 + m/2), subnormal e=0: m/2).
std::vector<Code> e2m1_grid() {
  std::vector<Code> grid;
  for (int code = 0; code < 8; ++code) {
    const int e = code >> 1, m = code & 1;
    grid.push_back({e == 0 ? 0.5f * m : std::ldexp(1.0f + 0.5f * m, e - 1), code});
  }
  return grid;
}

// Naive round-to-nearest-even onto a grid: nearest value, on a tie the even code, beyond the top the top.
float nearest_even(const std::vector<Code>& grid, float x) {
  const float magnitude = std::fabs(x);
  const Code* best = &grid[0];
  for (const Code& c : grid) {
    const double d = std::fabs(static_cast<double>(c.value) - magnitude);
    const double best_d = std::fabs(static_cast<double>(best->value) - magnitude);
    if (d < best_d || (d == best_d && c.code % 2 == 0 && best->code % 2 != 0)) best = &c;
  }
  return std::copysign(best->value, x);
}

TEST(Quantize, E4m3EveryCodeRoundTrips) {
  int finite = 0;
  for (int code = 0; code < 256; ++code) {
    const float v = f8e4m3_to_f32(static_cast<uint8_t>(code));
    if (std::isnan(v)) {
      EXPECT_TRUE(code == 0x7f || code == 0xff) << code;
      EXPECT_TRUE(std::isnan(e4m3_round(v)));
      continue;
    }
    ++finite;
    EXPECT_EQ(e4m3_round(v), v) << "code " << code;
    EXPECT_EQ(std::signbit(e4m3_round(v)), std::signbit(v)) << "code " << code;
  }
  EXPECT_EQ(finite, 254);
}

TEST(Quantize, E4m3MidpointsTiesToEvenAndSaturates) {
  const std::vector<Code> grid = e4m3_grid();
  for (size_t i = 0; i + 1 < grid.size(); ++i) {
    const float mid = 0.5f * (grid[i].value + grid[i + 1].value);
    const float expected = grid[i].code % 2 == 0 ? grid[i].value : grid[i + 1].value;
    EXPECT_EQ(e4m3_round(mid), expected) << mid;
    EXPECT_EQ(e4m3_round(-mid), -expected) << mid;
    // Just off the midpoint goes to the nearer neighbour.
    EXPECT_EQ(e4m3_round(std::nextafter(mid, 0.0f)), grid[i].value) << mid;
    EXPECT_EQ(e4m3_round(std::nextafter(mid, 1e9f)), grid[i + 1].value) << mid;
  }
  EXPECT_EQ(e4m3_round(460.0f), 448.0f);
  EXPECT_EQ(e4m3_round(-1e6f), -448.0f);
}

TEST(Quantize, E4m3RandomValuesMatchNaiveNearest) {
  const std::vector<Code> grid = e4m3_grid();
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> exponent(-12.0f, 9.5f);
  for (int i = 0; i < 20000; ++i) {
    const float x = (i % 2 ? -1.0f : 1.0f) * std::exp2(exponent(rng));
    ASSERT_EQ(e4m3_round(x), nearest_even(grid, x)) << x;
  }
}

TEST(Quantize, E2m1EveryCodeMidpointAndRandomValue) {
  const std::vector<Code> grid = e2m1_grid();
  const float expected_values[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  for (int code = 0; code < 16; ++code) {  // all 16 codes: bit 3 is the sign
    const float v = (code & 8 ? -1.0f : 1.0f) * grid[code & 7].value;
    EXPECT_EQ(grid[code & 7].value, expected_values[code & 7]);
    EXPECT_EQ(e2m1_round(v), v) << code;
  }
  for (size_t i = 0; i + 1 < grid.size(); ++i) {
    const float mid = 0.5f * (grid[i].value + grid[i + 1].value);
    EXPECT_EQ(e2m1_round(mid), grid[i].code % 2 == 0 ? grid[i].value : grid[i + 1].value) << mid;
  }
  EXPECT_EQ(e2m1_round(7.0f), 6.0f);
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> value(-8.0f, 8.0f);
  for (int i = 0; i < 20000; ++i) {
    const float x = value(rng);
    ASSERT_EQ(e2m1_round(x), nearest_even(grid, x)) << x;
  }
}

TEST(Quantize, Ue8m0ScaleIsCeilPowerOfTwo) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<double> exponent(-20.0, 20.0);
  for (int i = 0; i < 10000; ++i) {
    const float amax = static_cast<float>(std::exp2(exponent(rng)));
    const float ratio = std::max(amax, 1e-4f) / 448.0f;
    const float expected = static_cast<float>(std::exp2(std::ceil(std::log2(static_cast<double>(ratio)))));
    ASSERT_EQ(ue8m0_scale(amax, 448.0f, 1e-4f), expected) << amax;
  }
  EXPECT_EQ(ue8m0_scale(448.0f, 448.0f, 1e-4f), 1.0f);  // exact power of two: no round-up
  EXPECT_EQ(ue8m0_scale(449.0f, 448.0f, 1e-4f), 2.0f);
  EXPECT_EQ(ue8m0_scale(0.0f, 6.0f, 6.0f * std::ldexp(1.0f, -126)), std::ldexp(1.0f, -126));
}

TEST(Quantize, BlockQuantizersMatchNaiveFormula) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const std::vector<Code> e4m3 = e4m3_grid(), e2m1 = e2m1_grid();
  for (const int64_t block : {32, 64, 128}) {
    std::vector<float> x(static_cast<size_t>(block * 6));
    for (size_t i = 0; i < x.size(); ++i) x[i] = normal(rng) * std::exp2(static_cast<float>(i / block) * 3.0f - 8.0f);
    std::vector<float> q8 = x, q4 = x;
    quantize_e4m3_blocks(q8.data(), static_cast<int64_t>(x.size()), block);
    quantize_e2m1_blocks(q4.data(), static_cast<int64_t>(x.size()), block);
    for (int64_t b = 0; b < 6; ++b) {
      double amax = 0;
      for (int64_t i = 0; i < block; ++i) amax = std::max(amax, std::fabs(static_cast<double>(x[b * block + i])));
      const double s8 = std::exp2(std::ceil(std::log2(std::max(amax, 1e-4) / 448.0)));
      const double s4 = std::exp2(std::ceil(std::log2(std::max(amax, 6.0 * std::ldexp(1.0, -126)) / 6.0)));
      for (int64_t i = 0; i < block; ++i) {
        const float v = x[b * block + i];
        EXPECT_EQ(q8[b * block + i], nearest_even(e4m3, static_cast<float>(v / s8)) * s8) << block << " " << i;
        EXPECT_EQ(q4[b * block + i], nearest_even(e2m1, static_cast<float>(v / s4)) * s4) << block << " " << i;
      }
      // The largest element of a block never saturates away more than one grid step.
      EXPECT_LE(std::fabs(q8[b * block] - x[b * block]), std::fabs(x[b * block]) / 8.0f + 1e-30f);
    }
  }
}

TEST(Quantize, HadamardMatchesMatrixIsInvolutiveAndOrthogonal) {
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const int64_t n : {1, 2, 8, 64, 128}) {
    std::vector<float> x(static_cast<size_t>(n));
    for (float& v : x) v = normal(rng);
    std::vector<float> y = x;
    hadamard_transform(y.data(), n, 1.0f);
    // Naive: H[i][j] = (−1)^popcount(i & j) (Sylvester order).
    for (int64_t i = 0; i < n; ++i) {
      double sum = 0;
      for (int64_t j = 0; j < n; ++j) sum += (std::popcount(static_cast<uint64_t>(i & j)) % 2 ? -1.0 : 1.0) * x[j];
      EXPECT_NEAR(y[i], sum, 1e-4 * std::sqrt(static_cast<double>(n))) << n << " " << i;
    }
    // H·H = n·I.
    std::vector<float> z = y;
    hadamard_transform(z.data(), n, 1.0f);
    for (int64_t i = 0; i < n; ++i) EXPECT_NEAR(z[i], static_cast<float>(n) * x[i], 1e-4 * n) << n;
    // Scaled by n^-1/2 it is orthogonal: norms and dot products are kept.
    std::vector<float> u = x, w(static_cast<size_t>(n));
    for (float& v : w) v = normal(rng);
    std::vector<float> rw = w;
    const float scale = 1.0f / std::sqrt(static_cast<float>(n));
    hadamard_transform(u.data(), n, scale);
    hadamard_transform(rw.data(), n, scale);
    double dot = 0, rotated_dot = 0, norm = 0, rotated_norm = 0;
    for (int64_t i = 0; i < n; ++i) {
      dot += x[i] * w[i];
      rotated_dot += u[i] * rw[i];
      norm += x[i] * x[i];
      rotated_norm += u[i] * u[i];
    }
    EXPECT_NEAR(rotated_dot, dot, 1e-4 * n);
    EXPECT_NEAR(rotated_norm, norm, 1e-4 * n);
  }
}

TEST(Quantize, RoundToBf16MatchesTruncatedBits) {
  std::vector<float> x = {1.0f, 1.0f + std::ldexp(1.0f, -8), 1.0f + 3 * std::ldexp(1.0f, -9), -3.14159f};
  round_to_bf16(x.data(), static_cast<int64_t>(x.size()));
  EXPECT_EQ(x[0], 1.0f);
  EXPECT_EQ(x[1], 1.0f);                            // tie -> even mantissa
  EXPECT_EQ(x[2], 1.0f + std::ldexp(1.0f, -7));     // 0.75 of a bf16 step rounds up
  EXPECT_EQ(x[3], -3.140625f);
}

}  // namespace
}  // namespace dsv4::ops::cpu
