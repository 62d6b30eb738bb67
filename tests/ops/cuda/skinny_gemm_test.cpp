// The decode-shaped bf16 GEMM (ops/cuda/skinny_gemm.h) against a naive fp64 product of the same bf16 values:
// 1..16 rows (both kernel variants: ≤ 8 and ≤ 16 tokens), output counts that are not multiples of the 8-row
// tile, `in` not a multiple of the 32-wide step (and shorter than one step), every warp count the launch picks,
// padded strides, a strided batch over column slices of x, one x for two weights (x batch stride 0), bf16
// output, accumulation into y; poisoned outputs, bitwise repeat, rejected shapes. And the fp32 router GEMV.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "ops/cuda/skinny_gemm.h"
#include "small_ops_util.h"

namespace dsv4::ops::cuda {
namespace {

using testing::small_ops::bitwise_equal;
using testing::small_ops::DeviceArray;

class CudaSkinnyGemm : public testing::small_ops::GpuTest {};

std::vector<uint16_t> random_bf16(size_t count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.05f, 1.0f);
  std::vector<uint16_t> v(count);
  for (auto& x : v) x = f32_to_bf16(normal(rng));
  return v;
}

void check(const SkinnyGemmParams& p, uint32_t seed) {
  SCOPED_TRACE(::testing::Message() << "rows " << p.rows << " out " << p.out << " in " << p.in << " batch " << p.batch
                                    << (p.bf16_output ? " bf16 out" : ""));
  const int64_t w_count = (p.batch - 1) * p.w_batch_stride + (p.out - 1) * p.w_stride + p.in;
  const int64_t x_count = (p.batch - 1) * p.x_batch_stride + (p.rows - 1) * p.x_stride + p.in;
  const int64_t y_count = (p.batch - 1) * p.y_batch_stride + (p.rows - 1) * p.y_stride + p.out;
  const auto w = random_bf16(static_cast<size_t>(w_count), seed), x = random_bf16(static_cast<size_t>(x_count), seed + 1);
  DeviceArray<uint16_t> dw(w), dx(x);
  DeviceArray<float> dy32(static_cast<size_t>(y_count));
  std::vector<float> y_before;
  if (p.accumulate) {  // y += x · Wᵀ over random y
    std::mt19937 rng(seed + 2);
    std::normal_distribution<float> normal(0.0f, 4.0f);
    y_before.resize(static_cast<size_t>(y_count));
    for (auto& v : y_before) v = normal(rng);
    dy32.upload(y_before);
  }
  DeviceArray<uint16_t> dy16(static_cast<size_t>(y_count));
  void* y = p.bf16_output ? static_cast<void*>(dy16.get()) : static_cast<void*>(dy32.get());
  ASSERT_TRUE(skinny_gemm_supported(p, dw.get(), dx.get()));
  ASSERT_EQ(skinny_gemm(p, dw.get(), dx.get(), y, nullptr), cudaSuccess);
  std::vector<float> actual(static_cast<size_t>(y_count));
  if (p.bf16_output) {
    const auto bits = dy16.download();
    for (size_t i = 0; i < bits.size(); ++i) actual[i] = bf16_to_f32(bits[i]);
  } else {
    actual = dy32.download();
  }
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t t = 0; t < p.rows; ++t)
      for (int64_t o = 0; o < p.out; ++o) {
        double sum = p.accumulate ? y_before[static_cast<size_t>(b * p.y_batch_stride + t * p.y_stride + o)] : 0.0;
        double magnitude = std::abs(sum);
        for (int64_t i = 0; i < p.in; ++i) {
          const double product = static_cast<double>(bf16_to_f32(w[b * p.w_batch_stride + o * p.w_stride + i])) *
                                 bf16_to_f32(x[b * p.x_batch_stride + t * p.x_stride + i]);
          sum += product;
          magnitude += std::abs(product);
        }
        const float got = actual[static_cast<size_t>(b * p.y_batch_stride + t * p.y_stride + o)];
        // fp32 accumulation: error ≲ in · 2^-24 · Σ|products|; bf16 output adds half an ulp of the result.
        const double bound = 1e-6 * magnitude + (p.bf16_output ? std::abs(sum) / 256 : 0.0);
        ASSERT_NEAR(got, sum, bound) << "batch " << b << " row " << t << " out " << o;
      }
  // Outputs between the rows' strides are untouched (still the poison), and the result repeats bitwise.
  if (!p.bf16_output && p.y_stride > p.out) {
    const auto raw = dy32.download();
    EXPECT_TRUE(std::isnan(raw[static_cast<size_t>(p.out)])) << "wrote past a row";
  }
  if (p.accumulate) dy32.upload(y_before);
  ASSERT_EQ(skinny_gemm(p, dw.get(), dx.get(), y, nullptr), cudaSuccess);
  if (!p.bf16_output) {
    EXPECT_TRUE(bitwise_equal(dy32.download(), actual)) << "not bitwise repeatable";
  }
}

