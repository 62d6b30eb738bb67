// A random sparse-attention decode problem over a paged KV arena laid out as the cache manager lays it out
// (cache/block_pool.h, cache/kv_entry_format.h): shared by the CPU-twin test, the GPU test and kbench.
// Blocks get shuffled global ids in pages with a tail, the layer under test is not the group's first, unwritten
// arena bytes are 0xff (NaN in bf16 and e4m3), and only the blocks the selected keys touch are allocated.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <unordered_map>
#include <vector>

#include "cache/kv_entry_format.h"
#include "core/dtype.h"
#include "ops/cpu/sparse_attention.h"

namespace dsv4::testing {

struct AttentionProblemSpec {
  int64_t heads = 64;
  KvEntryFormat format = KvEntryFormat::kFp8;
  std::vector<int32_t> positions;  // one query token per request
  int64_t ratio = 4;               // 4: CSA (top_k random picks), 128: HCA (every visible entry), 0: SWA only
  int64_t top_k = 512;
  double invalid_fraction = 0.0;  // picks replaced by −1
  int64_t window = 128;
  int64_t window_entries_per_block = 64;
  int64_t compressed_entries_per_block = 64;  // 64 for C4 groups, 2 for C128
  int64_t layers_in_group = 2;                // the tested layer is index 1
  float sink_max = 6.0f;                      // sinks ~ U(-2, sink_max): large enough to move the output
  uint32_t seed = 1;
  int64_t prefill_chunk = 0;  // > 0: token t's last (rng mod prefill_chunk) window positions come from a chunk pool
  int64_t pick_span = 0;  // CSA picks drawn from the first pick_span visible entries (0: all); kbench bounds memory
  bool keep_reference = true;  // keep each token's keys (dequantized, in order) for the reference formula
};

struct AttentionProblem {
  AttentionProblemSpec spec;
  std::vector<uint8_t> arena;
  int64_t page_bytes = 0, blocks_per_page = 3;
  int64_t window_block_bytes = 0, compressed_block_bytes = 0;
  int64_t window_region = 0, compressed_region = 0;
  int64_t window_stride = 0, compressed_table_stride = 0;
  std::vector<int32_t> window_table, compressed_table, chunk_table, chunk_starts;
  std::vector<int32_t> indices, lengths, positions;
  std::vector<int32_t> rows;  // block-table row of each token (make_prefill_problem: all 0); empty = token index
  int64_t compressed_stride = 1;
  std::vector<uint16_t> q;
  std::vector<float> sinks, inv_freq;
  int64_t unique_keys = 0;  // distinct entries read (bytes counted for bandwidth)
  // reference_keys[t]: the keys of token t (window, then the valid picks), dequantized without the arena.
  std::vector<std::vector<float>> reference_keys;

  int64_t tokens() const { return static_cast<int64_t>(positions.size()); }

  // Regions, block and page bytes from spec (the layer under test is one of spec.layers_in_group).
  void set_block_geometry() {
    window_region = kv_region_bytes(spec.format, spec.window_entries_per_block);
    compressed_region = kv_region_bytes(spec.format, spec.compressed_entries_per_block);
    window_block_bytes = window_region * spec.layers_in_group;
    compressed_block_bytes = compressed_region * spec.layers_in_group;
    page_bytes = (blocks_per_page * std::max(window_block_bytes, compressed_block_bytes) + 4095) / 4096 * 4096 + 4096;
  }

