// Request: one generation request as the engine tracks it from add_request() to its finish (nano-vllm's
// `Sequence`, vLLM v1's `Request`). The scheduler owns every Request; the model runner and the cache manager know
// only its id.
#pragma once
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace dsv4 {

using RequestId = uint64_t;  // the same alias as cache/hybrid_kv_cache_manager.h

// A sampled-token slot with nothing in it (a mid-prefill chunk samples nothing).
inline constexpr int32_t kNoToken = -1;

// vLLM's / OpenAI's sampling parameters (engine/sampler.h applies them, validate() checks them). The defaults
// are greedy decoding (temperature 0) so that every existing caller keeps its outputs; the OpenAI server maps an
// absent `temperature` to OpenAI's default 1.0 itself.
struct SamplingParams {
  int64_t max_tokens = 16;             // generated tokens, at least 1
  bool ignore_eos = false;             // do not stop on the model's eos ids
  std::vector<int32_t> stop_token_ids; // stop on any of these (always, whatever ignore_eos)

  double temperature = 0.0;         // < 1e-5: greedy (argmax, lowest index on ties); else logits / temperature
  int64_t top_k = -1;               // keep the k most likely tokens; -1 or 0 = off
  double top_p = 1.0;               // keep the smallest set with cumulative probability >= top_p; 1 = off
  double min_p = 0.0;               // drop tokens with p < min_p * p_max; 0 = off
  double repetition_penalty = 1.0;  // vLLM: tokens in prompt + output: logit / r if > 0, logit * r if <= 0
  double frequency_penalty = 0.0;   // OpenAI: logit -= frequency_penalty * count in the output
  double presence_penalty = 0.0;    // OpenAI: logit -= presence_penalty if the token is in the output
  std::optional<uint64_t> seed;     // a per-request generator seeded from it: reproducible whatever the batch
  int64_t min_tokens = 0;           // eos / stop ids cannot be sampled before this many output tokens
  std::optional<int64_t> logprobs;  // N: the sampled token's logprob and the top-N alternatives (raw logits)
};

// Throws dsv4::Error naming the parameter and its value for an invalid one (defined in engine/sampler.cpp).
void validate(const SamplingParams& params);

enum class RequestStatus {
  kWaiting,           // queued, holds no blocks
  kRunning,           // admitted: holds blocks in the cache manager
  kPreempted,         // evicted by recompute: back in the waiting queue (at its front), holds no blocks
  kFinishedStopped,   // sampled an eos or stop token
  kFinishedLength,    // reached max_tokens or max_model_len
  kFinishedAborted,   // abort(), or the engine could not run it (Request::error says why)
};
const char* request_status_name(RequestStatus status);
inline bool is_finished(RequestStatus status) {
  return status == RequestStatus::kFinishedStopped || status == RequestStatus::kFinishedLength ||
         status == RequestStatus::kFinishedAborted;
}
// The OpenAI finish_reason of a finished status ("stop", "length", "abort"); nullptr while unfinished.
const char* finish_reason(RequestStatus status);

// The fields every step touches come first (one cache line per request in the decode loop).
struct Request {
  RequestId id = 0;
  std::vector<int32_t> token_ids;  // the prompt, then every generated token (an eos / stop token included)
  int64_t num_prompt_tokens = 0;
  // Tokens whose KV state is in the cache: a prefix hit counts as computed. The next chunk starts here.
  int64_t num_computed_tokens = 0;
  RequestStatus status = RequestStatus::kWaiting;
  SamplingParams params;
  uint64_t arrival = 0;  // add order
  int64_t num_preemptions = 0;
  int64_t num_cached_tokens = 0;  // prefix-cache hit at first admission (OpenAI usage.cached_tokens)
  std::string error;  // why the engine aborted it (empty for a user abort)

  int64_t num_tokens() const { return static_cast<int64_t>(token_ids.size()); }
  int64_t num_output_tokens() const { return num_tokens() - num_prompt_tokens; }
  std::span<const int32_t> prompt() const { return std::span<const int32_t>(token_ids).first(num_prompt_tokens); }
  std::span<const int32_t> output() const { return std::span<const int32_t>(token_ids).subspan(num_prompt_tokens); }
};

// What one engine step produced for one request. A request mid-prefill produces nothing; a finished one
// produces its last token (if any) with finished = true.
// Logprobs of one sampled token (SamplingParams::logprobs), from the raw model distribution as vLLM returns them.
struct TokenLogprob {
  int32_t token = kNoToken;
  float logprob = 0.0f;
};

// What logprobs = N returns for one sampled token.
struct SampleResult {
  int32_t token = kNoToken;
  float logprob = 0.0f;           // of `token` under the raw model distribution
  int64_t rank = 0;               // 1 + the number of tokens with a strictly larger raw logit
  std::vector<TokenLogprob> top;  // the N most likely raw tokens, descending (lower index first on ties)
};

struct RequestOutput {
  RequestId id = 0;
  std::vector<int32_t> new_token_ids;  // at most one per step (single-token decode)
  std::vector<SampleResult> new_logprobs;  // one per new token when SamplingParams::logprobs is set
  bool finished = false;
  RequestStatus status = RequestStatus::kRunning;
  std::string error;  // set when the engine aborted the request
  int64_t num_cached_tokens = 0;  // prompt tokens that were a prefix-cache hit (first admission)
};

}  // namespace dsv4