SkinnyGemmParams plain(int64_t rows, int64_t out, int64_t in) {
  SkinnyGemmParams p;
  p.rows = rows;
  p.out = out;
  p.in = in;
  p.w_stride = in;
  p.x_stride = in;
  p.y_stride = out;
  return p;
}

TEST_F(CudaSkinnyGemm, DecodeShapesMatchNaiveProduct) {
  uint32_t seed = 1;
  for (const int64_t rows : {1, 2, 3, 5, 8, 9, 13, 16}) {
    check(plain(rows, 1024, 4096), seed++);  // wq_a: 16 warps a tile
    check(plain(rows, 37, 1024), seed++);    // out not a multiple of 8
    check(plain(rows, 64, 4104), seed++);    // in not a multiple of the 32-wide step
  }
  check(plain(1, 4096, 8192), seed++);   // wo_b: 4 warps a tile, several batches of steps each
  check(plain(8, 32768, 1024), seed++);  // wq_b: 4096 tiles
  check(plain(3, 19, 24), seed++);       // in shorter than one step: one warp
  check(plain(16, 8, 200), seed++);
}

TEST_F(CudaSkinnyGemm, StridesBatchesAndBf16Output) {
  // wo_a: 4 groups, group g reads columns [g·256, (g+1)·256) of x and writes its slice of y, in bf16.
  SkinnyGemmParams grouped = plain(3, 32, 256);
  grouped.batch = 4;
  grouped.w_batch_stride = 32 * 256;
  grouped.x_stride = 4 * 256;
  grouped.x_batch_stride = 256;
  grouped.y_stride = 4 * 32;
  grouped.y_batch_stride = 32;
  grouped.bf16_output = true;
  check(grouped, 11);
  // The compressor's wkv ‖ wgate: one x, two weights, outputs one after the other.
  SkinnyGemmParams pair = plain(2, 48, 512);
  pair.batch = 2;
  pair.w_batch_stride = 48 * 512;
  pair.x_batch_stride = 0;
  pair.y_batch_stride = 2 * 48;
  check(pair, 12);
  // Padded row strides of W, x and y.
  SkinnyGemmParams padded = plain(4, 20, 96);
  padded.w_stride = 104;
  padded.x_stride = 112;
  padded.y_stride = 25;
  check(padded, 13);
  // y += x · Wᵀ (the residual-adding linears), at both kernel variants.
  SkinnyGemmParams accumulate = plain(2, 40, 520);
  accumulate.accumulate = true;
  check(accumulate, 14);
  accumulate.rows = 11;
  check(accumulate, 15);
}

TEST_F(CudaSkinnyGemm, RejectsWhatItDoesNotTake) {
  DeviceArray<uint16_t> buffer(4096);
  SkinnyGemmParams p = plain(17, 16, 64);  // too many rows
  EXPECT_FALSE(skinny_gemm_supported(p, buffer.get(), buffer.get()));
  EXPECT_EQ(skinny_gemm(p, buffer.get(), buffer.get(), buffer.get(), nullptr), cudaErrorInvalidValue);
  p = plain(1, 16, 60);  // in not a multiple of 8
  EXPECT_FALSE(skinny_gemm_supported(p, buffer.get(), buffer.get()));
  p = plain(1, 16, 64);  // misaligned x
  EXPECT_FALSE(skinny_gemm_supported(p, buffer.get(), buffer.get() + 1));
  EXPECT_TRUE(skinny_gemm_supported(p, buffer.get(), buffer.get()));
  p.accumulate = true;  // accumulation is fp32 only
  p.bf16_output = true;
  EXPECT_FALSE(skinny_gemm_supported(p, buffer.get(), buffer.get()));
}

// Gathered batches (w_batch_index): batch b multiplies expert index[b] of a stack of 8, as a batch-1 decode's
// routed experts; a repeated expert, and indices outside the stack write zeros.
TEST_F(CudaSkinnyGemm, GatheredBatchesReadTheIndexedWeights) {
  constexpr int64_t kExperts = 8, kOut = 72, kIn = 200;
  const std::vector<int32_t> index = {3, 0, 7, 7, -1, 9};
  const auto batches = static_cast<int64_t>(index.size());
  const auto w = random_bf16(static_cast<size_t>(kExperts * kOut * kIn), 41);
  for (const bool per_batch_x : {false, true}) {
    SCOPED_TRACE(per_batch_x ? "x per batch" : "one x");
    const auto x = random_bf16(static_cast<size_t>((per_batch_x ? batches : 1) * kIn), 42);
    DeviceArray<uint16_t> dw(w), dx(x);
    DeviceArray<int32_t> dindex(index);
    DeviceArray<float> dy(static_cast<size_t>(batches * kOut));
    SkinnyGemmParams p = plain(1, kOut, kIn);
    p.batch = batches;
    p.w_batch_stride = kOut * kIn;
    p.x_batch_stride = per_batch_x ? kIn : 0;
    p.y_batch_stride = kOut;
    p.w_batch_index = dindex.get();
    p.w_batch_count = kExperts;
    ASSERT_TRUE(skinny_gemm_supported(p, dw.get(), dx.get()));
    ASSERT_EQ(skinny_gemm(p, dw.get(), dx.get(), dy.get(), nullptr), cudaSuccess);
    const std::vector<float> actual = dy.download();
    for (int64_t b = 0; b < batches; ++b)
      for (int64_t o = 0; o < kOut; ++o) {
        const float got = actual[static_cast<size_t>(b * kOut + o)];
        if (index[b] < 0 || index[b] >= kExperts) {
          ASSERT_EQ(got, 0.0f) << "batch " << b;
          continue;
        }
        double sum = 0.0, magnitude = 0.0;
        for (int64_t i = 0; i < kIn; ++i) {
          const double product = static_cast<double>(bf16_to_f32(w[(index[b] * kOut + o) * kIn + i])) *
                                  bf16_to_f32(x[(per_batch_x ? b : 0) * kIn + i]);
          sum += product;
          magnitude += std::abs(product);
        }
        ASSERT_NEAR(got, sum, 1e-6 * magnitude) << "batch " << b << " out " << o;
      }
    p.accumulate = true;  // gathered batches do not accumulate
    EXPECT_FALSE(skinny_gemm_supported(p, dw.get(), dx.get()));
  }
}

