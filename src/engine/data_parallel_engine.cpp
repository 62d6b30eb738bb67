#include "engine/data_parallel_engine.h"

#include <algorithm>

#include "core/error.h"

namespace dsv4 {
namespace {

DataParallelRouterConfig router_config(DataParallelRouterConfig router, size_t num_ranks,
                                       const EngineConfig& config) {
  router.num_ranks = static_cast<int>(num_ranks);
  // The router's queue-delay unit is one rank step's token budget.
  router.prefill_tokens_per_step = config.max_num_batched_tokens;
  return router;
}

}  // namespace

EngineConfig DataParallelEngine::rank_config(EngineConfig config, bool lockstep) {
  // The ranks report prefix-cache events to the router.
  config.record_prefix_cache_events = config.enable_prefix_caching;
  if (lockstep) config.forward_every_step = true;
  return config;
}

DataParallelEngine::DataParallelEngine(std::vector<ModelBackend*> rank_backends, EngineConfig config,
                                       DataParallelRouterConfig router, bool lockstep,
                                       std::vector<std::unique_ptr<RankEngine>> remote_ranks)
    : router_(router_config(std::move(router), rank_backends.size() + remote_ranks.size(), config)) {
  DSV4_CHECK(!rank_backends.empty(), "a data-parallel engine needs at least one rank in this process");
  DSV4_CHECK(router_.config().prefix_cache_salt.empty(),
             "the router's prefix_cache_salt must be empty: the ranks' cache managers hash with no salt");
  for (const ModelBackend* backend : rank_backends) {
    DSV4_CHECK(backend != nullptr, "a data-parallel rank has no backend");
    // Every rank must serve the same model, or a request's tokens would depend on where it was routed.
    DSV4_CHECK(backend->config().vocab_size == rank_backends[0]->config().vocab_size &&
                   backend->config().num_hidden_layers == rank_backends[0]->config().num_hidden_layers &&
                   backend->config().hidden_size == rank_backends[0]->config().hidden_size,
               "data-parallel ranks serve different models");
  }
  for (const auto& remote : remote_ranks) DSV4_CHECK(remote != nullptr, "a data-parallel rank has no engine");
  config = rank_config(std::move(config), lockstep);
  const size_t num_ranks = rank_backends.size() + remote_ranks.size();
  if (lockstep) lockstep_ = std::make_unique<LockstepGate>(static_cast<int>(num_ranks));
  for (size_t r = 0; r < num_ranks; ++r) {
    auto rank = std::make_unique<Rank>();
    rank->index = static_cast<int>(r);
    if (r < rank_backends.size()) {
      rank->engine = std::make_unique<LocalRankEngine>(*rank_backends[r], config);
    } else {
      rank->engine = std::move(remote_ranks[r - rank_backends.size()]);
      rank->engine->set_request_checker(ranks_[0]->engine.get());
    }
    rank->stats = rank->engine->stats();
    ranks_.push_back(std::move(rank));
  }
  max_model_len_ = ranks_[0]->engine->max_model_len();
  // Threads start once every rank exists: a constructor that throws half way has none to stop.
  for (auto& rank : ranks_) rank->thread = std::thread([this, r = rank.get()] { run_rank(*r); });
}

DataParallelEngine::~DataParallelEngine() {
  for (auto& rank : ranks_) {
    {
      std::lock_guard lock(rank->mutex);
      rank->stopping = true;
    }
    rank->wake.notify_all();
  }
  if (lockstep_) lockstep_->stop();
  for (auto& rank : ranks_)
    if (rank->thread.joinable()) rank->thread.join();
}

RequestId DataParallelEngine::add_request(std::vector<int32_t> prompt, SamplingParams params) {
  const RequestId id = next_id_;
  for (;;) {
    const RankChoice choice = router_.route(prompt);  // throws once every rank has failed
    Rank& rank = *ranks_[static_cast<size_t>(choice.rank)];
    // Rejected here, synchronously, as a single Engine rejects it: the rank's thread never sees it.
    rank.engine->check_request(id, prompt, params);
    const int64_t prompt_tokens = static_cast<int64_t>(prompt.size());
    {
      std::lock_guard lock(rank.mutex);
      // The rank may have failed since its last report: route again among the others.
      if (rank.failed) {
        router_.mark_rank_failed(choice.rank);
        continue;
      }
      rank.inbox.push_back({true, id, std::move(prompt), std::move(params)});
    }
    rank.wake.notify_one();
    if (lockstep_) lockstep_->command_posted();
    router_.on_admitted(choice.rank, id, prompt_tokens,
                        std::min(choice.matched_prefix_tokens, prompt_tokens - 1));
    live_.emplace(id, choice.rank);
    ++next_id_;
    return id;
  }
}

bool DataParallelEngine::abort(RequestId id) {
  const auto it = live_.find(id);
  if (it == live_.end()) return false;
  Rank& rank = *ranks_[static_cast<size_t>(it->second)];
  live_.erase(it);
  router_.on_finished(id);
  {
    std::lock_guard lock(rank.mutex);
    if (rank.failed) return true;  // its requests are gone already
    rank.inbox.push_back({false, id, {}, {}});
  }
  ++unapplied_aborts_;
  rank.wake.notify_one();
  if (lockstep_) lockstep_->command_posted();
  return true;
}

std::vector<RequestOutput> DataParallelEngine::step() {
  std::vector<RankReport> reports;
  {
    std::unique_lock lock(reports_mutex_);
    if (has_unfinished()) reports_ready_.wait_for(lock, report_wait, [this] { return !reports_.empty(); });
    reports.swap(reports_);
  }
  std::vector<RequestOutput> outputs;
  for (RankReport& report : reports) {
    unapplied_aborts_ -= report.aborts_applied;
    if (!router_.rank_failed(report.rank)) {
      router_.on_blocks_evicted(report.rank, report.events.evicted);
      router_.on_blocks_cached(report.rank, report.events.cached);
      for (const RankProgress& progress : report.progress)
        if (live_.count(progress.id))
          router_.on_progress(progress.id, progress.num_computed_tokens, progress.num_tokens);
    }
    if (report.failed) router_.mark_rank_failed(report.rank);
    for (RequestOutput& output : report.outputs) {
      const auto it = live_.find(output.id);
      if (it == live_.end()) continue;  // aborted by the caller while the rank was stepping it
      if (output.finished) {
        live_.erase(it);
        router_.on_finished(output.id);
      }
      outputs.push_back(std::move(output));
    }
  }
  return outputs;
}

int DataParallelEngine::rank_of(RequestId id) const {
  const auto it = live_.find(id);
  return it == live_.end() ? -1 : it->second;
}

bool DataParallelEngine::rank_failed(int rank) const {
  DSV4_CHECK(rank >= 0 && rank < num_ranks(), "rank " + std::to_string(rank) + " out of range");
  std::lock_guard lock(ranks_[static_cast<size_t>(rank)]->mutex);
  return ranks_[static_cast<size_t>(rank)]->failed;
}

EngineStats DataParallelEngine::rank_stats(int rank) const {
  DSV4_CHECK(rank >= 0 && rank < num_ranks(), "rank " + std::to_string(rank) + " out of range");
  std::lock_guard lock(ranks_[static_cast<size_t>(rank)]->mutex);
  return ranks_[static_cast<size_t>(rank)]->stats;
}

EngineStats DataParallelEngine::stats() const {
  EngineStats total;
  total.num_ranks = num_ranks();
  total.failed_ranks = 0;
  for (const auto& rank : ranks_) {
    std::lock_guard lock(rank->mutex);
    if (rank->failed) {
      ++total.failed_ranks;
      continue;
    }
    total.accumulate(rank->stats);
  }
  return total;
}

void DataParallelEngine::post_report(RankReport report) {
  {
    std::lock_guard lock(reports_mutex_);
    reports_.push_back(std::move(report));
  }
  reports_ready_.notify_all();
}

void DataParallelEngine::fail_rank(Rank& rank, const std::string& cause, RankReport& report) {
  const std::string error = "data-parallel rank " + std::to_string(rank.index) + " failed: " + cause;
  std::deque<RankCommand> unapplied;
  {
    std::lock_guard lock(rank.mutex);
    rank.failed = true;  // from here on add_request routes around it and abort sends it nothing
    rank.failure = error;
    unapplied.swap(rank.inbox);
  }
  rank.engine->fail(error, report);
  for (const RankCommand& command : unapplied) {
    if (command.add) report.outputs.push_back(aborted_output(command.id, error));
    else
      ++report.aborts_applied;  // nothing left to free: the failure aborted everything
  }
  report.failed = true;
  EngineStats stats;
  try {
    stats = rank.engine->stats();
  } catch (const std::exception&) {
  }
  std::lock_guard lock(rank.mutex);
  rank.stats = std::move(stats);
}

void DataParallelEngine::run_rank(Rank& rank) {
  RankEngine& engine = *rank.engine;
  for (;;) {
    std::deque<RankCommand> commands;
    // Read before the inbox is taken: a command posted after this moves it, so an idle round cannot miss it.
    const uint64_t commands_seen = lockstep_ ? lockstep_->commands_posted() : 0;
    {
      std::unique_lock lock(rank.mutex);
      if (!lockstep_) {
        // An idle rank looks at its connection every 100 ms: a worker killed meanwhile fails now, not when the
        // next request routed to it finds it gone.
        bool lost = false;
        while (!rank.wake.wait_for(lock, std::chrono::milliseconds(100), [&] {
          return rank.stopping || !rank.inbox.empty() || engine.has_unfinished();
        }))
          if ((lost = engine.connection_lost())) break;
        if (lost && !rank.stopping) {
          lock.unlock();
          RankReport report;
          report.rank = rank.index;
          fail_rank(rank, "its worker process ended (the connection closed)", report);
          post_report(std::move(report));
          return;
        }
      }
      if (rank.stopping) return;
      commands.swap(rank.inbox);
    }
    RankReport report;
    report.rank = rank.index;
    bool step = false;
    try {
      if (lockstep_) {
        const bool own_work = engine.apply(std::move(commands), report);
        const LockstepGate::Decision decision = lockstep_->arrive(own_work);
        if (decision == LockstepGate::Decision::kStop) return;
        step = decision == LockstepGate::Decision::kStep;  // an idle rank steps too: an empty forward
        engine.step(step, report);
      } else {
        engine.apply_and_step(std::move(commands), report);
      }
    } catch (const std::exception& error) {
      fail_rank(rank, error.what(), report);
      if (lockstep_) {
        lockstep_->leave();
        // With the experts split no rank can serve without this one's: release every rank's collectives (the
        // in-process group's abort reaches all of them at once; NCCL's and a worker process's do not).
        const std::string reason = "data-parallel rank " + std::to_string(rank.index) + " failed: " + error.what();
        for (auto& other : ranks_) other->engine->abort_collectives(reason);
      }
      post_report(std::move(report));
      return;
    }
    {
      std::lock_guard lock(rank.mutex);
      rank.stats = engine.stats();
    }
    if (report.stepped || !report.outputs.empty() || !report.events.empty() || report.aborts_applied > 0)
      post_report(std::move(report));
    if (lockstep_ && !step) lockstep_->wait_for_commands(commands_seen);  // nothing anywhere: sleep
  }
}

// ---- LockstepGate ----

DataParallelEngine::LockstepGate::Decision DataParallelEngine::LockstepGate::arrive(bool has_work) {
  std::unique_lock lock(mutex_);
  if (stopping_) return Decision::kStop;
  any_work_ = any_work_ || has_work;
  const uint64_t round = round_;
  if (++arrived_ >= members_) {
    complete_round();
  } else {
    wake_.notify_all();  // a rank asleep in wait_for_commands joins this round
    wake_.wait(lock, [&] { return stopping_ || round_ != round; });
  }
  return stopping_ ? Decision::kStop : decision_;
}

void DataParallelEngine::LockstepGate::leave() {
  std::lock_guard lock(mutex_);
  --members_;
  if (members_ > 0 && arrived_ >= members_) complete_round();
}

void DataParallelEngine::LockstepGate::complete_round() {
  decision_ = any_work_ ? Decision::kStep : Decision::kIdle;
  any_work_ = false;
  arrived_ = 0;
  ++round_;
  wake_.notify_all();
}

uint64_t DataParallelEngine::LockstepGate::commands_posted() const {
  std::lock_guard lock(mutex_);
  return commands_;
}

void DataParallelEngine::LockstepGate::command_posted() {
  {
    std::lock_guard lock(mutex_);
    ++commands_;
  }
  wake_.notify_all();
}

// Also ends when another rank has arrived at the gate: the commands it took may have been posted before this
// rank read `seen`, so only its arrival says that a round has work.
void DataParallelEngine::LockstepGate::wait_for_commands(uint64_t seen) {
  std::unique_lock lock(mutex_);
  wake_.wait(lock, [&] { return stopping_ || commands_ != seen || arrived_ > 0; });
}

void DataParallelEngine::LockstepGate::stop() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
}

}  // namespace dsv4
