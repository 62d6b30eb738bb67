// The index-key writer, indexer-scores and top-k kernels against their CPU twins, at production shapes (64 heads,
// head_dim 128, k 512/1024, 262,144 candidates) and corner cases; outputs poisoned, repeats bitwise. Skips
// without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "../indexer_paged_fixture.h"
#include "cache/index_key_writer.h"
#include "ops/cpu/indexer_paged.h"
#include "ops/cuda/device.h"
#include "ops/cuda/indexer_scores.h"
#include "ops/cuda/top_k.h"

namespace dsv4::ops::cuda {
namespace {

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

class CudaIndexerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (list_devices().empty()) GTEST_SKIP() << "no CUDA device";
  }
};

template <typename T>
T* to_device(const std::vector<T>& host) {
  T* d = nullptr;
  if (cudaMalloc(&d, std::max<size_t>(1, host.size()) * sizeof(T)) != cudaSuccess) return nullptr;
  cudaMemcpy(d, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
  return d;
}
template <typename T>
std::vector<T> to_host(const T* d, size_t n) {
  std::vector<T> h(n);
  cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost);
  return h;
}

TEST_F(CudaIndexerTest, WriterMatchesCpuQuantizerByteForByte) {
  for (const IndexKeyDtype dtype : {IndexKeyDtype::kFp8, IndexKeyDtype::kBf16}) {
    const auto c = testing::make_paged_case(dtype, {1000, 77}, {}, 1, 31);
    std::mt19937 rng(4);
    const int64_t count = 1077;
    std::vector<uint16_t> keys = testing::random_bf16(count * 128, rng, 2.0f);
    for (int ch = 0; ch < 128; ++ch) keys[5 * 128 + ch] = f32_to_bf16(1e-7f * ch);  // tiny: subnormal e4m3, floor
    for (int ch = 0; ch < 128; ++ch) keys[6 * 128 + ch] = 0;                        // all zero
    std::vector<int64_t> slots;
    for (int r = 0; r < 2; ++r)
      for (int e = 0; e < (r == 0 ? 1000 : 77); ++e)
        slots.push_back(int64_t{c.block_tables[r * c.block_table_stride + e / 64]} * 64 + e % 64);
    auto expected = c.pool;
    write_index_keys_cpu(c.layout, keys.data(), slots.data(), count, expected.data());
    std::byte* d_pool = to_device(c.pool);
    uint16_t* d_keys = to_device(keys);
    int64_t* d_slots = to_device(slots);
    CUDA_OK(write_index_keys_cuda(c.layout, d_keys, d_slots, count, d_pool, nullptr));
    const auto actual = to_host(d_pool, c.pool.size());
    cudaFree(d_pool);
    cudaFree(d_keys);
    cudaFree(d_slots);
    size_t mismatches = 0;
    for (size_t i = 0; i < actual.size(); ++i) mismatches += actual[i] != expected[i];
    EXPECT_EQ(mismatches, 0u) << (dtype == IndexKeyDtype::kFp8 ? "fp8" : "bf16");
  }
}

