// cuBLASLt projections (ops/cuda/gemm.h) against a naive fp64 product: the exact fp32 mode, bf16 operands, the
// strided batch the grouped output projection uses, two weights over one input (x batch stride 0, the compressor's
// wkv ‖ wgate), the bf16 output (wo_a straight into wo_b's operand), and one Gemm serving many row counts through
// its row buckets.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "ops/cuda/gemm.h"
#include "small_ops_util.h"

namespace dsv4::ops::cuda {
namespace {

using testing::small_ops::DeviceArray;

class CudaGemm : public testing::small_ops::GpuTest {};

std::vector<float> random_values(size_t count, uint32_t seed, bool bf16_grid) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.1f, 1.0f);
  std::vector<float> v(count);
  for (auto& x : v) x = bf16_grid ? bf16_to_f32(f32_to_bf16(normal(rng))) : normal(rng);
  return v;
}

std::vector<uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = f32_to_bf16(v[i]);
  return out;
}

// y[b][r, o] = Σ_i x[b·xs + r·in + i] · w[b·in·out + o·in + i] in fp64.
std::vector<double> naive(const std::vector<float>& w, const std::vector<float>& x, int64_t batch, int64_t rows,
                          int64_t out, int64_t in, int64_t x_batch_stride) {
  std::vector<double> y(static_cast<size_t>(batch * rows * out));
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t o = 0; o < out; ++o) {
        double sum = 0;
        for (int64_t i = 0; i < in; ++i)
          sum += static_cast<double>(x[b * x_batch_stride + r * in + i]) * w[(b * out + o) * in + i];
        y[(b * rows + r) * out + o] = sum;
      }
  return y;
}

double rel_l2(const std::vector<float>& actual, const std::vector<double>& expected) {
  double num = 0, den = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    num += (actual[i] - expected[i]) * (actual[i] - expected[i]);
    den += expected[i] * expected[i];
  }
  return std::sqrt(num / den);
}

TEST_F(CudaGemm, Fp32LinearIsExactToRounding) {
  const int64_t rows = 7, out = 96, in = 160;
  const auto w = random_values(out * in, 1, false), x = random_values(rows * in, 2, false);
  DeviceArray<float> dw(w), dx(x), dy(static_cast<size_t>(rows * out));
  Gemm gemm;
  gemm.linear({dw.get(), GemmDtype::kF32, out, in, 0}, dx.get(), rows, dy.get(), nullptr);
  EXPECT_LE(rel_l2(dy.download(), naive(w, x, 1, rows, out, in, 0)), 1e-6);
}

TEST_F(CudaGemm, TwoWeightsOverOneInput) {
  for (const GemmDtype dtype : {GemmDtype::kF32, GemmDtype::kBf16}) {
    const bool bf16 = dtype == GemmDtype::kBf16;
    const int64_t rows = 5, out = 64, in = 256;
    const auto w = random_values(2 * out * in, 3, bf16), x = random_values(rows * in, 4, bf16);
    DeviceArray<float> dw32(w), dx32(x), dy(static_cast<size_t>(2 * rows * out));
    DeviceArray<uint16_t> dw16(to_bf16(w)), dx16(to_bf16(x));
    const void* wp = bf16 ? static_cast<const void*>(dw16.get()) : dw32.get();
    const void* xp = bf16 ? static_cast<const void*>(dx16.get()) : dx32.get();
    Gemm gemm;
    gemm.linear_batched({wp, dtype, out, in, 0}, 2, out * in, xp, in, 0, rows, dy.get(), out, rows * out, nullptr);
    EXPECT_LE(rel_l2(dy.download(), naive(w, x, 2, rows, out, in, 0)), bf16 ? 1e-5 : 1e-6) << (bf16 ? "bf16" : "f32");
  }
}

