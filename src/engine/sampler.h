// Sampler: one next token from one request's logits (vLLM v1 `Sampler`), on the CPU, one row at a time.
//
// Order of operations on a row of logits [vocab] (vLLM v1's):
//   1. min_tokens: while the output is shorter than min_tokens, the stop ids (stop_token_ids, and the model's
//   eos
//      ids unless ignore_eos) get -inf.
//   2. penalties: repetition_penalty over every token in prompt + output (vLLM: logit / r if logit > 0, else
//      logit * r); then frequency_penalty * count and presence_penalty * [count > 0] over the output tokens
//      only (OpenAI) are subtracted.
//   3. temperature < kGreedyTemperature: argmax of the penalised logits, the lowest index on ties. Else
//      logits / temperature, then
//   4. min_p: drop tokens with p < min_p * p_max (on the full tempered distribution; computed in logit
//   space),
//   5. top_k: the k largest (nth_element; ties broken by the lower index, so the kept set is deterministic;
//      without top_p the kept set is then walked in ascending index order, as without top_k),
//   6. top_p: on the candidates sorted descending and renormalised, the smallest prefix whose cumulative
//      probability is >= top_p (at least one token),
//   7. one draw: u in [0, 1) from the request's generator (53 bits of a mt19937_64), inverted against the
//      candidates' cumulative weights exp(l - l_max) in double.
//
// Logprobs follow vLLM's default (logprobs_mode = "raw_logprobs"): the log-softmax of the RAW model logits,
// before min_tokens, penalties, temperature and truncation; the sampled token's logprob and rank, and the top
// N.
//
// Generators: a request with a seed gets mt19937_64(seed), so its tokens do not depend on what it is batched
// with (one draw per sampled token, none for greedy); without a seed, one seeded from a process-wide counter.
#pragma once
#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "engine/request.h"

namespace dsv4 {

inline constexpr double kGreedyTemperature = 1e-5;  // vLLM's _SAMPLING_EPS: below it, greedy
inline constexpr int64_t kMaxLogprobs = 20;         // OpenAI's top_logprobs limit

// Per-request sampler state: lives from a request's first sampled token to its finish (it survives
// preemption, so a preempted seeded request continues its stream).
struct RequestSamplerState {
  std::mt19937_64 rng;
  int64_t num_prompt_tokens = 0;  // splits prompt_and_output for the output-only penalties / min_tokens
  std::vector<int32_t> min_tokens_stop_ids;  // suppressed while the output is shorter than min_tokens
};

// u in [0, 1) from the top 53 bits of one draw of the request's generator: step 7's draw (the same on every standard
// library; std::uniform_real_distribution is not). The device sampler's callers draw it with this too.
inline double draw_uniform(RequestSamplerState& state) { return static_cast<double>(state.rng() >> 11) * 0x1.0p-53; }

// The state of a request with these params: `eos_token_ids` are the model's (suppressed by min_tokens unless
// ignore_eos).
RequestSamplerState make_sampler_state(const SamplingParams& params, int64_t num_prompt_tokens,
                                       std::span<const int32_t> eos_token_ids);

// Steps 1 and 2 above in place on `logits` [vocab]: min_tokens suppression and the penalties.
void apply_penalties(std::span<float> logits, const SamplingParams& params, const RequestSamplerState& state,
                     std::span<const int32_t> prompt_and_output);

// Samples the next token from `logits` [vocab]; `prompt_and_output` is the request's tokens so far. Writes
// the logprobs into *logprobs_out when it is non-null (params.logprobs gives N; 0 or absent: only the sampled
// one).
int32_t sample(std::span<const float> logits, const SamplingParams& params, RequestSamplerState& state,
               std::span<const int32_t> prompt_and_output, SampleResult* logprobs_out);

// The greedy sampler: the first index of the largest logit.
int32_t argmax_token(std::span<const float> logits);

}  // namespace dsv4
