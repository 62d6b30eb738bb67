// libFuzzer target: one message of the data-parallel rank protocol (engine/rank_protocol.h) as the front or a
// worker reads it. Each decoder may only throw dsv4::Error; whatever one accepts must encode to a message that
// decodes to the same encoding (nothing is lost or invented on the way between processes).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "core/error.h"
#include "engine/rank_protocol.h"

namespace {

template <typename Decode>
void round_trip(const nlohmann::json& message, Decode decode) {
  try {
    const auto decoded = decode(message);
    const nlohmann::json encoded = dsv4::rank_protocol::encode(decoded);
    const nlohmann::json again = dsv4::rank_protocol::encode(decode(encoded));
    if (encoded != again) std::abort();
  } catch (const dsv4::Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  nlohmann::json message;
  try {
    message = dsv4::rank_protocol::parse_message(std::string(reinterpret_cast<const char*>(data), size));
  } catch (const dsv4::Error&) {
    return 0;
  }
  round_trip(message, [](const nlohmann::json& m) { return dsv4::rank_protocol::decode_command(m); });
  round_trip(message, [](const nlohmann::json& m) { return dsv4::rank_protocol::decode_report(m); });
  round_trip(message, [](const nlohmann::json& m) { return dsv4::rank_protocol::decode_stats(m); });
  return 0;
}
