// combine_expert_rows (the host-grouped and expert-parallel MoE's last step) against the naive formula on random
// rows: out[t] = Σ_k w[t, k] · rows[slot[t, k]] (k in order, slots < 0 skipped) + shared[t]. The float4 path
// (hidden % 4 == 0) and the scalar path (odd widths), with and without the shared rows; the float4 path must equal
// the scalar path bit for bit (same operations per element); null slots (rows in token order). Skips without a GPU.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "ops/cuda/moe_combine.h"
#include "small_ops_util.h"

namespace dsv4::ops::cuda {
namespace {

using testing::small_ops::bitwise_equal;
using testing::small_ops::DeviceArray;

class CudaMoeCombine : public testing::small_ops::GpuTest {};

struct Case {
  std::vector<int32_t> slots;
  std::vector<float> weights, rows, shared;
};

Case random_case(int64_t tokens, int64_t top_k, int64_t hidden, int64_t num_rows, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int32_t> slot(-1, static_cast<int32_t>(num_rows) - 1);  // -1: no row
  Case c;
  c.slots.resize(static_cast<size_t>(tokens * top_k));
  for (auto& s : c.slots) s = slot(rng);
  c.weights.resize(c.slots.size());
  for (auto& w : c.weights) w = normal(rng);
  c.rows.resize(static_cast<size_t>(num_rows * hidden));
  for (auto& v : c.rows) v = normal(rng);
  c.shared.resize(static_cast<size_t>(tokens * hidden));
  for (auto& v : c.shared) v = normal(rng);
  return c;
}

std::vector<float> naive(const Case& c, int64_t tokens, int64_t top_k, int64_t hidden, bool with_shared) {
  std::vector<float> out(static_cast<size_t>(tokens * hidden));
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t j = 0; j < hidden; ++j) {
      double sum = with_shared ? c.shared[static_cast<size_t>(t * hidden + j)] : 0.0;
      for (int64_t k = 0; k < top_k; ++k) {
        const int32_t s = c.slots[static_cast<size_t>(t * top_k + k)];
        if (s >= 0)
          sum += double(c.weights[static_cast<size_t>(t * top_k + k)]) * c.rows[static_cast<size_t>(s * hidden + j)];
      }
      out[static_cast<size_t>(t * hidden + j)] = static_cast<float>(sum);
    }
  return out;
}

std::vector<float> run(const Case& c, int64_t tokens, int64_t top_k, int64_t hidden, bool with_shared,
                       size_t row_offset = 0) {
  // row_offset floats in front of the rows: 1 misaligns them, so the scalar path runs.
  std::vector<float> rows(row_offset, 0.0f);
  rows.insert(rows.end(), c.rows.begin(), c.rows.end());
  DeviceArray<int32_t> d_slots(c.slots);
  DeviceArray<float> d_weights(c.weights), d_rows(rows), d_shared(c.shared);
  DeviceArray<float> d_out(static_cast<size_t>(tokens * hidden));
  EXPECT_EQ(combine_expert_rows({tokens, top_k, hidden}, d_slots.get(), d_weights.get(), d_rows.get() + row_offset,
                                with_shared ? d_shared.get() : nullptr, d_out.get(), nullptr),
            cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return d_out.download();
}

TEST_F(CudaMoeCombine, MatchesTheFormulaOnBothPaths) {
  for (const int64_t hidden : {int64_t{4096}, int64_t{12}, int64_t{10}})
    for (const bool with_shared : {true, false}) {
      SCOPED_TRACE(::testing::Message() << "hidden " << hidden << (with_shared ? ", shared" : ", no shared"));
      const int64_t tokens = 37, top_k = 6, num_rows = 150;
      const Case c = random_case(tokens, top_k, hidden, num_rows, static_cast<uint32_t>(hidden + with_shared));
      const std::vector<float> expected = naive(c, tokens, top_k, hidden, with_shared);
      const std::vector<float> actual = run(c, tokens, top_k, hidden, with_shared);
      for (size_t i = 0; i < expected.size(); ++i)
        ASSERT_NEAR(actual[i], expected[i], 1e-5f * (1.0f + std::fabs(expected[i]))) << i;
      if (hidden % 4 == 0) {
        EXPECT_TRUE(bitwise_equal(run(c, tokens, top_k, hidden, with_shared, 1), actual))
            << "the float4 and the scalar path differ";
      }
    }
}

// slots nullptr: row t·top_k + k, bitwise the call with those slots spelled out (both paths).
TEST_F(CudaMoeCombine, NullSlotsReadTheRowsInTokenOrder) {
  for (const int64_t hidden : {int64_t{4096}, int64_t{10}}) {
    SCOPED_TRACE(::testing::Message() << "hidden " << hidden);
    const int64_t tokens = 3, top_k = 6;
    Case c = random_case(tokens, top_k, hidden, tokens * top_k, static_cast<uint32_t>(hidden + 7));
    for (size_t i = 0; i < c.slots.size(); ++i) c.slots[i] = static_cast<int32_t>(i);
    const std::vector<float> explicit_slots = run(c, tokens, top_k, hidden, true);
    DeviceArray<float> d_weights(c.weights), d_rows(c.rows), d_shared(c.shared);
    DeviceArray<float> d_out(static_cast<size_t>(tokens * hidden));
    ASSERT_EQ(combine_expert_rows({tokens, top_k, hidden}, nullptr, d_weights.get(), d_rows.get(), d_shared.get(),
                                  d_out.get(), nullptr),
              cudaSuccess);
    EXPECT_TRUE(bitwise_equal(d_out.download(), explicit_slots));
  }
}

}  // namespace
}  // namespace dsv4::ops::cuda
