#include "server/openai_protocol.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.h"

namespace dsv4::server {

using json = nlohmann::json;
using ojson = nlohmann::ordered_json;

namespace {

const char* default_error_type(int status) {
  switch (status) {
    case 400: return "BadRequestError";
    case 401: return "AuthenticationError";
    case 404: return "NotFoundError";
    case 405: return "MethodNotAllowedError";
    case 413: return "RequestTooLargeError";
    case 429: return "RateLimitError";
    case 503: return "ServiceUnavailableError";
    default: return status >= 500 ? "InternalServerError" : "BadRequestError";
  }
}

[[noreturn]] void bad(const std::string& param, const std::string& message) {
  throw ApiError(400, message, param);
}

const char* type_name(const ojson& value) {
  return value.type_name();
}

// Typed look-ups: an absent or null field is "not given"; a field of the wrong type is a 400 naming it.
std::optional<double> get_number(const ojson& body, const char* key) {
  const auto it = body.find(key);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_number()) bad(key, std::string("'") + key + "' must be a number, got " + type_name(*it));
  const double value = it->get<double>();
  if (!std::isfinite(value)) bad(key, std::string("'") + key + "' must be finite");
  return value;
}

std::optional<int64_t> get_integer(const ojson& body, const char* key) {
  const auto it = body.find(key);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (it->is_number_integer()) {
    if (it->is_number_unsigned() && it->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
      bad(key, std::string("'") + key + "' is out of range");
    return it->get<int64_t>();
  }
  // 3.0 is accepted as 3 (JSON has one number type); 3.5 is not an integer.
  if (it->is_number_float()) {
    const double value = it->get<double>();
    if (std::isfinite(value) && value == std::floor(value) && std::fabs(value) < 9.0e15)
      return static_cast<int64_t>(value);
  }
  bad(key, std::string("'") + key + "' must be an integer, got " + type_name(*it));
}

std::optional<bool> get_bool(const ojson& body, const char* key) {
  const auto it = body.find(key);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_boolean()) bad(key, std::string("'") + key + "' must be a boolean, got " + type_name(*it));
  return it->get<bool>();
}

std::optional<std::string> get_string(const ojson& body, const char* key) {
  const auto it = body.find(key);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_string()) bad(key, std::string("'") + key + "' must be a string, got " + type_name(*it));
  return it->get<std::string>();
}

std::vector<int32_t> token_id_array(const ojson& array, const std::string& param) {
  std::vector<int32_t> ids;
  ids.reserve(array.size());
  for (const auto& item : array) {
    if (!item.is_number_integer()) bad(param, "'" + param + "' must be an array of integer token ids");
    const int64_t id = item.is_number_unsigned() && item.get<uint64_t>() > INT32_MAX ? -1 : item.get<int64_t>();
    if (id < 0 || id > std::numeric_limits<int32_t>::max())
      bad(param, "'" + param + "': token id " + item.dump() + " is out of range");
    ids.push_back(static_cast<int32_t>(id));
  }
  return ids;
}

std::vector<PromptInput> parse_prompt(const ojson& body) {
  const auto it = body.find("prompt");
  if (it == body.end() || it->is_null()) bad("prompt", "'prompt' is required");
  std::vector<PromptInput> prompts;
  if (it->is_string()) {
    prompts.emplace_back(it->get<std::string>());
  } else if (it->is_array() && !it->empty()) {
    if ((*it)[0].is_number()) {
      prompts.emplace_back(token_id_array(*it, "prompt"));
    } else {
      for (const auto& item : *it) {
        if (item.is_string()) prompts.emplace_back(item.get<std::string>());
        else if (item.is_array() && !item.empty()) prompts.emplace_back(token_id_array(item, "prompt"));
        else bad("prompt", "'prompt' must be a string, an array of strings, of token ids, or of token-id arrays");
      }
    }
  } else {
    bad("prompt", "'prompt' must be a non-empty string or array, got " + std::string(type_name(*it)));
  }
  for (const auto& prompt : prompts)
    if (std::holds_alternative<std::vector<int32_t>>(prompt) && std::get<std::vector<int32_t>>(prompt).empty())
      bad("prompt", "'prompt' holds an empty token list");
  return prompts;
}

