// RankEngine: what one data-parallel rank's thread in DataParallelEngine drives (engine/data_parallel_engine.h).
// Two implementations: LocalRankEngine, an Engine in this process, and RemoteRankEngine
// (engine/remote_rank_engine.h), the same Engine in a worker process of its own (one process per GPU, issue 9),
// reached over a socket. The rank thread's loop — take the inbox, apply it, meet the lockstep gate, step, report —
// is the same for both, so a rank behaves alike wherever it runs.
//
// Request ids here are the front's (DataParallelEngine's); a LocalRankEngine maps them to its Engine's own.
#pragma once
#include <cstdint>
#include <deque>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/engine.h"
#include "engine/serving_engine.h"

namespace dsv4 {

// A request for the rank, posted by the front: add a request or abort one.
struct RankCommand {
  bool add = true;   // else abort
  RequestId id = 0;  // the front's id
  std::vector<int32_t> prompt;
  SamplingParams params;
};

// Progress of a request a step scheduled or preempted (the router's load estimate).
struct RankProgress {
  RequestId id = 0;
  int64_t num_computed_tokens = 0, num_tokens = 0;
};

// What one rank step produced, with the front's request ids.
struct RankReport {
  int rank = 0;
  std::vector<RequestOutput> outputs;
  std::vector<RankProgress> progress;
  PrefixCacheEvents events;
  int64_t aborts_applied = 0;  // abort commands taken from the inbox (a failed rank's unapplied ones count)
  bool failed = false;
  bool stepped = false;  // the rank ran a step with work of its own (an idle lockstep rank's empty forward: false)
};

// An output that finishes request `id` as aborted by the engine, with `error` as the reason.
RequestOutput aborted_output(RequestId id, const std::string& error);

class RankEngine {
 public:
  virtual ~RankEngine() = default;

  // What add_request would reject, thrown as dsv4::Error, without queueing (the front's thread; any thread may
  // call it while the rank steps). A remote rank checks against its twin in the front (set_request_checker).
  virtual void check_request(RequestId id, std::span<const int32_t> prompt, const SamplingParams& params) const = 0;
  virtual int64_t max_model_len() const = 0;
  // A rank in another process checks requests against `twin`, a rank in this process serving the same model
  // (DataParallelEngine passes its rank 0); a local rank ignores it.
  virtual void set_request_checker(const RankEngine* twin) { (void)twin; }
  // The rank thread's loop, in this order each round:
  // Applies the inbox's commands; an add the engine rejects finishes at once as an aborted output in `report`.
  // Returns whether the engine then has unfinished requests.
  virtual bool apply(std::deque<RankCommand> commands, RankReport& report) = 0;
  // Runs one step when `forward` (an idle lockstep rank steps over an empty batch), then adds the prefix-cache
  // events. Throws when the step fails; the rank is then failed (fail()).
  virtual void step(bool forward, RankReport& report) = 0;
  // apply, then step when there is work: one round of a rank that steps on its own (no lockstep). A remote rank
  // does both in one round trip.
  virtual void apply_and_step(std::deque<RankCommand> commands, RankReport& report);
  // Whether requests are unfinished, as of the last apply / step.
  virtual bool has_unfinished() const = 0;
  // The engine's figures as of the last apply / step.
  virtual EngineStats stats() const = 0;
  // After a failed step: finishes every request the rank holds as aborted with `error` (outputs in `report`) and
  // frees what it can.
  virtual void fail(const std::string& error, RankReport& report) = 0;
  // Whether the rank is known to be gone without a call (a worker process whose connection closed): an idle
  // rank's thread checks it, so a worker killed while idle fails its rank before a request is routed there.
  virtual bool connection_lost() const { return false; }
  // Releases this rank's collectives (expert parallelism), from any thread: a failed rank's peers then fail
  // instead of waiting for it. A remote rank's process is ended.
  virtual void abort_collectives(const std::string& reason) = 0;
};

// A rank whose Engine runs in this process, on the rank thread.
class LocalRankEngine final : public RankEngine {
 public:
  // The backend must outlive this; `config` as DataParallelEngine::rank_config gives it.
  LocalRankEngine(ModelBackend& backend, const EngineConfig& config) : backend_(backend), engine_(backend, config) {}

  void check_request(RequestId id, std::span<const int32_t> prompt, const SamplingParams& params) const override {
    engine_.check_request(id, prompt, params);
  }
  int64_t max_model_len() const override { return engine_.max_model_len(); }
  bool apply(std::deque<RankCommand> commands, RankReport& report) override;
  void step(bool forward, RankReport& report) override;
  bool has_unfinished() const override { return engine_.has_unfinished(); }
  EngineStats stats() const override { return engine_.stats(); }
  void fail(const std::string& error, RankReport& report) override;
  void abort_collectives(const std::string& reason) override { backend_.abort_collectives(reason); }

  const Engine& engine() const { return engine_; }

 private:
  ModelBackend& backend_;
  Engine engine_;
  // The engine's request ids <-> the front's.
  std::unordered_map<RequestId, RequestId> to_front_, to_local_;
};

}  // namespace dsv4
