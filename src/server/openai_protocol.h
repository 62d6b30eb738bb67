// The OpenAI API as vLLM serves it: request bodies of /v1/completions and /v1/chat/completions parsed and
// validated into engine terms, and the response / stream-chunk / error objects built back (OpenAI's shapes,
// vLLM's extra sampling fields). Pure functions of JSON text: no sockets, no engine, no tokenizer, so the
// libFuzzer target (fuzz/openai_request_fuzzer.cpp) drives exactly what the server runs.
#pragma once
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/request.h"
#include "tokenizer/chat_encoding.h"

namespace dsv4::server {

// An error the client caused or must know about, rendered as OpenAI's
// {"error": {"message", "type", "param", "code"}} with the HTTP status.
class ApiError : public std::runtime_error {
 public:
  ApiError(int status, std::string message, std::string param = {}, std::string type = {});
  int status() const { return status_; }
  const std::string& type() const { return type_; }
  const std::string& param() const { return param_; }

 private:
  int status_;
  std::string param_, type_;
};
std::string error_body(int status, std::string_view message, std::string_view param = {},
                       std::string_view type = {});

enum class Endpoint { kCompletions, kChatCompletions };

// One prompt of a completions request: text to tokenize, or token ids as given.
using PromptInput = std::variant<std::string, std::vector<int32_t>>;

struct GenerationRequest {
  Endpoint endpoint = Endpoint::kCompletions;
  std::string model;                    // empty: the served model
  std::vector<PromptInput> prompts;     // completions: one or more; chat: empty (messages instead)
  nlohmann::ordered_json messages;      // chat: the conversation, key order kept for the encoder
  ChatEncodingOptions chat;             // chat: thinking mode, reasoning effort, tools
  SamplingParams sampling;              // temperature, top_p, ... as the engine takes them
  std::optional<int64_t> max_tokens;    // max_tokens / max_completion_tokens; absent: the server's default
  int64_t n = 1;                        // choices per prompt
  std::vector<std::string> stop;        // stop strings (not emitted)
  bool stream = false;
  bool include_usage = false;           // stream_options.include_usage
  bool continuous_usage_stats = false;  // stream_options.continuous_usage_stats (vLLM): usage on every chunk
  bool echo = false;                    // completions: the prompt text precedes the completion
  bool skip_special_tokens = true;
  bool include_stop_str_in_output = false;
  // Completions `logprobs: N` / chat `logprobs: true` + `top_logprobs: N` (N alternatives, 0..20); also the
  // engine's SamplingParams::logprobs.
  std::optional<int64_t> logprobs;
};

// Parses and validates a request body. Throws ApiError(400) naming the field for malformed JSON, a wrong type,
// a missing field or an invalid value. Unknown fields are ignored, as OpenAI and vLLM do.
GenerationRequest parse_generation_request(std::string_view body, Endpoint endpoint);

// /tokenize and /detokenize bodies (vLLM's): {"prompt": text | "messages": [...], "add_special_tokens"} and
// {"tokens": [ids]}.
struct TokenizeRequest {
  std::optional<std::string> prompt;
  nlohmann::ordered_json messages;  // null unless given
  ChatEncodingOptions chat;
  bool add_special_tokens = true;
};
TokenizeRequest parse_tokenize_request(std::string_view body);
std::vector<int32_t> parse_detokenize_request(std::string_view body);

// The pieces of one choice that the server accumulates (non-streaming) or sends as they come (streaming).
struct ChoiceLogprobs {
  std::vector<std::string> tokens;  // each sampled token's text
  std::vector<std::vector<uint8_t>> token_bytes;
  std::vector<float> logprobs;
  std::vector<std::vector<std::pair<std::string, float>>> top;  // alternatives per token, descending
  std::vector<std::vector<std::vector<uint8_t>>> top_bytes;
  size_t size() const { return tokens.size(); }
};

struct Usage {
  int64_t prompt_tokens = 0, completion_tokens = 0, cached_tokens = 0;
};
nlohmann::json usage_json(const Usage& usage);

// Completions: `text_offset` starts at `text_offset_base` (the text before this delta in the choice).
nlohmann::json completion_logprobs_json(const ChoiceLogprobs& logprobs, int64_t text_offset_base);
nlohmann::json chat_logprobs_json(const ChoiceLogprobs& logprobs);

// Thinking mode: the model writes its reasoning, then `</think>`, then the answer (the prompt already ends with
// `<think>`). Splits streamed text into reasoning_content and content as vLLM's DeepSeek reasoning parser does,
// holding back a tail that may be the start of a `</think>` cut between two deltas.
class ReasoningSplitter {
 public:
  struct Parts {
    std::string reasoning, content;
  };
  Parts push(std::string_view text);
  Parts flush();  // at the end: a held-back tail is reasoning (the marker never came)

 private:
  bool in_content_ = false;
  std::string held_;
};

}  // namespace dsv4::server
