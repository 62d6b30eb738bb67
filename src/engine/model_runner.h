// ModelRunner: turns a SchedulerOutput into one ModelBackend::forward (engine/model_backend.h) and samples (engine/sampler.h, with each
// request's SamplingParams) the requests whose chunk reached their last known token. It owns the per-request
// SequenceState and sampler state (its generator), and executes the cache manager's block copies.
//
// The seam to the paged cache is two callbacks:
//   - StateFactory makes the SequenceState of a request at its first chunk after admission. The default makes a
//     ContiguousSequenceState (the model's own host storage, num_tokens() = 0); the paged state will be built
//     from the manager's block tables with num_tokens() = the prefix hit.
//   - CopyExecutor runs HybridKvCacheManager::take_pending_copies() (prefix-hit restores before the forward,
//     checkpoint snapshots after the commit). The default does nothing: ContiguousSequenceState does not live in
//     the arena, so the copies have nothing to move; the paged state binds it to a memcpy / device copy.
// A state is fed from its own num_tokens() to the chunk's end, so a state that restored less than the prefix hit
// (the contiguous one restores nothing) recomputes the missing tokens and the math is exactly a cold run's.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "cache/hybrid_kv_cache_manager.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"
#include "engine/model_backend.h"

namespace dsv4 {

class ModelRunner {
 public:
  // `chunk` is the request's first chunk since admission (chunk.start = its prefix hit).
  using StateFactory = std::function<std::unique_ptr<SequenceState>(const ScheduledChunk& chunk)>;
  using CopyExecutor = std::function<void(std::span<const BlockCopy> copies)>;

  explicit ModelRunner(ModelBackend& backend);

  void set_state_factory(StateFactory factory) { state_factory_ = std::move(factory); }
  void set_copy_executor(CopyExecutor executor) { copy_executor_ = std::move(executor); }
  // execute() with nothing scheduled still runs the backend's forward over an empty batch (an expert-parallel
  // rank serving the other ranks' rows; EngineConfig::forward_every_step).
  void set_forward_every_step(bool enabled) { forward_every_step_ = enabled; }

  void execute_copies(std::span<const BlockCopy> copies);

  // Drops the states of out.finished_ids and out.preempted_ids (the sampler states of finished ones only: a
  // preempted request keeps its generator), runs the forward over out.scheduled (LogitsMode::kLastPerSequence)
  // and writes into sampled[i] (resized to out.scheduled.size()) the token sampled for out.scheduled[i] where it
  // samples, kNoToken elsewhere. A chunk without params samples greedily.
  void execute(const SchedulerOutput& out, std::vector<int32_t>& sampled);

  // The logprobs of the token the last execute() sampled for `id`, if its params asked for them; else nullptr.
  // Valid until the next execute().
  const SampleResult* last_logprobs(RequestId id) const {
    const auto it = logprobs_.find(id);
    return it == logprobs_.end() ? nullptr : &it->second;
  }

  // Drops a request's state now (finished or aborted); out.finished_ids would drop it at the next step.
  void release(RequestId id) {
    states_.erase(id);
    sampler_states_.erase(id);
  }

  int64_t num_states() const { return static_cast<int64_t>(states_.size()); }
  // Tokens recomputed this run because a state restored less than the scheduler's prefix hit.
  int64_t num_recomputed_tokens() const { return num_recomputed_tokens_; }

 private:
  std::unique_ptr<SequenceState> make_state(const ScheduledChunk& chunk);
  RequestSamplerState& sampler_state(const ScheduledChunk& chunk);  // made at the first sampled token
  void execute_on_device(const SchedulerOutput& out, std::vector<int32_t>& sampled);

  ModelBackend& backend_;
  StateFactory state_factory_;
  CopyExecutor copy_executor_;
  std::unordered_map<RequestId, std::unique_ptr<SequenceState>> states_;
  std::unordered_map<RequestId, RequestSamplerState> sampler_states_;  // first sample to finish
  std::unordered_map<RequestId, SampleResult> logprobs_;               // the last execute()'s
  std::vector<int32_t> eos_token_ids_;
  std::vector<SequenceChunk> batch_;
  std::vector<DeviceSampleRow> device_rows_;
  std::vector<SampleResult> device_results_;
  int64_t num_recomputed_tokens_ = 0;
  bool forward_every_step_ = false;
};

}  // namespace dsv4
