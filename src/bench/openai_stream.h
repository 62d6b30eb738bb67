// What one SSE event of an OpenAI streaming response means to the benchmark: generated text (a token event),
// the usage report, the end of the stream, or an error the server sent in the stream.
//
//   /v1/completions:      data: {"choices":[{"index":0,"text":"Hel","finish_reason":null}], ...}
//   /v1/chat/completions: data: {"choices":[{"index":0,"delta":{"content":"Hel"}}], ...}
//   usage (stream_options.include_usage): data: {"choices":[],"usage":{"completion_tokens":128, ...}}
//   end:                  data: [DONE]
//   error:                data: {"error":{"message":"...", ...}}
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace dsv4::bench {

enum class ApiKind { kCompletions, kChatCompletions };

// The API an endpoint path speaks: ".../chat/completions" is the chat API, anything else the completions API.
ApiKind api_kind_of_endpoint(std::string_view endpoint);

struct StreamPayload {
  bool done = false;                 // data: [DONE]
  std::optional<std::string> error;  // set when the payload is not a valid chunk or is an error object
  // Generated text of the first choice: completions "text", chat "delta.content" plus "delta.reasoning_content".
  // A chunk with no generated text (the chat role chunk, a finish_reason-only chunk) is no token event.
  std::string text;
  std::optional<int64_t> completion_tokens;  // "usage.completion_tokens", when the chunk carries usage

  bool is_token_event() const { return !text.empty(); }
};

// Never throws: malformed input becomes `error`.
StreamPayload decode_stream_payload(std::string_view data, ApiKind api);

}  // namespace dsv4::bench
