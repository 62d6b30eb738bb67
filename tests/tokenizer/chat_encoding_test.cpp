// DeepSeek-V4 chat encoding against the reference encoder's own test cases (encoding/tests/test_input_N.json
// -> test_output_N.txt of the V4 model repository, in tests/fixtures/chat/ with their provenance), plus
// hand-derived cases for the features those four cases do not reach.
#include "tokenizer/chat_encoding.h"

#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>

#include "core/error.h"

namespace dsv4 {
namespace {

using ojson = nlohmann::ordered_json;

const std::string kChatFixtures = std::string(DSV4_FIXTURES) + "/chat";

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << path;
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

ChatEncodingOptions thinking() {
  ChatEncodingOptions o;
  o.thinking_mode = ThinkingMode::kThinking;
  return o;
}

// Reference case 3: interleaved thinking + search (system, latest_reminder, developer with tools, assistant
// tool call, tool result, final assistant), thinking mode.
TEST(ChatEncodingReference, Case3InterleavedThinkingSearch) {
  const std::string input = read_file(kChatFixtures + "/test_input_3.json");
  const std::string gold = read_file(kChatFixtures + "/test_output_3.txt");
  EXPECT_EQ(encode_messages_json(input, thinking()), gold);
}

// Reference case 4: quick instruction task (action) in chat mode, with latest_reminder and a long answer.
TEST(ChatEncodingReference, Case4QuickInstructionTask) {
  const std::string input = read_file(kChatFixtures + "/test_input_4.json");
  const std::string gold = read_file(kChatFixtures + "/test_output_4.txt");
  EXPECT_EQ(encode_messages_json(input, {}), gold);
}

// Reference case 1: thinking with tools (tools attached to the first message, as the reference test does);
// the assistant's reasoning and its DSML tool call, the tool result merged into a user turn, the final answer.
TEST(ChatEncodingReference, Case1ThinkingWithTools) {
  const ojson input = ojson::parse(read_file(kChatFixtures + "/test_input_1.json"));
  ojson messages = input.at("messages");
  messages[0]["tools"] = input.at("tools");
  EXPECT_EQ(encode_messages(messages, thinking()), read_file(kChatFixtures + "/test_output_1.txt"));
}

// Reference case 2: thinking without tools; the reasoning of turns before the last user message is dropped.
TEST(ChatEncodingReference, Case2DropThinking) {
  const std::string input = read_file(kChatFixtures + "/test_input_2.json");
  const std::string got = encode_messages_json(input, thinking());
  EXPECT_EQ(got, read_file(kChatFixtures + "/test_output_2.txt"));
  EXPECT_EQ(got.find("The user said hello"), std::string::npos);

  ChatEncodingOptions keep = thinking();
  keep.drop_thinking = false;
  EXPECT_NE(encode_messages_json(input, keep).find("<think>The user said hello, I should greet back.</think>"),
            std::string::npos);
}

TEST(ChatEncoding, GenerationPromptChatAndThinking) {
  const ojson messages =
      ojson::parse(R"([{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}])");
  EXPECT_EQ(encode_messages(messages), "<｜begin▁of▁sentence｜>S<｜User｜>Q<｜Assistant｜></think>");
  EXPECT_EQ(encode_messages(messages, thinking()),
            "<｜begin▁of▁sentence｜>S<｜User｜>Q<｜Assistant｜><think>");
  ChatEncodingOptions no_bos;
  no_bos.add_bos = false;
  EXPECT_EQ(encode_messages(messages, no_bos), "S<｜User｜>Q<｜Assistant｜></think>");
}

TEST(ChatEncoding, ReasoningEffortMaxOnlyInThinkingMode) {
  const ojson messages = ojson::parse(R"([{"role": "user", "content": "Q"}])");
  ChatEncodingOptions o = thinking();
  o.reasoning_effort = ReasoningEffort::kMax;
  const std::string got = encode_messages(messages, o);
  EXPECT_EQ(
      got.rfind("<｜begin▁of▁sentence｜>Reasoning Effort: Absolute maximum with no shortcuts permitted.\n",
                0),
      0u);
  EXPECT_NE(got.find("left unchecked.\n\n<｜User｜>Q<｜Assistant｜><think>"), std::string::npos);
  o.reasoning_effort = ReasoningEffort::kHigh;
  EXPECT_EQ(encode_messages(messages, o), "<｜begin▁of▁sentence｜><｜User｜>Q<｜Assistant｜><think>");
  o.thinking_mode = ThinkingMode::kChat;
  o.reasoning_effort = ReasoningEffort::kMax;
  EXPECT_EQ(encode_messages(messages, o), "<｜begin▁of▁sentence｜><｜User｜>Q<｜Assistant｜></think>");
}

TEST(ChatEncoding, ToolResultsMergedAndSortedByCallOrder) {
  const ojson messages = ojson::parse(R"([
    {"role": "user", "content": "Q"},
    {"role": "assistant", "content": null, "tool_calls": [
      {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{\"n\": 1, \"s\": [1, \"x\"]}"}},
      {"id": "b", "type": "function", "function": {"name": "g", "arguments": "not json"}}]},
    {"role": "tool", "tool_call_id": "b", "content": "B"},
    {"role": "tool", "tool_call_id": "a", "content": [{"type": "text", "text": "A1"}, {"type": "image"}]},
    {"role": "user", "content": "more"}
  ])");
  EXPECT_EQ(
      encode_messages(messages),
      "<｜begin▁of▁sentence｜><｜User｜>Q<｜Assistant｜></think>\n\n<｜DSML｜tool_calls>\n"
      "<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"n\" string=\"false\">1</｜DSML｜parameter>\n"
      "<｜DSML｜parameter name=\"s\" string=\"false\">[1, \"x\"]</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
      "<｜DSML｜invoke name=\"g\">\n<｜DSML｜parameter name=\"arguments\" string=\"true\">not "
      "json</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>"
      "<｜User｜><tool_result>A1\n\n[Unsupported image]</tool_result>\n\n<tool_result>B</tool_result>\n\nmore"
      "<｜Assistant｜></think>");
}

TEST(ChatEncoding, ContextIsNotRenderedAndSuppressesBos) {
  const ojson context = ojson::parse(R"([{"role": "user", "content": "Q1"},
    {"role": "assistant", "content": "A1", "reasoning_content": "R1"}])");
  const ojson messages = ojson::parse(R"([{"role": "user", "content": "Q2"}])");
  ChatEncodingOptions o = thinking();
  o.context = context;
  EXPECT_EQ(encode_messages(messages, o), "<｜User｜>Q2<｜Assistant｜><think>");
  // The full conversation is the context's encoding (as it was then) followed by this.
  ojson all = context;
  all.push_back(messages[0]);
  EXPECT_EQ(encode_messages(all, thinking()),
            "<｜begin▁of▁sentence｜><｜User｜>Q1<｜Assistant｜></"
            "think>A1<｜end▁of▁sentence｜><｜User｜>Q2<｜Assistant｜><think>");
}

