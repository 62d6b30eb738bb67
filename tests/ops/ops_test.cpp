// Each CPU op against a naive double-precision formula on random inputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "ops/cpu/attention.h"
#include "ops/cpu/compressor.h"
#include "ops/cpu/hyper_connection.h"
#include "ops/cpu/indexer.h"
#include "ops/cpu/linear.h"
#include "ops/cpu/moe.h"
#include "ops/cpu/norm.h"
#include "ops/cpu/rope.h"

namespace dsv4::ops::cpu {
namespace {

std::vector<float> random_vector(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = normal(rng);
  return v;
}

void expect_close(const std::vector<float>& actual, const std::vector<double>& expected, double tolerance) {
  ASSERT_EQ(actual.size(), expected.size());
  double err = 0, norm = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    err += (actual[i] - expected[i]) * (actual[i] - expected[i]);
    norm += expected[i] * expected[i];
  }
  EXPECT_LE(std::sqrt(err / std::max(norm, 1e-30)), tolerance);
}

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

TEST(Ops, LinearMatchesNaiveGemm) {
  const int64_t rows = 7, in = 37, out = 19;
  const auto x = random_vector(rows * in, 1), w = random_vector(out * in, 2);
  std::vector<float> y(rows * out);
  linear(x.data(), rows, in, w.data(), out, y.data());
  std::vector<double> expected(rows * out);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < out; ++o)
      for (int64_t i = 0; i < in; ++i) expected[r * out + o] += double(x[r * in + i]) * w[o * in + i];
  expect_close(y, expected, 1e-6);
}

// kDeepSeek's GEMM (docs/numerics.md "Canonical accumulation in kDeepSeek"): each dot product is the double sum in
// channel order rounded once to fp32 (per k_block block, the block partials added in fp32), bit for bit, and a row's
// result does not depend on how many rows the call holds (prefill vs decode).
TEST(Ops, LinearF64RoundsTheDoubleSumOnceWhateverTheRowCount) {
  const int64_t rows = 9, in = 320, out = 19;  // out not a multiple of the 4-output tile
  const auto x = random_vector(rows * in, 21), w = random_vector(out * in, 22, 0.05f);
  for (const int64_t k_block : {int64_t{0}, int64_t{32}, int64_t{128}}) {
    std::vector<float> y(rows * out);
    linear_f64(x.data(), rows, in, w.data(), out, y.data(), k_block);
    const int64_t block = k_block == 0 ? in : k_block;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t o = 0; o < out; ++o) {
        float expected = 0;
        for (int64_t begin = 0; begin < in; begin += block) {
          double sum = 0;
          for (int64_t i = begin; i < std::min(in, begin + block); ++i) sum += double(x[r * in + i]) * w[o * in + i];
          expected += static_cast<float>(sum);
        }
        EXPECT_EQ(y[r * out + o], expected) << "k_block " << k_block << " row " << r << " out " << o;
      }
      std::vector<float> alone(out);  // the same row on its own
      linear_f64(&x[r * in], 1, in, w.data(), out, alone.data(), k_block);
      EXPECT_TRUE(std::equal(alone.begin(), alone.end(), &y[r * out])) << "k_block " << k_block << " row " << r;
    }
  }
  // Strided: a column slice of a wider input and output.
  std::vector<float> wide(rows * 2 * out, -1.0f), y(rows * out);
  linear_f64(x.data(), rows, in / 2, w.data(), out, y.data());
  linear_f64_strided(x.data(), rows, in / 2, in, w.data(), out, wide.data() + out, 2 * out);
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<float> row(out);
    linear_f64(&x[r * in], 1, in / 2, w.data(), out, row.data());
    EXPECT_TRUE(std::equal(row.begin(), row.end(), &wide[r * 2 * out + out])) << r;
    EXPECT_EQ(wide[r * 2 * out], -1.0f);  // the other columns untouched
  }
}

