// The index-key format (cache/index_key_format.h) and the CPU twins of the indexer kernels
// (ops/cpu/indexer_paged.h) against independent double-precision and brute-force references.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "cache/index_key_format.h"
#include "core/dtype.h"
#include "indexer_paged_fixture.h"
#include "ops/cpu/indexer_paged.h"

namespace dsv4 {
namespace {

TEST(IndexKeyFormat, E4m3EncoderRoundsToNearestEven) {
  // Every finite code decodes and re-encodes to itself.
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7f) == 0x7f) continue;  // NaN
    const float v = f8e4m3_to_f32(static_cast<uint8_t>(code));
    if (code == 0x80) {
      EXPECT_EQ(f32_to_e4m3_rne(v), 0x80);  // −0
      continue;
    }
    EXPECT_EQ(f32_to_e4m3_rne(v), code) << code;
  }
  // Midpoints between neighbouring positive codes go to the even code; just off them, to the nearer one.
  for (int code = 0; code < 0x7e; ++code) {
    const float lo = f8e4m3_to_f32(static_cast<uint8_t>(code)), hi = f8e4m3_to_f32(static_cast<uint8_t>(code + 1));
    const float mid = 0.5f * (lo + hi);
    EXPECT_EQ(f32_to_e4m3_rne(mid), (code % 2 == 0) ? code : code + 1) << code;
    EXPECT_EQ(f32_to_e4m3_rne(std::nextafter(mid, 0.0f)), code) << code;
    EXPECT_EQ(f32_to_e4m3_rne(std::nextafter(mid, 1e9f)), code + 1) << code;
    EXPECT_EQ(f32_to_e4m3_rne(-mid), 0x80 | ((code % 2 == 0) ? code : code + 1)) << code;
  }
  EXPECT_EQ(f32_to_e4m3_rne(448.0f), 0x7e);
  EXPECT_EQ(f32_to_e4m3_rne(1e6f), 0x7e);
  EXPECT_EQ(f32_to_e4m3_rne(-INFINITY), 0xfe);
  EXPECT_EQ(f32_to_e4m3_rne(std::nanf("")) & 0x7f, 0x7f);
  // Random values: the code is a nearest one.
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> exponent(-12.0f, 9.0f);
  for (int i = 0; i < 100000; ++i) {
    const float x = std::exp2(exponent(rng)) * ((rng() & 1) ? 1.0f : -1.0f);
    const uint8_t c = f32_to_e4m3_rne(x);
    const float err = std::fabs(f8e4m3_to_f32(c) - std::clamp(x, -448.0f, 448.0f));
    for (int d : {-1, 1}) {
      const int neighbour = (c & 0x7f) + d;
      if (neighbour < 0 || neighbour > 0x7e) continue;
      const float other = f8e4m3_to_f32(static_cast<uint8_t>((c & 0x80) | neighbour));
      EXPECT_LE(err, std::fabs(other - std::clamp(x, -448.0f, 448.0f))) << x;
    }
  }
}

TEST(IndexKeyFormat, ScaleIsThePowerOfTwoOfActQuant) {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> exponent(-20.0f, 20.0f);
  for (int i = 0; i < 10000; ++i) {
    const float amax = std::exp2(exponent(rng));
    const float scale = index_key_fp8_scale(amax);
    int e;
    EXPECT_EQ(std::frexp(scale, &e), 0.5f) << amax;  // a power of two
    const double expected = std::exp2(std::ceil(std::log2(std::max(double(amax), 1e-4) / 448.0)));
    EXPECT_EQ(scale, static_cast<float>(expected)) << amax;
  }
  EXPECT_EQ(index_key_fp8_scale(448.0f), 1.0f);
  EXPECT_EQ(index_key_fp8_scale(0.0f), index_key_fp8_scale(1e-4f));
}

TEST(IndexKeyFormat, WriteThenReadRoundTripsInThePagedLayout) {
  for (const IndexKeyDtype dtype : {IndexKeyDtype::kBf16, IndexKeyDtype::kFp8}) {
    const auto c = testing::make_paged_case(dtype, {130, 1, 64}, {}, 130, 11);
    EXPECT_EQ(c.layout.entry_bytes(), dtype == IndexKeyDtype::kFp8 ? 132 : 256);
    // Re-draw the keys of request 0 with the fixture's generator to know them: write them again, read them back.
    std::mt19937 rng(5);
    const std::vector<uint16_t> keys = testing::random_bf16(130 * 128, rng, 3.0f);
    std::vector<int64_t> slots(130);
    for (int e = 0; e < 130; ++e) slots[e] = int64_t{c.block_tables[e / 64]} * 64 + e % 64;
    auto pool = c.pool;
    write_index_keys_cpu(c.layout, keys.data(), slots.data(), 130, pool.data());
    std::vector<float> back(128);
    for (int e = 0; e < 130; ++e) {
      read_index_key_cpu(c.layout, pool.data(), c.block_tables[e / 64], e % 64, back.data());
      float amax = 0;
      for (int ch = 0; ch < 128; ++ch) amax = std::max(amax, std::fabs(bf16_to_f32(keys[e * 128 + ch])));
      const float scale = index_key_fp8_scale(amax);
      for (int ch = 0; ch < 128; ++ch) {
        const float x = bf16_to_f32(keys[e * 128 + ch]);
        if (dtype == IndexKeyDtype::kBf16) {
          ASSERT_EQ(back[ch], x);
        } else {
          // e4m3: 3 mantissa bits (relative 2^-4 at worst), subnormal step 2^-9 · scale.
          ASSERT_LE(std::fabs(back[ch] - x), std::max(std::fabs(x) / 16.0f, scale * 0x1p-10f)) << e << " " << ch;
        }
      }
    }
    // Bytes outside this layer's runs of the written blocks are untouched.
    size_t changed_outside = 0;
    for (size_t i = 0; i < pool.size(); ++i) {
      if (pool[i] == c.pool[i]) continue;
      bool inside = false;
      for (int b = 0; b < 3; ++b) {
        const int64_t start = c.layout.run_offset(c.block_tables[b]);
        inside |= static_cast<int64_t>(i) >= start && static_cast<int64_t>(i) < start + 64 * c.layout.entry_bytes();
      }
      changed_outside += !inside;
    }
    EXPECT_EQ(changed_outside, 0u);
  }
}