void check_scores(IndexKeyDtype dtype, const std::vector<int32_t>& entries,
                  const std::vector<std::pair<int32_t, int32_t>>& queries, int64_t max_entries, uint32_t seed,
                  int q_scale_log2 = 0, bool deepseek = false) {
  auto c = testing::make_paged_case(dtype, entries, queries, max_entries, seed);
  // q scaled by a power of two (exact in bf16): the FP8 wgmma kernel rescales q per token into f16's range.
  for (uint16_t& value : c.q) value = f32_to_bf16(std::ldexp(bf16_to_f32(value), q_scale_log2));
  const size_t n = queries.size() * static_cast<size_t>(max_entries);
  std::vector<float> expected(n);
  IndexerScoresParams twin = c.params(expected.data());
  twin.deepseek_roundings = deepseek;
  cpu::indexer_scores_paged(twin);

  std::byte* d_pool = to_device(c.pool);
  int32_t* d_tables = to_device(c.block_tables);
  int32_t* d_entries = to_device(c.request_entries);
  int32_t* d_request = to_device(c.token_request);
  int32_t* d_position = to_device(c.token_position);
  uint16_t* d_q = to_device(c.q);
  float* d_w = to_device(c.weights);
  float* d_scores = nullptr;
  CUDA_OK(cudaMalloc(&d_scores, n * 4));
  IndexerScoresParams p = c.params(d_scores);
  p.pool = d_pool;
  p.block_tables = d_tables;
  p.request_entries = d_entries;
  p.token_request = d_request;
  p.token_position = d_position;
  p.q = d_q;
  p.weights = d_w;
  p.deepseek_roundings = deepseek;
  // Both kernels: the warpgroup-MMA one (the default on a Hopper) and the mma.sync one (DSV4_INDEXER_KERNEL=mma);
  // the first also on a grid of 3 CTAs, whose shares of the (token, tile) items cross tokens (DSV4_INDEXER_CTAS).
  struct SwitchOffOnExit {
    ~SwitchOffOnExit() {
      ::unsetenv("DSV4_INDEXER_KERNEL");
      ::unsetenv("DSV4_INDEXER_CTAS");
    }
  } switch_off_on_exit;  // also when an ASSERT returns early
  for (const char* kernel : {"wgmma", "wgmma on 3 CTAs", "mma"}) {
    ::setenv("DSV4_INDEXER_KERNEL", std::strncmp(kernel, "wgmma", 5) == 0 ? "wgmma" : "mma", 1);
    if (std::strcmp(kernel, "wgmma on 3 CTAs") == 0) ::setenv("DSV4_INDEXER_CTAS", "3", 1);
    else ::unsetenv("DSV4_INDEXER_CTAS");
    CUDA_OK(cudaMemset(d_scores, 0xff, n * 4));  // NaN wherever the kernel fails to write
    CUDA_OK(indexer_scores(p, nullptr));
    CUDA_OK(cudaDeviceSynchronize());
    const auto actual = to_host(d_scores, n);
    CUDA_OK(cudaMemset(d_scores, 0xff, n * 4));
    CUDA_OK(indexer_scores(p, nullptr));
    const auto repeat = to_host(d_scores, n);
    EXPECT_EQ(std::memcmp(actual.data(), repeat.data(), n * 4), 0) << kernel << ": not bitwise repeatable";
    for (size_t t = 0; t < queries.size(); ++t) {
      double err = 0, norm = 0;
      for (int64_t s = 0; s < max_entries; ++s) {
        const float a = actual[t * max_entries + s], e = expected[t * max_entries + s];
        ASSERT_FALSE(std::isnan(a)) << kernel << ": unwritten score " << t << " " << s;
        if (std::isinf(e)) {
          ASSERT_EQ(a, e) << kernel << " " << t << " " << s;
          continue;
        }
        ASSERT_FALSE(std::isinf(a)) << kernel << " " << t << " " << s;
        err += (double(a) - e) * (double(a) - e);
        norm += double(e) * e;
      }
      // fp32 sums in another order; kDeepSeek's bf16 roundings land the other way now and then (one bf16 step).
      EXPECT_LE(std::sqrt(err / std::max(norm, 1e-30)), deepseek ? 4e-3 : 3e-5) << kernel << ": token " << t;
    }
  }
  for (void* ptr : std::initializer_list<void*>{d_pool, d_tables, d_entries, d_request, d_position, d_q, d_w, d_scores})
    cudaFree(ptr);
}

// Numerics::kDeepSeek's roundings (IndexerScoresParams::deepseek_roundings) against indexer_scores_bf16 in the
// twin: bf16 keys, the weights carrying the whole scale (softmax_scale 1, as the CUDA model passes them).
TEST_F(CudaIndexerTest, DeepSeekRoundingsMatchCpuTwin) {
  check_scores(IndexKeyDtype::kBf16, {2049, 77}, {{0, 8199}, {0, 8000}, {1, 300}, {1, 307}}, 2112, 31, 0, true);
}

TEST_F(CudaIndexerTest, ScoresMatchCpuTwinDecodeAndPrefill) {
  for (const IndexKeyDtype dtype : {IndexKeyDtype::kFp8, IndexKeyDtype::kBf16}) {
    // Requests: 2049 entries (decode, ragged tail), 77 (prefill queries straddling the 64-entry page boundary),
    // 0 (no entry: all −inf), 1.
    const std::vector<int32_t> entries = {2049, 77, 0, 1};
    std::vector<std::pair<int32_t, int32_t>> queries = {{0, 8199}, {2, 3}, {3, 4}, {3, 2}, {0, 1000}};
    for (int pos : {0, 3, 4, 255, 256, 259, 307, 310}) queries.push_back({1, pos});
    check_scores(dtype, entries, queries, 2061, dtype == IndexKeyDtype::kFp8 ? 1 : 2);
  }
}

TEST_F(CudaIndexerTest, ScoresMatchCpuTwinWithLargeAndTinyQueries) {
  // |q| up to ~2^24 (beyond f16's 65504) and down to ~2^-40 (below f16's subnormals): the FP8 kernel's per-token
  // power-of-two rescaling keeps every product exact.
  for (const int q_scale_log2 : {22, -40})
    for (const IndexKeyDtype dtype : {IndexKeyDtype::kFp8, IndexKeyDtype::kBf16})
      check_scores(dtype, {300, 129}, {{0, 1203}, {1, 515}, {1, 300}}, 304, 5, q_scale_log2);
}

