#include "tokenizer/chat_encoding.h"

#include <algorithm>
#include <limits>
#include <optional>
#include <unordered_map>
#include <vector>

#include "core/error.h"

namespace dsv4 {
namespace {

using ojson = nlohmann::ordered_json;

constexpr std::string_view kBos = "<｜begin▁of▁sentence｜>";
constexpr std::string_view kEos = "<｜end▁of▁sentence｜>";
constexpr std::string_view kThinkStart = "<think>";
constexpr std::string_view kThinkEnd = "</think>";
constexpr std::string_view kUser = "<｜User｜>";
constexpr std::string_view kAssistant = "<｜Assistant｜>";
constexpr std::string_view kLatestReminder = "<｜latest_reminder｜>";
constexpr std::string_view kDsml = "｜DSML｜";

constexpr std::string_view kEffortMax =
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the "
    "root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n";

// The tools section appended to a system / developer message; the schemas go between the two halves.
constexpr std::string_view kToolsHead =
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
    "\"<｜DSML｜tool_calls>\" block like the following:\n\n"
    "<｜DSML｜tool_calls>\n"
    "<｜DSML｜invoke name=\"$TOOL_NAME\">\n"
    "<｜DSML｜parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</｜DSML｜parameter>\n"
    "...\n"
    "</｜DSML｜invoke>\n"
    "<｜DSML｜invoke name=\"$TOOL_NAME2\">\n"
    "...\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>\n\n"
    "String parameters should be specified as is and set `string=\"true\"`. For all other types (numbers, "
    "booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\n"
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n";
constexpr std::string_view kToolsTail =
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n";

constexpr std::string_view kResponseFormatHead =
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n";

// Task -> special token; "action" also opens the assistant turn.
std::optional<std::string_view> task_token(std::string_view task) {
  if (task == "action") return "<｜action｜>";
  if (task == "query") return "<｜query｜>";
  if (task == "authority") return "<｜authority｜>";
  if (task == "domain") return "<｜domain｜>";
  if (task == "title") return "<｜title｜>";
  if (task == "read_url") return "<｜read_url｜>";
  return std::nullopt;
}

struct Block {
  enum class Kind { kText, kToolResult };
  Kind kind = Kind::kText;
  std::string text;         // the text, or the tool result's content flattened to text
  std::string tool_use_id;  // tool results only
};

// One message after tool merging. Fields mirror the OpenAI message; null JSON means absent.
struct Message {
  std::string role;
  std::optional<std::string> content;
  bool has_blocks = false;  // user messages after merging: rendered from `blocks`
  std::vector<Block> blocks;
  ojson tools;  // the `function` objects of the OpenAI tools, or null
  ojson response_format;
  ojson tool_calls;  // OpenAI tool_calls array, or null
  std::optional<std::string> reasoning;
  bool wo_eos = false;
  std::optional<std::string> task;
  size_t source = 0;  // index in the caller's array, for error messages
};

std::string where(size_t index, std::string_view field) {
  return "chat_encoding: message " + std::to_string(index) + " field '" + std::string(field) + "'";
}

// JSON "truthiness" the reference relies on (`if tools:`): null, empty containers/strings, false, 0 are
// false.
bool truthy(const ojson& v) {
  if (v.is_null()) return false;
  if (v.is_array() || v.is_object() || v.is_string())
    return !v.empty() && !(v.is_string() && v.get_ref<const std::string&>().empty());
  if (v.is_boolean()) return v.get<bool>();
  if (v.is_number()) return v != 0;
  return true;
}

// Text of a `content` field: a string, null (absent), or OpenAI content parts of type "text" (concatenated).
std::optional<std::string> content_text(const ojson& msg, size_t index) {
  const auto it = msg.find("content");
  if (it == msg.end() || it->is_null()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_array()) {
    std::string out;
    for (const ojson& part : *it) {
      if (!part.is_object() || part.value("type", std::string()) != "text")
        throw Error(where(index, "content") + ": only content parts of type \"text\" are supported, got " +
                    python_json_dumps(part));
      const auto text = part.find("text");
      if (text != part.end() && text->is_string()) out += text->get<std::string>();
    }
    return out;
  }
  throw Error(where(index, "content") + ": expected a string, null or content parts, got " +
              python_json_dumps(*it));
}

std::optional<std::string> optional_string(const ojson& msg, std::string_view key, size_t index) {
  const auto it = msg.find(key);
  if (it == msg.end() || it->is_null()) return std::nullopt;
  if (!it->is_string()) throw Error(where(index, key) + ": expected a string, got " + python_json_dumps(*it));
  return it->get<std::string>();
}

// A tool message's content: a string, or blocks whose text parts are kept and others marked unsupported.
std::string tool_result_text(const ojson& msg, size_t index) {
  const auto it = msg.find("content");
  if (it == msg.end() || it->is_null()) return {};
  if (it->is_string()) return it->get<std::string>();
  if (it->is_array()) {
    std::string out;
    for (size_t i = 0; i < it->size(); ++i) {
      const ojson& b = (*it)[i];
      if (i > 0) out += "\n\n";
      const std::string type = b.is_object() ? b.value("type", std::string()) : std::string();
      if (type == "text")
        out += b.value("text", std::string());
      else
        out += "[Unsupported " + (type.empty() ? std::string("None") : type) + "]";
    }
    return out;
  }
  return python_json_dumps(*it);
}

Message parse_message(const ojson& msg, size_t index) {
  if (!msg.is_object()) throw Error("chat_encoding: message " + std::to_string(index) + " is not an object");
  Message m;
  m.source = index;
  const auto role = msg.find("role");
  if (role == msg.end() || !role->is_string())
    throw Error(where(index, "role") + ": missing or not a string");
  m.role = role->get<std::string>();
  if (m.role != "tool") m.content = content_text(msg, index);  // tool content: tool_result_text()
  if (const auto t = msg.find("tools"); t != msg.end() && truthy(*t)) {
    if (!t->is_array()) throw Error(where(index, "tools") + ": expected an array");
    m.tools = ojson::array();
    for (const ojson& tool : *t) {
      if (!tool.is_object() || !tool.contains("function"))
        throw Error(where(index, "tools") + ": expected {\"type\":\"function\",\"function\":{...}}, got " +
                    python_json_dumps(tool));
      m.tools.push_back(tool.at("function"));
    }
  }
  if (const auto rf = msg.find("response_format"); rf != msg.end()) m.response_format = *rf;
  if (const auto tc = msg.find("tool_calls"); tc != msg.end()) m.tool_calls = *tc;
  m.reasoning = optional_string(msg, "reasoning_content", index);
  if (const auto w = msg.find("wo_eos"); w != msg.end()) m.wo_eos = truthy(*w);
  m.task = optional_string(msg, "task", index);
  return m;
}

// Tool messages become <tool_result> blocks of a user turn; consecutive user/tool messages share one turn
// (a user message does not join a turn that carries a task). User messages keep only content, task, wo_eos.
std::vector<Message> merge_tool_messages(const ojson& messages, size_t first_index) {
  std::vector<Message> merged;
  for (size_t i = 0; i < messages.size(); ++i) {
    const ojson& msg = messages[i];
    const size_t index = first_index + i;
    const Message m = parse_message(msg, index);
    const bool join = !merged.empty() && merged.back().role == "user" && merged.back().has_blocks;
    if (m.role == "tool") {
      Block block{Block::Kind::kToolResult, tool_result_text(msg, index), {}};
      if (const auto id = msg.find("tool_call_id"); id != msg.end() && id->is_string())
        block.tool_use_id = *id;
      if (join) {
        merged.back().blocks.push_back(std::move(block));
      } else {
        Message user;
        user.role = "user";
        user.has_blocks = true;
        user.blocks.push_back(std::move(block));
        user.source = index;
        merged.push_back(std::move(user));
      }
    } else if (m.role == "user") {
      Block block{Block::Kind::kText, m.content.value_or(""), {}};
      if (join && !merged.back().task) {
        merged.back().blocks.push_back(std::move(block));
      } else {
        Message user;
        user.role = "user";
        user.content = m.content;
        user.has_blocks = true;
        user.blocks.push_back(std::move(block));
        user.task = m.task;
        user.wo_eos = m.wo_eos;
        user.source = index;
        merged.push_back(std::move(user));
      }
    } else {
      merged.push_back(m);
    }
  }
  return merged;
}

// Reorders the tool_result blocks of each user turn into the order of the latest assistant tool_calls (by
// id; unknown ids sort as position 0; stable), leaving the other blocks where they are.
void sort_tool_results(std::vector<Message*>& messages) {
  std::unordered_map<std::string, size_t> order;
  for (Message* m : messages) {
    if (m->role == "assistant" && truthy(m->tool_calls) && m->tool_calls.is_array()) {
      order.clear();
      for (size_t i = 0; i < m->tool_calls.size(); ++i) {
        const ojson& tc = m->tool_calls[i];
        std::string id;
        if (tc.is_object()) {
          if (const auto it = tc.find("id"); it != tc.end() && it->is_string()) id = *it;
          if (id.empty())
            if (const auto f = tc.find("function"); f != tc.end() && f->is_object())
              if (const auto it = f->find("id"); it != f->end() && it->is_string()) id = *it;
        }
        if (!id.empty()) order[id] = i;
      }
    } else if (m->role == "user" && m->has_blocks) {
      std::vector<Block> results;
      for (const Block& b : m->blocks)
        if (b.kind == Block::Kind::kToolResult) results.push_back(b);
      if (results.size() < 2 || order.empty()) continue;
      std::stable_sort(results.begin(), results.end(), [&](const Block& a, const Block& b) {
        const auto rank = [&](const Block& x) {
          const auto it = order.find(x.tool_use_id);
          return it == order.end() ? size_t{0} : it->second;
        };
        return rank(a) < rank(b);
      });
      size_t next = 0;
      for (Block& b : m->blocks)
        if (b.kind == Block::Kind::kToolResult) b = results[next++];
    }
  }
}

int last_user_index(const std::vector<Message>& messages) {
  for (int i = static_cast<int>(messages.size()) - 1; i >= 0; --i)
    if (messages[i].role == "user" || messages[i].role == "developer") return i;
  return -1;
}

// Before the last user/developer message: assistant turns lose their reasoning, developer messages (and any
// role other than user, system, tool, latest_reminder, direct_search_results) are dropped.
std::vector<Message> drop_thinking_messages(const std::vector<Message>& messages) {
  const int last_user = last_user_index(messages);
  std::vector<Message> out;
  for (int i = 0; i < static_cast<int>(messages.size()); ++i) {
    const Message& m = messages[i];
    const bool keep = m.role == "user" || m.role == "system" || m.role == "tool" ||
                      m.role == "latest_reminder" || m.role == "direct_search_results";
    if (keep || i >= last_user) {
      out.push_back(m);
    } else if (m.role == "assistant") {
      out.push_back(m);
      out.back().reasoning.reset();
    }
  }
  return out;
}

std::string render_tools(const ojson& functions) {
  std::string out(kToolsHead);
  for (size_t i = 0; i < functions.size(); ++i) {
    if (i > 0) out += '\n';
    out += python_json_dumps(functions[i]);
  }
  out += kToolsTail;
  return out;
}

// `arguments` (a JSON string; an object is accepted as is) as DSML parameters, one per line.
std::string dsml_arguments(const ojson& arguments, size_t index) {
  ojson args;
  if (arguments.is_object()) {
    args = arguments;
  } else {
    const std::string text =
        arguments.is_string() ? arguments.get<std::string>() : python_json_dumps(arguments);
    try {
      args = ojson::parse(text);
    } catch (const ojson::exception&) {
      args = ojson::object({{"arguments", text}});
    }
    if (!args.is_object())
      throw Error(where(index, "tool_calls.function.arguments") + ": expected a JSON object, got " + text);
  }
  std::string out;
  bool first = true;
  for (const auto& [key, value] : args.items()) {
    if (!first) out += '\n';
    first = false;
    const bool is_str = value.is_string();
    out.append("<").append(kDsml).append("parameter name=\"").append(key);
    out.append("\" string=\"").append(is_str ? "true" : "false").append("\">");
    out.append(is_str ? value.get<std::string>() : python_json_dumps(value));
    out.append("</").append(kDsml).append("parameter>");
  }
  return out;
}

std::string render_tool_calls(const ojson& tool_calls, size_t index) {
  if (!tool_calls.is_array()) throw Error(where(index, "tool_calls") + ": expected an array");
  std::string invokes;
  for (size_t i = 0; i < tool_calls.size(); ++i) {
    const ojson& tc = tool_calls[i];
    if (!tc.is_object() || !tc.contains("function") || !tc.at("function").is_object())
      throw Error(where(index, "tool_calls") + ": expected {\"function\":{\"name\",\"arguments\"}}, got " +
                  python_json_dumps(tc));
    const ojson& f = tc.at("function");
    const auto name = f.find("name");
    if (name == f.end() || !name->is_string())
      throw Error(where(index, "tool_calls.function.name") + ": missing or not a string");
    const auto arguments = f.find("arguments");
    if (i > 0) invokes += '\n';
    invokes.append("<")
        .append(kDsml)
        .append("invoke name=\"")
        .append(name->get<std::string>())
        .append("\">\n");
    invokes.append(dsml_arguments(arguments == f.end() ? ojson("{}") : *arguments, index));
    invokes.append("\n</").append(kDsml).append("invoke>");
  }
  std::string out("\n\n<");
  out.append(kDsml)
      .append("tool_calls>\n")
      .append(invokes)
      .append("\n</")
      .append(kDsml)
      .append("tool_calls>");
  return out;
}

std::string render_message(size_t index, const std::vector<Message>& messages, ThinkingMode mode,
                           bool drop_thinking, ReasoningEffort effort) {
  const Message& m = messages[index];
  const bool thinking = mode == ThinkingMode::kThinking;
  const int last_user = last_user_index(messages);
  std::string out;
  if (index == 0 && thinking && effort == ReasoningEffort::kMax) out += kEffortMax;

  const auto append_extras = [&] {
    if (truthy(m.tools)) out += "\n\n" + render_tools(m.tools);
    if (truthy(m.response_format))
      out += "\n\n" + std::string(kResponseFormatHead) + python_json_dumps(m.response_format);
  };

  if (m.role == "system") {
    out += m.content.value_or("");
    append_extras();
  } else if (m.role == "developer") {
    if (!m.content || m.content->empty())
      throw Error(where(m.source, "content") + ": empty for role developer");
    out += kUser;
    out += *m.content;
    append_extras();
  } else if (m.role == "user") {
    out += kUser;
    if (m.has_blocks && !m.blocks.empty()) {
      for (size_t i = 0; i < m.blocks.size(); ++i) {
        if (i > 0) out += "\n\n";
        const Block& b = m.blocks[i];
        switch (b.kind) {
          case Block::Kind::kText:
            out += b.text;
            break;
          case Block::Kind::kToolResult:
            out += "<tool_result>" + b.text + "</tool_result>";
            break;
        }
      }
    } else {
      out += m.content.value_or("");
    }
  } else if (m.role == "latest_reminder") {
    out += kLatestReminder;
    out += m.content.value_or("");
  } else if (m.role == "assistant") {
    const bool prev_has_task = index > 0 && messages[index - 1].task.has_value();
    if (thinking && !prev_has_task && (!drop_thinking || static_cast<int>(index) > last_user)) {
      out += m.reasoning.value_or("");
      out += kThinkEnd;
    }
    out += m.content.value_or("");
    if (truthy(m.tool_calls)) out += render_tool_calls(m.tool_calls, m.source);
    if (!m.wo_eos) out += kEos;
  } else {
    throw Error(where(m.source, "role") + ": unsupported role '" + m.role + "'");
  }

  // The transition into the next turn: only before an assistant / latest_reminder message or at the end.
  if (index + 1 < messages.size() && messages[index + 1].role != "assistant" &&
      messages[index + 1].role != "latest_reminder")
    return out;
  if (m.task) {
    const auto token = task_token(*m.task);
    if (!token)
      throw Error(where(m.source, "task") + ": unknown task '" + *m.task +
                  "' (action, query, authority, domain, title, read_url)");
    if (*m.task == "action") {
      out += kAssistant;
      out += thinking ? kThinkStart : kThinkEnd;
    }
    out += *token;
  } else if (m.role == "user" || m.role == "developer") {
    out += kAssistant;
    out += thinking && (!drop_thinking || static_cast<int>(index) >= last_user) ? kThinkStart : kThinkEnd;
  }
  return out;
}

void dump_python(const ojson& v, std::string& out) {
  if (v.is_object()) {
    out += '{';
    bool first = true;
    for (const auto& [key, value] : v.items()) {
      if (!first) out += ", ";
      first = false;
      out += ojson(key).dump(-1, ' ', false, ojson::error_handler_t::replace);
      out += ": ";
      dump_python(value, out);
    }
    out += '}';
  } else if (v.is_array()) {
    out += '[';
    for (size_t i = 0; i < v.size(); ++i) {
      if (i > 0) out += ", ";
      dump_python(v[i], out);
    }
    out += ']';
  } else if (v.is_boolean()) {
    out += v.get<bool>() ? "true" : "false";
  } else if (v.is_number_float()) {
    const double d = v.get<double>();
    if (d != d)
      out += "NaN";
    else if (d == std::numeric_limits<double>::infinity())
      out += "Infinity";
    else if (d == -std::numeric_limits<double>::infinity())
      out += "-Infinity";
    else
      out += v.dump();
  } else {
    out += v.dump(-1, ' ', false, ojson::error_handler_t::replace);
  }
}

}  // namespace

std::string python_json_dumps(const ojson& value) {
  std::string out;
  dump_python(value, out);
  return out;
}

std::string encode_messages(const ojson& messages, const ChatEncodingOptions& options) {
  if (!messages.is_array()) throw Error("chat_encoding: messages must be a JSON array");
  const ojson context_json = options.context.is_null() ? ojson::array() : options.context;
  if (!context_json.is_array()) throw Error("chat_encoding: context must be a JSON array");
  ojson own = messages;
  if (truthy(options.tools)) {
    if (own.empty()) throw Error("chat_encoding: tools given with no messages");
    own[0]["tools"] = options.tools;
  }

  // Merge tool messages (context and messages separately), then sort tool results across both.
  std::vector<Message> context = merge_tool_messages(context_json, 0);
  std::vector<Message> msgs = merge_tool_messages(own, context_json.size());
  {
    std::vector<Message*> all;
    for (Message& m : context) all.push_back(&m);
    for (Message& m : msgs) all.push_back(&m);
    sort_tool_results(all);
  }
  std::vector<Message> full = context;
  full.insert(full.end(), msgs.begin(), msgs.end());

  std::string prompt = options.add_bos && context.empty() ? std::string(kBos) : std::string();

  bool drop = options.drop_thinking;
  if (std::any_of(full.begin(), full.end(), [](const Message& m) { return truthy(m.tools); })) drop = false;

  size_t render_from = context.size();
  if (options.thinking_mode == ThinkingMode::kThinking && drop) {
    full = drop_thinking_messages(full);
    render_from = drop_thinking_messages(context).size();
  }
  for (size_t i = render_from; i < full.size(); ++i)
    prompt += render_message(i, full, options.thinking_mode, drop, options.reasoning_effort);
  return prompt;
}

std::string encode_messages_json(std::string_view messages_json, const ChatEncodingOptions& options) {
  ojson messages;
  try {
    messages = ojson::parse(messages_json);
  } catch (const ojson::exception& e) {
    throw Error(std::string("chat_encoding: messages are not valid JSON: ") + e.what());
  }
  return encode_messages(messages, options);
}

}  // namespace dsv4
