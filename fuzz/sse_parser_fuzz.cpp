// libFuzzer target: an SSE response body -> SseParser -> decode_stream_payload. The first byte of the input
// picks a chunking; the events must not depend on it (the network may split the body anywhere), and neither the
// parser nor the payload decoder may crash or throw anything but dsv4::Error (an oversized event).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>
#include <vector>

#include "bench/openai_stream.h"
#include "bench/sse_parser.h"
#include "core/error.h"

namespace {

// Events of `body` fed in pieces of the lengths cycled from `pattern`; false when the parser refused it.
bool parse(std::string_view body, std::string_view pattern, std::vector<dsv4::bench::SseEvent>& events) {
  dsv4::bench::SseParser parser(4096);  // small, so the fuzzer reaches the oversized-event path
  try {
    size_t step = 0;
    for (size_t at = 0; at < body.size();) {
      const size_t piece = pattern.empty() ? body.size() : 1 + static_cast<unsigned char>(pattern[step++ % pattern.size()]) % 16;
      parser.feed(body.substr(at, piece), events);
      at += piece;
    }
  } catch (const dsv4::Error&) {
    return false;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const size_t pattern_len = static_cast<unsigned char>(input[0]) % 8;
  if (1 + pattern_len > input.size()) return 0;
  const std::string_view pattern = input.substr(1, pattern_len), body = input.substr(1 + pattern_len);

  std::vector<dsv4::bench::SseEvent> whole, pieces;
  const bool whole_ok = parse(body, {}, whole);
  const bool pieces_ok = parse(body, pattern, pieces);
  if (whole_ok != pieces_ok) std::abort();  // the size limit is on lines and events, not on feeds
  if (whole_ok && whole != pieces) std::abort();
  for (const auto& event : whole) {
    (void)dsv4::bench::decode_stream_payload(event.data, dsv4::bench::ApiKind::kCompletions);
    (void)dsv4::bench::decode_stream_payload(event.data, dsv4::bench::ApiKind::kChatCompletions);
  }
  return 0;
}
