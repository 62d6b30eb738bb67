// The sampler: empirical frequencies over many seeded draws against the expected renormalised distribution
// for temperature, top-k, top-p (the excluded tail never drawn), min-p; seed reproducibility; penalties and
// min_tokens against hand computations; raw logprobs; validation messages; greedy unchanged; and in the
// engine, identical seeded requests give identical outputs whatever they are batched with.
#include "engine/sampler.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <vector>

#include "../model/test_models.h"
#include "core/error.h"
#include "engine/engine.h"

namespace dsv4 {
namespace {

using ::testing::HasSubstr;

// Deliberately unsorted, with a near tie, spanning a few nats.
const std::vector<float> kLogits = {1.0f, 2.5f, -0.5f, 0.3f, 2.4f, -2.0f, 0.0f, 1.7f, -1.0f, 0.9f};

std::vector<double> softmax(const std::vector<double>& l) {
  const double max = *std::max_element(l.begin(), l.end());
  std::vector<double> p(l.size());
  double sum = 0.0;
  for (size_t i = 0; i < l.size(); ++i) sum += p[i] = std::isinf(l[i]) ? 0.0 : std::exp(l[i] - max);
  for (double& v : p) v /= sum;
  return p;
}

std::vector<double> tempered(double temperature) {
  std::vector<double> l(kLogits.begin(), kLogits.end());
  for (double& v : l) v /= temperature;
  return l;
}

// Renormalises p over the tokens where keep is true.
std::vector<double> renormalised(std::vector<double> p, const std::vector<bool>& keep) {
  double sum = 0.0;
  for (size_t i = 0; i < p.size(); ++i) sum += keep[i] ? p[i] : 0.0;
  for (size_t i = 0; i < p.size(); ++i) p[i] = keep[i] ? p[i] / sum : 0.0;
  return p;
}

constexpr int kDraws = 40000;

std::vector<int64_t> draw_counts(const SamplingParams& params, uint64_t seed) {
  SamplingParams seeded = params;
  seeded.seed = seed;
  RequestSamplerState state = make_sampler_state(seeded, 1, {});
  const std::vector<int32_t> context = {0};
  std::vector<int64_t> counts(kLogits.size(), 0);
  for (int i = 0; i < kDraws; ++i) {
    const int32_t t = sample(kLogits, seeded, state, context, nullptr);
    EXPECT_GE(t, 0);
    EXPECT_LT(t, static_cast<int32_t>(kLogits.size()));
    ++counts[static_cast<size_t>(t)];
  }
  return counts;
}

// Max |frequency - p| < 0.01, tokens with p = 0 are never drawn (exactly), tokens expected > 20 times are
// drawn.
void expect_matches(const std::vector<int64_t>& counts, const std::vector<double>& expected) {
  double max_diff = 0.0;
  for (size_t i = 0; i < counts.size(); ++i) {
    const double freq = static_cast<double>(counts[i]) / kDraws;
    max_diff = std::max(max_diff, std::abs(freq - expected[i]));
    if (expected[i] == 0.0) {
      EXPECT_EQ(counts[i], 0) << "token " << i << " is outside the kept set";
    } else if (expected[i] * kDraws > 20) {
      EXPECT_GT(counts[i], 0) << "token " << i << " (p " << expected[i] << ") never drawn";
    }
  }
  EXPECT_LT(max_diff, 0.01);
}

SamplingParams sampling(double temperature) {
  SamplingParams p;
  p.temperature = temperature;
  p.max_tokens = 100;
  return p;
}

TEST(Sampler, TemperatureMatchesTheSoftmax) {
  for (const double t : {0.5, 1.0, 2.0}) {
    SCOPED_TRACE(t);
    expect_matches(draw_counts(sampling(t), 11), softmax(tempered(t)));
  }
}

TEST(Sampler, TopKKeepsTheKLargestRenormalised) {
  SamplingParams p = sampling(1.0);
  p.top_k = 3;  // tokens 1 (2.5), 4 (2.4), 7 (1.7)
  std::vector<bool> keep(kLogits.size(), false);
  keep[1] = keep[4] = keep[7] = true;
  expect_matches(draw_counts(p, 12), renormalised(softmax(tempered(1.0)), keep));
  p.top_k = static_cast<int64_t>(kLogits.size()) + 5;  // more than the vocabulary: off
  expect_matches(draw_counts(p, 13), softmax(tempered(1.0)));
}

TEST(Sampler, TopPExcludesExactlyTheTail) {
  const std::vector<double> probs = softmax(tempered(1.0));
  std::vector<size_t> order(probs.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return probs[a] > probs[b]; });
  for (const double top_p : {0.3, 0.6, 0.8, 0.95}) {
    SCOPED_TRACE(top_p);
    // The smallest descending prefix with cumulative >= top_p; everything after it is the excluded tail.
    std::vector<bool> keep(probs.size(), false);
    double cum = 0.0, tail = 1.0;
    for (const size_t i : order) {
      keep[i] = true;
      cum += probs[i];
      tail -= probs[i];
      if (cum >= top_p) break;
    }
    SamplingParams p = sampling(1.0);
    p.top_p = top_p;
    const auto counts = draw_counts(p, 14);
    expect_matches(counts, renormalised(probs, keep));
    int64_t excluded = 0;
    for (size_t i = 0; i < probs.size(); ++i)
      if (!keep[i]) excluded += counts[i];
    EXPECT_EQ(excluded, 0) << "the excluded tail (mass " << tail << ") was drawn";
    EXPECT_LT(tail, 1.0 - top_p + 1e-12);
  }
  SamplingParams p = sampling(1.0);
  p.top_p = 1e-9;  // always at least one token: the most likely
  const auto counts = draw_counts(p, 15);
  EXPECT_EQ(counts[1], kDraws);
}

TEST(Sampler, MinPIsRelativeToTheMaxProbability) {
  for (const double min_p : {0.1, 0.3, 0.9}) {
    SCOPED_TRACE(min_p);
    const double t = 0.8;
    const std::vector<double> probs = softmax(tempered(t));
    const double pmax = *std::max_element(probs.begin(), probs.end());
    std::vector<bool> keep(probs.size());
    for (size_t i = 0; i < probs.size(); ++i) keep[i] = probs[i] >= min_p * pmax;
    SamplingParams p = sampling(t);
    p.min_p = min_p;
    expect_matches(draw_counts(p, 16), renormalised(probs, keep));
  }
}

TEST(Sampler, TopKThenTopPThenMinPCombined) {
  // min_p on the full distribution, then top_k, then top_p on the renormalised top-k set (vLLM's order).
  const std::vector<double> probs = softmax(tempered(1.0));
  SamplingParams p = sampling(1.0);
  p.min_p = 0.05;  // drops tokens 2 (-0.5), 5 (-2.0) and 8 (-1.0): e^-3 < 0.05
  p.top_k = 5;     // tokens 1, 4, 7, 0, 9
  p.top_p = 0.7;
  std::vector<bool> keep(probs.size(), false);
  for (const size_t i : {1, 4, 7, 0, 9}) keep[i] = true;
  const std::vector<double> k5 = renormalised(probs, keep);
  std::fill(keep.begin(), keep.end(), false);
  double cum = 0.0;
  for (const size_t i : {1, 4, 7, 0, 9}) {
    keep[i] = true;
    if ((cum += k5[i]) >= 0.7) break;
  }
  expect_matches(draw_counts(p, 17), renormalised(probs, keep));
}

TEST(Sampler, SameSeedSameSequenceDifferentSeedsDiffer) {
  auto run = [](uint64_t seed) {
    SamplingParams p = sampling(1.0);
    p.seed = seed;
    RequestSamplerState state = make_sampler_state(p, 1, {});
    std::vector<int32_t> context = {0}, out;
    for (int i = 0; i < 200; ++i) out.push_back(sample(kLogits, p, state, context, nullptr));
    return out;
  };
  EXPECT_EQ(run(1234), run(1234));
  EXPECT_NE(run(1234), run(1235));
  // Unseeded requests get distinct generators.
  SamplingParams p = sampling(1.0);
  RequestSamplerState a = make_sampler_state(p, 1, {}), b = make_sampler_state(p, 1, {});
  std::vector<int32_t> sa, sb, context = {0};
  for (int i = 0; i < 200; ++i) {
    sa.push_back(sample(kLogits, p, a, context, nullptr));
    sb.push_back(sample(kLogits, p, b, context, nullptr));
  }
  EXPECT_NE(sa, sb);
}

TEST(Sampler, GreedyIsTheFirstArgmaxAndDrawsNothing) {
  const std::vector<float> tied = {0.5f, 3.0f, -1.0f, 3.0f, 2.9f};
  SamplingParams p;  // the default: temperature 0
  EXPECT_EQ(p.temperature, 0.0);
  RequestSamplerState state = make_sampler_state(p, 1, {});
  const std::mt19937_64 before = state.rng;
  const std::vector<int32_t> context = {2};
  for (int i = 0; i < 10; ++i) EXPECT_EQ(sample(tied, p, state, context, nullptr), 1);
  EXPECT_EQ(argmax_token(tied), 1);
  EXPECT_TRUE(state.rng == before) << "greedy consumed random numbers";
  p.temperature = 1e-6;  // below kGreedyTemperature
  EXPECT_EQ(sample(tied, p, state, context, nullptr), 1);
}

TEST(Sampler, PenaltiesMatchAHandComputation) {
  // prompt {0, 1, 1}, output {1, 2, 2, 2, 4}: repetition on 0, 1, 2, 4; frequency / presence on 1 (x1), 2
  // (x3), 4 (x1) only.
  std::vector<float> logits = {2.0f, -1.0f, 0.5f, 3.0f, -0.25f, 1.0f};
  const std::vector<int32_t> context = {0, 1, 1, 1, 2, 2, 2, 4};
  SamplingParams p = sampling(1.0);
  p.repetition_penalty = 2.0;
  p.frequency_penalty = 0.5;
  p.presence_penalty = 0.25;
  RequestSamplerState state = make_sampler_state(p, 3, {});
  apply_penalties(logits, p, state, context);
  const std::vector<float> expected = {
      2.0f / 2.0f,                       // prompt only: repetition
      -1.0f * 2.0f - 0.5f * 1 - 0.25f,   // negative: multiplied; once in the output
      0.5f / 2.0f - 0.5f * 3 - 0.25f,    // three times in the output
      3.0f,                              // absent
      -0.25f * 2.0f - 0.5f * 1 - 0.25f,  // negative, once in the output
      1.0f};                             // absent
  for (size_t i = 0; i < logits.size(); ++i) EXPECT_FLOAT_EQ(logits[i], expected[i]) << "token " << i;

  // The penalties apply to greedy decoding too: token 3 (3.0) stays the argmax unless penalised.
  std::vector<float> row = {2.0f, 0.0f, 0.0f, 3.0f};
  SamplingParams g;
  g.repetition_penalty = 1.6;  // 3.0 / 1.6 = 1.875 < 2.0
  RequestSamplerState gs = make_sampler_state(g, 1, {});
  const std::vector<int32_t> with3 = {3};
  EXPECT_EQ(sample(row, g, gs, with3, nullptr), 0);
  g.repetition_penalty = 1.4;  // 3.0 / 1.4 = 2.14 > 2.0
  EXPECT_EQ(sample(row, g, gs, with3, nullptr), 3);
  g.repetition_penalty = 1.0;
  g.presence_penalty = 1.5;  // the prompt is not the output: no effect
  EXPECT_EQ(sample(row, g, gs, with3, nullptr), 3);
  const std::vector<int32_t> out3 = {0, 3};  // prompt {0}, output {3}: 3.0 - 1.5 < 2.0 - 0
  EXPECT_EQ(sample(row, g, gs, out3, nullptr), 0);
}

TEST(Sampler, MinTokensSuppressesEosAndStopIdsUntilReached) {
  const std::vector<float> row = {0.0f, 5.0f, 4.0f, 1.0f};  // 1 = eos, 2 = a stop id, 3 is what is left
  const std::vector<int32_t> eos = {1};
  SamplingParams p;
  p.max_tokens = 10;
  p.min_tokens = 2;
  p.stop_token_ids = {2};
  RequestSamplerState state = make_sampler_state(p, 1, eos);
  EXPECT_EQ(sample(row, p, state, std::vector<int32_t>{0}, nullptr), 3);        // 0 output tokens
  EXPECT_EQ(sample(row, p, state, std::vector<int32_t>{0, 3}, nullptr), 3);     // 1
  EXPECT_EQ(sample(row, p, state, std::vector<int32_t>{0, 3, 3}, nullptr), 1);  // 2: reached
  p.ignore_eos = true;  // eos is not a stop then; the stop id still is
  RequestSamplerState ignoring = make_sampler_state(p, 1, eos);
  EXPECT_EQ(sample(row, p, ignoring, std::vector<int32_t>{0}, nullptr), 1);
  // Sampling with a temperature never draws a suppressed id.
  SamplingParams t = p;
  t.ignore_eos = false;
  t.temperature = 1.0;
  t.seed = 3;
  t.min_tokens = 10;
  RequestSamplerState ts = make_sampler_state(t, 1, eos);
  for (int i = 0; i < 2000; ++i) {
    const int32_t token = sample(row, t, ts, std::vector<int32_t>{0}, nullptr);
    ASSERT_NE(token, 1);
    ASSERT_NE(token, 2);
  }
}

TEST(Sampler, LogprobsAreTheRawLogSoftmax) {
  SamplingParams p = sampling(0.5);
  p.logprobs = 3;
  p.seed = 5;
  p.top_k = 2;
  p.repetition_penalty = 1.3;
  RequestSamplerState state = make_sampler_state(p, 1, {});
  SampleResult result;
  const std::vector<int32_t> context = {1};
  const std::vector<double> raw = softmax(std::vector<double>(kLogits.begin(), kLogits.end()));
  for (int i = 0; i < 50; ++i) {
    const int32_t token = sample(kLogits, p, state, context, &result);
    EXPECT_EQ(result.token, token);
    EXPECT_NEAR(result.logprob, std::log(raw[static_cast<size_t>(token)]), 1e-5);
    int64_t rank = 1;
    for (const float v : kLogits) rank += v > kLogits[static_cast<size_t>(token)];
    EXPECT_EQ(result.rank, rank);
    ASSERT_EQ(result.top.size(), 3u);
    const int32_t top[] = {1, 4, 7};
    for (size_t j = 0; j < 3; ++j) {
      EXPECT_EQ(result.top[j].token, top[j]);
      EXPECT_NEAR(result.top[j].logprob, std::log(raw[static_cast<size_t>(top[j])]), 1e-5);
    }
  }
  // Large logits: the log-sum-exp does not overflow.
  const std::vector<float> big = {1000.0f, 999.0f, -1000.0f};
  SamplingParams g;
  g.logprobs = 0;
  RequestSamplerState gs = make_sampler_state(g, 1, {});
  EXPECT_EQ(sample(big, g, gs, context, &result), 0);
  EXPECT_NEAR(result.logprob, -std::log1p(std::exp(-1.0)), 1e-5);
  EXPECT_TRUE(result.top.empty());
}

TEST(Sampler, ValidationNamesTheParameterAndValue) {
  auto message = [](auto mutate) {
    SamplingParams p;
    mutate(p);
    try {
      validate(p);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(valid)");
  };
  EXPECT_EQ(message([](SamplingParams&) {}), "(valid)");
  EXPECT_THAT(message([](SamplingParams& p) { p.temperature = -0.5; }), HasSubstr("temperature = -0.5"));
  EXPECT_THAT(message([](SamplingParams& p) { p.temperature = std::nan(""); }),
              HasSubstr("temperature = nan"));
  EXPECT_THAT(message([](SamplingParams& p) { p.top_p = 0.0; }), HasSubstr("top_p = 0"));
  EXPECT_THAT(message([](SamplingParams& p) { p.top_p = 1.5; }), HasSubstr("top_p = 1.5"));
  EXPECT_THAT(message([](SamplingParams& p) { p.top_k = -2; }), HasSubstr("top_k = -2"));
  EXPECT_THAT(message([](SamplingParams& p) { p.min_p = 1.25; }), HasSubstr("min_p = 1.25"));
  EXPECT_THAT(message([](SamplingParams& p) { p.min_p = -0.1; }), HasSubstr("min_p = -0.1"));
  EXPECT_THAT(message([](SamplingParams& p) { p.repetition_penalty = 0.0; }),
              HasSubstr("repetition_penalty = 0"));
  EXPECT_THAT(message([](SamplingParams& p) { p.frequency_penalty = 2.5; }),
              HasSubstr("frequency_penalty = 2.5"));
  EXPECT_THAT(message([](SamplingParams& p) { p.presence_penalty = -3.0; }),
              HasSubstr("presence_penalty = -3"));
  EXPECT_THAT(message([](SamplingParams& p) { p.max_tokens = 0; }), HasSubstr("max_tokens = 0"));
  EXPECT_THAT(message([](SamplingParams& p) { p.logprobs = 21; }), HasSubstr("logprobs = 21"));
  EXPECT_THAT(message([](SamplingParams& p) { p.logprobs = -1; }), HasSubstr("logprobs = -1"));
  EXPECT_THAT(message([](SamplingParams& p) { p.min_tokens = 17; }), HasSubstr("min_tokens = 17"));
  EXPECT_EQ(message([](SamplingParams& p) {
              p.top_k = -1;
              p.top_p = 1.0;
              p.min_p = 1.0;
              p.frequency_penalty = -2.0;
              p.presence_penalty = 2.0;
              p.logprobs = 20;
              p.top_k = 0;
            }),
            "(valid)");
}

// --- In the engine ---

std::vector<int32_t> run_alone(DeepseekV4Model& model, const std::vector<int32_t>& prompt,
                               const SamplingParams& params) {
  EngineConfig config;
  config.kv_cache_bytes = int64_t{64} << 20;
  Engine engine(model, config);
  const RequestId id = engine.add_request(prompt, params);
  std::vector<int32_t> tokens;
  while (engine.has_unfinished())
    for (const RequestOutput& output : engine.step())
      if (output.id == id)
        tokens.insert(tokens.end(), output.new_token_ids.begin(), output.new_token_ids.end());
  return tokens;
}

TEST(SamplerEngine, SeededRequestsAreReproducibleWhateverTheBatch) {
  const ModelConfig config = testing::small_config();
  DeepseekV4Model model = testing::random_model(config, 31);
  std::mt19937 rng(9);
  auto ids = [&](size_t n) {
    std::vector<int32_t> out(n);
    for (auto& t : out) t = static_cast<int32_t>(rng() % static_cast<uint32_t>(config.vocab_size));
    return out;
  };
  const auto prompt = ids(37);
  SamplingParams params;
  params.max_tokens = 24;
  params.ignore_eos = true;
  params.temperature = 1.5;  // a flat distribution: different seeds must diverge
  params.seed = 77;
  const auto expected = run_alone(model, prompt, params);
  ASSERT_EQ(expected.size(), 24u);

  EngineConfig engine_config;
  engine_config.kv_cache_bytes = int64_t{64} << 20;
  engine_config.max_num_batched_tokens = 48;  // chunked prefills beside decodes
  Engine engine(model, engine_config);
  SamplingParams other = params;
  other.seed = 78;
  SamplingParams unseeded = params;
  unseeded.seed.reset();
  unseeded.top_p = 0.9;
  const RequestId a = engine.add_request(prompt, params);
  const RequestId b = engine.add_request(ids(90), unseeded);
  const RequestId c = engine.add_request(prompt, params);
  const RequestId d = engine.add_request(prompt, other);
  std::map<RequestId, std::vector<int32_t>> tokens;
  while (engine.has_unfinished())
    for (const RequestOutput& output : engine.step()) {
      EXPECT_TRUE(output.error.empty()) << output.error;
      auto& t = tokens[output.id];
      t.insert(t.end(), output.new_token_ids.begin(), output.new_token_ids.end());
    }
  EXPECT_EQ(tokens[a], expected);
  EXPECT_EQ(tokens[c], expected);
  EXPECT_NE(tokens[d], expected) << "a different seed gave the same 24 tokens";
  EXPECT_EQ(tokens[b].size(), 24u);
  EXPECT_EQ(engine.runner().num_states(), 0);

  // Invalid params are rejected at add_request, naming the request and the parameter.
  SamplingParams bad = params;
  bad.top_p = 2.0;
  try {
    engine.add_request(prompt, bad);
    ADD_FAILURE() << "top_p = 2 accepted";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("top_p = 2"));
    EXPECT_THAT(e.what(), HasSubstr("request "));
  }
}

}  // namespace
}  // namespace dsv4

