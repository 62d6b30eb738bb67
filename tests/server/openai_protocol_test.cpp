// Request parsing and validation of the OpenAI routes (server/openai_protocol.h): defaults as OpenAI documents
// them, each field of the wrong type or out of range rejected naming the field, and the reasoning splitter on
// every cut of a stream.
#include "server/openai_protocol.h"

#include <gtest/gtest.h>

#include <random>

namespace dsv4::server {
namespace {

ApiError parse_error(const std::string& body, Endpoint endpoint = Endpoint::kCompletions) {
  try {
    parse_generation_request(body, endpoint);
  } catch (const ApiError& error) {
    return error;
  }
  ADD_FAILURE() << "accepted: " << body;
  return ApiError(0, "");
}

TEST(OpenAiProtocol, CompletionDefaultsAreOpenAis) {
  const GenerationRequest request = parse_generation_request(R"({"prompt": "hi"})", Endpoint::kCompletions);
  ASSERT_EQ(request.prompts.size(), 1u);
  EXPECT_EQ(std::get<std::string>(request.prompts[0]), "hi");
  EXPECT_DOUBLE_EQ(request.sampling.temperature, 1.0);
  EXPECT_DOUBLE_EQ(request.sampling.top_p, 1.0);
  EXPECT_EQ(request.n, 1);
  EXPECT_FALSE(request.max_tokens.has_value());
  EXPECT_FALSE(request.stream);
  EXPECT_FALSE(request.logprobs.has_value());
  EXPECT_TRUE(request.skip_special_tokens);
}

TEST(OpenAiProtocol, EveryPromptFormAndTheSamplingFields) {
  const GenerationRequest ids = parse_generation_request(
      R"({"prompt": [[5, 6], [7]], "max_tokens": 9, "temperature": 0, "top_k": 4, "min_p": 0.2, "seed": 11,
          "repetition_penalty": 1.3, "presence_penalty": -0.5, "frequency_penalty": 0.25, "min_tokens": 2,
          "ignore_eos": true, "stop_token_ids": [3, 4], "stop": "END", "n": 2, "logprobs": 3, "stream": true,
          "stream_options": {"include_usage": true}, "unknown_field": {"ignored": [1, 2]}})",
      Endpoint::kCompletions);
  ASSERT_EQ(ids.prompts.size(), 2u);
  EXPECT_EQ(std::get<std::vector<int32_t>>(ids.prompts[0]), (std::vector<int32_t>{5, 6}));
  EXPECT_EQ(ids.max_tokens, 9);
  EXPECT_EQ(ids.sampling.top_k, 4);
  EXPECT_DOUBLE_EQ(ids.sampling.min_p, 0.2);
  EXPECT_EQ(ids.sampling.seed, 11u);
  EXPECT_DOUBLE_EQ(ids.sampling.repetition_penalty, 1.3);
  EXPECT_EQ(ids.sampling.min_tokens, 2);
  EXPECT_TRUE(ids.sampling.ignore_eos);
  EXPECT_EQ(ids.sampling.stop_token_ids, (std::vector<int32_t>{3, 4}));
  EXPECT_EQ(ids.stop, (std::vector<std::string>{"END"}));
  EXPECT_EQ(ids.n, 2);
  EXPECT_EQ(ids.logprobs, 3);
  EXPECT_EQ(ids.sampling.logprobs, 3);
  EXPECT_TRUE(ids.include_usage);
  const GenerationRequest flat = parse_generation_request(R"({"prompt": [1, 2, 3]})", Endpoint::kCompletions);
  EXPECT_EQ(std::get<std::vector<int32_t>>(flat.prompts[0]).size(), 3u);
  const GenerationRequest texts = parse_generation_request(R"({"prompt": ["a", "b", "c"]})", Endpoint::kCompletions);
  EXPECT_EQ(texts.prompts.size(), 3u);
}