TEST(ChatEncoding, WoEosResponseFormatDeveloperAndTasks) {
  ojson messages = ojson::parse(R"([
    {"role": "system", "content": "S", "response_format": {"type": "json_object", "b": 1, "a": "é"}},
    {"role": "user", "content": "Q"},
    {"role": "assistant", "content": "partial", "wo_eos": true}
  ])");
  EXPECT_EQ(
      encode_messages(messages),
      "<｜begin▁of▁sentence｜>S\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema "
      "to "
      "reply:\n{\"type\": \"json_object\", \"b\": 1, \"a\": \"é\"}<｜User｜>Q<｜Assistant｜></think>partial");
  const ojson titled = ojson::parse(R"([{"role": "user", "content": "Q", "task": "title"}])");
  EXPECT_EQ(encode_messages(titled), "<｜begin▁of▁sentence｜><｜User｜>Q<｜title｜>");
  const ojson action = ojson::parse(R"([{"role": "user", "content": "Q", "task": "action"}])");
  EXPECT_EQ(encode_messages(action, thinking()),
            "<｜begin▁of▁sentence｜><｜User｜>Q<｜Assistant｜><think><｜action｜>");
  const ojson dev = ojson::parse(R"([{"role": "developer", "content": "D"}])");
  EXPECT_EQ(encode_messages(dev), "<｜begin▁of▁sentence｜><｜User｜>D<｜Assistant｜></think>");
  // Consecutive user messages share one turn.
  const ojson two = ojson::parse(R"([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])");
  EXPECT_EQ(encode_messages(two), "<｜begin▁of▁sentence｜><｜User｜>a\n\nb<｜Assistant｜></think>");
}

TEST(ChatEncoding, ErrorsNameTheMessage) {
  const auto fails = [](const char* text, const std::string& needle) {
    try {
      encode_messages_json(text);
      ADD_FAILURE() << "no error for " << text;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  fails(R"([{"role": "robot", "content": "x"}])", "unsupported role 'robot'");
  fails(R"([{"role": "developer", "content": ""}])", "message 0 field 'content'");
  fails(R"([{"role": "user", "content": "x", "task": "dance"}])", "unknown task 'dance'");
  fails(R"([{"content": "x"}])", "field 'role'");
  fails(R"({"role": "user"})", "must be a JSON array");
  fails("[", "not valid JSON");
}

TEST(ChatEncoding, PythonJsonDumps) {
  EXPECT_EQ(python_json_dumps(ojson::parse(R"({"z": [1, 2.5, true, null], "a": "\"é\n"})")),
            R"({"z": [1, 2.5, true, null], "a": "\"é\n"})");
  EXPECT_EQ(python_json_dumps(ojson::object()), "{}");
  EXPECT_EQ(python_json_dumps(ojson::array()), "[]");
}

}  // namespace
}  // namespace dsv4