TEST(Ops, RmsNormMatchesFormula) {
  const int64_t rows = 5, dim = 67;
  const auto x = random_vector(rows * dim, 3, 4.0f), w = random_vector(dim, 4);
  for (const bool weighted : {true, false}) {
    std::vector<float> y(x.size());
    rms_norm(x.data(), rows, dim, dim, weighted ? w.data() : nullptr, 1e-6f, y.data());
    std::vector<double> expected(x.size());
    for (int64_t r = 0; r < rows; ++r) {
      double ms = 0;
      for (int64_t i = 0; i < dim; ++i) ms += double(x[r * dim + i]) * x[r * dim + i] / dim;
      for (int64_t i = 0; i < dim; ++i)
        expected[r * dim + i] = (weighted ? w[i] : 1.0) * x[r * dim + i] / std::sqrt(ms + 1e-6);
    }
    expect_close(y, expected, 1e-6);
  }
}

TEST(Ops, RopeRotatesTrailingPairsAndInverts) {
  const int64_t rows = 3, heads = 2, head_dim = 24;
  RopeTable table{{0.9f, 0.3f, 0.05f, 0.01f}, 1.0f};  // rope_dim 8: channels 16..23
  auto x = random_vector(rows * heads * head_dim, 5);
  const auto original = x;
  const int64_t positions[] = {0, 7, 1000};
  apply_rope(x.data(), rows, heads * head_dim, heads, head_dim, positions, table);
  std::vector<double> expected(original.begin(), original.end());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < 4; ++i) {
        const int64_t base = r * heads * head_dim + h * head_dim + 16 + 2 * i;
        const double angle = double(table.inv_freq[i]) * positions[r];
        expected[base] = original[base] * std::cos(angle) - original[base + 1] * std::sin(angle);
        expected[base + 1] = original[base + 1] * std::cos(angle) + original[base] * std::sin(angle);
      }
  expect_close(x, expected, 1e-5);
  apply_rope(x.data(), rows, heads * head_dim, heads, head_dim, positions, table, /*inverse=*/true);
  expect_close(x, std::vector<double>(original.begin(), original.end()), 1e-5);
}

TEST(Ops, HyperConnectionMatchesFormula) {
  const HyperConnectionParams p{4, 16, 20, 1e-6f, 1e-6f};
  const int64_t tokens = 3, mix = (2 + p.hc) * p.hc;
  const auto streams = random_vector(tokens * p.hc * p.hidden, 6);
  const auto fn = random_vector(mix * p.hc * p.hidden, 7, 0.2f), base = random_vector(mix, 8, 0.5f);
  const std::vector<float> scale = {0.7f, 1.3f, 0.9f};
  std::vector<float> collapsed(tokens * p.hidden), post(tokens * p.hc), comb(tokens * p.hc * p.hc);
  hc_pre(p, streams.data(), tokens, fn.data(), base.data(), scale.data(), collapsed.data(), post.data(), comb.data());
  std::vector<double> expected_collapsed(collapsed.size()), expected_post(post.size()), expected_comb(comb.size());
  const int64_t width = p.hc * p.hidden;
  for (int64_t t = 0; t < tokens; ++t) {
    const float* h = &streams[t * width];
    double ms = 0;
    for (int64_t i = 0; i < width; ++i) ms += double(h[i]) * h[i] / width;
    std::vector<double> m(mix);
    for (int64_t o = 0; o < mix; ++o)
      for (int64_t i = 0; i < width; ++i) m[o] += h[i] / std::sqrt(ms + 1e-6) * fn[o * width + i];
    std::vector<double> pre(p.hc), c(p.hc * p.hc);
    for (int64_t s = 0; s < p.hc; ++s) {
      pre[s] = sigmoid(m[s] * scale[0] + base[s]) + 1e-6;
      expected_post[t * p.hc + s] = 2 * sigmoid(m[p.hc + s] * scale[1] + base[p.hc + s]);
    }
    for (int64_t j = 0; j < p.hc; ++j) {
      double sum = 0;
      for (int64_t k = 0; k < p.hc; ++k) sum += c[j * p.hc + k] = std::exp(m[2 * p.hc + j * p.hc + k] * scale[2] + base[2 * p.hc + j * p.hc + k]);
      for (int64_t k = 0; k < p.hc; ++k) c[j * p.hc + k] = c[j * p.hc + k] / sum + 1e-6;
    }
    for (int64_t iter = 0; iter < p.sinkhorn_iters; ++iter) {
      if (iter > 0)
        for (int64_t j = 0; j < p.hc; ++j) {
          double sum = 0;
          for (int64_t k = 0; k < p.hc; ++k) sum += c[j * p.hc + k];
          for (int64_t k = 0; k < p.hc; ++k) c[j * p.hc + k] /= sum + 1e-6;
        }
      for (int64_t k = 0; k < p.hc; ++k) {
        double sum = 0;
        for (int64_t j = 0; j < p.hc; ++j) sum += c[j * p.hc + k];
        for (int64_t j = 0; j < p.hc; ++j) c[j * p.hc + k] /= sum + 1e-6;
      }
    }
    std::copy(c.begin(), c.end(), expected_comb.begin() + t * p.hc * p.hc);
    for (int64_t d = 0; d < p.hidden; ++d)
      for (int64_t s = 0; s < p.hc; ++s) expected_collapsed[t * p.hidden + d] += pre[s] * h[s * p.hidden + d];
  }
  expect_close(collapsed, expected_collapsed, 1e-5);
  expect_close(post, expected_post, 1e-5);
  expect_close(comb, expected_comb, 1e-5);
  // Sinkhorn ends on a column normalisation: columns sum to 1, rows nearly so.
  for (int64_t k = 0; k < p.hc; ++k) {
    double column = 0;
    for (int64_t j = 0; j < p.hc; ++j) column += comb[j * p.hc + k];
    EXPECT_NEAR(column, 1.0, 1e-5);
  }

  const auto y = random_vector(tokens * p.hidden, 9);
  std::vector<float> out(streams.size());
  hc_post(p, y.data(), streams.data(), tokens, post.data(), comb.data(), out.data());
  std::vector<double> expected_out(out.size());
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t k = 0; k < p.hc; ++k)
      for (int64_t d = 0; d < p.hidden; ++d) {
        double v = double(post[t * p.hc + k]) * y[t * p.hidden + d];
        for (int64_t j = 0; j < p.hc; ++j) v += double(comb[t * p.hc * p.hc + j * p.hc + k]) * streams[(t * p.hc + j) * p.hidden + d];
        expected_out[(t * p.hc + k) * p.hidden + d] = v;
      }
  expect_close(out, expected_out, 1e-6);
}

