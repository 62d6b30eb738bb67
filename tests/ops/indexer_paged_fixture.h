// Random paged index-key caches for the indexer tests (CPU twins in dsv4_tests, kernels in dsv4_gpu_tests):
// several requests whose blocks are scattered over pages of a pool shared with two other layers of the group.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "cache/index_key_format.h"
#include "core/dtype.h"
#include "ops/cpu/indexer_paged.h"

namespace dsv4::testing {

struct PagedIndexerCase {
  IndexKeyPagedLayout layout;
  std::vector<std::byte> pool;
  std::vector<int32_t> block_tables, request_entries, token_request, token_position;
  int64_t block_table_stride = 0;
  std::vector<uint16_t> q;  // bf16 [tokens, 64, 128]
  std::vector<float> weights;
  int64_t max_entries = 0;

  ops::IndexerScoresParams params(float* scores) const {
    ops::IndexerScoresParams p;
    p.num_tokens = static_cast<int64_t>(token_request.size());
    p.max_entries = max_entries;
    p.softmax_scale = 1.0f / std::sqrt(128.0f);
    p.keys = layout;
    p.pool = pool.data();
    p.block_tables = block_tables.data();
    p.block_table_stride = block_table_stride;
    p.request_entries = request_entries.data();
    p.token_request = token_request.data();
    p.token_position = token_position.data();
    p.q = q.data();
    p.weights = weights.data();
    p.scores = scores;
    return p;
  }
};

inline std::vector<uint16_t> random_bf16(size_t n, std::mt19937& rng, float sigma) {
  std::normal_distribution<float> normal(0.0f, sigma);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = f32_to_bf16(normal(rng));
  return v;
}

// `entries[r]` entries per request; `queries` = (request, position) pairs. Blocks: 64 entries of 3 layers, this
// layer second; 5 blocks per page; every request's blocks drawn from a shuffled list, so neighbours in a table
// are far apart in memory. Keys are written with write_index_keys_cpu (the quantizer under test elsewhere).
inline PagedIndexerCase make_paged_case(IndexKeyDtype dtype, const std::vector<int32_t>& entries,
                                        const std::vector<std::pair<int32_t, int32_t>>& queries, int64_t max_entries,
                                        uint32_t seed) {
  std::mt19937 rng(seed);
  PagedIndexerCase c;
  c.layout.dtype = dtype;
  c.layout.head_dim = 128;
  c.layout.entries_per_block = 64;
  c.layout.layer_slot = 1;
  c.layout.block_bytes = c.layout.entry_bytes() * 64 * 3;
  c.layout.max_blocks_per_page = 5;
  c.layout.page_bytes = 5 * c.layout.block_bytes + 4096;  // a tail, as real pages have
  int64_t stride = 1, total_blocks = 0;
  for (int32_t n : entries) {
    stride = std::max<int64_t>(stride, (n + 63) / 64);
    total_blocks += (n + 63) / 64;
  }
  c.block_table_stride = stride;
  const int64_t pool_blocks = total_blocks + 7;  // a few never used
  const int64_t pages = (pool_blocks + 4) / 5;
  c.pool.resize(static_cast<size_t>(pages * c.layout.page_bytes));
  for (auto& b : c.pool) b = static_cast<std::byte>(rng());  // other layers' bytes: noise, never read
  std::vector<int32_t> ids(static_cast<size_t>(pages * 5));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  c.block_tables.assign(static_cast<size_t>(entries.size() * stride), -1);
  size_t next = 0;
  std::vector<uint16_t> keys;
  std::vector<int64_t> slots;
  for (size_t r = 0; r < entries.size(); ++r) {
    for (int64_t b = 0; b < (entries[r] + 63) / 64; ++b) c.block_tables[r * stride + b] = ids[next++];
    const std::vector<uint16_t> k = random_bf16(static_cast<size_t>(entries[r]) * 128, rng, 1.0f);
    keys.insert(keys.end(), k.begin(), k.end());
    for (int32_t e = 0; e < entries[r]; ++e)
      slots.push_back(static_cast<int64_t>(c.block_tables[r * stride + e / 64]) * 64 + e % 64);
  }
  write_index_keys_cpu(c.layout, keys.data(), slots.data(), static_cast<int64_t>(slots.size()), c.pool.data());
  c.request_entries = entries;
  for (const auto& [request, position] : queries) {
    c.token_request.push_back(request);
    c.token_position.push_back(position);
  }
  c.q = random_bf16(queries.size() * 64 * 128, rng, 1.0f);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  c.weights.resize(queries.size() * 64);
  for (auto& w : c.weights) w = uniform(rng) / 8.0f;
  c.max_entries = max_entries;
  return c;
}

// Scores with ties (a coarse grid), −inf holes and a NaN or two, for the top-k tests.
inline std::vector<float> random_scores(int64_t rows, int64_t columns, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> kind(0, 99);
  std::vector<float> s(static_cast<size_t>(rows * columns));
  for (auto& x : s) {
    const int k = kind(rng);
    x = normal(rng);
    if (k < 20) x = std::round(x * 8.0f) / 8.0f;  // many exact ties
    if (k == 20) x = -INFINITY;
    if (k == 21) x = -0.0f;
    if (k == 22) x = 0.0f;
  }
  if (!s.empty()) s[s.size() / 3] = std::nanf("");
  return s;
}

}  // namespace dsv4::testing