// Message content may be a string or OpenAI's array of parts; the text parts are joined with "\n" as vLLM joins
// them. Images and audio are refused: V4 is a text model.
ojson normalize_messages(const ojson& body) {
  const auto it = body.find("messages");
  if (it == body.end() || it->is_null()) bad("messages", "'messages' is required");
  if (!it->is_array() || it->empty()) bad("messages", "'messages' must be a non-empty array");
  ojson messages = ojson::array();
  for (size_t i = 0; i < it->size(); ++i) {
    const ojson& message = (*it)[i];
    const std::string where = "messages[" + std::to_string(i) + "]";
    if (!message.is_object()) bad(where, "'" + where + "' must be an object");
    const auto role = message.find("role");
    if (role == message.end() || !role->is_string()) bad(where + ".role", "'" + where + ".role' must be a string");
    ojson normalized = message;
    const auto content = message.find("content");
    if (content != message.end() && content->is_array()) {
      std::string text;
      for (size_t p = 0; p < content->size(); ++p) {
        const ojson& part = (*content)[p];
        const std::string part_where = where + ".content[" + std::to_string(p) + "]";
        if (!part.is_object() || !part.contains("type") || !part["type"].is_string())
          bad(part_where, "'" + part_where + "' must be an object with a string 'type'");
        if (part["type"] != "text")
          bad(part_where, "'" + part_where + "': content part type '" + part["type"].get<std::string>() +
                              "' is not supported (DeepSeek-V4 is a text model)");
        if (!part.contains("text") || !part["text"].is_string())
          bad(part_where, "'" + part_where + ".text' must be a string");
        if (!text.empty()) text += "\n";
        text += part["text"].get<std::string>();
      }
      normalized["content"] = text;
    } else if (content != message.end() && !content->is_string() && !content->is_null()) {
      bad(where + ".content", "'" + where + ".content' must be a string, an array of parts or null");
    }
    messages.push_back(std::move(normalized));
  }
  return messages;
}

void parse_chat_options(const ojson& body, ChatEncodingOptions& chat) {
  chat.thinking_mode = ThinkingMode::kChat;
  if (const auto kwargs = body.find("chat_template_kwargs"); kwargs != body.end() && !kwargs->is_null()) {
    if (!kwargs->is_object()) bad("chat_template_kwargs", "'chat_template_kwargs' must be an object");
    // vLLM's DeepSeek recipes pass {"thinking": true}; Qwen-style clients pass {"enable_thinking": true}.
    for (const char* key : {"thinking", "enable_thinking"})
      if (const auto flag = get_bool(*kwargs, key); flag && *flag) chat.thinking_mode = ThinkingMode::kThinking;
  }
  if (const auto effort = get_string(body, "reasoning_effort")) {
    if (*effort == "max") chat.reasoning_effort = ReasoningEffort::kMax;
    else if (*effort == "high") chat.reasoning_effort = ReasoningEffort::kHigh;
    else if (*effort == "low" || *effort == "medium" || *effort == "none" || *effort == "minimal")
      chat.reasoning_effort = ReasoningEffort::kNone;
    else bad("reasoning_effort", "'reasoning_effort' must be one of none, minimal, low, medium, high, max");
  }
  const auto tools = body.find("tools");
  if (tools != body.end() && !tools->is_null()) {
    if (!tools->is_array()) bad("tools", "'tools' must be an array");
    for (size_t i = 0; i < tools->size(); ++i) {
      const ojson& tool = (*tools)[i];
      if (!tool.is_object() || !tool.contains("function") || !tool["function"].is_object() ||
          !tool["function"].contains("name") || !tool["function"]["name"].is_string())
        bad("tools", "'tools[" + std::to_string(i) + "]' must be {\"type\": \"function\", \"function\": {\"name\", ...}}");
    }
    if (!tools->empty()) chat.tools = *tools;
  }
  if (const auto choice = body.find("tool_choice"); choice != body.end() && !choice->is_null()) {
    if (*choice == "none") chat.tools = nullptr;
    else if (*choice != "auto")
      bad("tool_choice", "'tool_choice' must be \"auto\" or \"none\" (forced tool calls need guided decoding)");
  }
  if (const auto format = body.find("response_format"); format != body.end() && !format->is_null()) {
    if (!format->is_object() || !format->contains("type") || (*format)["type"] != "text")
      bad("response_format", "'response_format' other than {\"type\": \"text\"} is not supported");
  }
}

