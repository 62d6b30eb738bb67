// The CUDA RoPE against its CPU twin (ops/cpu/rope.h apply_rope): V4-Flash query (64 × 512, rope 64), K=V
// (1 × 512) and indexer query (64 × 128) shapes, a tiny shape, forward and inverse, padded row strides, and
// positions near 1,000,000 (where the fp32 angle is large and cos/sin must be the precise ones).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "ops/cpu/rope.h"
#include "ops/cuda/rope.h"
#include "small_ops_util.h"

namespace dsv4::ops::cuda {
namespace {

using testing::small_ops::bitwise_equal;
using testing::small_ops::DeviceArray;

class CudaRope : public testing::small_ops::GpuTest {};

struct Case {
  int64_t rows, heads, head_dim, rope_dim, pad;  // row_stride = heads · head_dim + pad
  float theta, attention_scaling;
  int64_t min_position, max_position;
};

// HF's default inv_freq: theta^(−2i / rope_dim), in fp32.
std::vector<float> inv_freq_for(int64_t rope_dim, float theta) {
  std::vector<float> f(static_cast<size_t>(rope_dim / 2));
  for (size_t i = 0; i < f.size(); ++i)
    f[i] = static_cast<float>(1.0 / std::pow(static_cast<double>(theta), 2.0 * static_cast<double>(i) / rope_dim));
  return f;
}

void check(const Case& c, bool inverse) {
  SCOPED_TRACE(::testing::Message() << c.rows << "x" << c.heads << "x" << c.head_dim << " rope " << c.rope_dim
                                    << " pad " << c.pad << " pos " << c.min_position << ".." << c.max_position
                                    << (inverse ? " inverse" : ""));
  const int64_t stride = c.heads * c.head_dim + c.pad;
  std::mt19937 rng(static_cast<uint32_t>(c.rows * 7 + c.heads * 131 + c.head_dim + c.max_position + inverse));
  std::normal_distribution<float> normal(0.0f, 1.5f);
  std::uniform_int_distribution<int64_t> pick(c.min_position, c.max_position);
  std::vector<float> x(static_cast<size_t>(c.rows * stride));
  for (auto& v : x) v = normal(rng);
  std::vector<int64_t> positions(static_cast<size_t>(c.rows));
  for (auto& p : positions) p = pick(rng);
  positions.front() = c.min_position;
  positions.back() = c.max_position;
  std::vector<int32_t> positions32(positions.begin(), positions.end());
  cpu::RopeTable table{inv_freq_for(c.rope_dim, c.theta), c.attention_scaling};
  std::vector<float> expected = x;
  cpu::apply_rope(expected.data(), c.rows, stride, c.heads, c.head_dim, positions.data(), table, inverse);

  DeviceArray<float> d_x(x), d_freq(table.inv_freq);
  DeviceArray<int32_t> d_pos(positions32);
  const RopeParams p{c.rows, stride, c.heads, c.head_dim, c.rope_dim, c.attention_scaling, inverse};
  ASSERT_EQ(apply_rope(p, d_x.get(), d_pos.get(), d_freq.get(), nullptr), cudaSuccess);
  const std::vector<float> actual = d_x.download();

  // Channels outside the rope slice (and the row padding) are untouched, bitwise; the rope channels agree to
  // the last ulps of cos/sin.
  std::vector<float> rot_actual, rot_expected;
  const int64_t offset = c.head_dim - c.rope_dim;
  for (int64_t r = 0; r < c.rows; ++r)
    for (int64_t i = 0; i < stride; ++i) {
      const size_t at = static_cast<size_t>(r * stride + i);
      const bool rope = i < c.heads * c.head_dim && i % c.head_dim >= offset;
      if (rope) {
        rot_actual.push_back(actual[at]);
        rot_expected.push_back(expected[at]);
      } else {
        ASSERT_EQ(actual[at], x[at]) << "row " << r << " channel " << i;
      }
    }
  EXPECT_LE(testing::small_ops::rel_l2(rot_actual, rot_expected), 1e-6);
  double worst = 0;
  for (size_t i = 0; i < rot_expected.size(); ++i)
    worst = std::max(worst, std::abs(static_cast<double>(rot_actual[i]) - rot_expected[i]));
  EXPECT_LE(worst, 2e-6 * 1.5 * 4 * std::max(1.0f, c.attention_scaling)) << "max abs difference";

  // Bitwise repeatable.
  d_x.upload(x);
  ASSERT_EQ(apply_rope(p, d_x.get(), d_pos.get(), d_freq.get(), nullptr), cudaSuccess);
  EXPECT_TRUE(bitwise_equal(d_x.download(), actual)) << "not bitwise repeatable";
}

TEST_F(CudaRope, V4FlashShapesMatchCpuTwin) {
  for (const bool inverse : {false, true}) {
    check({33, 64, 512, 64, 0, 10000.0f, 1.0f, 0, 70000}, inverse);      // q, main rope
    check({33, 64, 512, 64, 0, 160000.0f, 1.2f, 0, 70000}, inverse);     // q / attention output, compress rope
    check({129, 1, 512, 64, 0, 10000.0f, 1.0f, 0, 8191}, inverse);       // K=V
    check({17, 64, 128, 64, 0, 160000.0f, 1.2f, 0, 70000}, inverse);     // indexer query
  }
}

TEST_F(CudaRope, TinyAndOddShapesMatchCpuTwin) {
  for (const bool inverse : {false, true}) {
    check({5, 4, 128, 32, 0, 10000.0f, 1.0f, 0, 300}, inverse);
    check({3, 4, 128, 128, 0, 10000.0f, 1.0f, 0, 300}, inverse);  // the whole head rotates
    check({7, 3, 9, 4, 1, 10000.0f, 0.9f, 0, 50}, inverse);      // odd head_dim and stride: the scalar path
    check({6, 2, 64, 64, 6, 10000.0f, 1.0f, 0, 50}, inverse);    // padded rows
  }
}

TEST_F(CudaRope, PositionsNearOneMillionMatchCpuTwin) {
  for (const bool inverse : {false, true}) {
    check({64, 64, 512, 64, 0, 10000.0f, 1.0f, 999'000, 1'048'575}, inverse);
    check({64, 1, 512, 64, 0, 160000.0f, 1.2f, 999'990, 1'000'010}, inverse);
    check({16, 64, 128, 64, 0, 160000.0f, 1.2f, 1'000'000, 1'000'063}, inverse);
  }
}

TEST_F(CudaRope, InverseUndoesForward) {
  const int64_t rows = 9, heads = 8, head_dim = 512, rope_dim = 64, stride = heads * head_dim;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(rows * stride));
  for (auto& v : x) v = normal(rng);
  std::vector<int32_t> positions(rows);
  for (int64_t r = 0; r < rows; ++r) positions[r] = static_cast<int32_t>(r * 100'003);
  const std::vector<float> inv_freq = inv_freq_for(rope_dim, 10000.0f);
  DeviceArray<float> d_x(x), d_freq(inv_freq);
  DeviceArray<int32_t> d_pos(positions);
  RopeParams p{rows, stride, heads, head_dim, rope_dim, 1.0f, false};
  ASSERT_EQ(apply_rope(p, d_x.get(), d_pos.get(), d_freq.get(), nullptr), cudaSuccess);
  p.inverse = true;
  ASSERT_EQ(apply_rope(p, d_x.get(), d_pos.get(), d_freq.get(), nullptr), cudaSuccess);
  EXPECT_LE(testing::small_ops::rel_l2(d_x.download(), x), 1e-6);
}

TEST_F(CudaRope, RejectsBadShapes) {
  RopeParams p{1, 8, 1, 8, 9, 1.0f, false};  // odd rope_dim
  EXPECT_EQ(apply_rope(p, nullptr, nullptr, nullptr, nullptr), cudaErrorInvalidValue);
  p.rope_dim = 16;  // wider than the head
  EXPECT_EQ(apply_rope(p, nullptr, nullptr, nullptr, nullptr), cudaErrorInvalidValue);
  p = {0, 512, 1, 512, 64, 1.0f, false};  // no rows: nothing to do
  EXPECT_EQ(apply_rope(p, nullptr, nullptr, nullptr, nullptr), cudaSuccess);
}

}  // namespace
}  // namespace dsv4::ops::cuda