// The kDeepSeek mHC (model.py's order of operations, double-accumulated mixes, Sinkhorn in double) computes the same
// function as the kHf ops up to fp32 rounding.
TEST(Ops, HyperConnectionDeepseekMatchesHf) {
  const HyperConnectionParams p{4, 16, 20, 1e-6f, 1e-6f};
  const int64_t tokens = 3, mix = (2 + p.hc) * p.hc;
  const auto streams = random_vector(tokens * p.hc * p.hidden, 16);
  const auto fn = random_vector(mix * p.hc * p.hidden, 17, 0.2f), base = random_vector(mix, 18, 0.5f);
  const std::vector<float> scale = {0.7f, 1.3f, 0.9f};
  std::vector<float> collapsed(tokens * p.hidden), post(tokens * p.hc), comb(tokens * p.hc * p.hc);
  std::vector<float> collapsed_ds(collapsed.size()), post_ds(post.size()), comb_ds(comb.size());
  hc_pre(p, streams.data(), tokens, fn.data(), base.data(), scale.data(), collapsed.data(), post.data(), comb.data());
  hc_pre_deepseek(p, 1e-6, streams.data(), tokens, fn.data(), base.data(), scale.data(), collapsed_ds.data(),
                  post_ds.data(), comb_ds.data());
  auto as_double = [](const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); };
  expect_close(collapsed_ds, as_double(collapsed), 1e-6);
  expect_close(post_ds, as_double(post), 1e-6);
  expect_close(comb_ds, as_double(comb), 1e-6);

  const auto y = random_vector(tokens * p.hidden, 19);
  std::vector<float> out(streams.size()), out_ds(streams.size());
  hc_post(p, y.data(), streams.data(), tokens, post.data(), comb.data(), out.data());
  hc_post_deepseek(p, y.data(), streams.data(), tokens, post.data(), comb.data(), out_ds.data());
  expect_close(out_ds, as_double(out), 1e-6);

  const auto head_fn = random_vector(p.hc * p.hc * p.hidden, 20, 0.2f);
  const std::vector<float> head_scale = {0.8f};
  std::vector<float> head(tokens * p.hidden), head_ds(head.size());
  hc_head(p, streams.data(), tokens, head_fn.data(), base.data(), head_scale.data(), head.data());
  hc_head_deepseek(p, streams.data(), tokens, head_fn.data(), base.data(), head_scale.data(), head_ds.data());
  expect_close(head_ds, as_double(head), 1e-6);
}