TEST(OpenAiProtocol, InvalidFieldsNameThemselves) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"prompt": "x", "temperature": "hot"})", "temperature"},
      {R"({"prompt": "x", "temperature": -1})", "temperature"},
      {R"({"prompt": "x", "max_tokens": 0})", "max_tokens"},
      {R"({"prompt": "x", "max_tokens": 2.5})", "max_tokens"},
      {R"({"prompt": "x", "n": 0})", "n"},
      {R"({"prompt": "x", "n": true})", "n"},
      {R"({"prompt": "x", "stop": 3})", "stop"},
      {R"({"prompt": "x", "stop": [""]})", "stop"},
      {R"({"prompt": "x", "logprobs": 21})", "logprobs"},
      {R"({"prompt": "x", "stream_options": {"include_usage": true}})", "stream_options"},
      {R"({"prompt": "x", "logit_bias": {"5": 1}})", "logit_bias"},
      {R"({"prompt": "x", "stop_token_ids": [-1]})", "stop_token_ids"},
      {R"({"prompt": "x", "echo": true, "logprobs": 1})", "echo"},
      {R"({"prompt": [1, "a"]})", "prompt"},
      {R"({"prompt": []})", "prompt"},
      {R"({"prompt": 5})", "prompt"},
      {R"({"max_tokens": 5})", "prompt"},
  };
  for (const auto& [body, param] : cases) {
    const ApiError error = parse_error(body);
    EXPECT_EQ(error.status(), 400) << body;
    EXPECT_EQ(error.param(), param) << body << ": " << error.what();
    EXPECT_NE(std::string(error.what()).find(param), std::string::npos) << error.what();
  }
  // The engine's own bounds, with its message.
  EXPECT_NE(std::string(parse_error(R"({"prompt": "x", "top_p": 0})").what()).find("top_p"), std::string::npos);
  EXPECT_NE(std::string(parse_error(R"({"prompt": "x", "min_p": 2})").what()).find("min_p"), std::string::npos);
  // Not JSON, not an object.
  EXPECT_NE(std::string(parse_error(R"({"prompt": )").what()).find("invalid JSON"), std::string::npos);
  EXPECT_NE(std::string(parse_error("[1, 2]").what()).find("JSON object"), std::string::npos);
  // A number literal past double's range is nlohmann's out_of_range, not a parse_error (found by the fuzzer).
  EXPECT_NE(std::string(parse_error(R"({"prompt": "x", "temperature": 1e999})").what()).find("invalid JSON"),
            std::string::npos);
  EXPECT_EQ(parse_error("2222222220000000E00200000000E0000").status(), 400);
}

TEST(OpenAiProtocol, ChatMessagesOptionsAndTheirErrors) {
  const GenerationRequest chat = parse_generation_request(
      R"({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
          "max_completion_tokens": 7, "logprobs": true, "top_logprobs": 2, "reasoning_effort": "max",
          "chat_template_kwargs": {"thinking": true}, "tool_choice": "auto",
          "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]})",
      Endpoint::kChatCompletions);
  EXPECT_EQ(chat.messages[0]["content"], "a\nb");
  EXPECT_EQ(chat.max_tokens, 7);
  EXPECT_EQ(chat.logprobs, 2);
  EXPECT_EQ(chat.chat.thinking_mode, ThinkingMode::kThinking);
  EXPECT_EQ(chat.chat.reasoning_effort, ReasoningEffort::kMax);
  EXPECT_TRUE(chat.chat.tools.is_array());
  const GenerationRequest plain = parse_generation_request(R"({"messages": [{"role": "user", "content": "hi"}],
      "logprobs": true, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"})",
                                                           Endpoint::kChatCompletions);
  EXPECT_EQ(plain.chat.thinking_mode, ThinkingMode::kChat);
  EXPECT_EQ(plain.logprobs, 0);
  EXPECT_TRUE(plain.chat.tools.is_null());

  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"messages": []})", "messages"},
      {R"({"messages": "hi"})", "messages"},
      {R"({"messages": [3]})", "messages[0]"},
      {R"({"messages": [{"content": "x"}]})", "messages[0].role"},
      {R"({"messages": [{"role": "user", "content": 5}]})", "messages[0].content"},
      {R"({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})",
       "messages[0].content[0]"},
      {R"({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})", "top_logprobs"},
      {R"({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "extreme"})", "reasoning_effort"},
      {R"({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"})", "tool_choice"},
      {R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]})", "tools"},
      {R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}})",
       "response_format"},
      {R"({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -3})", "max_completion_tokens"},
  };
  for (const auto& [body, param] : cases) {
    const ApiError error = parse_error(body, Endpoint::kChatCompletions);
    EXPECT_EQ(error.status(), 400) << body;
    EXPECT_EQ(error.param(), param) << body << ": " << error.what();
  }
}