void parse_sampling(const ojson& body, Endpoint endpoint, GenerationRequest& request) {
  SamplingParams& s = request.sampling;
  const char* max_key = "max_tokens";
  std::optional<int64_t> max_tokens = get_integer(body, "max_tokens");
  if (endpoint == Endpoint::kChatCompletions) {
    if (const auto completion = get_integer(body, "max_completion_tokens")) {
      max_tokens = completion;
      max_key = "max_completion_tokens";
    }
  }
  if (max_tokens && *max_tokens < 1) bad(max_key, std::string("'") + max_key + "' must be at least 1");
  request.max_tokens = max_tokens;
  s.temperature = get_number(body, "temperature").value_or(1.0);  // OpenAI's default
  if (s.temperature < 0) bad("temperature", "'temperature' must be >= 0");
  s.top_p = get_number(body, "top_p").value_or(1.0);
  s.top_k = get_integer(body, "top_k").value_or(-1);
  s.min_p = get_number(body, "min_p").value_or(0.0);
  s.repetition_penalty = get_number(body, "repetition_penalty").value_or(1.0);
  s.frequency_penalty = get_number(body, "frequency_penalty").value_or(0.0);
  s.presence_penalty = get_number(body, "presence_penalty").value_or(0.0);
  s.min_tokens = get_integer(body, "min_tokens").value_or(0);
  s.ignore_eos = get_bool(body, "ignore_eos").value_or(false);
  if (const auto seed = get_integer(body, "seed")) s.seed = static_cast<uint64_t>(*seed);
  if (const auto ids = body.find("stop_token_ids"); ids != body.end() && !ids->is_null()) {
    if (!ids->is_array()) bad("stop_token_ids", "'stop_token_ids' must be an array of token ids");
    s.stop_token_ids = token_id_array(*ids, "stop_token_ids");
  }
  request.n = get_integer(body, "n").value_or(1);
  if (request.n < 1 || request.n > 128) bad("n", "'n' must be between 1 and 128");
  if (const auto best_of = get_integer(body, "best_of"); best_of && *best_of != request.n)
    bad("best_of", "'best_of' other than n is not supported");
  if (const auto stop = body.find("stop"); stop != body.end() && !stop->is_null()) {
    if (stop->is_string()) {
      request.stop.push_back(stop->get<std::string>());
    } else if (stop->is_array()) {
      for (const auto& item : *stop) {
        if (!item.is_string()) bad("stop", "'stop' must be a string or an array of strings");
        request.stop.push_back(item.get<std::string>());
      }
    } else {
      bad("stop", "'stop' must be a string or an array of strings, got " + std::string(type_name(*stop)));
    }
    for (const auto& text : request.stop)
      if (text.empty()) bad("stop", "'stop' strings must not be empty");
  }
  if (const auto bias = body.find("logit_bias"); bias != body.end() && !bias->is_null()) {
    if (!bias->is_object()) bad("logit_bias", "'logit_bias' must be an object");
    if (!bias->empty()) bad("logit_bias", "'logit_bias' is not supported");
  }
  request.skip_special_tokens = get_bool(body, "skip_special_tokens").value_or(true);
  request.include_stop_str_in_output = get_bool(body, "include_stop_str_in_output").value_or(false);

  if (endpoint == Endpoint::kCompletions) {
    if (const auto logprobs = get_integer(body, "logprobs")) {
      if (*logprobs < 0 || *logprobs > 20) bad("logprobs", "'logprobs' must be between 0 and 20");
      request.logprobs = *logprobs;
    }
    request.echo = get_bool(body, "echo").value_or(false);
    if (request.echo && request.logprobs)
      bad("echo", "'echo' with 'logprobs' is not supported (prompt logprobs are not computed)");
    if (const auto suffix = get_string(body, "suffix"); suffix && !suffix->empty())
      bad("suffix", "'suffix' is not supported");
  } else {
    const bool logprobs = get_bool(body, "logprobs").value_or(false);
    const auto top = get_integer(body, "top_logprobs");
    if (top && (*top < 0 || *top > 20)) bad("top_logprobs", "'top_logprobs' must be between 0 and 20");
    if (top && !logprobs) bad("top_logprobs", "'top_logprobs' needs 'logprobs': true");
    if (logprobs) request.logprobs = top.value_or(0);
  }
  s.logprobs = request.logprobs;

  request.stream = get_bool(body, "stream").value_or(false);
  if (const auto options = body.find("stream_options"); options != body.end() && !options->is_null()) {
    if (!options->is_object()) bad("stream_options", "'stream_options' must be an object");
    if (!request.stream) bad("stream_options", "'stream_options' is only allowed when 'stream' is true");
    request.include_usage = get_bool(*options, "include_usage").value_or(false);
    request.continuous_usage_stats = get_bool(*options, "continuous_usage_stats").value_or(false);
  }
  // The engine's own bounds (temperature, top_p in (0, 1], min_p, penalties, ...) with its messages.
  SamplingParams check = s;
  check.max_tokens = max_tokens.value_or(1);
  try {
    validate(check);
  } catch (const Error& error) {
    throw ApiError(400, error.what());
  }
}