// skinny_gemm_f32 (the fp32 router GEMV) against an fp64 product of the same fp32 values: 1..8 rows, V4-Flash's
// router (256 × 4096), the 4-layer cut's (16 × 4096), odd out, `in` shorter than one pass of the CTA, padded
// strides; poisoned outputs, bitwise repeat, rejected shapes.
void check_f32(const SkinnyGemmParams& p, uint32_t seed) {
  SCOPED_TRACE(::testing::Message() << "fp32 rows " << p.rows << " out " << p.out << " in " << p.in);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.02f, 1.0f);
  std::vector<float> w(static_cast<size_t>((p.out - 1) * p.w_stride + p.in)),
      x(static_cast<size_t>((p.rows - 1) * p.x_stride + p.in));
  for (auto& v : w) v = normal(rng);
  for (auto& v : x) v = normal(rng);
  DeviceArray<float> dw(w), dx(x), dy(static_cast<size_t>((p.rows - 1) * p.y_stride + p.out));
  ASSERT_TRUE(skinny_gemm_f32_supported(p, dw.get(), dx.get()));
  ASSERT_EQ(skinny_gemm_f32(p, dw.get(), dx.get(), dy.get(), nullptr), cudaSuccess);
  const std::vector<float> actual = dy.download();
  for (int64_t t = 0; t < p.rows; ++t)
    for (int64_t o = 0; o < p.out; ++o) {
      double sum = 0.0, magnitude = 0.0;
      for (int64_t i = 0; i < p.in; ++i) {
        const double product = static_cast<double>(w[o * p.w_stride + i]) * x[t * p.x_stride + i];
        sum += product;
        magnitude += std::abs(product);
      }
      ASSERT_NEAR(actual[static_cast<size_t>(t * p.y_stride + o)], sum, 2e-6 * magnitude) << "row " << t << " out " << o;
    }
  if (p.y_stride > p.out) {
    EXPECT_TRUE(std::isnan(actual[static_cast<size_t>(p.out)])) << "wrote past a row";
  }
  dy.poison();
  ASSERT_EQ(skinny_gemm_f32(p, dw.get(), dx.get(), dy.get(), nullptr), cudaSuccess);
  EXPECT_TRUE(bitwise_equal(dy.download(), actual)) << "not bitwise repeatable";
}

TEST_F(CudaSkinnyGemm, Fp32RouterShapesMatchNaiveProduct) {
  uint32_t seed = 100;
  for (const int64_t rows : {1, 2, 5, 8})
    for (const auto& [out, in] : std::vector<std::pair<int64_t, int64_t>>{{256, 4096}, {16, 4096}, {7, 12}, {33, 2052}})
      check_f32(plain(rows, out, in), seed++);
  SkinnyGemmParams padded = plain(3, 20, 1000);
  padded.w_stride = 1004;
  padded.x_stride = 1024;
  padded.y_stride = 24;
  check_f32(padded, seed++);
  DeviceArray<float> buffer(4096);
  SkinnyGemmParams p = plain(9, 16, 64);  // too many rows
  EXPECT_FALSE(skinny_gemm_f32_supported(p, buffer.get(), buffer.get()));
  EXPECT_EQ(skinny_gemm_f32(p, buffer.get(), buffer.get(), buffer.get(), nullptr), cudaErrorInvalidValue);
  p = plain(1, 16, 62);  // in not a multiple of 4
  EXPECT_FALSE(skinny_gemm_f32_supported(p, buffer.get(), buffer.get()));
  p = plain(1, 16, 64);
  EXPECT_FALSE(skinny_gemm_f32_supported(p, buffer.get(), buffer.get() + 1));  // misaligned x
  p.accumulate = true;
  EXPECT_FALSE(skinny_gemm_f32_supported(p, buffer.get(), buffer.get()));
}

}  // namespace
}  // namespace dsv4::ops::cuda
