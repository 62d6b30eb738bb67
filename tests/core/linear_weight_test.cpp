// LinearWeight (core/linear_weight.h) and the CPU linears over it (ops/cpu/linear.h): decoding against the
// e4m3 / e2m1 formulas of research/model_spec.md §2.1 written out independently here, and the quantized
// products against the same products over the dequantized fp32 matrix.
#include "core/linear_weight.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "ops/cpu/linear.h"
#include "ops/cpu/quantize.h"

namespace dsv4 {
namespace {

using ::testing::HasSubstr;

// OCP e4m3 (fn): sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal (m/8 · 2^-6);
// S.1111.111 is NaN, no infinities.
float e4m3_formula(uint8_t code) {
  const int sign = code >> 7, exponent = (code >> 3) & 0xf, mantissa = code & 0x7;
  if (exponent == 0xf && mantissa == 0x7) return std::nanf("");
  const float magnitude = exponent == 0
                              ? std::ldexp(static_cast<float>(mantissa) / 8.0f, -6)
                              : std::ldexp(1.0f + static_cast<float>(mantissa) / 8.0f, exponent - 7);
  return sign ? -magnitude : magnitude;
}

// e2m1: sign, 2 exponent bits (bias 1), 1 mantissa bit; exponent 0 is subnormal (m · 0.5).
float e2m1_formula(uint8_t nibble) {
  const int sign = nibble >> 3, exponent = (nibble >> 1) & 0x3, mantissa = nibble & 0x1;
  const float magnitude = exponent == 0
                              ? 0.5f * static_cast<float>(mantissa)
                              : std::ldexp(1.0f + 0.5f * static_cast<float>(mantissa), exponent - 1);
  return sign ? -magnitude : magnitude;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

struct Fp8Matrix {
  int64_t out, in;
  std::vector<uint8_t> codes;
  std::vector<float> block_scales;  // [ceil(out/128), ceil(in/128)]
  std::vector<float> expected;      // the formula's fp32 matrix

  Fp8Matrix(int64_t out_rows, int64_t in_cols, uint32_t seed) : out(out_rows), in(in_cols) {
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int> byte(0, 255), exponent(-12, 4);
    std::uniform_real_distribution<float> mantissa(0.5f, 2.0f);
    codes.resize(static_cast<size_t>(out * in));
    for (uint8_t& c : codes) {
      do c = static_cast<uint8_t>(byte(rng));
      while ((c & 0x7f) == 0x7f);  // no NaN codes: the checkpoints hold none
    }
    const int64_t bc = ceil_div(in, 128);
    block_scales.resize(static_cast<size_t>(ceil_div(out, 128) * bc));
    // fp32 `weight_scale_inv` need not be powers of two; the decode must use them as given.
    for (float& s : block_scales) s = std::ldexp(mantissa(rng), exponent(rng));
    expected.resize(codes.size());
    for (int64_t r = 0; r < out; ++r)
      for (int64_t c = 0; c < in; ++c)
        expected[r * in + c] = e4m3_formula(codes[r * in + c]) * block_scales[(r / 128) * bc + c / 128];
  }
  LinearWeight weight() const { return LinearWeight::fp8_block_scaled(out, in, codes, block_scales); }
};

struct Fp4Matrix {
  int64_t out, in;
  std::vector<uint8_t> packed;
  std::vector<float> scales;  // [out, in / 32], powers of two
  std::vector<float> expected;

  Fp4Matrix(int64_t out_rows, int64_t in_cols, uint32_t seed) : out(out_rows), in(in_cols) {
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int> byte(0, 255), exponent(-20, 8);
    packed.resize(static_cast<size_t>(out * in / 2));
    for (uint8_t& b : packed) b = static_cast<uint8_t>(byte(rng));
    const int64_t groups = ceil_div(in, 32);
    scales.resize(static_cast<size_t>(out * groups));
    for (float& s : scales) s = std::ldexp(1.0f, exponent(rng));
    expected.resize(static_cast<size_t>(out * in));
    for (int64_t r = 0; r < out; ++r)
      for (int64_t c = 0; c < in; ++c) {
        const uint8_t b = packed[(r * in + c) / 2];
        const uint8_t nibble = c % 2 == 0 ? (b & 0xf) : (b >> 4);  // the even column in the low nibble
        expected[r * in + c] = e2m1_formula(nibble) * scales[r * groups + c / 32];
      }
  }
  LinearWeight weight() const {
    return LinearWeight::fp4_group_scaled(out, in, packed, scales, "test.w2.weight");
  }
};

void expect_bitwise(const float* actual, const float* expected, int64_t n, const std::string& what) {
  int64_t differing = 0;
  for (int64_t i = 0; i < n; ++i) differing += std::memcmp(&actual[i], &expected[i], sizeof(float)) != 0;
  EXPECT_EQ(differing, 0) << what << ": " << differing << " of " << n << " values differ";
}

std::vector<float> random_vector(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = normal(rng);
  return v;
}

TEST(LinearWeight, Fp8DecodesToTheFormula) {
  // Neither dimension a multiple of 128: partial scale blocks on both axes.
  const Fp8Matrix m(300, 200, 1);
  const LinearWeight w = m.weight();
  EXPECT_EQ(w.encoding(), WeightEncoding::kF8E4M3);
  EXPECT_EQ(w.shape(), (std::vector<int64_t>{300, 200}));
  expect_bitwise(w.dequantized().ptr(), m.expected.data(), 300 * 200, "whole matrix");
  std::vector<float> rows(static_cast<size_t>(50 * 200));
  w.dequantize_rows(110, 50, rows.data());  // straddles the row-block boundary at 128
  expect_bitwise(rows.data(), &m.expected[110 * 200], 50 * 200, "rows 110..160");
  // codes + one fp32 scale per row and 128 columns
  EXPECT_EQ(w.storage_bytes(), size_t{300 * 200 + 300 * 2 * 4});
  EXPECT_THROW(w.dense(), Error);
  EXPECT_THROW(w.dequantize_rows(290, 11, rows.data()), Error);
  // The checkpoint's block scales come back as given, and the codes as stored (the device FP8 GEMM's
  // operands).
  std::vector<float> block_scales;
  ASSERT_TRUE(w.fp8_block_scales(block_scales));
  EXPECT_EQ(block_scales, m.block_scales);
  EXPECT_EQ(w.codes(), m.codes);
}

TEST(LinearWeight, Fp4DecodesToTheFormula) {
  const Fp4Matrix m(70, 96, 2);
  const LinearWeight w = m.weight();
  EXPECT_EQ(w.encoding(), WeightEncoding::kFp4E2M1);
  expect_bitwise(w.dequantized().ptr(), m.expected.data(), 70 * 96, "whole matrix");
  std::vector<float> rows(static_cast<size_t>(3 * 96));
  w.dequantize_rows(67, 3, rows.data());
  expect_bitwise(rows.data(), &m.expected[67 * 96], 3 * 96, "last rows");
  EXPECT_EQ(w.storage_bytes(), size_t{70 * 48 + 70 * 3});  // packed pairs + one exponent byte per 32
}

TEST(LinearWeight, Fp4RejectsScalesThatAreNotPowersOfTwo) {
  Fp4Matrix m(4, 64, 3);
  m.scales[5] = 0.75f;
  try {
    (void)m.weight();
    FAIL() << "a 0.75 MXFP4 scale was accepted";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("test.w2.weight"));
    EXPECT_THAT(e.what(), HasSubstr("not a UE8M0 power of two"));
  }
  m.scales[5] = 0.0f;
  EXPECT_THROW((void)m.weight(), Error);
}

TEST(LinearWeight, ConcatRowsStacksAnyRowCount) {
  // 130 + 70 rows: the bottom matrix's first scale block lands mid-block of the stack.
  const Fp8Matrix top(130, 160, 4), bottom(70, 160, 5);
  const LinearWeight stacked = LinearWeight::concat_rows(top.weight(), bottom.weight());
  ASSERT_EQ(stacked.rows(), 200);
  const Tensor decoded = stacked.dequantized();
  expect_bitwise(decoded.ptr(), top.expected.data(), 130 * 160, "top");
  expect_bitwise(decoded.ptr() + 130 * 160, bottom.expected.data(), 70 * 160, "bottom");
  // Rows 128..129 carry top's second block scales, 130..199 bottom's first: no longer one scale per 128 rows.
  std::vector<float> unused;
  EXPECT_FALSE(stacked.fp8_block_scales(unused));
  std::vector<float> aligned;
  EXPECT_TRUE(
      LinearWeight::concat_rows(Fp8Matrix(128, 160, 17).weight(), bottom.weight()).fp8_block_scales(aligned));
  EXPECT_EQ(aligned.size(), size_t{2 * 2});

  const Fp4Matrix a(5, 64, 6), b(3, 64, 7);
  const Tensor fp4 = LinearWeight::concat_rows(a.weight(), b.weight()).dequantized();
  expect_bitwise(fp4.ptr(), a.expected.data(), 5 * 64, "fp4 top");
  expect_bitwise(fp4.ptr() + 5 * 64, b.expected.data(), 3 * 64, "fp4 bottom");

  Tensor dense({8, 64});
  dense.data = random_vector(8 * 64, 8);
  EXPECT_THROW(LinearWeight::concat_rows(a.weight(), LinearWeight(dense)), Error);  // encodings differ
  EXPECT_THROW(LinearWeight::concat_rows(top.weight(), a.weight()), Error);
}

// The quantized products equal the products over the dequantized matrix: bit for bit in the
// double-accumulated path (its sums do not depend on how outputs are grouped), to fp32 rounding in the BLAS
// path.
TEST(LinearWeight, QuantizedLinearsEqualTheDequantizedOnes) {
  const Fp8Matrix fp8(260, 384, 9);
  const Fp4Matrix fp4(130, 192, 10);
  for (const LinearWeight& w : {fp8.weight(), fp4.weight()}) {
    const Tensor dense = w.dequantized();
    const LinearWeight dense_weight(dense);
    const int64_t out = w.rows(), in = w.cols();
    for (const int64_t rows : {int64_t{1}, int64_t{7}}) {
      const std::vector<float> x = random_vector(rows * in, static_cast<uint32_t>(rows + out));
      for (const int64_t k_block : {int64_t{0}, int64_t{32}, int64_t{128}}) {
        std::vector<float> expected(static_cast<size_t>(rows * out)), actual(expected.size());
        ops::cpu::linear_f64(x.data(), rows, in, dense.ptr(), out, expected.data(), k_block);
        ops::cpu::linear_f64(x.data(), rows, w, actual.data(), k_block);
        expect_bitwise(actual.data(), expected.data(), rows * out,
                       "linear_f64 rows " + std::to_string(rows) + " k_block " + std::to_string(k_block));
        ops::cpu::linear_f64(x.data(), rows, dense_weight, actual.data(), k_block);
        expect_bitwise(actual.data(), expected.data(), rows * out, "dense LinearWeight");
      }
      // Rows [first, first + count) of the weight into a strided output: the grouped wo_a form.
      const int64_t first = 5, count = out - 11, y_stride = count + 3;
      std::vector<float> expected(static_cast<size_t>(rows * y_stride), -1.0f), actual(expected);
      ops::cpu::linear_f64_strided(x.data(), rows, in, in, dense.ptr() + first * in, count, expected.data(),
                                   y_stride, 128);
      ops::cpu::linear_f64_strided(x.data(), rows, in, w, first, count, actual.data(), y_stride, 128);
      expect_bitwise(actual.data(), expected.data(), rows * y_stride, "linear_f64_strided");

      // fp32 BLAS path, accumulating (beta 1) into a random y.
      std::vector<float> y0 = random_vector(rows * out, 11);
      std::vector<float> blas_expected(y0), blas_actual(y0);
      ops::cpu::linear(x.data(), rows, in, dense.ptr(), out, blas_expected.data(), 1.0f);
      ops::cpu::linear(x.data(), rows, w, blas_actual.data(), 1.0f);
      for (int64_t i = 0; i < rows * out; ++i)
        ASSERT_NEAR(blas_actual[i], blas_expected[i], 1e-5f * (1.0f + std::fabs(blas_expected[i]))) << i;
      std::vector<float> strided_expected(static_cast<size_t>(rows * y_stride), 2.0f),
          strided_actual(strided_expected);
      ops::cpu::linear_strided(x.data(), rows, in, in, dense.ptr() + first * in, count,
                               strided_expected.data(), y_stride);
      ops::cpu::linear_strided(x.data(), rows, in, w, first, count, strided_actual.data(), y_stride);
      for (int64_t i = 0; i < rows * y_stride; ++i)
        ASSERT_NEAR(strided_actual[i], strided_expected[i], 1e-5f * (1.0f + std::fabs(strided_expected[i])))
            << i;
    }
  }
}

// The plain absmax quantizer's squared error of one group: scale amax / reach rounded to bf16, nearest level.
// The requantizer searches a set of scales that includes this one, so it can only do better.
double absmax_group_error(const float* x, int bits, float offset) {
  float amax = 0.0f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
  if (amax == 0.0f) return 0.0;
  const float top = static_cast<float>((1 << bits) - 1);
  const float reach = std::max(offset, top - offset);
  const float scale = bf16_to_f32(f32_to_bf16(amax / reach));
  double error = 0.0;
  for (int i = 0; i < 32; ++i) {
    const float code = std::clamp(std::floor(x[i] / scale + offset + 0.5f), 0.0f, top);
    const double d = x[i] - (code - offset) * scale;
    error += d * d;
  }
  return error;
}

// Routed experts requantized below MXFP4 (issue 7 item 5): exact storage, decoded values on each format's
// grid, never worse than absmax per group, and a measured overall error.
TEST(LinearWeight, RequantizesToThreeAndTwoBits) {
  const Fp4Matrix source(96, 256, 14);
  struct Case {
    WeightEncoding encoding;
    int bits;
    float offset;
    double max_relative_rms;  // measured 0.179 (Q3) and 0.333 (Q2) on these uniformly random MXFP4 codes
  };
  for (const Case& c :
       {Case{WeightEncoding::kQ3G32, 3, 4.0f, 0.22}, Case{WeightEncoding::kQ2G32, 2, 1.5f, 0.45}}) {
    const LinearWeight w = source.weight().requantized(c.encoding);
    EXPECT_EQ(w.encoding(), c.encoding);
    EXPECT_EQ(w.shape(), source.weight().shape());
    // bits · params / 8: the weight planner's count (cache/weight_plan.h) is the real one.
    EXPECT_EQ(static_cast<double>(w.storage_bytes()),
              LinearWeight::bits_per_parameter(c.encoding) * 96 * 256 / 8);
    const Tensor decoded = w.dequantized();
    double error = 0.0, norm = 0.0;
    for (int64_t g = 0; g < 96 * 256 / 32; ++g) {
      const float* x = &source.expected[g * 32];
      const float* y = decoded.ptr() + g * 32;
      double group_error = 0.0;
      for (int i = 0; i < 32; ++i) {
        group_error += (x[i] - y[i]) * static_cast<double>(x[i] - y[i]);
        norm += static_cast<double>(x[i]) * x[i];
      }
      error += group_error;
      ASSERT_LE(group_error, absmax_group_error(x, c.bits, c.offset) * (1 + 1e-6)) << "group " << g;
      // On the grid: the values of a group are (integer − offset) times one scale, at most 2^bits distinct.
      std::vector<float> distinct(y, y + 32);
      std::sort(distinct.begin(), distinct.end());
      EXPECT_LE(std::unique(distinct.begin(), distinct.end()) - distinct.begin(), 1 << c.bits)
          << "group " << g;
    }
    const double relative_rms = std::sqrt(error / norm);
    std::printf("MXFP4 -> %d-bit groups of 32: relative RMS error %.3f\n", c.bits, relative_rms);
    EXPECT_LT(relative_rms, c.max_relative_rms);
    EXPECT_GT(relative_rms, 0.0);  // fewer levels than MXFP4's 15: something is lost

    // The products over it equal those over its dequantization, bit for bit (the FP4 expert path, k_block
    // 32).
    const std::vector<float> x = random_vector(3 * 256, 15);
    std::vector<float> expected(3 * 96), actual(3 * 96);
    ops::cpu::linear_f64(x.data(), 3, 256, decoded.ptr(), 96, expected.data(), 32);
    ops::cpu::linear_f64(x.data(), 3, w, actual.data(), 32);
    expect_bitwise(actual.data(), expected.data(), 3 * 96, "requantized linear_f64");
  }
  const Fp8Matrix odd(4, 200, 16);
  EXPECT_THROW((void)odd.weight().requantized(WeightEncoding::kQ3G32),
               Error);  // 200 columns: not groups of 32
  EXPECT_THROW((void)source.weight().requantized(WeightEncoding::kF8E4M3), Error);
}

// The quantizers' grids (core/weight_quantizer.h, computed from bits so the device shares them) against the
// formulas above, and low_bit_grouped rebuilding what requantized() made.
TEST(LinearWeight, QuantizerGridsAndTheLowBitFactory) {
  for (int code = 0; code <= 126; ++code)
    EXPECT_EQ(quantizer::e4m3_magnitude(code), e4m3_formula(static_cast<uint8_t>(code))) << "e4m3 " << code;
  for (int code = 0; code <= 7; ++code)
    EXPECT_EQ(quantizer::e2m1_magnitude(code), e2m1_formula(static_cast<uint8_t>(code))) << "e2m1 " << code;
  const Fp4Matrix source(8, 96, 19);
  for (const WeightEncoding encoding : {WeightEncoding::kQ3G32, WeightEncoding::kQ2G32}) {
    const LinearWeight w = source.weight().requantized(encoding);
    const LinearWeight rebuilt = LinearWeight::low_bit_grouped(encoding, 8, 96, w.codes(), w.group_scales());
    EXPECT_EQ(rebuilt.encoding(), encoding);
    EXPECT_EQ(rebuilt.dequantized().data, w.dequantized().data);
    EXPECT_THAT([&] { (void)LinearWeight::low_bit_grouped(encoding, 8, 64, w.codes(), w.group_scales()); },
                ::testing::ThrowsMessage<Error>(HasSubstr("expected")));
  }
  EXPECT_THROW((void)LinearWeight::low_bit_grouped(WeightEncoding::kF8E4M3, 1, 32, {}, {}), Error);

  // The extremes: a group so small that every candidate scale flushes to zero in bf16 decodes to zeros with
  // zero codes (no float → int conversion of x / 0); a group so large that every candidate's squared error
  // overflows still gets the first candidate's scale, not zero.
  Tensor extremes({2, 32});
  for (int i = 0; i < 32; ++i) {
    extremes.data[i] = (i % 2 ? 1.0f : -1.0f) * static_cast<float>(i + 1) * 0x1p-145f;
    extremes.data[32 + i] = (i % 2 ? 1.0f : -1.0f) * static_cast<float>(i + 1) * 0x1p110f;
  }
  for (const WeightEncoding encoding : {WeightEncoding::kQ3G32, WeightEncoding::kQ2G32}) {
    const LinearWeight w = LinearWeight(extremes).requantized(encoding);
    EXPECT_EQ(w.group_scales()[0], 0);
    const size_t group_bytes = w.codes().size() / 2;
    EXPECT_EQ(std::vector<uint8_t>(w.codes().begin(), w.codes().begin() + group_bytes),
              std::vector<uint8_t>(group_bytes, 0));
    EXPECT_GT(bf16_to_f32(w.group_scales()[1]), 0x1p100f);
    const Tensor decoded = w.dequantized();
    for (int i = 0; i < 32; ++i) EXPECT_EQ(decoded.data[i], 0.0f);
    for (int i = 32; i < 64; ++i) EXPECT_TRUE(std::isfinite(decoded.data[i]));
  }
}

// quantize_fp8_blocks against the recipe's own quantizers (ops/cpu/quantize.h): UE8M0 block scale of the
// 128×128 block's amax, e4m3 round-to-nearest-even of value / scale; blocks of very different magnitudes,
// partial blocks.
TEST(LinearWeight, QuantizesDenseWeightsToTheReleasedFp8Layout) {
  const int64_t rows = 300, cols = 200;
  Tensor dense({rows, cols});
  std::mt19937 rng(18);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      dense.data[r * cols + c] =
          normal(rng) * std::ldexp(1.0f, static_cast<int>((r / 128 + 2 * (c / 128)) * 3 - 9));
  dense.data[5] = 0.0f;
  const LinearWeight w = LinearWeight::quantize_fp8_blocks(dense);
  ASSERT_EQ(w.encoding(), WeightEncoding::kF8E4M3);
  std::vector<float> scales;
  ASSERT_TRUE(w.fp8_block_scales(scales));
  ASSERT_EQ(scales.size(), size_t{3 * 2});
  const Tensor decoded = w.dequantized();
  int64_t differing = 0;
  for (int64_t br = 0; br < 3; ++br)
    for (int64_t bc = 0; bc < 2; ++bc) {
      float amax = 0.0f;
      for (int64_t r = br * 128; r < std::min(rows, br * 128 + 128); ++r)
        for (int64_t c = bc * 128; c < std::min(cols, bc * 128 + 128); ++c)
          amax = std::max(amax, std::fabs(dense.data[r * cols + c]));
      const float scale = ops::cpu::ue8m0_scale(amax, ops::cpu::kE4m3Max, 1e-4f);
      EXPECT_EQ(scales[br * 2 + bc], scale) << "block " << br << ", " << bc;
      for (int64_t r = br * 128; r < std::min(rows, br * 128 + 128); ++r)
        for (int64_t c = bc * 128; c < std::min(cols, bc * 128 + 128); ++c) {
          const float expected = ops::cpu::e4m3_round(dense.data[r * cols + c] / scale) * scale;
          differing += std::memcmp(&expected, &decoded.data[r * cols + c], sizeof(float)) != 0 &&
                       !(expected == 0.0f && decoded.data[r * cols + c] == 0.0f);
        }
    }
  EXPECT_EQ(differing, 0);
}

// quantize_mxfp4_groups against the recipe's FP4 quantizer (ops/cpu/quantize.h quantize_e2m1_blocks: UE8M0
// scale of each 32-wide group's amax, e2m1 round-to-nearest-even): rows of very different magnitudes, an
// all-zero group.
TEST(LinearWeight, QuantizesDenseWeightsToTheMxfp4Layout) {
  const int64_t rows = 37, cols = 96;
  Tensor dense({rows, cols});
  std::mt19937 rng(19);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      dense.data[r * cols + c] = normal(rng) * std::ldexp(1.0f, static_cast<int>(r % 7) * 3 - 12);
  for (int64_t c = 32; c < 64; ++c) dense.data[3 * cols + c] = 0.0f;
  const LinearWeight w = LinearWeight::quantize_mxfp4_groups(dense);
  ASSERT_EQ(w.encoding(), WeightEncoding::kFp4E2M1);
  EXPECT_EQ(w.storage_bytes(), static_cast<size_t>(rows * cols / 2 + rows * cols / 32));
  std::vector<float> expected = dense.data;
  for (int64_t r = 0; r < rows; ++r) ops::cpu::quantize_e2m1_blocks(expected.data() + r * cols, cols, 32);
  const Tensor decoded = w.dequantized();
  int64_t differing = 0;
  for (size_t i = 0; i < expected.size(); ++i)
    differing += expected[i] != decoded.data[i];  // -0 == +0: the sign of a zero code is not kept
  EXPECT_EQ(differing, 0);
  EXPECT_THROW((void)LinearWeight::quantize_mxfp4_groups(Tensor({4, 48})), Error);
}

TEST(LinearWeight, RowRangeOutsideTheWeightThrows) {
  const Fp8Matrix m(16, 128, 12);
  const LinearWeight w = m.weight();
  const std::vector<float> x = random_vector(128, 13);
  std::vector<float> y(16);
  EXPECT_THROW(ops::cpu::linear_f64_strided(x.data(), 1, 128, w, 10, 7, y.data(), 16), Error);
  EXPECT_THROW(ops::cpu::linear_strided(x.data(), 1, 128, w, -1, 4, y.data(), 16), Error);
}

}  // namespace
}  // namespace dsv4
