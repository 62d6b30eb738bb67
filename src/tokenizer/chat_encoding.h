// DeepSeek-V4 chat encoding: OpenAI-style messages -> the prompt string the model was trained on.
//
// V4 ships no Jinja chat template; its reference encoder is `encoding/encoding_dsv4.py` in the DeepSeek-V4
// model repository. This is a native implementation of the same format, checked against the reference's own
// test cases (tests/fixtures/chat/, tests/tokenizer/chat_encoding_test.cpp). The format:
//
//   <｜begin▁of▁sentence｜>                       (add_bos and no context)
//   [reasoning-effort preamble]                   (thinking mode, effort max, before message 0)
//   system:          {content}[\n\n## Tools ...][\n\n## Response Format ...]
//   developer:       <｜User｜>{content}[tools][response format]
//   user:            <｜User｜>{text or <tool_result>..</tool_result> blocks, joined by \n\n}
//   latest_reminder: <｜latest_reminder｜>{content}
//   assistant:       [{reasoning_content}</think>]{content}[\n\n<｜DSML｜tool_calls>...]<｜end▁of▁sentence｜>
//
// After a user/developer message that is last or followed by an assistant / latest_reminder message comes
// the generation prompt `<｜Assistant｜>` plus `<think>` (thinking mode, current turn) or `</think>`.
// `tool` messages are merged into a user message as <tool_result> blocks (consecutive tool/user messages
// become one user turn, results sorted into the order of the preceding assistant's tool_calls by id).
// In thinking mode with drop_thinking (and no message carrying tools), assistant turns before the last
// user/developer message lose their reasoning (and earlier developer messages are dropped).
// Per-message extras the reference reads: `wo_eos` (assistant: no EOS), `task` (one of action, query,
// authority, domain, title, read_url: a task token instead of the generation prompt), `response_format`.
//
// Objects keep their key order (nlohmann::ordered_json): tool schemas and tool-call arguments are printed as
// Python's json.dumps prints them (", " / ": " separators, non-ASCII kept), in the order given.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace dsv4 {

enum class ThinkingMode { kChat, kThinking };
// kNone and kHigh add nothing; kMax prepends the reference's maximum-effort instruction (thinking mode only).
enum class ReasoningEffort { kNone, kHigh, kMax };

struct ChatEncodingOptions {
  ThinkingMode thinking_mode = ThinkingMode::kChat;
  // Drop reasoning_content of assistant turns before the last user message (thinking mode; ignored, as in
  // the reference, when any message carries tools).
  bool drop_thinking = true;
  // Prepend BOS (only when `context` is empty).
  bool add_bos = true;
  ReasoningEffort reasoning_effort = ReasoningEffort::kNone;
  // OpenAI `tools` of the request ([{"type":"function","function":{...}}]); when non-empty it is attached to
  // messages[0] as the reference's test driver does, so it renders only if messages[0] is system/developer.
  nlohmann::ordered_json tools = nullptr;
  // Messages already encoded earlier (a cached prefix): they shape drop_thinking and the transitions but
  // are not rendered, and suppress BOS.
  nlohmann::ordered_json context = nullptr;
};

// Encodes `messages` (a JSON array of OpenAI-style messages). Throws dsv4::Error naming the message index
// and field on malformed input (unknown role, empty developer content, unknown task, non-object arguments).
std::string encode_messages(const nlohmann::ordered_json& messages, const ChatEncodingOptions& options = {});
// Same, from JSON text (parsed preserving key order).
std::string encode_messages_json(std::string_view messages_json, const ChatEncodingOptions& options = {});

// Python json.dumps(value, ensure_ascii=False) of `value`: ", " and ": " separators, keys in stored order.
std::string python_json_dumps(const nlohmann::ordered_json& value);

}  // namespace dsv4
