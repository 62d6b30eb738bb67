// The CUDA embedding against the CPU forward's first step (DeepseekV4Model::forward: every stream of a token starts
// as its embedding row), fp32 and bf16 tables, V4-Flash and tiny shapes; a pure copy, so bitwise.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "ops/cuda/embedding.h"
#include "small_ops_util.h"

namespace dsv4::ops::cuda {
namespace {

using testing::small_ops::bitwise_equal;
using testing::small_ops::DeviceArray;

class CudaEmbedding : public testing::small_ops::GpuTest {};

struct Shape {
  int64_t vocab, hidden, hc, tokens;
};

std::vector<int32_t> random_ids(const Shape& s, std::mt19937& rng) {
  std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(s.vocab - 1));
  std::vector<int32_t> ids(static_cast<size_t>(s.tokens));
  for (auto& id : ids) id = pick(rng);
  ids.front() = 0;
  ids.back() = static_cast<int32_t>(s.vocab - 1);
  if (s.tokens > 2) ids[1] = ids.back();  // a repeated id
  return ids;
}

// The CPU forward's loop: h[t, s] = embed[id] for the hc streams.
std::vector<float> expected_streams(const Shape& s, const std::vector<float>& table, const std::vector<int32_t>& ids) {
  std::vector<float> h(static_cast<size_t>(s.tokens * s.hc * s.hidden));
  for (int64_t t = 0; t < s.tokens; ++t)
    for (int64_t k = 0; k < s.hc; ++k)
      std::memcpy(&h[(t * s.hc + k) * s.hidden], &table[ids[t] * s.hidden], s.hidden * sizeof(float));
  return h;
}

const Shape kShapes[] = {{1000, 4096, 4, 67}, {1000, 7168, 4, 3}, {50, 256, 4, 5}, {50, 7, 4, 9}, {13, 6, 1, 4}};

TEST_F(CudaEmbedding, Fp32TableMatchesCpuForward) {
  for (const Shape& s : kShapes) {
    std::mt19937 rng(static_cast<uint32_t>(s.vocab + s.hidden * 7 + s.tokens));
    std::normal_distribution<float> normal(0.0f, 0.5f);
    std::vector<float> table(static_cast<size_t>(s.vocab * s.hidden));
    for (auto& v : table) v = normal(rng);
    const std::vector<int32_t> ids = random_ids(s, rng);
    const std::vector<float> expected = expected_streams(s, table, ids);
    DeviceArray<float> d_table(table), d_out(expected.size());
    DeviceArray<int32_t> d_ids(ids);
    const EmbeddingParams p{s.tokens, s.vocab, s.hidden, s.hc};
    ASSERT_EQ(embedding(p, d_table.get(), d_ids.get(), d_out.get(), nullptr), cudaSuccess);
    const std::vector<float> actual = d_out.download();
    EXPECT_TRUE(bitwise_equal(actual, expected)) << s.hidden << " hc " << s.hc;
    d_out.poison();
    ASSERT_EQ(embedding(p, d_table.get(), d_ids.get(), d_out.get(), nullptr), cudaSuccess);
    EXPECT_TRUE(bitwise_equal(d_out.download(), actual)) << "not bitwise repeatable";
  }
}

TEST_F(CudaEmbedding, Bf16TableWidensExactly) {
  for (const Shape& s : kShapes) {
    std::mt19937 rng(static_cast<uint32_t>(s.vocab * 3 + s.hidden + s.tokens));
    std::normal_distribution<float> normal(0.0f, 0.5f);
    std::vector<uint16_t> table(static_cast<size_t>(s.vocab * s.hidden));
    std::vector<float> widened(table.size());
    for (size_t i = 0; i < table.size(); ++i) widened[i] = dsv4::bf16_to_f32(table[i] = dsv4::f32_to_bf16(normal(rng)));
    const std::vector<int32_t> ids = random_ids(s, rng);
    const std::vector<float> expected = expected_streams(s, widened, ids);
    DeviceArray<uint16_t> d_table(table);
    DeviceArray<float> d_out(expected.size());
    DeviceArray<int32_t> d_ids(ids);
    ASSERT_EQ(embedding_bf16({s.tokens, s.vocab, s.hidden, s.hc}, d_table.get(), d_ids.get(), d_out.get(), nullptr),
              cudaSuccess);
    EXPECT_TRUE(bitwise_equal(d_out.download(), expected)) << s.hidden << " hc " << s.hc;
  }
}

TEST_F(CudaEmbedding, OutOfRangeIdGivesNanRowsNotAStrayRead) {
  const Shape s{10, 64, 4, 3};
  std::vector<float> table(static_cast<size_t>(s.vocab * s.hidden), 1.0f);
  const std::vector<int32_t> ids{3, 10, -1};
  DeviceArray<float> d_table(table), d_out(static_cast<size_t>(s.tokens * s.hc * s.hidden));
  DeviceArray<int32_t> d_ids(ids);
  ASSERT_EQ(embedding({s.tokens, s.vocab, s.hidden, s.hc}, d_table.get(), d_ids.get(), d_out.get(), nullptr),
            cudaSuccess);
  const std::vector<float> out = d_out.download();
  for (int64_t i = 0; i < s.hc * s.hidden; ++i) EXPECT_EQ(out[i], 1.0f);
  for (size_t i = s.hc * s.hidden; i < out.size(); ++i) EXPECT_TRUE(std::isnan(out[i])) << i;
}

}  // namespace
}  // namespace dsv4::ops::cuda
