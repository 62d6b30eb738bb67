// The fused per-head RMSNorm + RoPE + bf16 cast against its CPU twin (ops/cpu/norm.h rms_norm over each head, then
// ops/cpu/rope.h apply_rope): V4-Flash q (64 × 512, rope 64, unweighted), K=V (1 × 512, kv_norm weight), the
// indexer query (64 × 128, RoPE only), a tiny shape, positions near 1,000,000; the bf16 output is bitwise the
// fp32 output rounded (core/dtype.h); poisoned outputs; bitwise repeat.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "ops/cpu/norm.h"
#include "ops/cpu/rope.h"
#include "ops/cuda/head_norm_rope.h"
#include "small_ops_util.h"

namespace dsv4::ops::cuda {
namespace {

using testing::small_ops::bitwise_equal;
using testing::small_ops::DeviceArray;

class CudaHeadNormRope : public testing::small_ops::GpuTest {};

struct Case {
  int64_t rows, heads, head_dim, rope_dim;
  bool normalize, weighted;
  float theta, attention_scaling;
  int64_t min_position, max_position;
};

void check(const Case& c) {
  SCOPED_TRACE(::testing::Message() << c.rows << "x" << c.heads << "x" << c.head_dim << " rope " << c.rope_dim
                                    << (c.normalize ? " norm" : "") << (c.weighted ? " weighted" : "") << " pos "
                                    << c.min_position << ".." << c.max_position);
  const int64_t count = c.rows * c.heads * c.head_dim;
  std::mt19937 rng(static_cast<uint32_t>(c.rows * 7 + c.heads * 131 + c.head_dim + c.max_position));
  std::normal_distribution<float> normal(0.3f, 1.7f);
  std::vector<float> x(static_cast<size_t>(count)), weight(static_cast<size_t>(c.head_dim));
  for (auto& v : x) v = normal(rng);
  for (auto& v : weight) v = 1.0f + 0.1f * normal(rng);
  std::uniform_int_distribution<int64_t> pick(c.min_position, c.max_position);
  std::vector<int64_t> positions(static_cast<size_t>(c.rows));
  for (auto& p : positions) p = pick(rng);
  positions.front() = c.min_position;
  positions.back() = c.max_position;
  std::vector<int32_t> positions32(positions.begin(), positions.end());
  std::vector<float> inv_freq(static_cast<size_t>(c.rope_dim / 2));
  for (size_t i = 0; i < inv_freq.size(); ++i)
    inv_freq[i] = static_cast<float>(std::pow(static_cast<double>(c.theta), -2.0 * static_cast<double>(i) / c.rope_dim));

  std::vector<float> expected = x;
  if (c.normalize)
    cpu::rms_norm(expected.data(), c.rows * c.heads, c.head_dim, c.head_dim, c.weighted ? weight.data() : nullptr,
                  1e-6f, expected.data());
  cpu::apply_rope(expected.data(), c.rows, c.heads * c.head_dim, c.heads, c.head_dim, positions.data(),
                  cpu::RopeTable{inv_freq, c.attention_scaling});

  DeviceArray<float> d_x(x), d_weight(weight), d_freq(inv_freq);
  DeviceArray<int32_t> d_pos(positions32);
  DeviceArray<uint16_t> d_bf16(static_cast<size_t>(count));  // poisoned
  const HeadNormRopeParams p{c.rows, c.heads, c.head_dim, c.rope_dim, c.normalize, 1e-6f, c.attention_scaling};
  ASSERT_EQ(head_norm_rope(p, d_x.get(), c.weighted ? d_weight.get() : nullptr, d_pos.get(), d_freq.get(),
                           d_bf16.get(), nullptr),
            cudaSuccess);
  const std::vector<float> actual = d_x.download();
  const std::vector<uint16_t> actual_bf16 = d_bf16.download();

  EXPECT_LE(testing::small_ops::rel_l2(actual, expected), 2e-6);
  double worst = 0;
  for (size_t i = 0; i < expected.size(); ++i)
    worst = std::max(worst, std::abs(static_cast<double>(actual[i]) - expected[i]) / (1.0 + std::abs(expected[i])));
  EXPECT_LE(worst, 1e-5) << "max relative difference";
  for (size_t i = 0; i < actual.size(); ++i)
    ASSERT_EQ(actual_bf16[i], f32_to_bf16(actual[i])) << "bf16 output " << i << " is not the rounded fp32 output";
  if (!c.normalize) {  // channels before the rope slice pass through bitwise
    for (int64_t h = 0; h < c.rows * c.heads; ++h)
      for (int64_t i = 0; i < c.head_dim - c.rope_dim; ++i)
        ASSERT_EQ(actual[h * c.head_dim + i], x[h * c.head_dim + i]);
  }

  // Bitwise repeatable, and the bf16 output is optional.
  d_x.upload(x);
  ASSERT_EQ(head_norm_rope(p, d_x.get(), c.weighted ? d_weight.get() : nullptr, d_pos.get(), d_freq.get(), nullptr,
                           nullptr),
            cudaSuccess);
  EXPECT_TRUE(bitwise_equal(d_x.download(), actual)) << "not bitwise repeatable";

  // keep_fp32 = false: the same bf16 result, the fp32 input left as it was; refused without a bf16 output.
  d_x.upload(x);
  DeviceArray<uint16_t> d_bf16_only(static_cast<size_t>(count));  // poisoned
  HeadNormRopeParams bf16_only = p;
  bf16_only.keep_fp32 = false;
  ASSERT_EQ(head_norm_rope(bf16_only, d_x.get(), c.weighted ? d_weight.get() : nullptr, d_pos.get(), d_freq.get(),
                           d_bf16_only.get(), nullptr),
            cudaSuccess);
  EXPECT_TRUE(bitwise_equal(d_x.download(), x)) << "keep_fp32 = false wrote the fp32 values";
  EXPECT_EQ(d_bf16_only.download(), actual_bf16);
  EXPECT_EQ(head_norm_rope(bf16_only, d_x.get(), nullptr, d_pos.get(), d_freq.get(), nullptr, nullptr),
            cudaErrorInvalidValue);
}

TEST_F(CudaHeadNormRope, V4FlashShapesMatchCpuTwin) {
  check({33, 64, 512, 64, true, false, 10000.0f, 1.0f, 0, 70000});     // q, main rope
  check({9, 64, 512, 64, true, false, 160000.0f, 1.2f, 0, 70000});     // q, compress rope (YaRN scaling)
  check({129, 1, 512, 64, true, true, 10000.0f, 1.0f, 0, 8191});       // K=V with kv_norm
  check({17, 64, 128, 64, false, false, 160000.0f, 1.2f, 0, 70000});   // indexer query
}

TEST_F(CudaHeadNormRope, TinyShapesMatchCpuTwin) {
  check({5, 4, 128, 32, true, false, 10000.0f, 1.0f, 0, 300});
  check({3, 1, 128, 128, true, true, 10000.0f, 1.0f, 0, 300});  // the whole head rotates
  check({7, 3, 10, 4, true, true, 10000.0f, 0.9f, 0, 50});      // a head narrower than a warp
  check({6, 2, 64, 0, true, true, 10000.0f, 1.0f, 0, 50});      // no rope slice: the norm alone
}

TEST_F(CudaHeadNormRope, PositionsNearOneMillionMatchCpuTwin) {
  check({64, 64, 512, 64, true, false, 10000.0f, 1.0f, 999'000, 1'048'575});
  check({16, 64, 128, 64, false, false, 160000.0f, 1.2f, 1'000'000, 1'000'063});
}

// Numerics::kDeepSeek's roundings against the CPU's kDeepSeek steps: the unweighted q norm with bf16
// intermediates (ops::cpu::head_rms_norm_bf16), the weighted K=V norm rounded before RoPE, the result rounded.
// The device sums a head's bf16 squares in another order (lanes, then a tree), so a mean that lands on a bf16
// rounding boundary can move its whole head by one ulp: every value must be within one bf16 ulp, and almost all
// equal.
void check_deepseek(const Case& c) {
  SCOPED_TRACE(::testing::Message() << c.rows << "x" << c.heads << "x" << c.head_dim << " rope " << c.rope_dim
                                    << (c.weighted ? " weighted" : ""));
  const int64_t count = c.rows * c.heads * c.head_dim;
  std::mt19937 rng(static_cast<uint32_t>(c.rows * 5 + c.heads * 17 + c.head_dim));
  std::normal_distribution<float> normal(0.1f, 2.3f);
  std::vector<float> x(static_cast<size_t>(count)), weight(static_cast<size_t>(c.head_dim));
  for (auto& v : x) v = bf16_to_f32(f32_to_bf16(normal(rng)));  // a bf16 projection's output
  for (auto& v : weight) v = 1.0f + 0.1f * normal(rng);
  std::vector<int64_t> positions(static_cast<size_t>(c.rows));
  std::uniform_int_distribution<int64_t> pick(c.min_position, c.max_position);
  for (auto& p : positions) p = pick(rng);
  std::vector<int32_t> positions32(positions.begin(), positions.end());
  std::vector<float> inv_freq(static_cast<size_t>(c.rope_dim / 2));
  for (size_t i = 0; i < inv_freq.size(); ++i)
    inv_freq[i] = static_cast<float>(std::pow(static_cast<double>(c.theta), -2.0 * static_cast<double>(i) / c.rope_dim));
  auto round_all = [](std::vector<float>& v) {
    for (float& e : v) e = bf16_to_f32(f32_to_bf16(e));
  };
  std::vector<float> expected = x;
  if (c.weighted) {
    cpu::rms_norm(expected.data(), c.rows * c.heads, c.head_dim, c.head_dim, weight.data(), 1e-6f, expected.data());
    round_all(expected);
  } else {
    cpu::head_rms_norm_bf16(expected.data(), c.rows * c.heads, c.head_dim, 1e-6f);
  }
  cpu::apply_rope(expected.data(), c.rows, c.heads * c.head_dim, c.heads, c.head_dim, positions.data(),
                  cpu::RopeTable{inv_freq, c.attention_scaling});
  round_all(expected);

  DeviceArray<float> d_x(x), d_weight(weight), d_freq(inv_freq);
  DeviceArray<int32_t> d_pos(positions32);
  DeviceArray<uint16_t> d_bf16(static_cast<size_t>(count));
  HeadNormRopeParams p{c.rows, c.heads, c.head_dim, c.rope_dim, true, 1e-6f, c.attention_scaling};
  p.deepseek_roundings = true;
  ASSERT_EQ(head_norm_rope(p, d_x.get(), c.weighted ? d_weight.get() : nullptr, d_pos.get(), d_freq.get(),
                           d_bf16.get(), nullptr),
            cudaSuccess);
  const std::vector<float> actual = d_x.download();
  const std::vector<uint16_t> actual_bf16 = d_bf16.download();
  int64_t equal = 0, far = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    ASSERT_EQ(actual_bf16[i], f32_to_bf16(actual[i])) << "element " << i;
    ASSERT_EQ(actual[i], bf16_to_f32(actual_bf16[i])) << "element " << i << " is not a bf16 value";
    if (actual[i] == expected[i]) {
      ++equal;
      continue;
    }
    const double ulp = std::ldexp(1.0, std::ilogb(std::max(std::fabs(expected[i]), 1e-30f)) - 7);
    if (std::fabs(static_cast<double>(actual[i]) - expected[i]) > ulp * 1.01 + 1e-6 && far++ < 5)
      ADD_FAILURE() << "element " << i << ": " << actual[i] << " vs " << expected[i];
  }
  EXPECT_EQ(far, 0);
  EXPECT_GE(static_cast<double>(equal), 0.97 * static_cast<double>(count));
  std::printf("  %lld of %lld values equal the CPU's\n", static_cast<long long>(equal), static_cast<long long>(count));
}

TEST_F(CudaHeadNormRope, DeepSeekRoundingsMatchTheCpuRecipe) {
  check_deepseek({33, 64, 512, 64, true, false, 10000.0f, 1.0f, 0, 70000});  // q
  check_deepseek({129, 1, 512, 64, true, true, 10000.0f, 1.0f, 0, 8191});    // K=V with kv_norm
  check_deepseek({7, 2, 128, 64, true, false, 10000.0f, 1.0f, 0, 300});      // the tiny FP8 checkpoint's q
}

TEST_F(CudaHeadNormRope, RejectsBadShapes) {
  HeadNormRopeParams p{1, 1, 9, 4, true, 1e-6f, 1.0f};  // odd head_dim
  EXPECT_EQ(head_norm_rope(p, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr), cudaErrorInvalidValue);
  p = {1, 1, 8, 10, true, 1e-6f, 1.0f};  // rope wider than the head
  EXPECT_EQ(head_norm_rope(p, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr), cudaErrorInvalidValue);
  p = {0, 64, 512, 64, true, 1e-6f, 1.0f};  // no rows: nothing to do
  EXPECT_EQ(head_norm_rope(p, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr), cudaSuccess);
}

}  // namespace
}  // namespace dsv4::ops::cuda