  // Parameters over `arena_base` and table pointers (host or device copies of the vectors above).
  ops::SparseAttentionParams params(uint8_t* arena_base, const int32_t* window_table_ptr,
                                    const int32_t* compressed_table_ptr, const int32_t* indices_ptr,
                                    const int32_t* lengths_ptr, const int32_t* positions_ptr, const float* sinks_ptr,
                                    const float* inv_freq_ptr, const int32_t* chunk_table_ptr,
                                    const int32_t* chunk_starts_ptr, const int32_t* rows_ptr = nullptr) const {
    ops::SparseAttentionParams p;
    p.tokens = tokens();
    p.heads = spec.heads;
    p.scale = 1.0f / std::sqrt(512.0f);
    p.format = spec.format;
    p.window = {arena_base, page_bytes, blocks_per_page, window_block_bytes, window_region,
                static_cast<int32_t>(spec.window_entries_per_block), window_table_ptr, window_stride};
    p.window_size = spec.window;
    p.compressed = {arena_base, page_bytes, blocks_per_page, compressed_block_bytes, compressed_region,
                    static_cast<int32_t>(spec.compressed_entries_per_block), compressed_table_ptr,
                    compressed_table_stride};
    p.compressed_indices = indices_ptr;
    p.compressed_lengths = spec.ratio > 0 ? lengths_ptr : nullptr;
    p.compressed_stride = compressed_stride;
    p.positions = positions_ptr;
    p.rows = rows.empty() ? nullptr : rows_ptr;
    p.sinks = sinks_ptr;
    p.rope_inv_freq = inv_freq_ptr;
    if (spec.prefill_chunk > 0) {
      p.chunk = p.window;
      p.chunk.block_table = chunk_table_ptr;
      p.chunk_starts = chunk_starts_ptr;
    }
    return p;
  }
  ops::SparseAttentionParams host_params() {
    return params(arena.data(), window_table.data(), compressed_table.data(), indices.data(), lengths.data(),
                  positions.data(), sinks.data(), inv_freq.data(), chunk_table.data(), chunk_starts.data(), rows.data());
  }
};

// A random K=V vector (rope channels included) written through the quantizer into entry `entry` of `pool` at
// block-table row `row`. Returns its dequantized image (the same vector through a private, unpaged entry) when
// `keep_reference`, else kKvHeadDim zeros.
inline std::vector<float> write_random_entry(const PagedKvPool& pool, KvEntryFormat format, int32_t row, int32_t entry,
                                             bool keep_reference, std::mt19937& rng,
                                             std::normal_distribution<float>& normal) {
  std::vector<uint16_t> kv(kKvHeadDim);
  const float magnitude = 0.5f + 1.5f * std::uniform_real_distribution<float>(0, 1)(rng);
  for (auto& v : kv) v = f32_to_bf16(magnitude * normal(rng));
  KvWriteParams w{1, format, true, pool, &entry, &row};
  write_kv_entries(w, kv.data());
  std::vector<float> image(kKvHeadDim);
  if (keep_reference) {
    uint8_t scratch[kKvBf16EntryBytes + kKvFp8ScaleBytes];
    const KvEntryAddress local{scratch, scratch + kKvBf16EntryBytes};
    kv_quantize_entry(format, kv.data(), local, true);
    kv_dequantize_entry(format, local, image.data());
  }
  return image;
}

// The last draws of a problem: each token's picks as indices (−7 past its length: never read) and lengths, then
// random q, the sinks and the RoPE frequencies.
inline void finish_problem(AttentionProblem& pr, const std::vector<std::vector<int32_t>>& picks, std::mt19937& rng,
                           std::normal_distribution<float>& normal) {
  const int64_t T = pr.tokens();
  pr.indices.assign(static_cast<size_t>(T * pr.compressed_stride), -7);
  pr.lengths.assign(static_cast<size_t>(T), 0);
  for (int64_t t = 0; t < T; ++t) {
    pr.lengths[static_cast<size_t>(t)] = static_cast<int32_t>(picks[static_cast<size_t>(t)].size());
    std::copy(picks[static_cast<size_t>(t)].begin(), picks[static_cast<size_t>(t)].end(),
              pr.indices.begin() + t * pr.compressed_stride);
  }
  pr.q.resize(static_cast<size_t>(T * pr.spec.heads * kKvHeadDim));
  for (auto& v : pr.q) v = f32_to_bf16(normal(rng));
  pr.sinks.resize(static_cast<size_t>(pr.spec.heads));
  for (auto& s : pr.sinks) s = std::uniform_real_distribution<float>(-2.0f, pr.spec.sink_max)(rng);
  for (int i = 0; i < kKvRopeDim / 2; ++i) pr.inv_freq.push_back(std::pow(10000.0f, -2.0f * i / kKvRopeDim));
}

inline AttentionProblem make_attention_problem(const AttentionProblemSpec& spec) {
  AttentionProblem pr;
  pr.spec = spec;
  pr.positions = spec.positions;
  std::mt19937 rng(spec.seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t T = pr.tokens();
  const KvEntryFormat f = spec.format;

  // Selected compressed entries per token.
  std::vector<std::vector<int32_t>> picks(T);
  int64_t max_picks = 1;
  for (int64_t t = 0; t < T; ++t) {
    if (spec.ratio == 0) continue;
    const int64_t visible = (int64_t{pr.positions[t]} + 1) / spec.ratio;
    if (spec.ratio == 128) {
      for (int64_t e = 0; e < visible; ++e) picks[t].push_back(static_cast<int32_t>(e));
    } else {
      const int64_t span = spec.pick_span > 0 ? std::min(spec.pick_span, visible) : visible;
      const int64_t k = std::min(spec.top_k, span);
      // k distinct entries of [0, visible): a partial Fisher-Yates over a sparse map keeps 1M contexts cheap.
      std::vector<int32_t> chosen;
      std::unordered_map<int64_t, int64_t> swapped;
      auto value_at = [&](int64_t i) {
        const auto it = swapped.find(i);
        return it == swapped.end() ? i : it->second;
      };
      for (int64_t i = 0; i < k; ++i) {
        const int64_t j = i + static_cast<int64_t>(rng() % static_cast<uint32_t>(span - i));
        const int64_t vi = value_at(i), vj = value_at(j);
        chosen.push_back(static_cast<int32_t>(vj));
        swapped[j] = vi;
        swapped[i] = vj;
      }
      picks[t] = chosen;
    }
    for (auto& e : picks[t])
      if (std::uniform_real_distribution<double>(0, 1)(rng) < spec.invalid_fraction) e = -1;
    max_picks = std::max<int64_t>(max_picks, static_cast<int64_t>(picks[t].size()));
  }
  pr.compressed_stride = max_picks;

  // Block tables: window blocks for positions t−W+1 … t, compressed blocks holding the picks.
  const int64_t wepb = spec.window_entries_per_block, cepb = spec.compressed_entries_per_block;
  pr.set_block_geometry();
  int64_t max_pos = 0;
  for (auto p : pr.positions) max_pos = std::max<int64_t>(max_pos, p);
  pr.window_stride = max_pos / wepb + 1;
  pr.compressed_table_stride = std::max<int64_t>(1, (max_pos + 1) / std::max<int64_t>(spec.ratio, 1) / cepb + 1);
  pr.window_table.assign(T * pr.window_stride, -1);
  pr.compressed_table.assign(T * pr.compressed_table_stride, -1);
  std::vector<std::pair<int64_t, int64_t>> window_needed, compressed_needed, chunk_needed;  // (token, block)
  pr.chunk_table.assign(T * pr.window_stride, -1);
  pr.chunk_starts.assign(T, 0);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t pos = pr.positions[t], first = std::max<int64_t>(0, pos - spec.window + 1);
    for (int64_t b = first / wepb; b <= pos / wepb; ++b) window_needed.emplace_back(t, b);
    if (spec.prefill_chunk > 0) {
      pr.chunk_starts[t] = static_cast<int32_t>(
          std::max<int64_t>(0, pos - static_cast<int64_t>(rng() % static_cast<uint32_t>(spec.prefill_chunk))));
      for (int64_t b = 0; b <= (pos - pr.chunk_starts[t]) / wepb; ++b) chunk_needed.emplace_back(t, b);
    }
    std::vector<int64_t> blocks;
    for (auto e : picks[t])
      if (e >= 0) blocks.push_back(e / cepb);
    std::sort(blocks.begin(), blocks.end());
    blocks.erase(std::unique(blocks.begin(), blocks.end()), blocks.end());
    for (auto b : blocks) compressed_needed.emplace_back(t, b);
  }
  // Window blocks live in the first pages, compressed blocks in later ones; ids are shuffled within each.
  const int64_t window_pages = (static_cast<int64_t>(window_needed.size()) + pr.blocks_per_page - 1) / pr.blocks_per_page;
  const int64_t compressed_pages =
      (static_cast<int64_t>(compressed_needed.size()) + pr.blocks_per_page - 1) / pr.blocks_per_page;
  const int64_t chunk_pages = (static_cast<int64_t>(chunk_needed.size()) + pr.blocks_per_page - 1) / pr.blocks_per_page;
  auto assign = [&](const std::vector<std::pair<int64_t, int64_t>>& needed, int64_t first_page,
                    std::vector<int32_t>& table, int64_t stride) {
    std::vector<int32_t> ids(needed.size());
    std::iota(ids.begin(), ids.end(), static_cast<int32_t>(first_page * pr.blocks_per_page));
    std::shuffle(ids.begin(), ids.end(), rng);
    for (size_t i = 0; i < needed.size(); ++i) table[needed[i].first * stride + needed[i].second] = ids[i];
  };
  assign(window_needed, 0, pr.window_table, pr.window_stride);
  assign(compressed_needed, window_pages, pr.compressed_table, pr.compressed_table_stride);
  assign(chunk_needed, window_pages + compressed_pages, pr.chunk_table, pr.window_stride);
  pr.arena.assign(static_cast<size_t>((window_pages + compressed_pages + chunk_pages + 1) * pr.page_bytes), 0xff);

  // Entries: random K=V vectors (rope channels included), written through the quantizer.
  ops::SparseAttentionParams p = pr.host_params();
  std::vector<std::unordered_map<int32_t, std::vector<float>>> images(T);  // compressed entry -> its key
  pr.reference_keys.resize(T);
  auto write = [&](const PagedKvPool& pool, int64_t t, int32_t entry) {
    return write_random_entry(pool, f, static_cast<int32_t>(t), entry, spec.keep_reference, rng, normal);
  };
  for (int64_t t = 0; t < T; ++t) {
    const int64_t pos = pr.positions[t];
    auto& ref = pr.reference_keys[t];
    for (int64_t e = std::max<int64_t>(0, pos - spec.window + 1); e <= pos; ++e) {
      // A chunk position is written to the chunk pool only: its paged window slot stays 0xff (NaN), so reading
      // the wrong source shows.
      const bool from_chunk = spec.prefill_chunk > 0 && e >= pr.chunk_starts[t];
      const std::vector<float> image = from_chunk ? write(p.chunk, t, static_cast<int32_t>(e - pr.chunk_starts[t]))
                                                  : write(p.window, t, static_cast<int32_t>(e));
      if (spec.keep_reference) ref.insert(ref.end(), image.begin(), image.end());
      ++pr.unique_keys;
    }
    for (const int32_t e : picks[t]) {
      if (e < 0) continue;
      if (!images[t].count(e)) {
        images[t][e] = write(p.compressed, t, e);
        ++pr.unique_keys;
      }
      if (spec.keep_reference) ref.insert(ref.end(), images[t][e].begin(), images[t][e].end());
    }
    images[t].clear();
  }
  finish_problem(pr, picks, rng, normal);
  return pr;
}

// One request's prefill chunk as the model runner lays it out: `tokens` query tokens at the consecutive positions
// first_position … first_position + tokens − 1, all in block-table row 0; the chunk's own K=V vectors in the chunk
// pool (chunk_starts = first_position for every token), the window positions before the chunk in the paged window;
// CSA picks spec.top_k distinct random entries of the (pos + 1) / 4 visible ones per query (all when fewer), HCA
// every visible entry, SWA none. Every entry is written once and shared by the queries that read it, as in the
// cache. spec.positions, prefill_chunk, invalid_fraction and pick_span are not used.
inline AttentionProblem make_prefill_problem(const AttentionProblemSpec& spec, int64_t first_position, int64_t tokens) {
  AttentionProblem pr;
  pr.spec = spec;
  pr.spec.prefill_chunk = 1;  // params() sets the chunk pool
  std::mt19937 rng(spec.seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const KvEntryFormat f = spec.format;
  const int64_t last = first_position + tokens - 1;
  for (int64_t t = 0; t < tokens; ++t) pr.positions.push_back(static_cast<int32_t>(first_position + t));
  pr.rows.assign(static_cast<size_t>(tokens), 0);
  pr.chunk_starts.assign(static_cast<size_t>(tokens), static_cast<int32_t>(first_position));

  std::vector<std::vector<int32_t>> picks(static_cast<size_t>(tokens));
  int64_t max_picks = 1;
  std::vector<int32_t> all;
  for (int64_t t = 0; t < tokens && spec.ratio > 0; ++t) {
    const int64_t visible = (first_position + t + 1) / spec.ratio;
    auto& chosen = picks[static_cast<size_t>(t)];
    if (spec.ratio == 128 || visible <= spec.top_k) {
      for (int64_t e = 0; e < visible; ++e) chosen.push_back(static_cast<int32_t>(e));
    } else {  // k distinct of [0, visible): a partial Fisher-Yates
      all.resize(static_cast<size_t>(visible));
      std::iota(all.begin(), all.end(), 0);
      for (int64_t i = 0; i < spec.top_k; ++i) {
        const int64_t j = i + static_cast<int64_t>(rng() % static_cast<uint32_t>(visible - i));
        std::swap(all[static_cast<size_t>(i)], all[static_cast<size_t>(j)]);
        chosen.push_back(all[static_cast<size_t>(i)]);
      }
    }
    max_picks = std::max<int64_t>(max_picks, static_cast<int64_t>(chosen.size()));
  }
  pr.compressed_stride = max_picks;

  const int64_t wepb = spec.window_entries_per_block, cepb = spec.compressed_entries_per_block;
  pr.set_block_geometry();
  // One row each: the window blocks before the chunk, the chunk's blocks (offsets 0 … tokens − 1), the compressed
  // blocks of every entry visible at the last position. Ids shuffled over the pages, as the pool hands them out.
  const int64_t window_first = std::max<int64_t>(0, first_position - spec.window + 1);
  const int64_t entries = spec.ratio > 0 ? (last + 1) / spec.ratio : 0;
  pr.window_stride = std::max<int64_t>(last / wepb + 1, (tokens - 1) / wepb + 1);
  pr.compressed_table_stride = std::max<int64_t>(1, (entries + cepb - 1) / cepb);
  pr.window_table.assign(static_cast<size_t>(pr.window_stride), -1);
  pr.chunk_table.assign(static_cast<size_t>(pr.window_stride), -1);
  pr.compressed_table.assign(static_cast<size_t>(pr.compressed_table_stride), -1);
  std::vector<std::pair<std::vector<int32_t>*, int64_t>> needed;  // (table, block)
  if (first_position > 0)
    for (int64_t b = window_first / wepb; b <= (first_position - 1) / wepb; ++b) needed.emplace_back(&pr.window_table, b);
  for (int64_t b = 0; b <= (tokens - 1) / wepb; ++b) needed.emplace_back(&pr.chunk_table, b);
  for (int64_t b = 0; b < (entries + cepb - 1) / cepb; ++b) needed.emplace_back(&pr.compressed_table, b);
  std::vector<int32_t> ids(needed.size());
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  for (size_t i = 0; i < needed.size(); ++i) (*needed[i].first)[static_cast<size_t>(needed[i].second)] = ids[i];
  const int64_t pages = (static_cast<int64_t>(needed.size()) + pr.blocks_per_page - 1) / pr.blocks_per_page + 1;
  pr.arena.assign(static_cast<size_t>(pages * pr.page_bytes), 0xff);

  ops::SparseAttentionParams p = pr.host_params();
  auto write = [&](const PagedKvPool& pool, int32_t entry) {
    ++pr.unique_keys;
    return write_random_entry(pool, f, 0, entry, spec.keep_reference, rng, normal);
  };
  std::vector<std::vector<float>> window_images, compressed_images;  // by position − window_first, by entry
  for (int64_t position = window_first; position <= last; ++position)
    window_images.push_back(position < first_position ? write(p.window, static_cast<int32_t>(position))
                                                      : write(p.chunk, static_cast<int32_t>(position - first_position)));
  for (int64_t e = 0; e < entries; ++e) compressed_images.push_back(write(p.compressed, static_cast<int32_t>(e)));
  if (spec.keep_reference) {
    pr.reference_keys.resize(static_cast<size_t>(tokens));
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t pos = first_position + t;
      auto& ref = pr.reference_keys[static_cast<size_t>(t)];
      for (int64_t position = std::max<int64_t>(0, pos - spec.window + 1); position <= pos; ++position) {
        const auto& image = window_images[static_cast<size_t>(position - window_first)];
        ref.insert(ref.end(), image.begin(), image.end());
      }
      for (const int32_t e : picks[static_cast<size_t>(t)])
        ref.insert(ref.end(), compressed_images[static_cast<size_t>(e)].begin(),
                   compressed_images[static_cast<size_t>(e)].end());
    }
  }
  finish_problem(pr, picks, rng, normal);
  return pr;
}

// The attention of docs/kernels/attention.md in double precision over reference_keys: softmax with the sink in
// the denominator, then the rope channels rotated by −t (angles as the model computes them: fp32 inv_freq · t).
inline std::vector<double> reference_attention(const AttentionProblem& pr) {
  const int64_t H = pr.spec.heads, d = kKvHeadDim;
  std::vector<double> out(static_cast<size_t>(pr.tokens() * H * d));
  for (int64_t t = 0; t < pr.tokens(); ++t) {
    const std::vector<float>& keys = pr.reference_keys[t];
    const int64_t n = static_cast<int64_t>(keys.size()) / d;
    std::vector<double> logits(static_cast<size_t>(n));
    for (int64_t h = 0; h < H; ++h) {
      const uint16_t* qh = &pr.q[(t * H + h) * d];
      double m = pr.sinks[h];
      for (int64_t j = 0; j < n; ++j) {
        double dot = 0;
        for (int64_t c = 0; c < d; ++c) dot += double(bf16_to_f32(qh[c])) * keys[j * d + c];
        logits[j] = dot / std::sqrt(512.0);
        m = std::max(m, logits[j]);
      }
      double denominator = std::exp(pr.sinks[h] - m);
      for (auto& l : logits) denominator += (l = std::exp(l - m));
      double* o = &out[(t * H + h) * d];
      for (int64_t j = 0; j < n; ++j)
        for (int64_t c = 0; c < d; ++c) o[c] += logits[j] / denominator * keys[j * d + c];
      if (n == 0) continue;
      for (int i = 0; i < kKvRopeDim / 2; ++i) {
        const double angle = pr.inv_freq[i] * static_cast<float>(pr.positions[t]);
        const double a = o[kKvNopeDim + 2 * i], b = o[kKvNopeDim + 2 * i + 1];
        o[kKvNopeDim + 2 * i] = a * std::cos(angle) + b * std::sin(angle);
        o[kKvNopeDim + 2 * i + 1] = b * std::cos(angle) - a * std::sin(angle);
      }
    }
  }
  return out;
}

// ‖actual − expected‖ / ‖expected‖ over tokens × heads × 512 (bf16 actual); NaN makes it NaN.
inline double relative_l2(const std::vector<uint16_t>& actual, const std::vector<double>& expected) {
  double err = 0, norm = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    const double a = bf16_to_f32(actual[i]);
    err += (a - expected[i]) * (a - expected[i]);
    norm += expected[i] * expected[i];
  }
  return norm > 0 ? std::sqrt(err / norm) : std::sqrt(err);
}

}  // namespace dsv4::testing