TEST(IndexerPaged, ScoresMatchADoubleReferenceWithCausalMask) {
  for (const IndexKeyDtype dtype : {IndexKeyDtype::kBf16, IndexKeyDtype::kFp8}) {
    // Request 1 is a prefill whose queries see 0, 1, ... entries; request 2 has no entry yet.
    const std::vector<int32_t> entries = {70, 201, 0};
    const std::vector<std::pair<int32_t, int32_t>> queries = {{0, 400}, {1, 2}, {1, 3}, {1, 7}, {1, 515},
                                                              {1, 803}, {1, 1000}, {2, 5}, {0, 100}};
    const int64_t max_entries = 205;
    const auto c = testing::make_paged_case(dtype, entries, queries, max_entries, 21);
    std::vector<float> scores(queries.size() * max_entries, 12345.0f);
    ops::cpu::indexer_scores_paged(c.params(scores.data()));
    std::vector<float> key(128);
    for (size_t t = 0; t < queries.size(); ++t) {
      const auto [r, pos] = queries[t];
      const int64_t visible = std::min<int64_t>(entries[r], (pos + 1) / 4);
      for (int64_t s = 0; s < max_entries; ++s) {
        const float got = scores[t * max_entries + s];
        if (s >= visible) {
          ASSERT_EQ(got, -std::numeric_limits<float>::infinity()) << t << " " << s;
          continue;
        }
        read_index_key_cpu(c.layout, c.pool.data(), c.block_tables[r * c.block_table_stride + s / 64],
                           static_cast<int32_t>(s % 64), key.data());
        double expected = 0, magnitude = 0;
        for (int h = 0; h < 64; ++h) {
          double dot = 0;
          for (int ch = 0; ch < 128; ++ch) dot += double(bf16_to_f32(c.q[(t * 64 + h) * 128 + ch])) * key[ch];
          expected += std::max(dot, 0.0) * c.weights[t * 64 + h] / std::sqrt(128.0);
          magnitude += std::fabs(dot * c.weights[t * 64 + h]) / std::sqrt(128.0);
        }
        ASSERT_NEAR(got, expected, 1e-5 * magnitude + 1e-30) << t << " " << s;
      }
    }
  }
}

TEST(IndexerPaged, TopKIsTheBruteForceSetInEntryOrder) {
  const int64_t rows = 7, columns = 3000;
  std::vector<float> scores = testing::random_scores(rows, columns, 9);
  // row 3: all masked; row 4: a single valid entry; row 5: everything ties.
  std::fill(scores.begin() + 3 * columns, scores.begin() + 4 * columns, -INFINITY);
  std::fill(scores.begin() + 4 * columns, scores.begin() + 5 * columns, -INFINITY);
  scores[4 * columns + 2999] = -1e30f;
  std::fill(scores.begin() + 5 * columns, scores.begin() + 6 * columns, 0.25f);
  const std::vector<int32_t> lengths_in = {3000, 2999, 17, 3000, 3000, 3000, 600};
  for (const int64_t k : {1, 512, 1024}) {
    for (const bool with_lengths : {false, true}) {
      std::vector<int32_t> indices(rows * k, -7), lengths(rows, -7);
      ops::TopKParams p{rows, columns, columns, k, scores.data(), with_lengths ? lengths_in.data() : nullptr,
                        indices.data(), lengths.data()};
      ops::cpu::top_k(p);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t n = with_lengths ? lengths_in[r] : columns;
        std::vector<int32_t> order;
        for (int32_t i = 0; i < n; ++i) {
          const float v = scores[r * columns + i];
          if (!std::isnan(v) && v != -INFINITY) order.push_back(i);
        }
        std::stable_sort(order.begin(), order.end(),
                         [&](int32_t a, int32_t b) { return scores[r * columns + a] > scores[r * columns + b]; });
        order.resize(std::min<size_t>(order.size(), static_cast<size_t>(k)));
        std::sort(order.begin(), order.end());
        ASSERT_EQ(lengths[r], static_cast<int32_t>(order.size())) << r;
        for (int64_t i = 0; i < k; ++i)
          ASSERT_EQ(indices[r * k + i], i < static_cast<int64_t>(order.size()) ? order[i] : -1) << r << " " << i;
      }
    }
  }
}

}  // namespace
}  // namespace dsv4
