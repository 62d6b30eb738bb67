#include "engine/rank_protocol.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cmath>
#include <limits>
#include <cstring>

#include "core/error.h"

namespace dsv4::rank_protocol {
namespace {

using nlohmann::json;

const json& member(const json& message, const char* name) {
  DSV4_CHECK(message.is_object(), std::string("rank message: expected an object around '") + name + "'");
  const auto it = message.find(name);
  DSV4_CHECK(it != message.end(), std::string("rank message: missing '") + name + "'");
  return *it;
}

// An integer in [lo, hi], checked before any conversion (a JSON number may be a float or out of range).
int64_t integer(const json& value, const char* name, int64_t lo = INT64_MIN, int64_t hi = INT64_MAX) {
  DSV4_CHECK(value.is_number_integer(), std::string("rank message: '") + name + "' must be an integer");
  if (value.is_number_unsigned()) {
    const auto v = value.get<uint64_t>();
    DSV4_CHECK(v <= static_cast<uint64_t>(hi), std::string("rank message: '") + name + "' out of range");
    return static_cast<int64_t>(v);
  }
  const auto v = value.get<int64_t>();
  DSV4_CHECK(v >= lo && v <= hi, std::string("rank message: '") + name + "' out of range");
  return v;
}
int64_t int_field(const json& message, const char* name, int64_t lo = INT64_MIN, int64_t hi = INT64_MAX) {
  return integer(member(message, name), name, lo, hi);
}
uint64_t uint_value(const json& value, const char* name) {
  DSV4_CHECK(value.is_number_unsigned(), std::string("rank message: '") + name + "' must be a non-negative integer");
  return value.get<uint64_t>();
}
uint64_t uint_field(const json& message, const char* name) { return uint_value(member(message, name), name); }
double double_field(const json& message, const char* name) {
  const json& value = member(message, name);
  DSV4_CHECK(value.is_number(), std::string("rank message: '") + name + "' must be a number");
  return value.get<double>();
}
bool bool_field(const json& message, const char* name) {
  const json& value = member(message, name);
  DSV4_CHECK(value.is_boolean(), std::string("rank message: '") + name + "' must be true or false");
  return value.get<bool>();
}
std::string string_field(const json& message, const char* name) {
  const json& value = member(message, name);
  DSV4_CHECK(value.is_string(), std::string("rank message: '") + name + "' must be a string");
  return value.get<std::string>();
}
const json& array_field(const json& message, const char* name) {
  const json& value = member(message, name);
  DSV4_CHECK(value.is_array(), std::string("rank message: '") + name + "' must be an array");
  return value;
}
std::vector<int32_t> token_array(const json& message, const char* name) {
  std::vector<int32_t> out;
  for (const json& value : array_field(message, name))
    out.push_back(static_cast<int32_t>(integer(value, name, INT32_MIN, INT32_MAX)));
  return out;
}
std::vector<uint64_t> hash_array(const json& message, const char* name) {
  std::vector<uint64_t> out;
  for (const json& value : array_field(message, name)) out.push_back(uint_value(value, name));
  return out;
}

// A logprob: JSON has no infinities (nlohmann writes a non-finite number as null), and the only non-finite
// logprob a sampler gives is -inf (a token of probability 0).
json encode_logprob(float value) { return std::isfinite(value) ? json(value) : json(nullptr); }
float decode_logprob(const json& value, const char* name) {
  if (value.is_null()) return -std::numeric_limits<float>::infinity();
  DSV4_CHECK(value.is_number(), std::string("rank message: '") + name + "' must be a number");
  const double v = value.get<double>();
  DSV4_CHECK(std::abs(v) <= std::numeric_limits<float>::max(), std::string("rank message: '") + name + "' out of range");
  return static_cast<float>(v);
}

json encode_params(const SamplingParams& p) {
  json out = {{"max_tokens", p.max_tokens},
              {"ignore_eos", p.ignore_eos},
              {"stop_token_ids", p.stop_token_ids},
              {"temperature", p.temperature},
              {"top_k", p.top_k},
              {"top_p", p.top_p},
              {"min_p", p.min_p},
              {"repetition_penalty", p.repetition_penalty},
              {"frequency_penalty", p.frequency_penalty},
              {"presence_penalty", p.presence_penalty},
              {"min_tokens", p.min_tokens}};
  if (p.seed) out["seed"] = *p.seed;
  if (p.logprobs) out["logprobs"] = *p.logprobs;
  return out;
}

SamplingParams decode_params(const json& in) {
  SamplingParams p;
  p.max_tokens = int_field(in, "max_tokens");
  p.ignore_eos = bool_field(in, "ignore_eos");
  p.stop_token_ids = token_array(in, "stop_token_ids");
  p.temperature = double_field(in, "temperature");
  p.top_k = int_field(in, "top_k");
  p.top_p = double_field(in, "top_p");
  p.min_p = double_field(in, "min_p");
  p.repetition_penalty = double_field(in, "repetition_penalty");
  p.frequency_penalty = double_field(in, "frequency_penalty");
  p.presence_penalty = double_field(in, "presence_penalty");
  p.min_tokens = int_field(in, "min_tokens");
  if (in.contains("seed")) p.seed = uint_field(in, "seed");
  if (in.contains("logprobs")) p.logprobs = int_field(in, "logprobs");
  return p;
}

RequestStatus decode_status(int64_t value) {
  DSV4_CHECK(value >= static_cast<int64_t>(RequestStatus::kWaiting) &&
                 value <= static_cast<int64_t>(RequestStatus::kFinishedAborted),
             "rank message: request status " + std::to_string(value) + " out of range");
  return static_cast<RequestStatus>(value);
}

json encode_output(const RequestOutput& o) {
  json logprobs = json::array();
  for (const SampleResult& s : o.new_logprobs) {
    json top = json::array();
    for (const TokenLogprob& t : s.top) top.push_back({t.token, encode_logprob(t.logprob)});
    logprobs.push_back(
        {{"token", s.token}, {"logprob", encode_logprob(s.logprob)}, {"rank", s.rank}, {"top", std::move(top)}});
  }
  return {{"id", o.id},
          {"new_token_ids", o.new_token_ids},
          {"new_logprobs", std::move(logprobs)},
          {"finished", o.finished},
          {"status", static_cast<int64_t>(o.status)},
          {"error", o.error},
          {"num_cached_tokens", o.num_cached_tokens}};
}

RequestOutput decode_output(const json& in) {
  RequestOutput o;
  o.id = uint_field(in, "id");
  o.new_token_ids = token_array(in, "new_token_ids");
  for (const json& s : array_field(in, "new_logprobs")) {
    SampleResult result;
    result.token = static_cast<int32_t>(int_field(s, "token", INT32_MIN, INT32_MAX));
    result.logprob = decode_logprob(member(s, "logprob"), "logprob");
    result.rank = int_field(s, "rank");
    for (const json& t : array_field(s, "top")) {
      DSV4_CHECK(t.is_array() && t.size() == 2, "rank message: a top logprob must be [token, logprob]");
      result.top.push_back({static_cast<int32_t>(integer(t[0], "top token", INT32_MIN, INT32_MAX)),
                            decode_logprob(t[1], "top logprob")});
    }
    o.new_logprobs.push_back(std::move(result));
  }
  o.finished = bool_field(in, "finished");
  o.status = decode_status(int_field(in, "status"));
  o.error = string_field(in, "error");
  o.num_cached_tokens = int_field(in, "num_cached_tokens");
  return o;
}

}  // namespace

json encode(const RankCommand& command) {
  json out = {{"add", command.add}, {"id", command.id}};
  if (command.add) {
    out["prompt"] = command.prompt;
    out["params"] = encode_params(command.params);
  }
  return out;
}

RankCommand decode_command(const json& message) {
  RankCommand command;
  command.add = bool_field(message, "add");
  command.id = uint_field(message, "id");
  if (command.add) {
    command.prompt = token_array(message, "prompt");
    command.params = decode_params(member(message, "params"));
  }
  return command;
}

json encode(const RankReport& report) {
  json outputs = json::array(), progress = json::array();
  for (const RequestOutput& output : report.outputs) outputs.push_back(encode_output(output));
  for (const RankProgress& p : report.progress) progress.push_back({p.id, p.num_computed_tokens, p.num_tokens});
  return {{"rank", report.rank},
          {"outputs", std::move(outputs)},
          {"progress", std::move(progress)},
          {"cached", report.events.cached},
          {"evicted", report.events.evicted},
          {"aborts_applied", report.aborts_applied},
          {"failed", report.failed},
          {"stepped", report.stepped}};
}

RankReport decode_report(const json& message) {
  RankReport report;
  report.rank = static_cast<int>(int_field(message, "rank", 0, INT32_MAX));
  for (const json& output : array_field(message, "outputs")) report.outputs.push_back(decode_output(output));
  for (const json& p : array_field(message, "progress")) {
    DSV4_CHECK(p.is_array() && p.size() == 3, "rank message: a progress entry must be [id, computed tokens, tokens]");
    report.progress.push_back({uint_value(p[0], "progress id"), integer(p[1], "computed tokens"),
                               integer(p[2], "tokens")});
  }
  report.events.cached = hash_array(message, "cached");
  report.events.evicted = hash_array(message, "evicted");
  report.aborts_applied = int_field(message, "aborts_applied");
  report.failed = bool_field(message, "failed");
  report.stepped = bool_field(message, "stepped");
  return report;
}

json encode(const EngineStats& s) {
  json groups = json::array();
  for (const EngineStats::Group& g : s.groups)
    groups.push_back({static_cast<int64_t>(g.kind), g.used_blocks, g.cached_blocks, g.capacity_blocks});
  return {{"running", s.running},
          {"waiting", s.waiting},
          {"preemptions", s.preemptions},
          {"pool_bytes", s.pool_bytes},
          {"used_bytes", s.used_bytes},
          {"cached_bytes", s.cached_bytes},
          {"groups", std::move(groups)},
          {"prefix_queries", s.prefix_queries},
          {"prefix_query_tokens", s.prefix_query_tokens},
          {"prefix_hit_tokens", s.prefix_hit_tokens}};
}

EngineStats decode_stats(const json& message) {
  EngineStats s;
  s.running = int_field(message, "running");
  s.waiting = int_field(message, "waiting");
  s.preemptions = int_field(message, "preemptions");
  s.pool_bytes = int_field(message, "pool_bytes");
  s.used_bytes = int_field(message, "used_bytes");
  s.cached_bytes = int_field(message, "cached_bytes");
  for (const json& g : array_field(message, "groups")) {
    DSV4_CHECK(g.is_array() && g.size() == 4, "rank message: a cache group must be [kind, used, cached, capacity]");
    const int64_t kind = integer(g[0], "cache group kind", 0, static_cast<int64_t>(CacheGroupKind::kC128State));
    s.groups.push_back({static_cast<CacheGroupKind>(kind), integer(g[1], "used blocks"), integer(g[2], "cached blocks"),
                        integer(g[3], "capacity blocks")});
  }
  s.prefix_queries = int_field(message, "prefix_queries");
  s.prefix_query_tokens = int_field(message, "prefix_query_tokens");
  s.prefix_hit_tokens = int_field(message, "prefix_hit_tokens");
  return s;
}

namespace {

// Writes all of `size` bytes; false when the peer is gone.
bool write_all(int fd, const char* data, size_t size) {
  while (size > 0) {
    const ssize_t n = ::send(fd, data, size, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    data += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

// Reads exactly `size` bytes: the count read before the connection closed (== size on success).
size_t read_all(int fd, char* data, size_t size) {
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::recv(fd, data + done, size - done, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw Error(std::string("rank connection: ") + std::strerror(errno));
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  return done;
}

}  // namespace

void send_message(int fd, const json& message) {
  const std::string text = message.dump();
  char header[8];
  uint64_t size = text.size();
  for (char& byte : header) {
    byte = static_cast<char>(size & 0xff);
    size >>= 8;
  }
  DSV4_CHECK(write_all(fd, header, sizeof header) && write_all(fd, text.data(), text.size()),
             "rank connection: the peer closed it (its process ended)");
}

std::optional<json> receive_message(int fd, uint64_t max_bytes) {
  unsigned char header[8];
  const size_t got = read_all(fd, reinterpret_cast<char*>(header), sizeof header);
  if (got == 0) return std::nullopt;
  DSV4_CHECK(got == sizeof header, "rank connection: closed inside a message header");
  uint64_t size = 0;
  for (int i = 7; i >= 0; --i) size = (size << 8) | header[i];
  DSV4_CHECK(size <= max_bytes, "rank connection: a message of " + std::to_string(size) + " bytes (limit " +
                                    std::to_string(max_bytes) + ")");
  std::string text(size, '\0');
  DSV4_CHECK(read_all(fd, text.data(), size) == size, "rank connection: closed inside a message");
  return parse_message(text);
}

json parse_message(const std::string& text) {
  json message = json::parse(text, nullptr, /*allow_exceptions=*/false);
  DSV4_CHECK(!message.is_discarded(), "rank connection: a message that is not JSON");
  DSV4_CHECK(message.is_object(), "rank connection: a message that is not a JSON object");
  return message;
}

}  // namespace dsv4::rank_protocol
