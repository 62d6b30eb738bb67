#include "server/engine_service.h"

#include <chrono>
#include <cstdio>

#include "core/error.h"
#include "tokenizer/incremental_detokenizer.h"
#include "tokenizer/stop_strings.h"

namespace dsv4::server {

using Clock = std::chrono::steady_clock;

namespace {
double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}
std::vector<uint8_t> bytes_of(const std::string& text) { return std::vector<uint8_t>(text.begin(), text.end()); }
}  // namespace

struct EngineService::ChoiceState {
  RequestId request = 0;
  std::unique_ptr<IncrementalDetokenizer> detokenizer;
  StopStringMatcher stop;
  bool finished = false;
  int64_t prompt_tokens = 0, output_tokens = 0, cached_tokens = 0;
  Clock::time_point last_token;
  bool has_token = false;
  ChoiceState(const Tokenizer& tokenizer, bool skip_special, std::vector<std::string> stop_strings)
      : detokenizer(std::make_unique<IncrementalDetokenizer>(tokenizer, skip_special)),
        stop(std::move(stop_strings)) {}
};

struct EngineService::Job {
  JobId id = 0;
  JobSpec spec;
  JobListener listener;
  Clock::time_point arrival;
  std::vector<ChoiceState> choices;
  int64_t unfinished = 0;
  std::string engine_error;  // set when the engine failed one of its requests (a data-parallel rank died)
};

EngineService::EngineService(DeepseekV4Model& model, const Tokenizer& tokenizer, EngineConfig config,
                             ServiceOptions options, ServerMetrics& metrics)
    : EngineService(std::make_unique<Engine>(model, config), tokenizer, options, metrics) {}

EngineService::EngineService(ModelBackend& backend, const Tokenizer& tokenizer, EngineConfig config,
                             ServiceOptions options, ServerMetrics& metrics)
    : EngineService(std::make_unique<Engine>(backend, config), tokenizer, options, metrics) {}

EngineService::EngineService(std::unique_ptr<ServingEngine> engine, const Tokenizer& tokenizer,
                             ServiceOptions options, ServerMetrics& metrics)
    : tokenizer_(tokenizer), options_(options), metrics_(metrics), engine_(std::move(engine)) {
  DSV4_CHECK(engine_ != nullptr, "the service needs an engine");
  DSV4_CHECK(options_.max_queued_jobs >= 1, "max_queued_jobs must be at least 1");
  max_model_len_ = engine_->max_model_len();
  start();
}

void EngineService::start() {
  publish_gauges();
  thread_ = std::thread([this] { run(); });
}

EngineService::~EngineService() { stop(); }

void EngineService::stop() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
  // The engine thread is gone: its state is ours to drop. The listeners go with their jobs, here and now.
  by_request_.clear();
  jobs_.clear();
  std::lock_guard lock(mutex_);
  inbox_.clear();
  cancels_.clear();
}

JobId EngineService::submit(JobSpec spec, JobListener listener) {
  DSV4_CHECK(!spec.choices.empty(), "a job needs at least one choice");
  auto job = std::make_unique<Job>();
  job->spec = std::move(spec);
  job->listener = std::move(listener);
  job->arrival = Clock::now();
  JobId id;
  {
    std::lock_guard lock(mutex_);
    if (draining_ || stopping_) throw ApiError(503, "the server is shutting down");
    if (active_ >= options_.max_queued_jobs)
      throw ApiError(503, "the server is overloaded: " + std::to_string(active_) +
                              " requests are queued or running (--max-queued-requests); retry later");
    id = next_job_++;
    job->id = id;
    ++active_;
    inbox_.push_back(std::move(job));
  }
  wake_.notify_one();
  return id;
}

void EngineService::cancel(JobId id) {
  {
    std::lock_guard lock(mutex_);
    cancels_.push_back(id);
  }
  wake_.notify_one();
}

void EngineService::begin_drain() {
  std::lock_guard lock(mutex_);
  draining_ = true;
}

int64_t EngineService::active_jobs() const {
  std::lock_guard lock(mutex_);
  return active_;
}

void EngineService::admit(std::unique_ptr<Job> job) {
  std::vector<RequestId> added;
  try {
    for (const auto& choice : job->spec.choices) {
      added.push_back(engine_->add_request(choice.prompt, choice.params));
    }
  } catch (const Error& error) {
    // The engine can never run this job (too long for max_model_len or the pool, a bad id): nothing of it stays.
    for (const RequestId id : added) engine_->abort(id);
    JobUpdate update;
    update.error_status = 400;
    update.error = error.what();
    update.done = true;
    {
      std::lock_guard lock(mutex_);
      --active_;
    }
    job->listener(std::move(update));
    return;
  }
  job->choices.reserve(added.size());
  for (size_t i = 0; i < added.size(); ++i) {
    ChoiceState& state = job->choices.emplace_back(tokenizer_, job->spec.skip_special_tokens, job->spec.stop);
    state.request = added[i];
    state.prompt_tokens = static_cast<int64_t>(job->spec.choices[i].prompt.size());
    metrics_.prompt_tokens += state.prompt_tokens;
    by_request_[added[i]] = {job.get(), i};
  }
  job->unfinished = static_cast<int64_t>(added.size());
  JobUpdate accepted;
  accepted.accepted = true;
  job->listener(std::move(accepted));
  jobs_[job->id] = std::move(job);
}

