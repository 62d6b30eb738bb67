// The CUDA mHC ops against their CPU twins (ops/cpu/hyper_connection.h hc_pre / hc_post / hc_head) on random
// inputs: V4-Flash (hc 4, D 4096) and V4-Pro (D 7168) shapes from one token (decode: many K splits) to 1,100
// (prefill: the tensor-core mixes, and the split-K kernel on request), the tiny preset's D 256, and hc 1 / 2 with
// widths that take the scalar path; hc_pre and
// hc_head with the following RMSNorm fused (against the CPU's hc_pre / hc_head then rms_norm); hc_post fused with the
// next hc_pre (against the CPU's hc_post then hc_pre).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "ops/cpu/hyper_connection.h"
#include "ops/cpu/norm.h"
#include "ops/cuda/hyper_connection.h"
#include "small_ops_util.h"

namespace dsv4::ops::cuda {
namespace {

using testing::small_ops::bitwise_equal;
using testing::small_ops::DeviceArray;
using testing::small_ops::max_rel;
using testing::small_ops::rel_l2;

class CudaHyperConnection : public testing::small_ops::GpuTest {};

struct Shape {
  int64_t tokens, hc, hidden;
};

struct Inputs {
  std::vector<float> streams, fn, base, scale;
};

// Streams ~ N(0, 1); fn ~ N(0, 0.02) (mixes of O(1) after the RMS norm); base ~ N(0, 0.5); scale ∈ [0.5, 2].
Inputs random_inputs(const Shape& s, int64_t mix, int64_t n_scale, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uniform(0.5f, 2.0f);
  Inputs in;
  in.streams.resize(static_cast<size_t>(s.tokens * s.hc * s.hidden));
  for (auto& v : in.streams) v = normal(rng);
  in.fn.resize(static_cast<size_t>(mix * s.hc * s.hidden));
  for (auto& v : in.fn) v = 0.02f * normal(rng) * std::sqrt(4096.0f / static_cast<float>(s.hidden));
  in.base.resize(static_cast<size_t>(mix));
  for (auto& v : in.base) v = 0.5f * normal(rng);
  in.scale.resize(static_cast<size_t>(n_scale));
  for (auto& v : in.scale) v = uniform(rng);
  return in;
}

struct PreOut {
  std::vector<float> collapsed, post, comb;
};

PreOut run_pre(const HyperConnectionParams& p, const Inputs& in) {
  DeviceArray<float> d_streams(in.streams), d_fn(in.fn), d_base(in.base), d_scale(in.scale);
  DeviceArray<float> d_collapsed(static_cast<size_t>(p.tokens * p.hidden)), d_post(static_cast<size_t>(p.tokens * p.hc)),
      d_comb(static_cast<size_t>(p.tokens * p.hc * p.hc));
  const size_t bytes = hc_workspace_bytes(p.tokens, p.hc);
  DeviceArray<uint8_t> workspace(bytes);
  EXPECT_EQ(hc_pre(p, d_streams.get(), d_fn.get(), d_base.get(), d_scale.get(), d_collapsed.get(), d_post.get(),
                   d_comb.get(), workspace.get(), bytes, nullptr),
            cudaSuccess);
  return {d_collapsed.download(), d_post.download(), d_comb.download()};
}

void check_pre(const Shape& s) {
  SCOPED_TRACE(::testing::Message() << s.tokens << " tokens, hc " << s.hc << ", D " << s.hidden);
  const int64_t mix = (2 + s.hc) * s.hc;
  const Inputs in = random_inputs(s, mix, 3, static_cast<uint32_t>(s.tokens * 1009 + s.hc * 31 + s.hidden));
  const cpu::HyperConnectionParams cp{s.hc, s.hidden, 20, 1e-6f, 1e-6f};
  PreOut expected{std::vector<float>(static_cast<size_t>(s.tokens * s.hidden)),
                  std::vector<float>(static_cast<size_t>(s.tokens * s.hc)),
                  std::vector<float>(static_cast<size_t>(s.tokens * s.hc * s.hc))};
  cpu::hc_pre(cp, in.streams.data(), s.tokens, in.fn.data(), in.base.data(), in.scale.data(), expected.collapsed.data(),
              expected.post.data(), expected.comb.data());
  const HyperConnectionParams p{s.tokens, s.hc, s.hidden, 20, 1e-6f, 1e-6f};
  const PreOut actual = run_pre(p, in);
  EXPECT_LE(rel_l2(actual.collapsed, expected.collapsed), 1e-5);
  EXPECT_LE(max_rel(actual.post, expected.post), 1e-5);
  EXPECT_LE(max_rel(actual.comb, expected.comb), 2e-5);
  EXPECT_LE(rel_l2(actual.comb, expected.comb), 1e-5);
  // The comb is doubly stochastic up to the eps floor: columns sum to ~1 after the last normalisation.
  for (int64_t t = 0; t < s.tokens; ++t)
    for (int64_t k = 0; k < s.hc; ++k) {
      double column = 0;
      for (int64_t j = 0; j < s.hc; ++j) column += actual.comb[(t * s.hc + j) * s.hc + k];
      EXPECT_NEAR(column, 1.0, 1e-4);
    }
  const PreOut repeat = run_pre(p, in);
  EXPECT_TRUE(bitwise_equal(repeat.collapsed, actual.collapsed) && bitwise_equal(repeat.post, actual.post) &&
              bitwise_equal(repeat.comb, actual.comb))
      << "not bitwise repeatable";
}

TEST_F(CudaHyperConnection, PreMatchesCpuTwinAtV4Shapes) {
  for (const Shape& s : {Shape{1, 4, 4096}, Shape{37, 4, 4096}, Shape{1100, 4, 4096}, Shape{5, 4, 7168}}) check_pre(s);
  // From 512 tokens the mixes run on the tensor cores (3xTF32); the split-K kernel on request (DSV4_HC_MIX_KERNEL).
  ::setenv("DSV4_HC_MIX_KERNEL", "simt", 1);
  check_pre(Shape{1100, 4, 4096});
  ::unsetenv("DSV4_HC_MIX_KERNEL");
  check_pre(Shape{515, 2, 2048});
}

// kDeepSeek's hc_pre and hc_head (pre, post, comb in double from the fp32 mixes, HyperConnectionParams::deepseek)
// against ops::cpu::hc_pre_deepseek / hc_head_deepseek on bf16 streams. The mixes are fp32 split-K sums here and
// double sums there, so the bounds are the fp32 path's.
void check_deepseek_pre_and_head(const Shape& s) {
  SCOPED_TRACE(::testing::Message() << s.tokens << " tokens, hc " << s.hc << ", D " << s.hidden << ", deepseek");
  const int64_t mix = (2 + s.hc) * s.hc;
  Inputs in = random_inputs(s, mix, 3, static_cast<uint32_t>(s.tokens * 433 + s.hidden));
  for (float& v : in.streams) v = bf16_to_f32(f32_to_bf16(v));
  const double hc_eps = 1e-6;
  const cpu::HyperConnectionParams cp{s.hc, s.hidden, 20, static_cast<float>(hc_eps), 1e-6f};
  PreOut expected{std::vector<float>(static_cast<size_t>(s.tokens * s.hidden)),
                  std::vector<float>(static_cast<size_t>(s.tokens * s.hc)),
                  std::vector<float>(static_cast<size_t>(s.tokens * s.hc * s.hc))};
  cpu::hc_pre_deepseek(cp, hc_eps, in.streams.data(), s.tokens, in.fn.data(), in.base.data(), in.scale.data(),
                       expected.collapsed.data(), expected.post.data(), expected.comb.data());
  HyperConnectionParams p{s.tokens, s.hc, s.hidden, 20, static_cast<float>(hc_eps), 1e-6f};
  p.deepseek = true;
  p.deepseek_hc_eps = hc_eps;
  const PreOut actual = run_pre(p, in);
  EXPECT_LE(rel_l2(actual.collapsed, expected.collapsed), 1e-5);
  EXPECT_LE(max_rel(actual.post, expected.post), 1e-5);
  EXPECT_LE(max_rel(actual.comb, expected.comb), 2e-5);
  // The fp32 path is farther from the double recipe than this one (its Sinkhorn rounds at every step).
  p.deepseek = false;
  const PreOut fp32 = run_pre(p, in);
  EXPECT_LE(rel_l2(actual.comb, expected.comb), rel_l2(fp32.comb, expected.comb));

  const Inputs head = random_inputs(s, s.hc, 1, static_cast<uint32_t>(s.tokens * 77 + s.hidden));
  std::vector<float> head_streams = in.streams, head_expected(static_cast<size_t>(s.tokens * s.hidden));
  cpu::hc_head_deepseek(cp, head_streams.data(), s.tokens, head.fn.data(), head.base.data(), head.scale.data(),
                        head_expected.data());
  DeviceArray<float> d_streams(head_streams), d_fn(head.fn), d_base(head.base), d_scale(head.scale),
      d_out(head_expected.size());
  p.deepseek = true;
  const size_t bytes = hc_workspace_bytes(s.tokens, s.hc);
  DeviceArray<uint8_t> workspace(bytes);
  ASSERT_EQ(hc_head(p, d_streams.get(), d_fn.get(), d_base.get(), d_scale.get(), d_out.get(), workspace.get(), bytes,
                    nullptr),
            cudaSuccess);
  EXPECT_LE(rel_l2(d_out.download(), head_expected), 1e-5);
}

TEST_F(CudaHyperConnection, DeepSeekPreAndHeadMatchCpuTwin) {
  for (const Shape& s : {Shape{1, 4, 4096}, Shape{37, 4, 4096}, Shape{3, 4, 128}, Shape{4, 2, 10}})
    check_deepseek_pre_and_head(s);
}

TEST_F(CudaHyperConnection, PreMatchesCpuTwinAtTinyShapes) {
  for (const Shape& s : {Shape{3, 4, 256}, Shape{2, 4, 6}, Shape{4, 2, 10}, Shape{5, 1, 64}, Shape{9, 2, 7}})
    check_pre(s);
}

void check_post(const Shape& s) {
  SCOPED_TRACE(::testing::Message() << s.tokens << " tokens, hc " << s.hc << ", D " << s.hidden);
  std::mt19937 rng(static_cast<uint32_t>(s.tokens * 17 + s.hidden));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uniform(0.0f, 2.0f);
  std::vector<float> y(static_cast<size_t>(s.tokens * s.hidden)), streams(static_cast<size_t>(s.tokens * s.hc * s.hidden));
  std::vector<float> post(static_cast<size_t>(s.tokens * s.hc)), comb(static_cast<size_t>(s.tokens * s.hc * s.hc));
  for (auto& v : y) v = normal(rng);
  for (auto& v : streams) v = normal(rng);
  for (auto& v : post) v = uniform(rng);
  for (auto& v : comb) v = 0.5f * uniform(rng);
  const cpu::HyperConnectionParams cp{s.hc, s.hidden, 20, 1e-6f, 1e-6f};
  std::vector<float> expected(streams.size());
  cpu::hc_post(cp, y.data(), streams.data(), s.tokens, post.data(), comb.data(), expected.data());
  DeviceArray<float> d_y(y), d_streams(streams), d_post(post), d_comb(comb), d_out(expected.size());
  const HyperConnectionParams p{s.tokens, s.hc, s.hidden, 20, 1e-6f, 1e-6f};
  ASSERT_EQ(hc_post(p, d_y.get(), d_streams.get(), d_post.get(), d_comb.get(), d_out.get(), nullptr), cudaSuccess);
  const std::vector<float> actual = d_out.download();
  EXPECT_LE(max_rel(actual, expected), 1e-6);
  EXPECT_LE(rel_l2(actual, expected), 1e-7);
  d_out.poison();
  ASSERT_EQ(hc_post(p, d_y.get(), d_streams.get(), d_post.get(), d_comb.get(), d_out.get(), nullptr), cudaSuccess);
  EXPECT_TRUE(bitwise_equal(d_out.download(), actual)) << "not bitwise repeatable";
}

TEST_F(CudaHyperConnection, PostMatchesCpuTwin) {
  for (const Shape& s : {Shape{1, 4, 4096}, Shape{37, 4, 4096}, Shape{5, 4, 7168}, Shape{3, 4, 256}, Shape{4, 2, 7},
                         Shape{2, 1, 5}})
    check_post(s);
}

// kDeepSeek's hc_post (model.py's order, the new streams in bf16) against ops::cpu::hc_post_deepseek then the
// bf16 rounding: the same fp32 operations in the same order, so bit for bit. hc_post_pre refuses the flag.
void check_post_deepseek(const Shape& s) {
  SCOPED_TRACE(::testing::Message() << s.tokens << " tokens, hc " << s.hc << ", D " << s.hidden << ", deepseek");
  std::mt19937 rng(static_cast<uint32_t>(s.tokens * 29 + s.hidden));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uniform(0.0f, 2.0f);
  std::vector<float> y(static_cast<size_t>(s.tokens * s.hidden)), streams(static_cast<size_t>(s.tokens * s.hc * s.hidden));
  std::vector<float> post(static_cast<size_t>(s.tokens * s.hc)), comb(static_cast<size_t>(s.tokens * s.hc * s.hc));
  auto bf16 = [](float v) { return bf16_to_f32(f32_to_bf16(v)); };
  for (auto& v : y) v = bf16(normal(rng));  // the sublayer's bf16 output and bf16 streams, as the model feeds it
  for (auto& v : streams) v = bf16(normal(rng));
  for (auto& v : post) v = uniform(rng);
  for (auto& v : comb) v = 0.5f * uniform(rng);
  const cpu::HyperConnectionParams cp{s.hc, s.hidden, 20, 1e-6f, 1e-6f};
  std::vector<float> expected(streams.size());
  cpu::hc_post_deepseek(cp, y.data(), streams.data(), s.tokens, post.data(), comb.data(), expected.data());
  for (float& v : expected) v = bf16(v);
  DeviceArray<float> d_y(y), d_streams(streams), d_post(post), d_comb(comb), d_out(expected.size());
  HyperConnectionParams p{s.tokens, s.hc, s.hidden, 20, 1e-6f, 1e-6f};
  p.deepseek = true;
  ASSERT_EQ(hc_post(p, d_y.get(), d_streams.get(), d_post.get(), d_comb.get(), d_out.get(), nullptr), cudaSuccess);
  EXPECT_TRUE(bitwise_equal(d_out.download(), expected));
  EXPECT_EQ(hc_post_pre(p, d_y.get(), d_streams.get(), d_post.get(), d_comb.get(), d_out.get(), nullptr, nullptr,
                        nullptr, nullptr, nullptr, nullptr, nullptr, 0, nullptr, nullptr),
            cudaErrorInvalidValue);
}

TEST_F(CudaHyperConnection, PostInDeepSeekOrderMatchesCpuTwinBitwise) {
  for (const Shape& s : {Shape{1, 4, 4096}, Shape{37, 4, 4096}, Shape{4, 2, 7}, Shape{2, 1, 5}}) check_post_deepseek(s);
}

void check_head(const Shape& s) {
  SCOPED_TRACE(::testing::Message() << s.tokens << " tokens, hc " << s.hc << ", D " << s.hidden);
  const Inputs in = random_inputs(s, s.hc, 1, static_cast<uint32_t>(s.tokens * 7 + s.hidden * 3 + s.hc));
  const cpu::HyperConnectionParams cp{s.hc, s.hidden, 20, 1e-6f, 1e-6f};
  std::vector<float> expected(static_cast<size_t>(s.tokens * s.hidden));
  cpu::hc_head(cp, in.streams.data(), s.tokens, in.fn.data(), in.base.data(), in.scale.data(), expected.data());
  DeviceArray<float> d_streams(in.streams), d_fn(in.fn), d_base(in.base), d_scale(in.scale), d_out(expected.size());
  const HyperConnectionParams p{s.tokens, s.hc, s.hidden, 20, 1e-6f, 1e-6f};
  // A workspace sized for a larger batch serves this one.
  const size_t bytes = hc_workspace_bytes(s.tokens + 50, s.hc);
  DeviceArray<uint8_t> workspace(bytes);
  ASSERT_EQ(hc_head(p, d_streams.get(), d_fn.get(), d_base.get(), d_scale.get(), d_out.get(), workspace.get(), bytes,
                    nullptr),
            cudaSuccess);
  const std::vector<float> actual = d_out.download();
  EXPECT_LE(rel_l2(actual, expected), 1e-5);
  d_out.poison();
  ASSERT_EQ(hc_head(p, d_streams.get(), d_fn.get(), d_base.get(), d_scale.get(), d_out.get(), workspace.get(), bytes,
                    nullptr),
            cudaSuccess);
  EXPECT_TRUE(bitwise_equal(d_out.download(), actual)) << "not bitwise repeatable";
}

TEST_F(CudaHyperConnection, HeadMatchesCpuTwin) {
  for (const Shape& s : {Shape{1, 4, 4096}, Shape{6, 4, 4096}, Shape{2, 4, 7168}, Shape{3, 4, 256}, Shape{3, 2, 6}})
    check_head(s);
}

// The one-launch hand-over's barrier words after a call: every count (every word but the generations) back at
// zero, and, where the call should have taken the hand-over (`expect_ran`), group 0's two generations advanced.
void expect_handover_words(const DeviceArray<unsigned>& sync, bool expect_ran) {
  const std::vector<unsigned> words = sync.download();
  for (size_t i = 0; i < words.size(); ++i) {
    bool generation = false;
    for (int group = 0; group < 8; ++group)  // the hand-over's token groups (one token each, up to 8)
      for (int barrier = 0; barrier < 2; ++barrier) generation |= i == hc_handover_generation_word(group, barrier);
    if (!generation) {
      EXPECT_EQ(words[i], 0u) << "barrier word " << i << " left nonzero";
    }
  }
  if (expect_ran) {
    EXPECT_TRUE(words[hc_handover_generation_word(0, 0)] > 0 && words[hc_handover_generation_word(0, 1)] > 0)
        << "the one-launch hand-over did not run";
  }
}

// hc_pre (or hc_head) with the sublayer's RMSNorm fused: collapsed = rms_norm(collapse) and its bf16 copy is that
// fp32 result rounded; post and comb are the unfused kernel's, bitwise.
void check_fused_norm(const Shape& s, bool head, bool weighted) {
  SCOPED_TRACE(::testing::Message() << s.tokens << " tokens, hc " << s.hc << ", D " << s.hidden
                                    << (head ? " head" : " pre") << (weighted ? " weighted" : ""));
  const int64_t mix = head ? s.hc : (2 + s.hc) * s.hc;
  const Inputs in = random_inputs(s, mix, head ? 1 : 3, static_cast<uint32_t>(s.tokens * 13 + s.hidden + head));
  std::vector<float> weight(static_cast<size_t>(s.hidden));
  std::mt19937 rng(static_cast<uint32_t>(s.hidden));
  std::normal_distribution<float> normal(1.0f, 0.1f);
  for (auto& v : weight) v = normal(rng);
  const cpu::HyperConnectionParams cp{s.hc, s.hidden, 20, 1e-6f, 1e-6f};
  std::vector<float> expected(static_cast<size_t>(s.tokens * s.hidden)), post(static_cast<size_t>(s.tokens * s.hc)),
      comb(static_cast<size_t>(s.tokens * s.hc * s.hc));
  if (head)
    cpu::hc_head(cp, in.streams.data(), s.tokens, in.fn.data(), in.base.data(), in.scale.data(), expected.data());
  else
    cpu::hc_pre(cp, in.streams.data(), s.tokens, in.fn.data(), in.base.data(), in.scale.data(), expected.data(),
                post.data(), comb.data());
  cpu::rms_norm(expected.data(), s.tokens, s.hidden, s.hidden, weighted ? weight.data() : nullptr, 1e-6f,
                expected.data());

  const HyperConnectionParams p{s.tokens, s.hc, s.hidden, 20, 1e-6f, 1e-6f};
  DeviceArray<float> d_streams(in.streams), d_fn(in.fn), d_base(in.base), d_scale(in.scale), d_weight(weight);
  DeviceArray<float> d_out(expected.size()), d_post(post.size()), d_comb(comb.size());
  DeviceArray<uint16_t> d_bf16(expected.size());
  const size_t bytes = hc_workspace_bytes(s.tokens, s.hc);
  DeviceArray<uint8_t> workspace(bytes);
  const CollapseNorm norm{weighted ? d_weight.get() : nullptr, 1e-6f, d_bf16.get()};
  if (head)
    ASSERT_EQ(hc_head(p, d_streams.get(), d_fn.get(), d_base.get(), d_scale.get(), d_out.get(), workspace.get(), bytes,
                      nullptr, &norm),
              cudaSuccess);
  else
    ASSERT_EQ(hc_pre(p, d_streams.get(), d_fn.get(), d_base.get(), d_scale.get(), d_out.get(), d_post.get(),
                     d_comb.get(), workspace.get(), bytes, nullptr, &norm),
              cudaSuccess);
  const std::vector<float> actual = d_out.download();
  const std::vector<uint16_t> actual_bf16 = d_bf16.download();
  EXPECT_LE(rel_l2(actual, expected), 1e-5);
  for (size_t i = 0; i < actual.size(); ++i)
    ASSERT_EQ(actual_bf16[i], f32_to_bf16(actual[i])) << "bf16 copy " << i << " is not the rounded fp32 result";
  if (!head) {
    const PreOut unfused = run_pre(p, in);
    EXPECT_TRUE(bitwise_equal(d_post.download(), unfused.post) && bitwise_equal(d_comb.download(), unfused.comb))
        << "the fused norm changed post / comb";
  }
  // Up to 64 tokens the finish kernel can keep its columns in registers (the decode form, DSV4_HC_FINISH=keep):
  // it must give the plain form's bits.
  ::setenv("DSV4_HC_FINISH", "keep", 1);
  DeviceArray<float> kept_out(expected.size()), kept_post(post.size()), kept_comb(comb.size());
  DeviceArray<uint16_t> kept_bf16(expected.size());
  const CollapseNorm kept_norm{weighted ? d_weight.get() : nullptr, 1e-6f, kept_bf16.get()};
  const cudaError_t kept_status =
      head ? hc_head(p, d_streams.get(), d_fn.get(), d_base.get(), d_scale.get(), kept_out.get(), workspace.get(), bytes,
                     nullptr, &kept_norm)
           : hc_pre(p, d_streams.get(), d_fn.get(), d_base.get(), d_scale.get(), kept_out.get(), kept_post.get(),
                    kept_comb.get(), workspace.get(), bytes, nullptr, &kept_norm);
  ::unsetenv("DSV4_HC_FINISH");
  ASSERT_EQ(kept_status, cudaSuccess);
  EXPECT_TRUE(bitwise_equal(kept_out.download(), actual)) << "the decode and plain finish forms differ";
  EXPECT_EQ(kept_bf16.download(), actual_bf16) << "the decode and plain finish forms differ in the bf16 copy";
  if (!head) {
    EXPECT_TRUE(bitwise_equal(kept_post.download(), d_post.download()) &&
                bitwise_equal(kept_comb.download(), d_comb.download()))
        << "the decode and plain finish forms differ in post / comb";
  }
  // The one-launch form (barrier words, ≤ 8 tokens, on by default; the streams read as they are): the CPU
  // twin's values to fp32 rounding, its bf16 copy the rounded fp32 result, the barrier words back at zero.
  DeviceArray<unsigned> sync(std::vector<unsigned>(kHcHandoverSyncBytes / sizeof(unsigned), 0u));
  DeviceArray<float> one_out(expected.size()), one_post(post.size()), one_comb(comb.size());
  DeviceArray<uint16_t> one_bf16(expected.size());
  const CollapseNorm one_norm{weighted ? d_weight.get() : nullptr, 1e-6f, one_bf16.get()};
  const cudaError_t one_status =
      head ? hc_head(p, d_streams.get(), d_fn.get(), d_base.get(), d_scale.get(), one_out.get(), workspace.get(), bytes,
                     nullptr, &one_norm, sync.get())
           : hc_pre(p, d_streams.get(), d_fn.get(), d_base.get(), d_scale.get(), one_out.get(), one_post.get(),
                    one_comb.get(), workspace.get(), bytes, nullptr, &one_norm, sync.get());
  ASSERT_EQ(one_status, cudaSuccess);
  const std::vector<float> one = one_out.download();
  const std::vector<uint16_t> one_copy = one_bf16.download();
  EXPECT_LE(rel_l2(one, expected), 1e-5) << "the one-launch form";
  for (size_t i = 0; i < one.size(); ++i)
    ASSERT_EQ(one_copy[i], f32_to_bf16(one[i])) << "the one-launch form's bf16 copy " << i;
  if (!head) {
    EXPECT_LE(max_rel(one_post.download(), post), 1e-5) << "the one-launch form's post";
    EXPECT_LE(rel_l2(one_comb.download(), comb), 1e-5) << "the one-launch form's comb";
  }
  expect_handover_words(sync, s.tokens <= 8 && s.hidden % 4 == 0);
}

TEST_F(CudaHyperConnection, FusedNormMatchesCpuTwin) {
  for (const bool head : {false, true})
    for (const bool weighted : {false, true})
      for (const Shape& s : {Shape{1, 4, 4096}, Shape{37, 4, 4096}, Shape{64, 4, 4096}, Shape{2, 4, 7168},
                             Shape{3, 4, 256}, Shape{4, 2, 10}, Shape{530, 4, 1024}})
        check_fused_norm(s, head, weighted);
}

// hc_post_pre (a sublayer's hc_post, then the next sublayer's hc_pre with its norm fused) against the CPU's hc_post
// then hc_pre then rms_norm, with post / comb overwritten in place as the model passes them: the new streams are
// hc_post's bit for bit; the mixes, made beside the new streams in one kernel with DSV4_HC_POST_MIX=1 or 3
// (tensor cores from 512 tokens, split-K below), within the bounds of check_pre; and the default two calls.
void check_post_pre(const Shape& s) {
  SCOPED_TRACE(::testing::Message() << s.tokens << " tokens, hc " << s.hc << ", D " << s.hidden);
  const int64_t mix = (2 + s.hc) * s.hc;
  const Inputs in = random_inputs(s, mix, 3, static_cast<uint32_t>(s.tokens * 29 + s.hidden + s.hc));
  std::mt19937 rng(static_cast<uint32_t>(s.tokens + 5 * s.hidden));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
  std::vector<float> y(static_cast<size_t>(s.tokens * s.hidden)), post(static_cast<size_t>(s.tokens * s.hc)),
      comb(static_cast<size_t>(s.tokens * s.hc * s.hc)), weight(static_cast<size_t>(s.hidden));
  for (auto& v : y) v = normal(rng);
  for (auto& v : post) v = 2.0f * uniform(rng);
  for (auto& v : comb) v = 0.5f * uniform(rng);
  for (auto& v : weight) v = 1.0f + 0.1f * normal(rng);
  const cpu::HyperConnectionParams cp{s.hc, s.hidden, 20, 1e-6f, 1e-6f};
  std::vector<float> next_streams(in.streams.size()), collapsed(y.size()), next_post(post.size()),
      next_comb(comb.size());
  cpu::hc_post(cp, y.data(), in.streams.data(), s.tokens, post.data(), comb.data(), next_streams.data());
  cpu::hc_pre(cp, next_streams.data(), s.tokens, in.fn.data(), in.base.data(), in.scale.data(), collapsed.data(),
              next_post.data(), next_comb.data());
  cpu::rms_norm(collapsed.data(), s.tokens, s.hidden, s.hidden, weight.data(), 1e-6f, collapsed.data());

  const HyperConnectionParams p{s.tokens, s.hc, s.hidden, 20, 1e-6f, 1e-6f};
  DeviceArray<float> d_y(y), d_streams(in.streams), d_fn(in.fn), d_base(in.base), d_scale(in.scale), d_weight(weight);
  DeviceArray<float> d_post_alone(post), d_comb_alone(comb), d_out_alone(next_streams.size());
  ASSERT_EQ(hc_post(p, d_y.get(), d_streams.get(), d_post_alone.get(), d_comb_alone.get(), d_out_alone.get(), nullptr),
            cudaSuccess);
  const std::vector<float> post_alone = d_out_alone.download();
  const size_t bytes = hc_workspace_bytes(s.tokens, s.hc);
  DeviceArray<uint8_t> workspace(bytes);
  // The one-launch hand-over's barrier words: zero before the first call, and left zero by every call.
  DeviceArray<unsigned> sync(std::vector<unsigned>(kHcHandoverSyncBytes / sizeof(unsigned), 0u));
  std::vector<float> first_handover;
  // "default": barrier words passed, no switch — the one-launch form runs up to 8 tokens; "off":
  // DSV4_HC_HANDOVER=0 with the words — never. Each with fresh words, to tell whether it ran.
  for (const char* mode : {"1", "3", "", "handover", "handover again", "default", "off"}) {
    SCOPED_TRACE(::testing::Message() << "mode " << mode);
    const bool handover = std::strncmp(mode, "handover", 8) == 0;
    const bool by_default = std::strcmp(mode, "default") == 0, off = std::strcmp(mode, "off") == 0;
    DeviceArray<unsigned> fresh_sync(std::vector<unsigned>(kHcHandoverSyncBytes / sizeof(unsigned), 0u));
    if (off) ::setenv("DSV4_HC_HANDOVER", "0", 1);
    else if (*mode && !by_default) ::setenv("DSV4_HC_POST_MIX", mode, 1);
    unsigned* words = handover ? sync.get() : by_default || off ? fresh_sync.get() : nullptr;
    DeviceArray<float> d_post(post), d_comb(comb), d_out(next_streams.size()), d_collapsed(collapsed.size());
    DeviceArray<uint16_t> d_bf16(collapsed.size());
    const CollapseNorm norm{d_weight.get(), 1e-6f, d_bf16.get()};
    ASSERT_EQ(hc_post_pre(p, d_y.get(), d_streams.get(), d_post.get(), d_comb.get(), d_out.get(), d_fn.get(),
                          d_base.get(), d_scale.get(), d_collapsed.get(), d_post.get(), d_comb.get(), workspace.get(),
                          bytes, nullptr, &norm, words),
              cudaSuccess);
    ::unsetenv("DSV4_HC_POST_MIX");
    ::unsetenv("DSV4_HC_HANDOVER");
    EXPECT_TRUE(bitwise_equal(d_out.download(), post_alone)) << "the new streams are not hc_post's";
    const std::vector<float> actual_post = d_post.download(), actual_comb = d_comb.download();
    const std::vector<float> actual_collapsed = d_collapsed.download();
    EXPECT_LE(rel_l2(actual_collapsed, collapsed), 1e-5);
    EXPECT_LE(max_rel(actual_post, next_post), 1e-5);
    EXPECT_LE(max_rel(actual_comb, next_comb), 2e-5);
    EXPECT_LE(rel_l2(actual_comb, next_comb), 1e-5);
    const std::vector<uint16_t> actual_bf16 = d_bf16.download();
    for (size_t i = 0; i < actual_bf16.size(); ++i)
      ASSERT_EQ(actual_bf16[i], f32_to_bf16(actual_collapsed[i])) << "bf16 copy " << i;
    if (by_default || off) {
      const std::vector<unsigned> after = fresh_sync.download();
      const bool ran = after[hc_handover_generation_word(0, 0)] > 0;
      EXPECT_EQ(ran, by_default && s.tokens <= 8 && s.hidden % 4 == 0) << "which form ran";
      expect_handover_words(fresh_sync, false);
    }
    if (handover) {
      expect_handover_words(sync, s.tokens <= 8 && s.hidden % 4 == 0);
      std::vector<float> outputs = actual_collapsed;
      outputs.insert(outputs.end(), actual_post.begin(), actual_post.end());
      outputs.insert(outputs.end(), actual_comb.begin(), actual_comb.end());
      if (first_handover.empty()) first_handover = outputs;
      else EXPECT_TRUE(bitwise_equal(outputs, first_handover)) << "the hand-over is not bitwise repeatable";
    }
  }
}

TEST_F(CudaHyperConnection, PostPreMatchesCpuPostThenPre) {
  // From 512 tokens the tensor-core kernel, below it the split-K one (1 token: 128 splits), D 10 the two calls.
  for (const Shape& s : {Shape{1100, 4, 4096}, Shape{600, 4, 7168}, Shape{515, 2, 2048}, Shape{1, 4, 4096},
                         Shape{8, 4, 4096}, Shape{37, 4, 4096}, Shape{130, 4, 4096}, Shape{5, 4, 7168}, Shape{3, 4, 256},
                         Shape{6, 2, 12}, Shape{4, 2, 10}})
    check_post_pre(s);
}

TEST_F(CudaHyperConnection, WorkspaceBoundHoldsForEveryBatchAndIsChecked) {
  // Every batch up to the bound's size fits (the launcher would refuse otherwise), and a short workspace is refused.
  const Shape s{9, 4, 4096};
  const Inputs in = random_inputs(s, 24, 3, 3);
  DeviceArray<float> d_streams(in.streams), d_fn(in.fn), d_base(in.base), d_scale(in.scale);
  DeviceArray<float> d_collapsed(static_cast<size_t>(s.tokens * s.hidden)), d_post(static_cast<size_t>(s.tokens * 4)),
      d_comb(static_cast<size_t>(s.tokens * 16));
  const size_t bytes = hc_workspace_bytes(s.tokens, s.hc);
  DeviceArray<uint8_t> workspace(bytes);
  for (int64_t tokens = 1; tokens <= s.tokens; ++tokens) {
    const HyperConnectionParams p{tokens, 4, 4096, 20, 1e-6f, 1e-6f};
    EXPECT_EQ(hc_pre(p, d_streams.get(), d_fn.get(), d_base.get(), d_scale.get(), d_collapsed.get(), d_post.get(),
                     d_comb.get(), workspace.get(), bytes, nullptr),
              cudaSuccess)
        << tokens;
  }
  const HyperConnectionParams p{s.tokens, 4, 4096, 20, 1e-6f, 1e-6f};
  EXPECT_EQ(hc_pre(p, d_streams.get(), d_fn.get(), d_base.get(), d_scale.get(), d_collapsed.get(), d_post.get(),
                   d_comb.get(), workspace.get(), 16, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(hc_pre({1, 3, 4096, 20, 1e-6f, 1e-6f}, d_streams.get(), d_fn.get(), d_base.get(), d_scale.get(),
                   d_collapsed.get(), d_post.get(), d_comb.get(), workspace.get(), bytes, nullptr),
            cudaErrorInvalidValue);  // hc 3 is not built
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
}  // namespace dsv4::ops::cuda