TEST(OpenAiProtocol, TokenizeAndDetokenizeBodies) {
  EXPECT_EQ(parse_tokenize_request(R"({"prompt": "hi", "add_special_tokens": false})").prompt, "hi");
  EXPECT_FALSE(parse_tokenize_request(R"({"prompt": "hi", "add_special_tokens": false})").add_special_tokens);
  EXPECT_TRUE(parse_tokenize_request(R"({"messages": [{"role": "user", "content": "x"}]})").messages.is_array());
  EXPECT_THROW(parse_tokenize_request(R"({})"), ApiError);
  EXPECT_THROW(parse_tokenize_request(R"({"prompt": "a", "messages": [{"role": "user", "content": "x"}]})"),
               ApiError);
  EXPECT_EQ(parse_detokenize_request(R"({"tokens": [1, 2]})"), (std::vector<int32_t>{1, 2}));
  EXPECT_THROW(parse_detokenize_request(R"({"tokens": "12"})"), ApiError);
}

TEST(OpenAiProtocol, ErrorBodyIsOpenAisShape) {
  const auto body = nlohmann::json::parse(error_body(404, "The model `x` does not exist.", "model"));
  EXPECT_EQ(body["error"]["message"], "The model `x` does not exist.");
  EXPECT_EQ(body["error"]["type"], "NotFoundError");
  EXPECT_EQ(body["error"]["param"], "model");
  EXPECT_EQ(body["error"]["code"], 404);
  // Invalid UTF-8 in a message (a client's bytes echoed back) still yields valid JSON.
  EXPECT_NO_THROW(nlohmann::json::parse(error_body(400, "bad \xff byte")));
}

// Every way of cutting "reasoning</think>answer" (and random text around it) into deltas splits it the same.
TEST(OpenAiProtocol, ReasoningSplitterOnEveryCut) {
  std::mt19937 rng(7);
  const std::string alphabet = "ab</think>< /thin";
  for (int trial = 0; trial < 200; ++trial) {
    std::string reasoning, answer;
    for (int i = 0, n = static_cast<int>(rng() % 12); i < n; ++i) reasoning += alphabet[rng() % alphabet.size()];
    for (int i = 0, n = static_cast<int>(rng() % 12); i < n; ++i) answer += alphabet[rng() % alphabet.size()];
    const bool has_marker = rng() % 4 != 0;
    const std::string text = has_marker ? reasoning + "</think>" + answer : reasoning;
    const size_t marker = text.find("</think>");
    const std::string want_reasoning = marker == std::string::npos ? text : text.substr(0, marker);
    const std::string want_content = marker == std::string::npos ? "" : text.substr(marker + 8);
    ReasoningSplitter splitter;
    std::string got_reasoning, got_content;
    for (size_t at = 0; at < text.size();) {
      const size_t length = 1 + rng() % 4;
      const auto parts = splitter.push(std::string_view(text).substr(at, length));
      got_reasoning += parts.reasoning;
      got_content += parts.content;
      at += length;
    }
    got_reasoning += splitter.flush().reasoning;
    EXPECT_EQ(got_reasoning, want_reasoning) << text;
    EXPECT_EQ(got_content, want_content) << text;
  }
}

}  // namespace
}  // namespace dsv4::server
