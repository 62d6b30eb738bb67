// Engine: the step loop (nano-vllm `LLMEngine`, vLLM v1 `EngineCore`). Requests go in with add_request(); every
// step() schedules (engine/scheduler.h), runs the model over the scheduled chunks and samples (engine/
// model_runner.h), then commits the computed tokens to the cache manager and applies the stop conditions.
//
// One step:
//   scheduler.schedule  -> who computes how many tokens; admit/allocate/release on the manager
//   restore copies      -> manager.take_pending_copies() before the forward (prefix-hit restores)
//   runner.execute      -> forward(batch, kLastPerSequence), sampling (engine/sampler.h) where a chunk reached its end
//   scheduler.update    -> append tokens, manager.commit, stop conditions, release finished
//   snapshot copies     -> manager.take_pending_copies() after the commit (checkpoints)
#pragma once
#include <cstdint>
#include <vector>

#include "cache/hybrid_kv_cache_manager.h"
#include "engine/model_backend.h"
#include "engine/model_runner.h"
#include "engine/request.h"
#include "engine/scheduler.h"
#include "engine/serving_engine.h"
#include "model/deepseek_v4.h"

namespace dsv4 {

struct EngineConfig {
  int64_t max_num_seqs = 64;
  int64_t max_num_batched_tokens = 512;
  int64_t max_model_len = 0;  // 0: the model's max_position_embeddings
  int64_t long_prefill_token_threshold = 0;
  int64_t kv_cache_bytes = int64_t{512} << 20;  // the block pool (CPU backend default)
  bool enable_prefix_caching = true;
  int64_t checkpoint_interval = 1024;  // tokens, a multiple of 256 (PrefixCacheOptions)
  // Record the prefix cache's registered / evicted block hashes for drain_prefix_cache_events() (a
  // data-parallel rank reports them to the router; PrefixCacheOptions::record_events).
  bool record_prefix_cache_events = false;
  // Every step() runs one forward, with an empty batch when nothing is scheduled: an expert-parallel rank must
  // enter each MoE sublayer's collectives whenever the other ranks do (docs/parallel.md; DataParallelEngine's
  // lockstep mode sets it).
  bool forward_every_step = false;
};

class Engine final : public ServingEngine {
 public:
  // The model (or backend) must outlive the engine. Throws dsv4::Error for an invalid config. The first form runs
  // the exact CPU backend (CpuModelBackend); the cache stores what the backend keeps (kv_storage()).
  Engine(DeepseekV4Model& model, EngineConfig config = {});
  Engine(ModelBackend& backend, EngineConfig config = {});

  // Queues a request and returns its id. Throws dsv4::Error naming the numbers when it can never run (empty
  // prompt, an id outside the vocabulary, prompt + max_tokens > max_model_len, more than the pool holds).
  RequestId add_request(std::vector<int32_t> prompt, SamplingParams params = {}) override;
  // What add_request checks, without queueing anything (the message names request `id`). It reads only the
  // engine's fixed configuration (model config, limits, pool geometry), so any thread may call it while
  // another steps the engine: DataParallelEngine rejects a request before handing it to a rank's thread.
  void check_request(RequestId id, std::span<const int32_t> prompt, const SamplingParams& params) const;
  // Parallel sampling (OpenAI / vLLM `n`): `n` requests for one prompt, child i with seed + i when a seed is
  // given (as vLLM's child requests), so each sample is reproducible on its own. Returns the ids in order.
  std::vector<RequestId> add_parallel_requests(const std::vector<int32_t>& prompt, const SamplingParams& params,
                                               int64_t n);
  // One scheduler step and one forward: the tokens each request got and the requests that finished.
  std::vector<RequestOutput> step() override;
  // Finishes a request as aborted and frees its blocks; false if it is unknown or already finished.
  bool abort(RequestId id) override;
  bool has_unfinished() const override { return scheduler_.has_unfinished(); }
  int64_t max_model_len() const override { return scheduler_.config().max_model_len; }
  EngineStats stats() const override;
  // The prefix cache's changes since the last call (config().record_prefix_cache_events).
  PrefixCacheEvents drain_prefix_cache_events() { return manager_.drain_prefix_cache_events(); }

  const EngineConfig& config() const { return config_; }
  const HybridKvCacheManager& cache() const { return manager_; }
  const Scheduler& scheduler() const { return scheduler_; }
  ModelRunner& runner() { return runner_; }
  // The last step's plan (valid until the next step()): for metrics and tests.
  const SchedulerOutput& last_scheduled() const { return scheduled_; }

 private:
  Engine(std::unique_ptr<ModelBackend> owned, ModelBackend* backend, EngineConfig config);

  EngineConfig config_;
  std::unique_ptr<ModelBackend> owned_backend_;  // the CPU backend of the first constructor
  ModelBackend& backend_;
  HybridKvCacheManager manager_;
  Scheduler scheduler_;
  ModelRunner runner_;
  RequestId next_id_ = 0;
  // Reused every step.
  SchedulerOutput scheduled_;
  std::vector<int32_t> sampled_;
  std::vector<TokenUpdate> updates_;
};

}  // namespace dsv4
