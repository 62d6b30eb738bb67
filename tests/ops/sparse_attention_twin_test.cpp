// The CPU twin of the sparse attention decode (ops/cpu/sparse_attention.h) against the formula in double over
// keys that never went through the arena: checks the paged addressing, both entry formats, the window and
// compressed index rules and the sink / inverse-RoPE epilogue at production shapes and corners.
#include <gtest/gtest.h>

#include <string>
#include <utility>

#include "ops/cpu/sparse_attention.h"
#include "sparse_attention_problem.h"

namespace dsv4::testing {
namespace {

void expect_twin_matches_formula(AttentionProblem pr, const char* what) {
  std::vector<uint16_t> out(pr.q.size(), 0xffff);  // poison: bf16 NaN
  ops::cpu::sparse_attention(pr.host_params(), pr.q.data(), out.data());
  const std::vector<double> expected = reference_attention(pr);
  // The twin is fp32 with a bf16 output: about 2^-9 relative per element.
  EXPECT_LE(relative_l2(out, expected), 4e-3) << what;
  for (size_t i = 0; i < out.size(); ++i) ASSERT_FALSE(std::isnan(bf16_to_f32(out[i]))) << what << " at " << i;
}
void expect_twin_matches_formula(const AttentionProblemSpec& spec, const char* what) {
  expect_twin_matches_formula(make_attention_problem(spec), what);
}

TEST(SparseAttentionTwin, FlashCsaProductionShape) {
  for (const KvEntryFormat format : {KvEntryFormat::kFp8, KvEntryFormat::kBf16}) {
    AttentionProblemSpec spec;
    spec.format = format;
    spec.positions = {8191, 131071, 515, 63};  // 63: 16 visible entries, fewer than top-k
    expect_twin_matches_formula(spec, format == KvEntryFormat::kFp8 ? "fp8" : "bf16");
  }
}

TEST(SparseAttentionTwin, ProCsaTopK1024) {
  AttentionProblemSpec spec;
  spec.heads = 128;
  spec.top_k = 1024;
  spec.positions = {131071, 5000};
  expect_twin_matches_formula(spec, "pro");
}

TEST(SparseAttentionTwin, HcaEveryEntryAt1M) {
  AttentionProblemSpec spec;
  spec.ratio = 128;
  spec.compressed_entries_per_block = 2;
  spec.positions = {1048575, 300, 126};  // 8192 entries; 2 entries; none
  expect_twin_matches_formula(spec, "hca");
}

TEST(SparseAttentionTwin, CornerCases) {
  AttentionProblemSpec spec;
  spec.invalid_fraction = 0.3;           // −1 picks are skipped
  spec.positions = {0, 1, 2, 130, 4099};  // window of 1 key, lengths not multiples of 4, straddled pages
  expect_twin_matches_formula(spec, "invalid picks");
  spec.invalid_fraction = 1.0;  // no valid compressed entry: window only
  expect_twin_matches_formula(spec, "all picks invalid");
  spec.ratio = 0;  // SWA layer
  expect_twin_matches_formula(spec, "swa");
}

TEST(SparseAttentionTwin, PrefillChunkKeys) {
  // Prefill: each query's most recent window keys come from the step's chunk pool; the paged slots of those
  // positions hold NaN, so a read from the wrong pool fails the check.
  for (const int64_t ratio : {int64_t{4}, int64_t{128}, int64_t{0}}) {
    AttentionProblemSpec spec;
    spec.ratio = ratio;
    spec.compressed_entries_per_block = ratio == 128 ? 2 : 64;
    spec.prefill_chunk = 200;  // from none of the window up to all of it
    spec.positions = {0, 5, 127, 128, 129, 300, 1000, 4095, 16383, 16384};
    expect_twin_matches_formula(spec, ratio == 4 ? "prefill csa" : ratio == 128 ? "prefill hca" : "prefill swa");
  }
}

TEST(SparseAttentionTwin, SinkAndSelectionMatter) {
  // The formula check above could pass with the sink or the picks ignored only if they did not move the
  // output; make sure they do at these magnitudes.
  AttentionProblemSpec spec;
  spec.positions = {4095};
  AttentionProblem pr = make_attention_problem(spec);
  std::vector<uint16_t> base(pr.q.size()), changed(pr.q.size());
  ops::cpu::sparse_attention(pr.host_params(), pr.q.data(), base.data());
  for (auto& s : pr.sinks) s += 3.0f;
  ops::cpu::sparse_attention(pr.host_params(), pr.q.data(), changed.data());
  EXPECT_NE(base, changed);
  for (auto& s : pr.sinks) s -= 3.0f;
  pr.lengths[0] -= 1;  // drop one pick
  ops::cpu::sparse_attention(pr.host_params(), pr.q.data(), changed.data());
  EXPECT_NE(base, changed);
}

TEST(SparseAttentionTwin, PrefillOfOneRequest) {
  // The runner's layout: one block-table row, consecutive positions, every query sharing the chunk's and the
  // compressed pool's entries. From position 0 (the window grows from one key) and from 1000 (the window straddles
  // the paged window and the chunk); top-k 16 so that CSA queries draw random picks.
  for (const int64_t ratio : {int64_t{4}, int64_t{128}, int64_t{0}})
    for (const auto& [first, tokens] : {std::pair<int64_t, int64_t>{0, 64}, {1000, 48}}) {
      AttentionProblemSpec spec;
      spec.ratio = ratio;
      spec.top_k = 16;
      spec.compressed_entries_per_block = ratio == 128 ? 2 : 64;
      spec.seed = static_cast<uint32_t>(ratio + first);
      const std::string what = "prefill ratio " + std::to_string(ratio) + " from " + std::to_string(first);
      expect_twin_matches_formula(make_prefill_problem(spec, first, tokens), what.c_str());
    }
}

}  // namespace
}  // namespace dsv4::testing
