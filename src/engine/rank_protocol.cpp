#include "engine/rank_protocol.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/error.h"

namespace dsv4::rank_protocol {
namespace {

using nlohmann::json;

// `message[name]` as a T; dsv4::Error naming the field when it is missing or of another type.
template <typename T>
T field(const json& message, const char* name) {
  DSV4_CHECK(message.is_object(), std::string("rank message: expected an object around '") + name + "'");
  const auto it = message.find(name);
  DSV4_CHECK(it != message.end(), std::string("rank message: missing '") + name + "'");
  try {
    return it->get<T>();
  } catch (const json::exception& error) {
    throw Error(std::string("rank message: '") + name + "' has the wrong type (" + error.what() + ")");
  }
}

const json& array_field(const json& message, const char* name) {
  DSV4_CHECK(message.is_object() && message.contains(name) && message.at(name).is_array(),
             std::string("rank message: '") + name + "' must be an array");
  return message.at(name);
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
  p.max_tokens = field<int64_t>(in, "max_tokens");
  p.ignore_eos = field<bool>(in, "ignore_eos");
  p.stop_token_ids = field<std::vector<int32_t>>(in, "stop_token_ids");
  p.temperature = field<double>(in, "temperature");
  p.top_k = field<int64_t>(in, "top_k");
  p.top_p = field<double>(in, "top_p");
  p.min_p = field<double>(in, "min_p");
  p.repetition_penalty = field<double>(in, "repetition_penalty");
  p.frequency_penalty = field<double>(in, "frequency_penalty");
  p.presence_penalty = field<double>(in, "presence_penalty");
  p.min_tokens = field<int64_t>(in, "min_tokens");
  if (in.contains("seed")) p.seed = field<uint64_t>(in, "seed");
  if (in.contains("logprobs")) p.logprobs = field<int64_t>(in, "logprobs");
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
    for (const TokenLogprob& t : s.top) top.push_back({t.token, t.logprob});
    logprobs.push_back({{"token", s.token}, {"logprob", s.logprob}, {"rank", s.rank}, {"top", std::move(top)}});
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
  o.id = field<RequestId>(in, "id");
  o.new_token_ids = field<std::vector<int32_t>>(in, "new_token_ids");
  for (const json& s : array_field(in, "new_logprobs")) {
    SampleResult result;
    result.token = field<int32_t>(s, "token");
    result.logprob = field<float>(s, "logprob");
    result.rank = field<int64_t>(s, "rank");
    for (const json& t : array_field(s, "top")) {
      DSV4_CHECK(t.is_array() && t.size() == 2 && t[0].is_number_integer() && t[1].is_number(),
                 "rank message: a top logprob must be [token, logprob]");
      result.top.push_back({t[0].get<int32_t>(), t[1].get<float>()});
    }
    o.new_logprobs.push_back(std::move(result));
  }
  o.finished = field<bool>(in, "finished");
  o.status = decode_status(field<int64_t>(in, "status"));
  o.error = field<std::string>(in, "error");
  o.num_cached_tokens = field<int64_t>(in, "num_cached_tokens");
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
  command.add = field<bool>(message, "add");
  command.id = field<RequestId>(message, "id");
  if (command.add) {
    command.prompt = field<std::vector<int32_t>>(message, "prompt");
    DSV4_CHECK(message.contains("params"), "rank message: an add command without 'params'");
    command.params = decode_params(message.at("params"));
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
  report.rank = field<int>(message, "rank");
  for (const json& output : array_field(message, "outputs")) report.outputs.push_back(decode_output(output));
  for (const json& p : array_field(message, "progress")) {
    DSV4_CHECK(p.is_array() && p.size() == 3 && p[0].is_number_unsigned() && p[1].is_number_integer() &&
                   p[2].is_number_integer(),
               "rank message: a progress entry must be [id, computed tokens, tokens]");
    report.progress.push_back({p[0].get<RequestId>(), p[1].get<int64_t>(), p[2].get<int64_t>()});
  }
  report.events.cached = field<std::vector<uint64_t>>(message, "cached");
  report.events.evicted = field<std::vector<uint64_t>>(message, "evicted");
  report.aborts_applied = field<int64_t>(message, "aborts_applied");
  report.failed = field<bool>(message, "failed");
  report.stepped = field<bool>(message, "stepped");
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
  s.running = field<int64_t>(message, "running");
  s.waiting = field<int64_t>(message, "waiting");
  s.preemptions = field<int64_t>(message, "preemptions");
  s.pool_bytes = field<int64_t>(message, "pool_bytes");
  s.used_bytes = field<int64_t>(message, "used_bytes");
  s.cached_bytes = field<int64_t>(message, "cached_bytes");
  for (const json& g : array_field(message, "groups")) {
    DSV4_CHECK(g.is_array() && g.size() == 4 && g[0].is_number_integer() && g[1].is_number_integer() &&
                   g[2].is_number_integer() && g[3].is_number_integer(),
               "rank message: a cache group must be [kind, used, cached, capacity]");
    const auto kind = g[0].get<int64_t>();
    DSV4_CHECK(kind >= 0 && kind <= static_cast<int64_t>(CacheGroupKind::kC128State),
               "rank message: cache group kind " + std::to_string(kind) + " out of range");
    s.groups.push_back({static_cast<CacheGroupKind>(kind), g[1].get<int64_t>(), g[2].get<int64_t>(),
                        g[3].get<int64_t>()});
  }
  s.prefix_queries = field<int64_t>(message, "prefix_queries");
  s.prefix_query_tokens = field<int64_t>(message, "prefix_query_tokens");
  s.prefix_hit_tokens = field<int64_t>(message, "prefix_hit_tokens");
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
