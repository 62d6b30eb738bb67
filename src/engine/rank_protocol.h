// The messages between DataParallelEngine's front and a rank in a worker process (engine/remote_rank_engine.h):
// JSON objects (nlohmann-json), each framed by an 8-byte little-endian length on a stream socket. One request,
// one reply, in order; the worker never speaks first.
//
//   front -> worker                                   worker -> front
//   {"op":"apply","commands":[RankCommand...]}        {"has_work":b,"report":RankReport,"stats":EngineStats}
//   {"op":"step","forward":b}                         the same
//   {"op":"apply_step","commands":[...]}              the same (applied, then stepped when it had work)
//   {"op":"stop"}                                     none: the worker returns
//   any reply may instead be {"error":"..."}: the rank failed (its step threw), and the worker returns.
//
// The decoders throw dsv4::Error naming the field for a malformed message (fuzz/rank_protocol_fuzz.cpp).
#pragma once
#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "engine/rank_engine.h"

namespace dsv4::rank_protocol {

nlohmann::json encode(const RankCommand& command);
RankCommand decode_command(const nlohmann::json& message);
nlohmann::json encode(const RankReport& report);
RankReport decode_report(const nlohmann::json& message);
nlohmann::json encode(const EngineStats& stats);
EngineStats decode_stats(const nlohmann::json& message);

// Writes one framed message; throws dsv4::Error when the peer is gone (no SIGPIPE).
void send_message(int fd, const nlohmann::json& message);
// Reads one framed message; nullopt when the peer closed the connection before a new message began; throws
// dsv4::Error for a connection lost mid-message, a frame over `max_bytes`, or text that is not JSON.
std::optional<nlohmann::json> receive_message(int fd, uint64_t max_bytes = uint64_t{1} << 30);
// One message's JSON text, parsed (the fuzzer's entry): an object, or dsv4::Error.
nlohmann::json parse_message(const std::string& text);

}  // namespace dsv4::rank_protocol
