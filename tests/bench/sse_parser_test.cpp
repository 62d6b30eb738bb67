#include "bench/sse_parser.h"

#include <gtest/gtest.h>

#include <random>

#include "bench/openai_stream.h"
#include "core/error.h"

namespace dsv4::bench {
namespace {

std::vector<SseEvent> parse_in_pieces(std::string_view stream, const std::vector<size_t>& cuts) {
  SseParser parser;
  std::vector<SseEvent> events;
  size_t from = 0;
  for (const size_t cut : cuts) {
    parser.feed(stream.substr(from, cut - from), events);
    from = cut;
  }
  parser.feed(stream.substr(from), events);
  return events;
}

// Every line ending the spec allows, comments, multi-line data, "data:" with and without the space, a field
// without a colon, an event type and id, a BOM, and a last event that never gets its blank line.
constexpr std::string_view kStream =
    "\xEF\xBB\xBF: keep-alive comment\r\n"
    "data: {\"choices\":[{\"text\":\"Hel\"}]}\r\n\r\n"
    "data:lo\n"
    "data:  two spaces keep one\n\n"
    "event: update\rid: 7\rdata: typed\r\r"
    "data\n\n"
    "retry: 100\nunknown: x\n\n"
    "event: orphan\n\n"
    "data: [DONE]\r\n\r\n"
    "data: unterminated";

const std::vector<SseEvent> kExpected = {
    {"", "{\"choices\":[{\"text\":\"Hel\"}]}", ""},
    {"", "lo\n two spaces keep one", ""},
    {"update", "typed", "7"},
    {"", "", "7"},  // "data" with no colon is a data line with an empty value; the id persists
    {"", "[DONE]", "7"},
};

TEST(SseParser, ParsesEveryLineEndingCommentsAndFields) {
  EXPECT_EQ(parse_in_pieces(kStream, {}), kExpected);
}

TEST(SseParser, SameEventsForASplitAtEveryByte) {
  for (size_t cut = 0; cut <= kStream.size(); ++cut)
    ASSERT_EQ(parse_in_pieces(kStream, {cut}), kExpected) << "split at byte " << cut;
}

TEST(SseParser, SameEventsForRandomChunkings) {
  std::mt19937 rng(1234);
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<size_t> cuts;
    for (size_t at = 0;;) {
      at += 1 + rng() % 7;
      if (at >= kStream.size()) break;
      cuts.push_back(at);
    }
    ASSERT_EQ(parse_in_pieces(kStream, cuts), kExpected) << "trial " << trial;
  }
}

TEST(SseParser, ByteAtATimeKeepsCrLfTogether) {
  // "\r" then "\n" in separate feeds is one line ending, not an empty line that would dispatch early.
  const std::string stream = "data: a\r\ndata: b\r\n\r\n";
  std::vector<size_t> cuts;
  for (size_t i = 1; i < stream.size(); ++i) cuts.push_back(i);
  const std::vector<SseEvent> expected = {{"", "a\nb", ""}};
  EXPECT_EQ(parse_in_pieces(stream, cuts), expected);
}

TEST(SseParser, OversizedEventThrows) {
  SseParser parser(64);
  std::vector<SseEvent> events;
  parser.feed("data: " + std::string(40, 'x') + "\n", events);
  EXPECT_THROW(parser.feed("data: " + std::string(40, 'y'), events), Error);
  SseParser endless(64);
  EXPECT_THROW(endless.feed(std::string(100, 'z'), events), Error);  // a line that never ends
}

TEST(OpenAiStream, CompletionsChunkIsATokenEvent) {
  const StreamPayload p = decode_stream_payload(
      R"({"id":"c1","object":"text_completion","choices":[{"index":0,"text":" world","finish_reason":null}]})",
      ApiKind::kCompletions);
  EXPECT_FALSE(p.error);
  EXPECT_TRUE(p.is_token_event());
  EXPECT_EQ(p.text, " world");
  EXPECT_FALSE(p.completion_tokens);
  EXPECT_FALSE(p.done);
}

TEST(OpenAiStream, ChatDeltaContentAndReasoningCountRoleChunkDoesNot) {
  const StreamPayload role =
      decode_stream_payload(R"({"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]})",
                            ApiKind::kChatCompletions);
  EXPECT_FALSE(role.error);
  EXPECT_FALSE(role.is_token_event());
  EXPECT_EQ(decode_stream_payload(R"({"choices":[{"delta":{"content":"hi"}}]})", ApiKind::kChatCompletions).text,
            "hi");
  EXPECT_EQ(decode_stream_payload(R"({"choices":[{"delta":{"reasoning_content":"hm"}}]})",
                                  ApiKind::kChatCompletions)
                .text,
            "hm");
  // A completions chunk read as chat (or the reverse) carries no text: the endpoint decides the shape.
  EXPECT_FALSE(decode_stream_payload(R"({"choices":[{"text":"x"}]})", ApiKind::kChatCompletions).is_token_event());
}

TEST(OpenAiStream, UsageDoneAndErrors) {
  const StreamPayload usage = decode_stream_payload(
      R"({"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":17,"total_tokens":22}})", ApiKind::kCompletions);
  EXPECT_FALSE(usage.error);
  EXPECT_FALSE(usage.is_token_event());
  EXPECT_EQ(usage.completion_tokens, 17);
  EXPECT_FALSE(decode_stream_payload(R"({"choices":[{"text":"a"}],"usage":null})", ApiKind::kCompletions)
                   .completion_tokens);
  EXPECT_TRUE(decode_stream_payload("[DONE]", ApiKind::kCompletions).done);

  const StreamPayload server_error =
      decode_stream_payload(R"({"error":{"message":"out of memory","code":500}})", ApiKind::kCompletions);
  ASSERT_TRUE(server_error.error);
  EXPECT_NE(server_error.error->find("out of memory"), std::string::npos);
  for (const char* bad : {"{\"choices\": [", "42", "\"text\"", R"({"choices":{"text":"a"}})", ""}) {
    const StreamPayload p = decode_stream_payload(bad, ApiKind::kCompletions);
    EXPECT_TRUE(p.error) << bad;
  }
}

TEST(OpenAiStream, ApiKindFollowsTheEndpointPath) {
  EXPECT_EQ(api_kind_of_endpoint("/v1/chat/completions"), ApiKind::kChatCompletions);
  EXPECT_EQ(api_kind_of_endpoint("/v1/chat/completions/"), ApiKind::kChatCompletions);
  EXPECT_EQ(api_kind_of_endpoint("/v1/completions"), ApiKind::kCompletions);
}

}  // namespace
}  // namespace dsv4::bench