TEST(Ops, SinkAttentionMatchesSoftmaxWithVirtualKey) {
  const SinkAttentionParams p{3, 32, 1.0f / std::sqrt(32.0f)};
  const int64_t num_keys = 11;
  const auto q = random_vector(p.heads * p.head_dim, 10, 2.0f), kv = random_vector(num_keys * p.head_dim, 11);
  const std::vector<float> sinks = {0.5f, -1.0f, 3.0f};
  std::vector<const float*> keys;
  for (int64_t j = 0; j < num_keys; ++j) keys.push_back(&kv[j * p.head_dim]);
  std::vector<float> out(p.heads * p.head_dim);
  sink_attention(p, q.data(), keys.data(), num_keys, sinks.data(), out.data());
  std::vector<double> expected(out.size());
  for (int64_t h = 0; h < p.heads; ++h) {
    std::vector<double> logits(num_keys);
    double denominator = std::exp(double(sinks[h]));
    for (int64_t j = 0; j < num_keys; ++j) {
      for (int64_t i = 0; i < p.head_dim; ++i) logits[j] += double(q[h * p.head_dim + i]) * kv[j * p.head_dim + i];
      denominator += logits[j] = std::exp(logits[j] * p.scale);
    }
    for (int64_t j = 0; j < num_keys; ++j)
      for (int64_t i = 0; i < p.head_dim; ++i) expected[h * p.head_dim + i] += logits[j] / denominator * kv[j * p.head_dim + i];
  }
  expect_close(out, expected, 1e-5);
  // No keys: the sink takes all the mass, the output is zero.
  sink_attention(p, q.data(), keys.data(), 0, sinks.data(), out.data());
  for (float v : out) EXPECT_EQ(v, 0.0f);
}

// The streaming compressor against the batch formula of transformers' compressors over a whole sequence.
void check_compressor(bool overlap, int64_t ratio, int64_t head_dim, int64_t tokens) {
  const CompressorParams p{ratio, head_dim, overlap};
  const int64_t width = p.width();
  const auto kv = random_vector(tokens * width, 12), gate = random_vector(tokens * width, 13, 2.0f);
  const auto ape = random_vector(ratio * width, 14);
  std::vector<float> kv_state(p.state_slots() * width, 0.0f), gate_state(p.state_slots() * width, -INFINITY);
  std::vector<float> entries, entry(head_dim);
  for (int64_t t = 0; t < tokens; ++t) {
    const bool emitted = compressor_append(p, kv_state.data(), gate_state.data(), &kv[t * width], &gate[t * width],
                                           ape.data(), t, entry.data());
    EXPECT_EQ(emitted, (t + 1) % ratio == 0);
    if (emitted) entries.insert(entries.end(), entry.begin(), entry.end());
  }
  const int64_t windows = tokens / ratio;
  ASSERT_EQ(static_cast<int64_t>(entries.size()), windows * head_dim);
  std::vector<double> expected(entries.size());
  for (int64_t w = 0; w < windows; ++w)
    for (int64_t c = 0; c < head_dim; ++c) {
      std::vector<std::pair<double, double>> slots;  // (gate, value)
      for (int64_t u = 0; u < ratio; ++u) {
        if (overlap && w > 0) {
          const int64_t t = (w - 1) * ratio + u;
          slots.emplace_back(gate[t * width + c] + ape[u * width + c], kv[t * width + c]);
        }
        const int64_t t = w * ratio + u, channel = overlap ? head_dim + c : c;
        slots.emplace_back(gate[t * width + channel] + ape[u * width + channel], kv[t * width + channel]);
      }
      double denominator = 0, pooled = 0;
      for (auto [g, v] : slots) denominator += std::exp(g);
      for (auto [g, v] : slots) pooled += std::exp(g) / denominator * v;
      expected[w * head_dim + c] = pooled;
    }
  expect_close(entries, expected, 1e-5);
}

