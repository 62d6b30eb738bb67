// Request: one generation request as the engine tracks it from add_request() to its finish (nano-vllm's
// `Sequence`, vLLM v1's `Request`). The scheduler owns every Request; the model runner and the cache manager know
// only its id.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace dsv4 {

using RequestId = uint64_t;  // the same alias as cache/hybrid_kv_cache_manager.h

// A sampled-token slot with nothing in it (a mid-prefill chunk samples nothing).
inline constexpr int32_t kNoToken = -1;

// Greedy decoding only for now; temperature / top-p / seeds arrive with engine/sampler.
struct SamplingParams {
  int64_t max_tokens = 16;             // generated tokens, at least 1
  bool ignore_eos = false;             // do not stop on the model's eos ids
  std::vector<int32_t> stop_token_ids; // stop on any of these (always, whatever ignore_eos)
};

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
  std::string error;  // why the engine aborted it (empty for a user abort)

  int64_t num_tokens() const { return static_cast<int64_t>(token_ids.size()); }
  int64_t num_output_tokens() const { return num_tokens() - num_prompt_tokens; }
  std::span<const int32_t> prompt() const { return std::span<const int32_t>(token_ids).first(num_prompt_tokens); }
  std::span<const int32_t> output() const { return std::span<const int32_t>(token_ids).subspan(num_prompt_tokens); }
};

// What one engine step produced for one request. A request mid-prefill produces nothing; a finished one
// produces its last token (if any) with finished = true.
struct RequestOutput {
  RequestId id = 0;
  std::vector<int32_t> new_token_ids;  // at most one per step with the greedy single-token decode
  bool finished = false;
  RequestStatus status = RequestStatus::kRunning;
  std::string error;  // set when the engine aborted the request
};

}  // namespace dsv4