TEST_F(CudaIndexerTest, ScoresMatchCpuTwinAt32KEntries) {
  check_scores(IndexKeyDtype::kFp8, {32768 + 37, 32768}, {{0, 4 * (32768 + 37)}, {1, 4 * 32768 - 1}, {1, 90000}},
               32768 + 40, 3);
}

void check_top_k(int64_t rows, int64_t columns, int64_t stride, int64_t k, const std::vector<float>& scores,
                 const std::vector<int32_t>& lengths_in) {
  std::vector<int32_t> expected(rows * k), expected_lengths(rows);
  TopKParams cp{rows, columns, stride, k, scores.data(), lengths_in.empty() ? nullptr : lengths_in.data(),
                expected.data(), expected_lengths.data()};
  cpu::top_k(cp);
  float* d_scores = to_device(scores);
  int32_t* d_row_lengths = lengths_in.empty() ? nullptr : to_device(lengths_in);
  int32_t *d_indices, *d_lengths;
  ASSERT_EQ(cudaMalloc(&d_indices, rows * k * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_lengths, rows * 4), cudaSuccess);
  const size_t ws_bytes = top_k_workspace_bytes(rows, columns, k);
  void* d_ws;
  ASSERT_EQ(cudaMalloc(&d_ws, ws_bytes), cudaSuccess);
  TopKParams p{rows, columns, stride, k, d_scores, d_row_lengths, d_indices, d_lengths};
  std::vector<int32_t> first;
  // Every path of top_k gives the same answer (the switches are read on every call): the default choice twice
  // (bitwise repeatable), then each path forced at this shape, and the sampled and grid paths' exact fallbacks over
  // global memory.
  const std::vector<std::vector<std::pair<const char*, const char*>>> runs = {
      {},
      {},
      {{"DSV4_TOPK_PATH", "cluster"}},
      {{"DSV4_TOPK_PATH", "chunked"}},
      {{"DSV4_TOPK_PATH", "sampled"}},
      {{"DSV4_TOPK_PATH", "sampled"}, {"DSV4_TOPK_FALLBACK", "1"}},
      {{"DSV4_TOPK_PATH", "grid"}},
      {{"DSV4_TOPK_PATH", "grid"}, {"DSV4_TOPK_FALLBACK", "1"}},
  };
  struct SwitchesOffOnExit {
    static void clear() {
      for (const char* name : {"DSV4_TOPK_PATH", "DSV4_TOPK_FALLBACK"}) unsetenv(name);
    }
    ~SwitchesOffOnExit() { clear(); }
  } switches_off_on_exit;  // also when an ASSERT returns early
  for (size_t run = 0; run < runs.size(); ++run) {
    SwitchesOffOnExit::clear();
    std::string label = "default";
    for (const auto& [name, value] : runs[run]) {
      setenv(name, value, 1);
      label = label == "default" ? std::string(name) + "=" + value : label + " " + name + "=" + value;
    }
    cudaMemset(d_indices, 0x7f, rows * k * 4);  // poison
    cudaMemset(d_lengths, 0x7f, rows * 4);
    cudaMemset(d_ws, 0x5a, ws_bytes);
    ASSERT_EQ(top_k(p, d_ws, ws_bytes, nullptr), cudaSuccess) << label;
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << label;
    const auto indices = to_host(d_indices, rows * k);
    const auto lengths = to_host(d_lengths, rows);
    EXPECT_EQ(lengths, expected_lengths) << rows << "x" << columns << " k " << k << " " << label;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < k; ++i)
        ASSERT_EQ(indices[r * k + i], expected[r * k + i])
            << "row " << r << " slot " << i << " of " << columns << " " << label;
    if (run == 0) {
      first = indices;
    } else if (run == 1) {
      EXPECT_EQ(first, indices) << "not bitwise repeatable";
    }
  }
  cudaFree(d_scores);
  if (d_row_lengths) cudaFree(d_row_lengths);
  cudaFree(d_indices);
  cudaFree(d_lengths);
  cudaFree(d_ws);
}

TEST_F(CudaIndexerTest, TopKMatchesCpuTwinAt262144Candidates) {
  for (const int64_t k : {512, 1024}) {
    const int64_t rows = 4, columns = 262144;
    std::vector<float> scores = testing::random_scores(rows, columns, static_cast<uint32_t>(k));
    // Row 1: the k-th score is tied many times across chunks; row 2: only 300 valid.
    for (int64_t i = 0; i < columns; ++i) {
      if (i % 97 == 0) scores[columns + i] = 3.0f;
      if (i % 1000 >= 1) scores[2 * columns + i] = -INFINITY;
    }
    check_top_k(rows, columns, columns, k, scores, {});
    check_top_k(rows, columns, columns, k, scores, {262144, 100003, 262144, 513});
  }
}

