#include "bench/openai_stream.h"

#include <nlohmann/json.hpp>

namespace dsv4::bench {

namespace {

using nlohmann::json;

std::string excerpt(std::string_view text) {
  constexpr size_t kMax = 200;
  return text.size() <= kMax ? std::string(text) : std::string(text.substr(0, kMax)) + "...";
}

void append_string_field(const json& object, const char* key, std::string& out) {
  const auto it = object.find(key);
  if (it != object.end() && it->is_string()) out += it->get_ref<const std::string&>();
}

}  // namespace

ApiKind api_kind_of_endpoint(std::string_view endpoint) {
  while (endpoint.ends_with('/')) endpoint.remove_suffix(1);
  return endpoint.ends_with("chat/completions") ? ApiKind::kChatCompletions : ApiKind::kCompletions;
}

StreamPayload decode_stream_payload(std::string_view data, ApiKind api) {
  StreamPayload payload;
  if (data == "[DONE]") {
    payload.done = true;
    return payload;
  }
  const json chunk = json::parse(data, nullptr, /*allow_exceptions=*/false);
  if (chunk.is_discarded() || !chunk.is_object()) {
    payload.error = "bad SSE payload (not a JSON object): " + excerpt(data);
    return payload;
  }
  if (const auto error = chunk.find("error"); error != chunk.end() && !error->is_null()) {
    const auto message = error->is_object() ? error->find("message") : error->end();
    payload.error = "server error in stream: " +
                    (message != error->end() && message->is_string() ? message->get<std::string>()
                                                                     : excerpt(error->dump()));
    return payload;
  }
  if (const auto choices = chunk.find("choices"); choices != chunk.end()) {
    if (!choices->is_array()) {
      payload.error = "bad SSE payload (\"choices\" is not an array): " + excerpt(data);
      return payload;
    }
    if (!choices->empty() && choices->front().is_object()) {
      const json& choice = choices->front();
      if (api == ApiKind::kCompletions) {
        append_string_field(choice, "text", payload.text);
      } else if (const auto delta = choice.find("delta"); delta != choice.end() && delta->is_object()) {
        append_string_field(*delta, "reasoning_content", payload.text);
        append_string_field(*delta, "content", payload.text);
      }
    }
  }
  if (const auto usage = chunk.find("usage"); usage != chunk.end() && usage->is_object()) {
    const auto tokens = usage->find("completion_tokens");
    if (tokens != usage->end() && tokens->is_number_integer()) payload.completion_tokens = tokens->get<int64_t>();
  }
  return payload;
}

}  // namespace dsv4::bench
