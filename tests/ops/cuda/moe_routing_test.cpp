// The CUDA MoE routing and clamped SwiGLU against their CPU twins (ops/cpu/moe.h router_scores + route_token,
// swiglu_clamped, and its bf16-output form): V4-Flash (256 experts, top-6, sqrtsoftplus, bias) and V4-Pro (384, top-8) shapes, softmax and
// sigmoid, hash routing from tid2eid, constructed ties (equal keys go to the lower expert id), bitwise repeats.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "ops/cpu/moe.h"
#include "ops/cuda/moe_routing.h"
#include "small_ops_util.h"

namespace dsv4::ops::cuda {
namespace {

using testing::small_ops::bitwise_equal;
using testing::small_ops::DeviceArray;
using testing::small_ops::max_rel;

class CudaMoeRouting : public testing::small_ops::GpuTest {};

cpu::RouterScore cpu_func(RouterScoreFunc f) {
  switch (f) {
    case RouterScoreFunc::kSoftmax: return cpu::RouterScore::kSoftmax;
    case RouterScoreFunc::kSigmoid: return cpu::RouterScore::kSigmoid;
    default: return cpu::RouterScore::kSqrtSoftplus;
  }
}

struct Routing {
  std::vector<int32_t> chosen;
  std::vector<float> weights, scores;
};

// The CPU forward's MoE routing (DeepseekV4Model::moe): router_scores in place, then route_token per token.
Routing cpu_route(const RouteParams& p, std::vector<float> logits, const std::vector<float>* bias,
                  const std::vector<int32_t>* tid2eid, const std::vector<int32_t>& token_ids) {
  Routing r{std::vector<int32_t>(static_cast<size_t>(p.tokens * p.top_k)),
            std::vector<float>(static_cast<size_t>(p.tokens * p.top_k)), {}};
  cpu::router_scores(logits.data(), p.tokens, p.experts, cpu_func(p.func));
  for (int64_t t = 0; t < p.tokens; ++t)
    cpu::route_token(&logits[t * p.experts], bias ? bias->data() : nullptr, p.experts, p.top_k,
                     tid2eid ? &(*tid2eid)[static_cast<size_t>(token_ids[t]) * p.top_k] : nullptr,
                     p.routed_scaling_factor, &r.chosen[t * p.top_k], &r.weights[t * p.top_k]);
  r.scores = std::move(logits);
  return r;
}

Routing gpu_route(const RouteParams& p, const std::vector<float>& logits, const std::vector<float>* bias,
                  const std::vector<int32_t>* tid2eid, const std::vector<int32_t>& token_ids) {
  DeviceArray<float> d_logits(logits), d_bias(bias ? *bias : std::vector<float>{}),
      d_scores(static_cast<size_t>(p.tokens * p.experts)), d_weights(static_cast<size_t>(p.tokens * p.top_k));
  DeviceArray<int32_t> d_tid2eid(tid2eid ? *tid2eid : std::vector<int32_t>{}), d_ids(token_ids),
      d_chosen(static_cast<size_t>(p.tokens * p.top_k));
  EXPECT_EQ(route(p, d_logits.get(), bias ? d_bias.get() : nullptr, tid2eid ? d_tid2eid.get() : nullptr,
                  d_ids.get(), d_chosen.get(), d_weights.get(), d_scores.get(), nullptr),
            cudaSuccess);
  return {d_chosen.download(), d_weights.download(), d_scores.download()};
}

// The chosen experts agree position by position, except where the CPU's own keys of the two candidates are equal to
// within 1e-6 (a near-tie an ulp of exp/log1p may flip; exact ties are checked bitwise elsewhere). Weights agree
// where the experts do.
void expect_same_routing(const RouteParams& p, const Routing& actual, const Routing& expected,
                         const std::vector<float>* bias) {
  EXPECT_LE(max_rel(actual.scores, expected.scores, 1e-6), 2e-6) << "router scores";
  int64_t mismatches = 0;
  for (int64_t t = 0; t < p.tokens; ++t)
    for (int64_t i = 0; i < p.top_k; ++i) {
      const size_t at = static_cast<size_t>(t * p.top_k + i);
      const int32_t a = actual.chosen[at], e = expected.chosen[at];
      ASSERT_GE(a, 0);
      ASSERT_LT(a, p.experts);
      if (a == e) {
        EXPECT_NEAR(actual.weights[at], expected.weights[at], 2e-6 * std::max(1.0f, std::abs(expected.weights[at])))
            << "token " << t << " slot " << i;
        continue;
      }
      ++mismatches;
      auto key = [&](int32_t x) { return expected.scores[t * p.experts + x] + (bias ? (*bias)[x] : 0.0f); };
      EXPECT_NEAR(key(a), key(e), 1e-6 * std::max(1.0f, std::abs(key(e)))) << "token " << t << " slot " << i;
    }
  EXPECT_LE(mismatches, 2) << "more near-ties than random inputs should give";
}

struct Case {
  int64_t tokens, experts, top_k;
  RouterScoreFunc func;
  bool with_bias;
  float scaling;
};

void check_learned(const Case& c) {
  SCOPED_TRACE(::testing::Message() << c.tokens << " tokens, " << c.experts << " experts, top " << c.top_k
                                    << ", func " << static_cast<int>(c.func) << (c.with_bias ? ", bias" : ""));
  std::mt19937 rng(static_cast<uint32_t>(c.tokens * 13 + c.experts * 7 + c.top_k + static_cast<int>(c.func)));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> logits(static_cast<size_t>(c.tokens * c.experts)), bias(static_cast<size_t>(c.experts));
  for (auto& v : logits) v = 2.0f * normal(rng);
  logits[0] = 25.0f;  // past softplus's threshold
  logits[1] = -30.0f;
  for (auto& v : bias) v = 0.1f * normal(rng);
  const RouteParams p{c.tokens, c.experts, c.top_k, c.func, c.scaling};
  const std::vector<int32_t> ids(static_cast<size_t>(c.tokens), 0);
  const std::vector<float>* b = c.with_bias ? &bias : nullptr;
  const Routing expected = cpu_route(p, logits, b, nullptr, ids);
  const Routing actual = gpu_route(p, logits, b, nullptr, ids);
  expect_same_routing(p, actual, expected, b);
  const Routing repeat = gpu_route(p, logits, b, nullptr, ids);
  EXPECT_TRUE(repeat.chosen == actual.chosen && bitwise_equal(repeat.weights, actual.weights) &&
              bitwise_equal(repeat.scores, actual.scores))
      << "not bitwise repeatable";
}

TEST_F(CudaMoeRouting, LearnedRoutingMatchesCpuTwin) {
  check_learned({50, 256, 6, RouterScoreFunc::kSqrtSoftplus, true, 1.5f});   // V4-Flash
  check_learned({513, 256, 6, RouterScoreFunc::kSqrtSoftplus, true, 1.5f});
  check_learned({21, 384, 8, RouterScoreFunc::kSqrtSoftplus, true, 2.5f});   // V4-Pro
  check_learned({30, 256, 6, RouterScoreFunc::kSoftmax, false, 1.0f});
  check_learned({30, 256, 8, RouterScoreFunc::kSigmoid, true, 2.5f});
  check_learned({9, 8, 2, RouterScoreFunc::kSqrtSoftplus, true, 1.5f});       // tiny
  check_learned({9, 40, 8, RouterScoreFunc::kSoftmax, true, 1.0f});
  check_learned({1, 1, 1, RouterScoreFunc::kSigmoid, false, 1.0f});
}

TEST_F(CudaMoeRouting, HashRoutingMatchesCpuTwin) {
  for (const auto& [tokens, experts, top_k] :
       {std::tuple<int64_t, int64_t, int64_t>{64, 256, 6}, {17, 384, 8}, {7, 8, 2}}) {
    SCOPED_TRACE(::testing::Message() << tokens << " tokens, " << experts << " experts, top " << top_k);
    const int64_t vocab = 1000;
    std::mt19937 rng(static_cast<uint32_t>(tokens + experts));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> logits(static_cast<size_t>(tokens * experts));
    for (auto& v : logits) v = 2.0f * normal(rng);
    std::vector<int32_t> tid2eid(static_cast<size_t>(vocab * top_k)), order(static_cast<size_t>(experts));
    std::iota(order.begin(), order.end(), 0);
    for (int64_t v = 0; v < vocab; ++v) {
      std::shuffle(order.begin(), order.end(), rng);
      std::copy(order.begin(), order.begin() + top_k, tid2eid.begin() + v * top_k);
    }
    std::vector<int32_t> ids(static_cast<size_t>(tokens));
    std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(vocab - 1));
    for (auto& id : ids) id = pick(rng);
    ids.back() = static_cast<int32_t>(vocab - 1);
    const RouteParams p{tokens, experts, top_k, RouterScoreFunc::kSqrtSoftplus, 1.5f};
    std::vector<float> bias(static_cast<size_t>(experts), 100.0f);  // ignored by hash routing, as in the twin
    const Routing expected = cpu_route(p, logits, nullptr, &tid2eid, ids);
    const Routing actual = gpu_route(p, logits, &bias, &tid2eid, ids);
    EXPECT_EQ(actual.chosen, expected.chosen);
    EXPECT_LE(max_rel(actual.weights, expected.weights, 1e-6), 2e-6);
    const Routing repeat = gpu_route(p, logits, &bias, &tid2eid, ids);
    EXPECT_TRUE(repeat.chosen == actual.chosen && bitwise_equal(repeat.weights, actual.weights));
  }
}

TEST_F(CudaMoeRouting, EqualKeysChooseTheLowerExpert) {
  // Rows of repeated logit values (equal scores whatever the rounding of exp/log1p, since equal inputs give equal
  // outputs), with and without a bias that keeps some of them equal: every tie must go to the lower expert id.
  for (const RouterScoreFunc func : {RouterScoreFunc::kSqrtSoftplus, RouterScoreFunc::kSoftmax, RouterScoreFunc::kSigmoid})
    for (const auto& [experts, top_k] : {std::pair<int64_t, int64_t>{256, 6}, {384, 8}, {8, 2}}) {
      SCOPED_TRACE(::testing::Message() << experts << " experts, top " << top_k << ", func " << static_cast<int>(func));
      const int64_t tokens = 6;
      std::vector<float> logits(static_cast<size_t>(tokens * experts));
      for (int64_t e = 0; e < experts; ++e) {
        logits[0 * experts + e] = 0.75f;                                   // all equal: 0 .. top_k−1
        logits[1 * experts + e] = 0.5f * static_cast<float>(e % 3);        // 2, 5, 8, ...
        logits[2 * experts + e] = e >= experts - 3 ? 1.0f : 0.25f;         // the last three, then 0, 1, ...
        logits[3 * experts + e] = -0.5f * static_cast<float>((e * 7) % 4); // 0, 4, 8, ... (e·7 ≡ 0 mod 4)
        logits[4 * experts + e] = (e % 2) ? 1.0f : -1.0f;
        logits[5 * experts + e] = 0.75f;
      }
      std::vector<float> bias(static_cast<size_t>(experts), 0.125f);  // equal bias keeps the ties
      for (const bool with_bias : {false, true}) {
        const RouteParams p{tokens, experts, top_k, func, 1.5f};
        const std::vector<int32_t> ids(static_cast<size_t>(tokens), 0);
        const std::vector<float>* b = with_bias ? &bias : nullptr;
        const Routing expected = cpu_route(p, logits, b, nullptr, ids);
        const Routing actual = gpu_route(p, logits, b, nullptr, ids);
        EXPECT_EQ(actual.chosen, expected.chosen) << (with_bias ? "bias" : "no bias");
        EXPECT_LE(max_rel(actual.weights, expected.weights, 1e-6), 2e-6);
        for (int64_t i = 0; i < top_k; ++i) EXPECT_EQ(actual.chosen[i], i) << "all-equal row";
      }
    }
}

TEST_F(CudaMoeRouting, RejectsUnsupportedShapes) {
  EXPECT_EQ(route({1, 385, 6, RouterScoreFunc::kSqrtSoftplus, 1.0f}, nullptr, nullptr, nullptr, nullptr, nullptr,
                  nullptr, nullptr, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(route({1, 256, 9, RouterScoreFunc::kSqrtSoftplus, 1.0f}, nullptr, nullptr, nullptr, nullptr, nullptr,
                  nullptr, nullptr, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(route({0, 256, 6, RouterScoreFunc::kSqrtSoftplus, 1.0f}, nullptr, nullptr, nullptr, nullptr, nullptr,
                  nullptr, nullptr, nullptr),
            cudaSuccess);
}

TEST_F(CudaMoeRouting, SwigluClampedMatchesCpuTwin) {
  for (const auto& [rows, inter] : {std::pair<int64_t, int64_t>{33, 2048}, {5, 3072}, {7, 256}, {3, 7}}) {
    SCOPED_TRACE(::testing::Message() << rows << "x" << inter);
    std::mt19937 rng(static_cast<uint32_t>(rows * 5 + inter));
    std::normal_distribution<float> normal(0.0f, 8.0f);  // wide enough that the ±10 clamp engages
    std::vector<float> gate_up(static_cast<size_t>(rows * 2 * inter));
    for (auto& v : gate_up) v = normal(rng);
    std::vector<float> expected(static_cast<size_t>(rows * inter));
    cpu::swiglu_clamped(gate_up.data(), rows, inter, 10.0f, expected.data());
    DeviceArray<float> d_in(gate_up), d_out(expected.size());
    ASSERT_EQ(swiglu_clamped({rows, inter, 10.0f}, d_in.get(), d_out.get(), nullptr), cudaSuccess);
    const std::vector<float> actual = d_out.download();
    EXPECT_LE(max_rel(actual, expected, 1e-6), 1e-6);
    d_out.poison();
    ASSERT_EQ(swiglu_clamped({rows, inter, 10.0f}, d_in.get(), d_out.get(), nullptr), cudaSuccess);
    EXPECT_TRUE(bitwise_equal(d_out.download(), actual)) << "not bitwise repeatable";
    // The bf16-output form (the host-grouped MoE's down-projection operand) is bitwise f32_to_bf16 of the above.
    DeviceArray<uint16_t> d_bf16(expected.size());
    ASSERT_EQ(swiglu_clamped_bf16({rows, inter, 10.0f}, d_in.get(), d_bf16.get(), nullptr), cudaSuccess);
    const std::vector<uint16_t> bits = d_bf16.download();
    for (size_t i = 0; i < bits.size(); ++i)
      ASSERT_EQ(bits[i], f32_to_bf16(actual[i])) << "element " << i;
  }
}

}  // namespace
}  // namespace dsv4::ops::cuda
