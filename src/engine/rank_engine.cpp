#include "engine/rank_engine.h"

namespace dsv4 {

RequestOutput aborted_output(RequestId id, const std::string& error) {
  RequestOutput output;
  output.id = id;
  output.finished = true;
  output.status = RequestStatus::kFinishedAborted;
  output.error = error;
  return output;
}

void RankEngine::apply_and_step(std::deque<RankCommand> commands, RankReport& report) {
  step(apply(std::move(commands), report), report);
}

bool LocalRankEngine::apply(std::deque<RankCommand> commands, RankReport& report) {
  for (RankCommand& command : commands) {
    if (!command.add) {
      ++report.aborts_applied;
      const auto it = to_local_.find(command.id);
      if (it == to_local_.end()) continue;  // finished before the abort arrived
      engine_.abort(it->second);
      to_front_.erase(it->second);
      to_local_.erase(it);
      continue;
    }
    try {
      const RequestId local = engine_.add_request(std::move(command.prompt), std::move(command.params));
      to_front_.emplace(local, command.id);
      to_local_.emplace(command.id, local);
    } catch (const std::exception& error) {  // the front checked it: only a rank-specific limit lands here
      report.outputs.push_back(aborted_output(command.id, error.what()));
    }
  }
  return engine_.has_unfinished();
}

void LocalRankEngine::step(bool forward, RankReport& report) {
  if (forward) {
    const bool own_work = engine_.has_unfinished();
    std::vector<RequestOutput> outputs = engine_.step();
    report.stepped = own_work;  // an idle rank's empty forward reports nothing
    // Progress of what this step scheduled or preempted, read before the finished ones are forgotten.
    const SchedulerOutput& scheduled = engine_.last_scheduled();
    auto progress = [&](RequestId local) {
      const Request* request = engine_.scheduler().find(local);
      const auto front = to_front_.find(local);
      if (request && front != to_front_.end())
        report.progress.push_back({front->second, request->num_computed_tokens, request->num_tokens()});
    };
    for (const ScheduledChunk& chunk : scheduled.scheduled) progress(chunk.id);
    for (const RequestId local : scheduled.preempted_ids) progress(local);
    for (RequestOutput& output : outputs) {
      const auto front = to_front_.find(output.id);
      if (front == to_front_.end()) continue;
      output.id = front->second;
      if (output.finished) {
        to_local_.erase(front->second);
        to_front_.erase(front);
      }
      report.outputs.push_back(std::move(output));
    }
  }
  report.events = engine_.drain_prefix_cache_events();
}

void LocalRankEngine::fail(const std::string& error, RankReport& report) {
  // Abort what the engine holds so its blocks return to the pool. A step that threw left the scheduler
  // between schedule() and update(), where abort is defined; should cleanup throw too, the requests still
  // finish.
  for (const auto& [local, front] : to_front_) {
    try {
      engine_.abort(local);
    } catch (const std::exception&) {
    }
    report.outputs.push_back(aborted_output(front, error));
  }
  to_front_.clear();
  to_local_.clear();
}

}  // namespace dsv4