TEST(Ops, CompressorOverlapMatchesBatchFormula) { check_compressor(true, 4, 16, 37); }
TEST(Ops, CompressorNonOverlapMatchesBatchFormula) { check_compressor(false, 8, 12, 41); }

TEST(Ops, IndexerScoresAndTopK) {
  const IndexerParams p{3, 16};
  const int64_t entries = 23;
  const auto q = random_vector(p.heads * p.head_dim, 15), w = random_vector(p.heads, 16);
  const auto keys = random_vector(entries * p.head_dim, 17);
  std::vector<const float*> key_ptrs;
  for (int64_t s = 0; s < entries; ++s) key_ptrs.push_back(&keys[s * p.head_dim]);
  std::vector<float> scores(entries);
  indexer_scores(p, q.data(), w.data(), key_ptrs.data(), entries, scores.data());
  std::vector<double> expected(entries);
  for (int64_t s = 0; s < entries; ++s)
    for (int64_t h = 0; h < p.heads; ++h) {
      double dot = 0;
      for (int64_t i = 0; i < p.head_dim; ++i) dot += double(q[h * p.head_dim + i]) * keys[s * p.head_dim + i];
      expected[s] += std::max(dot, 0.0) / 4.0 * w[h];
    }
  expect_close(scores, expected, 1e-5);
  for (const int64_t k : {1, 5, 23, 40}) {
    const auto picked = top_k_indices(scores.data(), entries, k);
    std::vector<int32_t> order(entries);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return scores[a] > scores[b]; });
    order.resize(std::min<int64_t>(k, entries));
    EXPECT_EQ(picked, order) << k;
  }
  // Ties resolve to the lower index.
  const std::vector<float> tied = {1, 3, 3, 0, 3};
  EXPECT_EQ(top_k_indices(tied.data(), 5, 2), (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(top_k_indices(tied.data(), 3, 5), (std::vector<int32_t>{1, 2, 0}));
}

TEST(Ops, RouterAndSwiglu) {
  const int64_t experts = 9, top_k = 3;
  auto logits = random_vector(experts, 18, 3.0f);
  const auto raw = logits;
  router_scores(logits.data(), 1, experts, RouterScore::kSqrtSoftplus);
  for (int64_t e = 0; e < experts; ++e) EXPECT_NEAR(logits[e], std::sqrt(std::log1p(std::exp(double(raw[e])))), 1e-6);
  const auto bias = random_vector(experts, 19, 0.5f);
  std::vector<int32_t> chosen(top_k);
  std::vector<float> weights(top_k);
  route_token(logits.data(), bias.data(), experts, top_k, nullptr, 1.5f, chosen.data(), weights.data());
  std::vector<int32_t> order(experts);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int a, int b) { return logits[a] + bias[a] > logits[b] + bias[b]; });
  double sum = 0;
  for (int64_t k = 0; k < top_k; ++k) {
    EXPECT_EQ(chosen[k], order[k]);
    sum += logits[order[k]];
  }
  for (int64_t k = 0; k < top_k; ++k) EXPECT_NEAR(weights[k], logits[order[k]] / sum * 1.5, 1e-6);
  // Hash routing keeps the table's experts; the weights still come from the scores.
  const int32_t fixed[] = {8, 0, 4};
  route_token(logits.data(), nullptr, experts, top_k, fixed, 1.0f, chosen.data(), weights.data());
  EXPECT_EQ(chosen, (std::vector<int32_t>{8, 0, 4}));
  EXPECT_NEAR(weights[0], logits[8] / (logits[8] + logits[0] + logits[4]), 1e-6);

  const int64_t inter = 5;
  const auto gate_up = random_vector(2 * 2 * inter, 20, 8.0f);
  std::vector<float> out(2 * inter);
  swiglu_clamped(gate_up.data(), 2, inter, 3.0f, out.data());
  std::vector<double> expected(out.size());
  for (int64_t r = 0; r < 2; ++r)
    for (int64_t i = 0; i < inter; ++i) {
      const double g = std::min<double>(gate_up[r * 2 * inter + i], 3.0);
      const double u = std::clamp<double>(gate_up[r * 2 * inter + inter + i], -3.0, 3.0);
      expected[r * inter + i] = g * sigmoid(g) * u;
    }
  expect_close(out, expected, 1e-6);
}

}  // namespace
}  // namespace dsv4::ops::cpu
