#include "engine/sampler.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>

#include "core/error.h"

namespace dsv4 {
namespace {

std::string num(double value) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%g", value);
  return buf;
}
std::string num(int64_t value) { return std::to_string(value); }

// Seeds the generators of requests without a seed: distinct per request, fixed per process run order.
std::atomic<uint64_t> g_unseeded_counter{0x9e3779b97f4a7c15ull};

struct Scratch {
  std::vector<float> logits;        // [vocab] processed
  std::vector<int32_t> candidates;  // token ids still in the running
  std::vector<int32_t> tokens;      // sorted copies of the context for the penalties
  std::vector<double> weights;
};
thread_local Scratch t_scratch;

void penalise(std::span<float> logits, const SamplingParams& params, const RequestSamplerState& state,
              std::span<const int32_t> prompt_and_output, std::vector<int32_t>& tokens) {
  const auto vocab = static_cast<int64_t>(logits.size());
  auto in_vocab = [vocab](int32_t t) { return t >= 0 && t < vocab; };
  if (params.repetition_penalty != 1.0) {
    tokens.assign(prompt_and_output.begin(), prompt_and_output.end());
    std::sort(tokens.begin(), tokens.end());
    tokens.erase(std::unique(tokens.begin(), tokens.end()), tokens.end());
    const auto r = static_cast<float>(params.repetition_penalty);
    for (const int32_t t : tokens)
      if (in_vocab(t)) logits[t] = logits[t] > 0.0f ? logits[t] / r : logits[t] * r;
  }
  if (params.frequency_penalty != 0.0 || params.presence_penalty != 0.0) {
    const size_t first = static_cast<size_t>(
        std::min<int64_t>(state.num_prompt_tokens, static_cast<int64_t>(prompt_and_output.size())));
    tokens.assign(prompt_and_output.begin() + static_cast<std::ptrdiff_t>(first), prompt_and_output.end());
    std::sort(tokens.begin(), tokens.end());
    for (size_t i = 0; i < tokens.size();) {
      size_t j = i;
      while (j < tokens.size() && tokens[j] == tokens[i]) ++j;
      if (in_vocab(tokens[i]))
        logits[tokens[i]] -= static_cast<float>(params.frequency_penalty * static_cast<double>(j - i) +
                                                params.presence_penalty);
      i = j;
    }
  }
}

void fill_logprobs(std::span<const float> raw, int32_t token, int64_t n, std::vector<int32_t>& order,
                   SampleResult& out) {
  double max = -std::numeric_limits<double>::infinity();
  for (const float v : raw) max = std::max(max, static_cast<double>(v));
  double sum = 0.0;
  for (const float v : raw) sum += std::exp(static_cast<double>(v) - max);
  const double lse = max + std::log(sum);
  out.token = token;
  out.logprob = static_cast<float>(static_cast<double>(raw[token]) - lse);
  out.rank = 1;
  for (const float v : raw) out.rank += v > raw[token];
  out.top.clear();
  n = std::min<int64_t>(n, static_cast<int64_t>(raw.size()));
  if (n <= 0) return;
  order.resize(raw.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
  auto before = [&](int32_t a, int32_t b) { return raw[a] > raw[b] || (raw[a] == raw[b] && a < b); };
  std::partial_sort(order.begin(), order.begin() + n, order.end(), before);
  for (int64_t i = 0; i < n; ++i)
    out.top.push_back({order[i], static_cast<float>(static_cast<double>(raw[order[i]]) - lse)});
}

}  // namespace

int32_t argmax_token(std::span<const float> logits) {
  return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

void validate(const SamplingParams& p) {
  DSV4_CHECK(p.max_tokens >= 1, "max_tokens = " + num(p.max_tokens) + ": must be at least 1");
  DSV4_CHECK(p.temperature >= 0.0 && std::isfinite(p.temperature),
             "temperature = " + num(p.temperature) + ": must be a finite number >= 0");
  DSV4_CHECK(p.top_p > 0.0 && p.top_p <= 1.0, "top_p = " + num(p.top_p) + ": must be in (0, 1]");
  DSV4_CHECK(p.top_k >= -1, "top_k = " + num(p.top_k) + ": must be -1 or 0 (off) or positive");
  DSV4_CHECK(p.min_p >= 0.0 && p.min_p <= 1.0, "min_p = " + num(p.min_p) + ": must be in [0, 1]");
  DSV4_CHECK(p.repetition_penalty > 0.0 && std::isfinite(p.repetition_penalty),
             "repetition_penalty = " + num(p.repetition_penalty) + ": must be a finite number > 0");
  DSV4_CHECK(p.frequency_penalty >= -2.0 && p.frequency_penalty <= 2.0,
             "frequency_penalty = " + num(p.frequency_penalty) + ": must be in [-2, 2]");
  DSV4_CHECK(p.presence_penalty >= -2.0 && p.presence_penalty <= 2.0,
             "presence_penalty = " + num(p.presence_penalty) + ": must be in [-2, 2]");
  DSV4_CHECK(
      p.min_tokens >= 0 && p.min_tokens <= p.max_tokens,
      "min_tokens = " + num(p.min_tokens) + ": must be in [0, max_tokens = " + num(p.max_tokens) + "]");
  if (p.logprobs)
    DSV4_CHECK(*p.logprobs >= 0 && *p.logprobs <= kMaxLogprobs,
               "logprobs = " + num(*p.logprobs) + ": must be in [0, " + num(kMaxLogprobs) + "]");
}

RequestSamplerState make_sampler_state(const SamplingParams& params, int64_t num_prompt_tokens,
                                       std::span<const int32_t> eos_token_ids) {
  RequestSamplerState state;
  state.rng.seed(params.seed ? *params.seed : g_unseeded_counter.fetch_add(1, std::memory_order_relaxed));
  state.num_prompt_tokens = num_prompt_tokens;
  if (params.min_tokens > 0) {
    state.min_tokens_stop_ids = params.stop_token_ids;
    if (!params.ignore_eos)
      state.min_tokens_stop_ids.insert(state.min_tokens_stop_ids.end(), eos_token_ids.begin(),
                                       eos_token_ids.end());
  }
  return state;
}

void apply_penalties(std::span<float> logits, const SamplingParams& params, const RequestSamplerState& state,
                     std::span<const int32_t> prompt_and_output) {
  const auto vocab = static_cast<int64_t>(logits.size());
  const int64_t num_output = static_cast<int64_t>(prompt_and_output.size()) - state.num_prompt_tokens;
  if (num_output < params.min_tokens)
    for (const int32_t t : state.min_tokens_stop_ids)
      if (t >= 0 && t < vocab) logits[t] = -std::numeric_limits<float>::infinity();
  penalise(logits, params, state, prompt_and_output, t_scratch.tokens);
}

int32_t sample(std::span<const float> raw, const SamplingParams& params, RequestSamplerState& state,
               std::span<const int32_t> prompt_and_output, SampleResult* logprobs_out) {
  DSV4_CHECK(!raw.empty(), "sample: empty logits");
  Scratch& s = t_scratch;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const auto vocab = static_cast<int64_t>(raw.size());
  const bool greedy = params.temperature < kGreedyTemperature;
  const bool untouched =
      params.repetition_penalty == 1.0 && params.frequency_penalty == 0.0 && params.presence_penalty == 0.0 &&
      static_cast<int64_t>(prompt_and_output.size()) - state.num_prompt_tokens >= params.min_tokens;
  if (greedy && untouched) {  // the common greedy decode: no copy of the row
    const int32_t token = argmax_token(raw);
    if (logprobs_out) fill_logprobs(raw, token, params.logprobs.value_or(0), s.candidates, *logprobs_out);
    return token;
  }
  s.logits.assign(raw.begin(), raw.end());

  apply_penalties(s.logits, params, state, prompt_and_output);  // 1. and 2.

  auto finish = [&](int32_t token) {
    if (logprobs_out) fill_logprobs(raw, token, params.logprobs.value_or(0), s.candidates, *logprobs_out);
    return token;
  };
  int32_t token = kNoToken;
  if (greedy) {  // 3.
    token = argmax_token(s.logits);
  } else {
    const float inv_t = static_cast<float>(1.0 / params.temperature);
    float max = kNegInf;
    for (float& v : s.logits) {
      v *= inv_t;
      max = std::max(max, v);
    }
    if (max == kNegInf)
      return finish(argmax_token(s.logits));  // every token suppressed: nothing to draw from
    // 4. min_p: p_i >= min_p * p_max  <=>  l_i - l_max >= log(min_p).
    const float floor = params.min_p > 0.0 ? max + static_cast<float>(std::log(params.min_p)) : kNegInf;
    s.candidates.clear();
    for (int64_t i = 0; i < vocab; ++i)
      if (s.logits[i] >= floor && s.logits[i] > kNegInf) s.candidates.push_back(static_cast<int32_t>(i));
    const std::vector<float>& l = s.logits;
    auto before = [&l](int32_t a, int32_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); };
    // 5. top_k.
    if (params.top_k > 0 && params.top_k < static_cast<int64_t>(s.candidates.size())) {
      std::nth_element(s.candidates.begin(), s.candidates.begin() + (params.top_k - 1), s.candidates.end(),
                       before);
      s.candidates.resize(static_cast<size_t>(params.top_k));
      // The draw walks the kept set in vocabulary order, as it does without top_k (nth_element's order is the
      // standard library's; the device sampler, ops/cuda/sampling.h, reproduces this one).
      if (params.top_p >= 1.0) std::sort(s.candidates.begin(), s.candidates.end());
    }
    // Weights relative to the max kept logit (which is the global max: min_p / top_k keep it).
    const double lmax = static_cast<double>(max);
    // 6. top_p.
    if (params.top_p < 1.0) {
      std::sort(s.candidates.begin(), s.candidates.end(), before);
      s.weights.resize(s.candidates.size());
      double total = 0.0;
      for (size_t i = 0; i < s.candidates.size(); ++i)
        total += s.weights[i] = std::exp(static_cast<double>(l[s.candidates[i]]) - lmax);
      const double target = params.top_p * total;
      double cum = 0.0;
      size_t keep = 0;
      while (keep < s.candidates.size()) {
        cum += s.weights[keep++];
        if (cum >= target) break;
      }
      s.candidates.resize(keep);
    }
    // 7. one draw.
    s.weights.resize(s.candidates.size());
    double total = 0.0;
    for (size_t i = 0; i < s.candidates.size(); ++i)
      total += s.weights[i] = std::exp(static_cast<double>(l[s.candidates[i]]) - lmax);
    const double u = draw_uniform(state) * total;
    double cum = 0.0;
    token = s.candidates.back();  // rounding: u * total past the last cumulative sum
    for (size_t i = 0; i < s.candidates.size(); ++i) {
      cum += s.weights[i];
      if (u < cum) {
        token = s.candidates[i];
        break;
      }
    }
  }
  return finish(token);
}

}  // namespace dsv4
