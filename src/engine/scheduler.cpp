#include "engine/scheduler.h"

#include <algorithm>

#include "core/error.h"

namespace dsv4 {
namespace {

std::string n(int64_t value) { return std::to_string(value); }

bool contains(const std::vector<int32_t>& ids, int32_t id) {
  return std::find(ids.begin(), ids.end(), id) != ids.end();
}

}  // namespace

void SchedulerConfig::validate() const {
  DSV4_CHECK(max_num_seqs >= 1, "max_num_seqs = " + n(max_num_seqs) + ": must be at least 1");
  DSV4_CHECK(max_num_batched_tokens >= 1,
        "max_num_batched_tokens = " + n(max_num_batched_tokens) + ": must be at least 1");
  DSV4_CHECK(max_model_len >= 2,
        "max_model_len = " + n(max_model_len) + ": must be at least 2 (a prompt token and one to generate)");
  DSV4_CHECK(long_prefill_token_threshold >= 0,
        "long_prefill_token_threshold = " + n(long_prefill_token_threshold) + ": must be 0 (off) or positive");
  DSV4_CHECK(!align_prefill_chunks || (checkpoint_interval > 0 && checkpoint_interval % kLogicalBlockTokens == 0),
        "checkpoint_interval = " + n(checkpoint_interval) + ": must be a positive multiple of " +
            n(kLogicalBlockTokens));
}

void SchedulerOutput::clear() {
  step = 0;
  scheduled.clear();
  preempted_ids.clear();
  finished_ids.clear();
  num_scheduled_tokens = 0;
}

Scheduler::Scheduler(SchedulerConfig config, HybridKvCacheManager& manager)
    : config_(std::move(config)), manager_(manager) {
  config_.validate();
}

void Scheduler::check_request(RequestId id, std::span<const int32_t> prompt,
                              const SamplingParams& params) const {
  const std::string what = "request " + std::to_string(id);
  DSV4_CHECK(!prompt.empty(), what + ": the prompt is empty");
  DSV4_CHECK(params.max_tokens >= 1, what + ": max_tokens = " + n(params.max_tokens) + ": must be at least 1");
  try {
    validate(params);
  } catch (const Error& e) {
    throw Error(what + ": " + e.what());
  }
  const int64_t prompt_tokens = static_cast<int64_t>(prompt.size());
  // Compared without overflow: max_tokens may be anything a client sends.
  const bool too_long = params.max_tokens > config_.max_model_len - prompt_tokens;
  const int64_t total = too_long ? 0 : prompt_tokens + params.max_tokens;
  if (too_long)
    throw Error(what + ": prompt of " + n(prompt_tokens) + " tokens + max_tokens " + n(params.max_tokens) +
                " exceeds max_model_len " + n(config_.max_model_len));
  if (!manager_.fits_in_pool(total))
    throw Error(what + ": prompt of " + n(prompt_tokens) + " tokens + max_tokens " + n(params.max_tokens) + " = " +
                n(total) + " tokens need more KV cache than the whole pool holds (" +
                n(manager_.pool().num_pages() * manager_.pool().page_bytes()) + " bytes; " +
                n(manager_.blocks_for_prompt(total)) + " blocks cold)");
}

void Scheduler::add_request(RequestId id, std::vector<int32_t> prompt, SamplingParams params) {
  check_request(id, prompt, params);
  DSV4_CHECK(requests_.count(id) == 0, "request " + std::to_string(id) + ": the id is already in use");
  const int64_t prompt_tokens = static_cast<int64_t>(prompt.size());
  auto request = std::make_unique<Request>();
  request->id = id;
  request->arrival = next_arrival_++;
  request->params = std::move(params);
  request->token_ids = std::move(prompt);
  request->num_prompt_tokens = prompt_tokens;
  waiting_.push_back(request.get());
  requests_.emplace(id, std::move(request));
}

const Request* Scheduler::find(RequestId id) const {
  const auto it = requests_.find(id);
  return it == requests_.end() ? nullptr : it->second.get();
}

bool Scheduler::abort(RequestId id) {
  const auto it = requests_.find(id);
  if (it == requests_.end()) return false;
  Request& request = *it->second;
  if (request.status == RequestStatus::kRunning) {
    manager_.release(id);
    running_.erase(std::find(running_.begin(), running_.end(), &request));
  } else {
    waiting_.erase(std::find(waiting_.begin(), waiting_.end(), &request));
  }
  request.status = RequestStatus::kFinishedAborted;
  finished_since_schedule_.push_back(id);
  retire(request);
  return true;
}

void Scheduler::retire(Request& request) {
  const auto it = requests_.find(request.id);
  retired_.push_back(std::move(it->second));
  requests_.erase(it);
}

int64_t Scheduler::chunk_tokens(const Request& request, int64_t budget) const {
  const int64_t start = request.num_computed_tokens, total = request.num_tokens();
  if (total - start == 1) return 1;  // a decode (budget > 0 here)
  int64_t count = std::min(total - start, budget);
  if (config_.long_prefill_token_threshold > 0) count = std::min(count, config_.long_prefill_token_threshold);
  const int64_t end = start + count;
  if (!config_.align_prefill_chunks) return count;
  if (end == total) {  // the final chunk (a decode included)
    const int64_t aligned = end / kLogicalBlockTokens * kLogicalBlockTokens;
    return config_.checkpoint_last_full_block && aligned > start ? aligned - start : count;
  }
  for (const int64_t unit : {config_.checkpoint_interval, kLogicalBlockTokens}) {
    const int64_t aligned = end / unit * unit;
    if (aligned > start) return aligned - start;
  }
  return count;
}

void Scheduler::emit(Request& request, int64_t num_tokens, bool first_chunk, SchedulerOutput& out) {
  const int64_t start = request.num_computed_tokens;
  const std::span<const int32_t> tokens(request.token_ids);
  out.scheduled.push_back({request.id, start, num_tokens, tokens.first(static_cast<size_t>(start + num_tokens)),
                           start + num_tokens == request.num_tokens(), first_chunk, &request.params,
                           request.num_prompt_tokens});
  out.num_scheduled_tokens += num_tokens;
  step_requests_.push_back(&request);
}

void Scheduler::preempt(Request& request, SchedulerOutput& out) {
  manager_.release(request.id);
  request.status = RequestStatus::kPreempted;
  request.num_computed_tokens = 0;
  ++request.num_preemptions;
  ++num_preemptions_;
  waiting_.push_front(&request);
  out.preempted_ids.push_back(request.id);
}

SchedulerOutput Scheduler::schedule() {
  SchedulerOutput out;
  schedule(out);
  return out;
}

void Scheduler::schedule(SchedulerOutput& out) {
  out.clear();
  out.step = ++step_;
  step_open_ = true;
  step_requests_.clear();
  retired_.clear();
  out.finished_ids.swap(finished_since_schedule_);
  int64_t budget = config_.max_num_batched_tokens;

  // (a) Running requests, oldest first. Victims come off the back, which is never a request scheduled already.
  for (size_t i = 0; i < running_.size() && budget > 0;) {
    Request& request = *running_[i];
    const int64_t count = chunk_tokens(request, budget);
    bool allocated = manager_.allocate(request.id, count);
    while (!allocated) {
      Request& victim = *running_.back();
      running_.pop_back();
      preempt(victim, out);
      if (&victim == &request) break;
      allocated = manager_.allocate(request.id, count);
    }
    if (!allocated) break;  // it preempted itself: everything after it is gone too
    emit(request, count, false, out);
    budget -= count;
    ++i;
  }

  // (b) Waiting requests, FCFS, only in a step that preempted nothing.
  while (out.preempted_ids.empty() && !waiting_.empty() && budget > 0 &&
         static_cast<int64_t>(running_.size()) < config_.max_num_seqs) {
    Request& request = *waiting_.front();
    const std::optional<int64_t> hit = manager_.admit(request.id, request.token_ids);
    int64_t count = 0;
    bool allocated = false;
    if (hit) {
      if (*hit < 0 || *hit >= request.num_tokens())
        throw Error("cache manager: prefix hit of " + n(*hit) + " tokens for request " + std::to_string(request.id) +
                    " of " + n(request.num_tokens()) + " tokens (must leave at least one token to compute)");
      request.num_computed_tokens = *hit;
      if (request.num_preemptions == 0) request.num_cached_tokens = *hit;  // as vLLM reports it: first admission
      count = chunk_tokens(request, budget);
      allocated = manager_.allocate(request.id, count);
      if (!allocated) {
        manager_.release(request.id);
        request.num_computed_tokens = 0;
      }
    }
    if (!allocated) {
      // Nothing runs, so the pool holds nothing but evictable cache: this request can never run. Abort it rather
      // than spin (add_request's fits_in_pool check makes this a cache-manager inconsistency).
      if (running_.empty()) {
        waiting_.pop_front();
        request.status = RequestStatus::kFinishedAborted;
        request.error = "request " + std::to_string(request.id) + " of " + n(request.num_tokens()) +
                        " tokens could not be scheduled in an idle KV cache pool of " +
                        n(manager_.pool().num_pages() * manager_.pool().page_bytes()) + " bytes (" +
                        (hit ? "allocating " + n(count) + " tokens after a prefix hit of " + n(*hit) + " failed"
                             : std::string("admission failed")) +
                        ")";
        finished_since_schedule_.push_back(request.id);
        retire(request);
        unreported_aborts_.push_back(std::move(retired_.back()));  // kept until update() has reported it
        retired_.pop_back();
        continue;
      }
      break;
    }
    waiting_.pop_front();
    request.status = RequestStatus::kRunning;
    running_.push_back(&request);
    emit(request, count, true, out);
    budget -= count;
  }
}

RequestStatus Scheduler::stop_status(const Request& request, int32_t token) const {
  if (!request.params.ignore_eos && contains(config_.eos_token_ids, token)) return RequestStatus::kFinishedStopped;
  if (contains(request.params.stop_token_ids, token)) return RequestStatus::kFinishedStopped;
  if (request.num_output_tokens() >= request.params.max_tokens || request.num_tokens() >= config_.max_model_len)
    return RequestStatus::kFinishedLength;
  return RequestStatus::kRunning;
}

void Scheduler::update(const SchedulerOutput& out, std::span<const int32_t> sampled,
                       std::vector<TokenUpdate>& updates) {
  // Messages are built only on failure: this runs every step (and the loop below once per request).
  if (!step_open_ || out.step != step_)
    throw Error("Scheduler::update: output of step " + std::to_string(out.step) + " is not the last scheduled step " +
                std::to_string(step_) + (step_open_ ? "" : " (already updated)"));
  if (out.scheduled.size() != step_requests_.size())
    throw Error("Scheduler::update: the scheduler output was modified");
  if (sampled.size() != out.scheduled.size())
    throw Error("Scheduler::update: " + std::to_string(sampled.size()) + " sampled tokens for " +
                std::to_string(out.scheduled.size()) + " scheduled requests");
  step_open_ = false;
  updates.clear();
  reported_aborts_.clear();
  reported_aborts_.swap(unreported_aborts_);
  for (const auto& request : reported_aborts_)
    updates.push_back({request->id, kNoToken, request->status, &request->error, request->num_cached_tokens});
  bool any_finished = false;
  for (size_t i = 0; i < out.scheduled.size(); ++i) {
    Request& request = *step_requests_[i];
    if (is_finished(request.status)) continue;  // aborted during the step
    const ScheduledChunk& chunk = out.scheduled[i];
    request.num_computed_tokens = chunk.start + chunk.num_tokens;
    manager_.commit(request.id, request.token_ids, request.num_computed_tokens);
    if (!chunk.samples) continue;
    const int32_t token = sampled[i];
    if (token < 0) throw Error("Scheduler::update: no token sampled for request " + std::to_string(request.id));
    request.token_ids.push_back(token);
    const RequestStatus status = stop_status(request, token);
    updates.push_back({request.id, token, status, nullptr, request.num_cached_tokens});
    if (is_finished(status)) {
      request.status = status;
      manager_.release(request.id);
      finished_since_schedule_.push_back(request.id);
      retire(request);
      any_finished = true;
    }
  }
  if (any_finished)
    running_.erase(std::remove_if(running_.begin(), running_.end(),
                                  [](const Request* request) { return is_finished(request->status); }),
                   running_.end());
}

void Scheduler::check_invariants() const {
  auto fail = [](const Request& request, const std::string& why) {
    throw Error("scheduler invariant: request " + std::to_string(request.id) + " (" +
                request_status_name(request.status) + "): " + why);
  };
  DSV4_CHECK(running_.size() + waiting_.size() == requests_.size(),
        "scheduler invariant: " + std::to_string(running_.size()) + " running + " + std::to_string(waiting_.size()) +
            " waiting != " + std::to_string(requests_.size()) + " requests");
  DSV4_CHECK(static_cast<int64_t>(running_.size()) <= config_.max_num_seqs,
        "scheduler invariant: " + std::to_string(running_.size()) + " running > max_num_seqs " +
            n(config_.max_num_seqs));
  for (const Request* request : running_) {
    const auto it = requests_.find(request->id);
    if (it == requests_.end() || it->second.get() != request) fail(*request, "running but not tracked");
    if (request->status != RequestStatus::kRunning) fail(*request, "in the running list");
    if (!manager_.has_request(request->id)) fail(*request, "running but unknown to the cache manager");
    if (manager_.num_computed(request->id) != request->num_computed_tokens)
      fail(*request, "num_computed " + n(request->num_computed_tokens) + " but the cache manager has " +
                         n(manager_.num_computed(request->id)));
    if (request->num_computed_tokens >= request->num_tokens())
      fail(*request, "nothing left to compute (" + n(request->num_computed_tokens) + " of " +
                         n(request->num_tokens()) + " tokens)");
  }
  for (const Request* request : waiting_) {
    const auto it = requests_.find(request->id);
    if (it == requests_.end() || it->second.get() != request) fail(*request, "waiting but not tracked");
    if (request->status != RequestStatus::kWaiting && request->status != RequestStatus::kPreempted)
      fail(*request, "in the waiting queue");
    if (manager_.has_request(request->id)) fail(*request, "waiting but holds cache blocks");
    if (request->num_computed_tokens != 0)
      fail(*request, "waiting with " + n(request->num_computed_tokens) + " tokens computed");
  }
}

}  // namespace dsv4