// The shapes where top_k's default choice changes (a 32K-column row: the cluster path at 1 row; on a 132-SM
// device the sampled path narrowed to 3 CTAs a row at 32 rows, where 4 would not sample and the cluster path
// no longer fits a wave, and at its own width of 3 at 40); check_top_k also forces every path on each.
TEST_F(CudaIndexerTest, TopKSameAnswerOnBothPaths) {
  for (const int64_t k : {512, 1024}) {
    const int64_t columns = 32768;
    for (const int64_t rows : {int64_t{1}, int64_t{32}, int64_t{40}}) {
      std::vector<float> scores = testing::random_scores(rows, columns, static_cast<uint32_t>(k + rows));
      for (int64_t i = 0; i < columns; ++i)
        if (i % 61 == 0) scores[i] = 2.0f;  // row 0: a tie crossing the threshold
      std::vector<int32_t> lengths(static_cast<size_t>(rows));
      for (int64_t r = 0; r < rows; ++r) lengths[r] = static_cast<int32_t>((r * 7919 + 1000) % (columns + 1));
      check_top_k(rows, columns, columns, k, scores, {});
      check_top_k(rows, columns, columns, k, scores, lengths);
    }
  }
}

// The sampled and grid paths' ways out of their estimates, on real data: (row 0) the large scores sit exactly on
// the sampled lines (every 16th run of 32; the grid path samples every 128th at 256K), so fewer than k keys of the
// row reach the sample's threshold; (row 1) 100,000 equal top scores overflow every CTA's candidate buffer (the
// sampled path's) and the grid select's 8,192. Both must take the exact fallback (2 rows of 256K: the grid path by
// default, the sampled path forced). Then 70 rows of 65,536, one CTA per row on a 132-SM device with a sample of
// its own.
TEST_F(CudaIndexerTest, TopKSampledPathFallsBackWhenTheEstimateFails) {
  for (const int64_t k : {512, 1024}) {
    const int64_t rows = 2, columns = 262144;
    std::vector<float> scores = testing::random_scores(rows, columns, static_cast<uint32_t>(k + 3));
    for (int64_t i = 0; i < columns; ++i) {
      if ((i / 32) % 16 == 0) scores[i] += 10.0f;
      if (i % 5 < 2 && i < 250000) scores[columns + i] = 4.5f;
    }
    check_top_k(rows, columns, columns, k, scores, {});
    check_top_k(rows, columns, columns, k, scores, {200001, 262144});
  }
  const int64_t rows = 70, columns = 65536;
  check_top_k(rows, columns, columns, 512, testing::random_scores(rows, columns, 71), {});
}

// Scores that rise with the entry (as recency can make real indexer scores): the whole answer sits in the last
// spans, so the grid path's last filter CTAs keep every candidate and the others none; a second row falls.
TEST_F(CudaIndexerTest, TopKWithTheAnswerInOneSpan) {
  for (const int64_t k : {512, 1024}) {
    const int64_t rows = 2, columns = 262144;
    std::vector<float> scores = testing::random_scores(rows, columns, static_cast<uint32_t>(k + 11));
    for (int64_t i = 0; i < columns; ++i) {
      scores[i] = 0.25f * scores[i] + 8.0f * static_cast<float>(i) / columns;
      scores[columns + i] = 0.25f * scores[columns + i] - 8.0f * static_cast<float>(i) / columns;
    }
    check_top_k(rows, columns, columns, k, scores, {});
    check_top_k(rows, columns, columns, k, scores, {150001, 3000});
  }
}

TEST_F(CudaIndexerTest, TopKCornerCases) {
  // Short rows, ragged lengths not multiples of 4 or 128, a padded stride, no valid entry, all tied, few valid.
  for (const int64_t k : {512, 1024}) {
    const int64_t rows = 6, columns = 16384 + 131, stride = columns + 5;
    std::vector<float> scores = testing::random_scores(rows, stride, 77);
    std::fill(scores.begin() + 1 * stride, scores.begin() + 2 * stride, -INFINITY);  // nothing valid
    std::fill(scores.begin() + 2 * stride, scores.begin() + 3 * stride, 1.5f);       // all tied
    for (int64_t i = 0; i < stride; ++i)
      if (i % 50 != 7) scores[3 * stride + i] = -INFINITY;  // ~330 valid < k
    check_top_k(rows, columns, stride, k, scores, {});
    check_top_k(rows, columns, stride, k, scores, {16515, 100, 16384, 1, 0, 1023});
    check_top_k(3, 2047, 2047, k, testing::random_scores(3, 2047, 5), {});
    check_top_k(2, 7, 7, k, testing::random_scores(2, 7, 6), {});
  }
}

}  // namespace
}  // namespace dsv4::ops::cuda