ojson parse_body(std::string_view body) {
  ojson parsed;
  try {
    parsed = ojson::parse(body);
  } catch (const ojson::exception& error) {
    // parse_error, and out_of_range for a number literal past double's range (406).
    throw ApiError(400, std::string("invalid JSON body: ") + error.what());
  }
  if (!parsed.is_object()) throw ApiError(400, "the request body must be a JSON object");
  return parsed;
}

}  // namespace

ApiError::ApiError(int status, std::string message, std::string param, std::string type)
    : std::runtime_error(std::move(message)), status_(status), param_(std::move(param)),
      type_(type.empty() ? default_error_type(status) : std::move(type)) {}

std::string error_body(int status, std::string_view message, std::string_view param, std::string_view type) {
  json error = {{"message", message},
                {"type", type.empty() ? default_error_type(status) : std::string(type)},
                {"param", param.empty() ? json(nullptr) : json(param)},
                {"code", status}};
  return json{{"error", error}}.dump(-1, ' ', false, json::error_handler_t::replace);
}

GenerationRequest parse_generation_request(std::string_view body, Endpoint endpoint) {
  const ojson parsed = parse_body(body);
  GenerationRequest request;
  request.endpoint = endpoint;
  request.model = get_string(parsed, "model").value_or("");
  if (endpoint == Endpoint::kCompletions) {
    request.prompts = parse_prompt(parsed);
  } else {
    request.messages = normalize_messages(parsed);
    parse_chat_options(parsed, request.chat);
  }
  parse_sampling(parsed, endpoint, request);
  return request;
}

TokenizeRequest parse_tokenize_request(std::string_view body) {
  const ojson parsed = parse_body(body);
  TokenizeRequest request;
  request.prompt = get_string(parsed, "prompt");
  if (parsed.contains("messages") && !parsed["messages"].is_null()) {
    request.messages = normalize_messages(parsed);
    parse_chat_options(parsed, request.chat);
  }
  if (request.prompt.has_value() == !request.messages.is_null())
    bad("prompt", "give exactly one of 'prompt' (a string) or 'messages'");
  request.add_special_tokens = get_bool(parsed, "add_special_tokens").value_or(true);
  return request;
}

