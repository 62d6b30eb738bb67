// EngineService: the engine (any ServingEngine: one Engine, or a DataParallelEngine of several ranks) on its
// own thread, fed by the HTTP threads (vLLM's AsyncLLM over EngineCore, in one process). A job is one API
// request: one engine request per choice (prompts x n). The engine thread adds submitted jobs, runs steps
// while anything is unfinished, turns each step's tokens into text (incremental detokenizer, stop strings)
// and hands every job its update through the job's listener. Cancelling a job (a client that went away)
// aborts its engine requests, which frees their blocks at once.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "engine/engine.h"
#include "engine/serving_engine.h"
#include "server/metrics.h"
#include "server/openai_protocol.h"
#include "tokenizer/tokenizer.h"

namespace dsv4::server {

using JobId = uint64_t;

struct JobSpec {
  struct Choice {
    std::vector<int32_t> prompt;
    SamplingParams params;
    int64_t prompt_index = 0;  // choices of one prompt (n > 1) count its tokens once in usage, as OpenAI does
  };
  std::vector<Choice> choices;  // the response's choices, in index order
  std::vector<std::string> stop;
  bool skip_special_tokens = true;
  bool include_stop_str_in_output = false;
};

struct ChoiceUpdate {
  int64_t index = 0;
  std::string text;                    // new text (whole UTF-8 characters only)
  std::vector<int32_t> token_ids;      // new tokens
  ChoiceLogprobs logprobs;             // one entry per new token when the job asked for logprobs
  std::optional<std::string> finish_reason;  // "stop", "length" or "abort" once finished
  std::optional<std::string> stop_reason;    // the stop string matched, when one ended it
};

// One delivery to a job's listener. The first one either accepts the job (`accepted`) or rejects it (`error`,
// with the HTTP status); later ones carry choice updates; the last has `done` and the final usage — and, when
// the engine failed the job (a data-parallel rank died), `error_status` 500 with the engine's message.
struct JobUpdate {
  bool accepted = false;
  int error_status = 0;
  std::string error;
  std::vector<ChoiceUpdate> choices;
  bool done = false;
  Usage usage;
};
// Called on the engine thread; must not block (the HTTP layer posts the update to the connection's strand).
using JobListener = std::function<void(JobUpdate)>;

struct ServiceOptions {
  int64_t max_queued_jobs = 1024;  // jobs not yet finished, beyond which submit() answers 503
};

class EngineService {
 public:
  // The model and tokenizer must outlive the service; the engine is built and owned here.
  EngineService(DeepseekV4Model& model, const Tokenizer& tokenizer, EngineConfig config, ServiceOptions options,
                ServerMetrics& metrics);
  // The same over any backend (the CUDA one): the backend must outlive the service.
  EngineService(ModelBackend& backend, const Tokenizer& tokenizer, EngineConfig config, ServiceOptions options,
                ServerMetrics& metrics);
  // Any serving engine, owned here (a DataParallelEngine for --data-parallel-size > 1).
  EngineService(std::unique_ptr<ServingEngine> engine, const Tokenizer& tokenizer, ServiceOptions options,
                ServerMetrics& metrics);
  ~EngineService();  // stop()
  // Stops the engine thread and destroys every job, with its listener, before returning; idempotent. Unfinished
  // jobs are dropped without a final update. A listener may own what the HTTP layer's I/O context serves (a
  // connection and its socket), so the server calls this while that context still exists: a job the engine
  // thread was still erasing after the last update once outlived the context (ASan: heap-use-after-free in
  // the socket's close at shutdown).
  void stop();
  EngineService(const EngineService&) = delete;
  EngineService& operator=(const EngineService&) = delete;

  // Queues a job; thread-safe. Throws ApiError(503) when max_queued_jobs are unfinished or the service drains.
  JobId submit(JobSpec spec, JobListener listener);
  // Aborts the job's unfinished requests and drops its listener (no further update); thread-safe, idempotent.
  void cancel(JobId id);
  // Refuse new jobs (503) while running ones finish: graceful shutdown.
  void begin_drain();
  // Jobs submitted and not yet finished or cancelled.
  int64_t active_jobs() const;

  int64_t max_model_len() const { return max_model_len_; }

 private:
  struct ChoiceState;
  struct Job;

  void run();
  void admit(std::unique_ptr<Job> job);
  void process(const std::vector<RequestOutput>& outputs);
  void finish_choice(Job& job, ChoiceState& choice, ChoiceUpdate& update, const std::string& reason);
  void publish_gauges();

  const Tokenizer& tokenizer_;
  void start();  // the engine thread
  int64_t max_model_len_ = 0;
  ServiceOptions options_;
  ServerMetrics& metrics_;
  std::unique_ptr<ServingEngine> engine_;

  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::unique_ptr<Job>> inbox_;
  std::vector<JobId> cancels_;
  int64_t active_ = 0;
  JobId next_job_ = 1;
  bool draining_ = false, stopping_ = false;

  // Engine-thread state.
  std::map<JobId, std::unique_ptr<Job>> jobs_;
  std::map<RequestId, std::pair<Job*, size_t>> by_request_;
  std::thread thread_;
};

}  // namespace dsv4::server