namespace dsv4 {
namespace {

TEST(SamplerEngine, LogprobsReachTheRequestOutputs) {
  const ModelConfig config = testing::small_config();
  DeepseekV4Model model = testing::random_model(config, 32);
  EngineConfig engine_config;
  engine_config.kv_cache_bytes = int64_t{32} << 20;
  Engine engine(model, engine_config);
  SamplingParams params;
  params.max_tokens = 6;
  params.temperature = 0.8;
  params.seed = 5;
  params.logprobs = 3;
  engine.add_request({1, 2, 3, 4, 5, 6, 7}, params);
  int64_t tokens = 0;
  while (engine.has_unfinished())
    for (const RequestOutput& output : engine.step()) {
      ASSERT_EQ(output.new_logprobs.size(), output.new_token_ids.size());
      for (size_t i = 0; i < output.new_token_ids.size(); ++i) {
        const SampleResult& result = output.new_logprobs[i];
        EXPECT_EQ(result.token, output.new_token_ids[i]);
        EXPECT_EQ(result.top.size(), 3u);
        EXPECT_LE(result.logprob, 0.0f);
        EXPECT_GE(result.top[0].logprob, result.logprob);
        ++tokens;
      }
    }
  EXPECT_GT(tokens, 0);
}

TEST(SamplerEngine, ParallelSamplesAreTheSeededChildren) {
  const ModelConfig config = testing::small_config();
  DeepseekV4Model model = testing::random_model(config, 33);
  EngineConfig engine_config;
  engine_config.kv_cache_bytes = int64_t{32} << 20;
  SamplingParams params;
  params.max_tokens = 8;
  params.temperature = 1.2;
  params.seed = 100;
  const std::vector<int32_t> prompt = {3, 1, 4, 1, 5, 9, 2, 6};
  auto collect = [&](Engine& engine) {
    std::map<RequestId, std::vector<int32_t>> out;
    while (engine.has_unfinished())
      for (const RequestOutput& output : engine.step())
        out[output.id].insert(out[output.id].end(), output.new_token_ids.begin(), output.new_token_ids.end());
    return out;
  };
  Engine together(model, engine_config);
  const std::vector<RequestId> ids = together.add_parallel_requests(prompt, params, 3);
  auto outputs = collect(together);
  for (size_t i = 0; i < ids.size(); ++i) {
    Engine alone(model, engine_config);
    SamplingParams child = params;
    child.seed = 100 + i;
    alone.add_request(prompt, child);
    EXPECT_EQ(outputs[ids[i]], collect(alone).begin()->second) << "sample " << i;
  }
  EXPECT_NE(outputs[ids[0]], outputs[ids[1]]);
  EXPECT_THROW(together.add_parallel_requests(prompt, params, 0), Error);
  params.top_p = 3;
  EXPECT_THROW(together.add_parallel_requests(prompt, params, 2), Error);
  EXPECT_FALSE(together.has_unfinished()) << "an invalid request was queued";
}

}  // namespace
}  // namespace dsv4