std::vector<int32_t> parse_detokenize_request(std::string_view body) {
  const ojson parsed = parse_body(body);
  const auto tokens = parsed.find("tokens");
  if (tokens == parsed.end() || !tokens->is_array()) bad("tokens", "'tokens' must be an array of token ids");
  return token_id_array(*tokens, "tokens");
}

json usage_json(const Usage& usage) {
  json out = {{"prompt_tokens", usage.prompt_tokens},
              {"completion_tokens", usage.completion_tokens},
              {"total_tokens", usage.prompt_tokens + usage.completion_tokens}};
  out["prompt_tokens_details"] = {{"cached_tokens", usage.cached_tokens}};
  return out;
}

namespace {
// Token text may be an incomplete UTF-8 sequence (a byte-level piece); JSON needs valid UTF-8, so invalid bytes
// become U+FFFD in strings while `bytes` keeps them exactly (as OpenAI does).
json text_value(const std::string& text) {
  return json::parse(json(text).dump(-1, ' ', false, json::error_handler_t::replace));
}
}  // namespace

json completion_logprobs_json(const ChoiceLogprobs& logprobs, int64_t text_offset_base) {
  json tokens = json::array(), token_logprobs = json::array(), top = json::array(), offsets = json::array();
  int64_t offset = text_offset_base;
  for (size_t i = 0; i < logprobs.size(); ++i) {
    tokens.push_back(text_value(logprobs.tokens[i]));
    token_logprobs.push_back(logprobs.logprobs[i]);
    json alternatives = json::object();
    for (const auto& [text, value] : logprobs.top[i])
      alternatives[text_value(text).get<std::string>()] = value;
    top.push_back(std::move(alternatives));
    offsets.push_back(offset);
    offset += static_cast<int64_t>(logprobs.tokens[i].size());
  }
  return {{"tokens", tokens}, {"token_logprobs", token_logprobs}, {"top_logprobs", top}, {"text_offset", offsets}};
}

json chat_logprobs_json(const ChoiceLogprobs& logprobs) {
  json content = json::array();
  for (size_t i = 0; i < logprobs.size(); ++i) {
    json top = json::array();
    for (size_t k = 0; k < logprobs.top[i].size(); ++k)
      top.push_back({{"token", text_value(logprobs.top[i][k].first)},
                     {"logprob", logprobs.top[i][k].second},
                     {"bytes", logprobs.top_bytes[i][k]}});
    content.push_back({{"token", text_value(logprobs.tokens[i])},
                       {"logprob", logprobs.logprobs[i]},
                       {"bytes", logprobs.token_bytes[i]},
                       {"top_logprobs", top}});
  }
  return {{"content", content}};
}

ReasoningSplitter::Parts ReasoningSplitter::push(std::string_view text) {
  static constexpr std::string_view kEnd = "</think>";
  Parts parts;
  if (in_content_) {
    parts.content = text;
    return parts;
  }
  held_ += text;
  if (const size_t at = held_.find(kEnd); at != std::string::npos) {
    parts.reasoning = held_.substr(0, at);
    parts.content = held_.substr(at + kEnd.size());
    held_.clear();
    in_content_ = true;
    return parts;
  }
  // Keep the longest suffix that is a proper prefix of the marker; the rest is reasoning for sure.
  size_t keep = std::min(held_.size(), kEnd.size() - 1);
  while (keep > 0 && held_.compare(held_.size() - keep, keep, kEnd.substr(0, keep)) != 0) --keep;
  parts.reasoning = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return parts;
}

ReasoningSplitter::Parts ReasoningSplitter::flush() {
  Parts parts;
  parts.reasoning = std::move(held_);
  held_.clear();
  return parts;
}

}  // namespace dsv4::server