TEST_F(CudaGemm, GroupedBatchWithBf16Output) {
  // wo_a's shape on a small scale: G groups, group g reads its own column slice of x and writes its slice of y.
  const int64_t groups = 4, rows = 3, out = 32, group_in = 128;
  const auto w = random_values(groups * out * group_in, 5, true), x = random_values(rows * groups * group_in, 6, true);
  DeviceArray<uint16_t> dw(to_bf16(w)), dx(to_bf16(x)), dy(static_cast<size_t>(rows * groups * out));
  Gemm gemm;
  gemm.linear_batched({dw.get(), GemmDtype::kBf16, out, group_in, 0}, groups, out * group_in, dx.get(),
                      groups * group_in, group_in, rows, dy.get(), groups * out, out, nullptr, GemmDtype::kBf16);
  const std::vector<uint16_t> y = dy.download();
  // The naive grouped product, then bf16 rounding: every value within half a bf16 ulp (+ accumulation noise).
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t o = 0; o < out; ++o) {
        double sum = 0;
        for (int64_t i = 0; i < group_in; ++i)
          sum += static_cast<double>(x[r * groups * group_in + g * group_in + i]) * w[(g * out + o) * group_in + i];
        const float actual = bf16_to_f32(y[static_cast<size_t>(r * groups * out + g * out + o)]);
        EXPECT_NEAR(actual, sum, std::abs(sum) * (1.0 / 256) + 1e-4) << "group " << g << " row " << r << " out " << o;
      }
}

// Above 64 rows one plan serves a power-of-two bucket of row counts, each call describing its own rows (gemm.h):
// one Gemm over many prefill lengths — bf16 and fp32, plain and strided-batched, rows in and across buckets,
// every length twice in shuffled order (a plan made for 128 rows then serving 65) — against the naive product.
TEST_F(CudaGemm, RowBucketsServeEveryRowCount) {
  const int64_t out = 96, in = 192, max_rows = 300;
  for (const GemmDtype dtype : {GemmDtype::kBf16, GemmDtype::kF32}) {
    const bool bf16 = dtype == GemmDtype::kBf16;
    const auto w = random_values(2 * out * in, 11, bf16), x = random_values(max_rows * in, 12, bf16);
    DeviceArray<float> dw32(w), dx32(x), dy(static_cast<size_t>(2 * max_rows * out));
    DeviceArray<uint16_t> dw16(to_bf16(w)), dx16(to_bf16(x));
    const void* wp = bf16 ? static_cast<const void*>(dw16.get()) : dw32.get();
    const void* xp = bf16 ? static_cast<const void*>(dx16.get()) : dx32.get();
    std::vector<int64_t> lengths = {128, 65, 100, 127, 129, 255, 256, 257, 300, 64, 1, 200, 65, 300, 129};
    std::mt19937 rng(13);
    std::shuffle(lengths.begin(), lengths.end(), rng);
    Gemm gemm;
    for (const int64_t rows : lengths) {
      SCOPED_TRACE(::testing::Message() << (bf16 ? "bf16" : "f32") << ", " << rows << " rows");
      dy.poison();
      gemm.linear({wp, dtype, out, in, 0}, xp, rows, dy.get(), nullptr);
      std::vector<float> y = dy.download();
      y.resize(static_cast<size_t>(rows * out));
      for (const float v : y) ASSERT_FALSE(std::isnan(v)) << "an output left unwritten";
      EXPECT_LE(rel_l2(y, naive(w, x, 1, rows, out, in, 0)), bf16 ? 1e-5 : 1e-6);
      // The batched form (two weights over one input) through the same buckets.
      dy.poison();
      gemm.linear_batched({wp, dtype, out, in, 0}, 2, out * in, xp, in, 0, rows, dy.get(), out, rows * out, nullptr);
      std::vector<float> y2 = dy.download();
      y2.resize(static_cast<size_t>(2 * rows * out));
      EXPECT_LE(rel_l2(y2, naive(w, x, 2, rows, out, in, 0)), bf16 ? 1e-5 : 1e-6) << "batched";
    }
  }
}

}  // namespace
}  // namespace dsv4::ops::cuda