void EngineService::finish_choice(Job& job, ChoiceState& choice, ChoiceUpdate& update, const std::string& reason) {
  if (choice.finished) return;
  choice.finished = true;
  --job.unfinished;
  update.finish_reason = reason;
  by_request_.erase(choice.request);
  metrics_.count_finished(reason);
  if (reason != "abort") metrics_.e2e_request_latency.observe(seconds_between(job.arrival, Clock::now()));
}

void EngineService::process(const std::vector<RequestOutput>& outputs) {
  const Clock::time_point now = Clock::now();
  std::map<Job*, JobUpdate> updates;
  for (const RequestOutput& output : outputs) {
    const auto found = by_request_.find(output.id);
    if (found == by_request_.end()) continue;  // cancelled or already finished by a stop string
    Job& job = *found->second.first;
    const size_t index = found->second.second;
    ChoiceState& choice = job.choices[index];
    JobUpdate& update = updates[&job];
    ChoiceUpdate* choice_update = nullptr;
    for (auto& existing : update.choices)
      if (existing.index == static_cast<int64_t>(index)) choice_update = &existing;
    if (!choice_update) {
      choice_update = &update.choices.emplace_back();
      choice_update->index = static_cast<int64_t>(index);
    }
    choice.cached_tokens = output.num_cached_tokens;
    for (size_t t = 0; t < output.new_token_ids.size() && !choice.finished; ++t) {
      const int32_t token = output.new_token_ids[t];
      ++choice.output_tokens;
      ++metrics_.generation_tokens;
      if (!choice.has_token) metrics_.time_to_first_token.observe(seconds_between(job.arrival, now));
      else metrics_.inter_token_latency.observe(seconds_between(choice.last_token, now));
      choice.has_token = true;
      choice.last_token = now;
      choice_update->token_ids.push_back(token);
      // Ids past the tokenizer's vocabulary (padding rows of the embedding) have no text, as in HF.
      const bool has_text = token < tokenizer_.vocab_size() && tokenizer_.id_to_token(token).has_value();
      const std::string piece = has_text ? choice.detokenizer->push(token) : std::string();
      if (!output.new_logprobs.empty() && t < output.new_logprobs.size()) {
        const SampleResult& sample = output.new_logprobs[t];
        ChoiceLogprobs& logprobs = choice_update->logprobs;
        const std::string token_text = has_text ? tokenizer_.decode(std::span(&token, 1)) : std::string();
        logprobs.tokens.push_back(token_text);
        logprobs.token_bytes.push_back(bytes_of(token_text));
        logprobs.logprobs.push_back(sample.logprob);
        auto& top = logprobs.top.emplace_back();
        auto& top_bytes = logprobs.top_bytes.emplace_back();
        for (const TokenLogprob& alternative : sample.top) {
          const bool alt_text = alternative.token < tokenizer_.vocab_size();
          const std::string text = alt_text ? tokenizer_.decode(std::span(&alternative.token, 1)) : std::string();
          top.emplace_back(text, alternative.logprob);
          top_bytes.push_back(bytes_of(text));
        }
      }
      std::string visible = choice.stop.push(piece);
      choice_update->text += visible;
      if (choice.stop.stopped()) {
        // A stop string ends the choice here; the engine request is aborted so its blocks free now.
        if (job.spec.include_stop_str_in_output) choice_update->text += choice.stop.matched();
        choice_update->stop_reason = choice.stop.matched();
        engine_->abort(choice.request);
        finish_choice(job, choice, *choice_update, "stop");
      }
    }
    if (output.finished && !choice.finished) {
      choice_update->text += choice.stop.push(choice.detokenizer->flush());
      if (!choice.stop.stopped()) choice_update->text += choice.stop.flush();
      std::string reason = "abort";
      if (output.status == RequestStatus::kFinishedStopped) reason = "stop";
      else if (output.status == RequestStatus::kFinishedLength) reason = "length";
      if (choice.stop.stopped()) {
        choice_update->stop_reason = choice.stop.matched();
        reason = "stop";
      }
      if (!output.error.empty()) {
        std::fprintf(stderr, "dsv4 serve: request %llu aborted by the engine: %s\n",
                     static_cast<unsigned long long>(output.id), output.error.c_str());
        metrics_.count_finished("error");
        if (job.engine_error.empty()) job.engine_error = output.error;
      }
      finish_choice(job, choice, *choice_update, reason);
    }
  }
  // A job the engine failed ends as an error (HTTP 500, or an error event mid-stream, as vLLM answers a dead
  // engine) rather than a quiet "abort": its other choices are aborted so that nothing of it keeps running.
  for (auto& [job, update] : updates) {
    if (job->engine_error.empty()) continue;
    for (size_t i = 0; i < job->choices.size(); ++i) {
      ChoiceState& choice = job->choices[i];
      if (choice.finished) continue;
      engine_->abort(choice.request);
      ChoiceUpdate& aborted = update.choices.emplace_back();
      aborted.index = static_cast<int64_t>(i);
      finish_choice(*job, choice, aborted, "abort");
    }
    update.error_status = 500;
    update.error = "the engine failed this request: " + job->engine_error;
  }
  for (auto& [job, update] : updates) {
    if (job->unfinished == 0) {
      update.done = true;
      for (const ChoiceState& choice : job->choices) {
        update.usage.completion_tokens += choice.output_tokens;
      }
      // Usage counts each prompt once (OpenAI): the n choices of one prompt share it.
      int64_t last_prompt = -1;
      for (size_t i = 0; i < job->choices.size(); ++i) {
        if (job->spec.choices[i].prompt_index == last_prompt) continue;
        last_prompt = job->spec.choices[i].prompt_index;
        update.usage.prompt_tokens += job->choices[i].prompt_tokens;
        update.usage.cached_tokens += job->choices[i].cached_tokens;
      }
    }
    // A finished job leaves the active count before its last update goes out: a client that saw `done` never
    // sees the job still counted.
    const bool finished = job->unfinished == 0;
    if (finished) {
      std::lock_guard lock(mutex_);
      --active_;
    }
    job->listener(std::move(update));
    if (finished) jobs_.erase(job->id);
  }
}

