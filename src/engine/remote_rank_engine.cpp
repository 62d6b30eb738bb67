#include "engine/remote_rank_engine.h"

#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include "core/error.h"
#include "engine/rank_protocol.h"

namespace dsv4 {

using nlohmann::json;

RemoteRankEngine::RemoteRankEngine(int fd, pid_t worker_pid, int64_t max_model_len, EngineStats stats)
    : fd_(fd), worker_pid_(worker_pid), max_model_len_(max_model_len), stats_(std::move(stats)) {}

RemoteRankEngine::~RemoteRankEngine() {
  try {
    rank_protocol::send_message(fd_, {{"op", "stop"}});
  } catch (const std::exception&) {  // already gone
  }
  ::shutdown(fd_, SHUT_RDWR);
  ::close(fd_);
  if (worker_pid_ > 0) {
    // A worker mid-step finishes it first; give it a few seconds, then end it.
    for (int i = 0; i < 100; ++i) {
      if (::waitpid(worker_pid_, nullptr, WNOHANG) != 0) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ::kill(worker_pid_, SIGKILL);
    ::waitpid(worker_pid_, nullptr, 0);
  }
}

void RemoteRankEngine::check_request(RequestId id, std::span<const int32_t> prompt,
                                     const SamplingParams& params) const {
  // The worker serves the same model under the same limits; what only it knows (its pool) it rejects on apply.
  if (twin_ != nullptr) twin_->check_request(id, prompt, params);
}

json RemoteRankEngine::encode_commands(const std::deque<RankCommand>& commands) {
  json encoded = json::array();
  for (const RankCommand& command : commands) {
    encoded.push_back(rank_protocol::encode(command));
    if (command.add) held_.insert(command.id);
    else
      held_.erase(command.id);
  }
  return encoded;
}

void RemoteRankEngine::call(const json& message, RankReport& report) {
  rank_protocol::send_message(fd_, message);
  const std::optional<json> reply = rank_protocol::receive_message(fd_);
  DSV4_CHECK(reply.has_value(), "its worker process ended (the connection closed)");
  if (reply->contains("error")) throw Error(reply->at("error").is_string() ? reply->at("error").get<std::string>()
                                                                          : "the worker failed");
  DSV4_CHECK(reply->contains("report") && reply->contains("stats"), "the worker's reply has no report");
  RankReport part = rank_protocol::decode_report(reply->at("report"));
  stats_ = rank_protocol::decode_stats(reply->at("stats"));
  DSV4_CHECK(reply->contains("has_work") && reply->at("has_work").is_boolean(), "the worker's reply has no has_work");
  has_work_ = reply->at("has_work").get<bool>();
  for (RequestOutput& output : part.outputs) {
    if (output.finished) held_.erase(output.id);
    report.outputs.push_back(std::move(output));
  }
  for (const RankProgress& progress : part.progress) report.progress.push_back(progress);
  report.events.cached.insert(report.events.cached.end(), part.events.cached.begin(), part.events.cached.end());
  report.events.evicted.insert(report.events.evicted.end(), part.events.evicted.begin(), part.events.evicted.end());
  report.aborts_applied += part.aborts_applied;
  report.stepped = report.stepped || part.stepped;
}

bool RemoteRankEngine::apply(std::deque<RankCommand> commands, RankReport& report) {
  call({{"op", "apply"}, {"commands", encode_commands(commands)}}, report);
  return has_work_;
}

void RemoteRankEngine::step(bool forward, RankReport& report) { call({{"op", "step"}, {"forward", forward}}, report); }

void RemoteRankEngine::apply_and_step(std::deque<RankCommand> commands, RankReport& report) {
  call({{"op", "apply_step"}, {"commands", encode_commands(commands)}}, report);
}

bool RemoteRankEngine::connection_lost() const {
  pollfd watch{fd_, POLLRDHUP, 0};
  // Only called between calls, when no reply is pending: any readable state is the peer's close (or garbage).
  return ::poll(&watch, 1, 0) > 0 && (watch.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLIN)) != 0;
}

void RemoteRankEngine::fail(const std::string& error, RankReport& report) {
  for (const RequestId id : held_) report.outputs.push_back(aborted_output(id, error));
  held_.clear();
  has_work_ = false;
  ::shutdown(fd_, SHUT_RDWR);  // a worker still alive sees the connection close and returns
}

void RemoteRankEngine::abort_collectives(const std::string& reason) {
  (void)reason;
  if (worker_pid_ > 0) ::kill(worker_pid_, SIGKILL);
  ::shutdown(fd_, SHUT_RDWR);
}

void serve_rank(int fd, int rank, RankEngine& engine) {
  for (;;) {
    std::optional<json> message;
    try {
      message = rank_protocol::receive_message(fd);
    } catch (const std::exception&) {
      return;  // the front is gone mid-message
    }
    if (!message) return;  // the front closed the connection
    const auto op_field = message->find("op");
    const std::string op = op_field != message->end() && op_field->is_string() ? op_field->get<std::string>() : "";
    if (op == "stop") return;
    RankReport report;
    report.rank = rank;
    try {
      std::deque<RankCommand> commands;
      if (op == "apply" || op == "apply_step") {
        DSV4_CHECK(message->contains("commands") && message->at("commands").is_array(), "a request without 'commands'");
        for (const json& command : message->at("commands")) commands.push_back(rank_protocol::decode_command(command));
      }
      if (op == "apply") {
        engine.apply(std::move(commands), report);
      } else if (op == "step") {
        DSV4_CHECK(message->contains("forward") && message->at("forward").is_boolean(), "a step without 'forward'");
        engine.step(message->at("forward").get<bool>(), report);
      } else if (op == "apply_step") {
        engine.apply_and_step(std::move(commands), report);
      } else {
        throw Error("unknown rank request '" + op + "'");
      }
    } catch (const std::exception& error) {
      // The rank fails: in lockstep its peers here may wait for it in a collective.
      engine.abort_collectives(error.what());
      try {
        rank_protocol::send_message(fd, {{"error", error.what()}});
      } catch (const std::exception&) {
      }
      return;
    }
    try {
      rank_protocol::send_message(fd, {{"has_work", engine.has_unfinished()},
                                       {"report", rank_protocol::encode(report)},
                                       {"stats", rank_protocol::encode(engine.stats())}});
    } catch (const std::exception&) {
      return;
    }
  }
}

}  // namespace dsv4
