// ServingEngine: what a front end (server/engine_service.h, the generate command) drives — requests in, each
// step's tokens out. Two implementations: Engine (one scheduler, one cache, one backend, stepped by the
// caller) and DataParallelEngine (N such engines, one per data-parallel attention rank, each on its own
// thread, behind a router; engine/data_parallel_engine.h). A front end written against this interface serves
// either unchanged.
//
// One thread drives a ServingEngine: add_request, abort, step and has_unfinished are not thread-safe against
// each other (DataParallelEngine's ranks run on their own threads behind this one).
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "cache/cache_spec.h"
#include "engine/request.h"

namespace dsv4 {

// Load and cache figures for metrics (GET /metrics): one engine's, or the sum over a data-parallel engine's
// live ranks.
struct EngineStats {
  int64_t running = 0, waiting = 0, preemptions = 0;
  int64_t pool_bytes = 0, used_bytes = 0, cached_bytes = 0;
  struct Group {
    CacheGroupKind kind = CacheGroupKind::kSwaKv;
    int64_t used_blocks = 0, cached_blocks = 0, capacity_blocks = 0;
  };
  std::vector<Group> groups;
  int64_t prefix_queries = 0, prefix_query_tokens = 0, prefix_hit_tokens = 0;
  int64_t num_ranks = 1, failed_ranks = 0;

  // Adds another engine's figures (groups matched by position: every rank has the same layout).
  void accumulate(const EngineStats& other);
};

class ServingEngine {
 public:
  virtual ~ServingEngine() = default;

  // Queues a request and returns its id. Throws dsv4::Error naming the numbers when it can never run (empty
  // prompt, an id outside the vocabulary, invalid sampling parameters, prompt + max_tokens > max_model_len,
  // more than the pool holds).
  virtual RequestId add_request(std::vector<int32_t> prompt, SamplingParams params) = 0;
  // Finishes a request as aborted and frees its blocks; no output for it follows. False if it is unknown or
  // already finished.
  virtual bool abort(RequestId id) = 0;
  // Advances the engine: the tokens requests got and the requests that finished (a request the engine had to
  // abort, e.g. on a failed data-parallel rank, finishes with status kFinishedAborted and `error` set).
  // Engine runs one step; DataParallelEngine returns what its ranks produced since the last call, waiting for
  // at least one rank step when there is none.
  virtual std::vector<RequestOutput> step() = 0;
  virtual bool has_unfinished() const = 0;

  // prompt + max_tokens bound of every request (the resolved EngineConfig::max_model_len).
  virtual int64_t max_model_len() const = 0;
  virtual EngineStats stats() const = 0;
};

}  // namespace dsv4