void EngineService::publish_gauges() {
  const EngineStats stats = engine_->stats();
  EngineGauges gauges;
  gauges.running = stats.running;
  gauges.waiting = stats.waiting;
  gauges.preemptions = stats.preemptions;
  gauges.pool_bytes = stats.pool_bytes;
  gauges.used_bytes = stats.used_bytes;
  gauges.cached_bytes = stats.cached_bytes;
  for (const EngineStats::Group& group : stats.groups) {
    EngineGauges::Group& gauge = gauges.groups.emplace_back();
    gauge.name = cache_group_name(group.kind);
    gauge.used_blocks = group.used_blocks;
    gauge.cached_blocks = group.cached_blocks;
    gauge.capacity_blocks = group.capacity_blocks;
  }
  gauges.prefix_queries = stats.prefix_queries;
  gauges.prefix_query_tokens = stats.prefix_query_tokens;
  gauges.prefix_hit_tokens = stats.prefix_hit_tokens;
  metrics_.set_engine(gauges);
}

void EngineService::run() {
  for (;;) {
    std::deque<std::unique_ptr<Job>> inbox;
    std::vector<JobId> cancels;
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || !inbox_.empty() || !cancels_.empty() || engine_->has_unfinished(); });
      if (stopping_) return;
      inbox.swap(inbox_);
      cancels.swap(cancels_);
    }
    for (auto& job : inbox) admit(std::move(job));
    for (const JobId id : cancels) {
      const auto found = jobs_.find(id);
      if (found == jobs_.end()) continue;  // finished already, or rejected
      Job& job = *found->second;
      for (ChoiceState& choice : job.choices) {
        if (choice.finished) continue;
        engine_->abort(choice.request);
        ChoiceUpdate ignored;
        finish_choice(job, choice, ignored, "abort");
      }
      jobs_.erase(found);
      std::lock_guard lock(mutex_);
      --active_;
    }
    if (engine_->has_unfinished()) {
      std::vector<RequestOutput> outputs;
      try {
        outputs = engine_->step();
      } catch (const std::exception& error) {
        // A failed step leaves the engine's state unknown: fail every job rather than serve wrong tokens.
        std::fprintf(stderr, "dsv4 serve: engine step failed: %s\n", error.what());
        for (auto& [id, job] : jobs_) {
          for (ChoiceState& choice : job->choices)
            if (!choice.finished) engine_->abort(choice.request);
          JobUpdate update;
          update.error_status = 500;
          update.error = std::string("engine step failed: ") + error.what();
          update.done = true;
          job->listener(std::move(update));
          std::lock_guard lock(mutex_);
          --active_;
        }
        jobs_.clear();
        by_request_.clear();
      }
      // The gauges of the state this step left, before any client hears of its outputs: a client that reads
      // /metrics right after its request finished must not see it still running (seen once under a loaded ctest,
      // server_openai_client_dp: dsv4:num_requests_running 1 after the last response).
      publish_gauges();
      process(outputs);
    }
    publish_gauges();
  }
}

}  // namespace dsv4::server
