// libFuzzer target: request bodies of every JSON route of dsv4 serve (server/openai_protocol.h), and the chat
// encoder on whatever messages pass validation. Any input must parse or raise ApiError / dsv4::Error: never
// crash, hang or leak (ASan + UBSan).
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "core/error.h"
#include "server/openai_protocol.h"
#include "tokenizer/chat_encoding.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  using namespace dsv4::server;
  for (const Endpoint endpoint : {Endpoint::kCompletions, Endpoint::kChatCompletions}) {
    try {
      const GenerationRequest request = parse_generation_request(body, endpoint);
      if (endpoint == Endpoint::kChatCompletions) (void)dsv4::encode_messages(request.messages, request.chat);
    } catch (const ApiError&) {
    } catch (const dsv4::Error&) {
    }
  }
  try {
    (void)parse_tokenize_request(body);
  } catch (const ApiError&) {
  }
  try {
    (void)parse_detokenize_request(body);
  } catch (const ApiError&) {
  }
  ReasoningSplitter splitter;
  for (size_t at = 0; at < size; at += 7) (void)splitter.push(body.substr(at, 7));
  (void)splitter.flush();
  return 0;
}
