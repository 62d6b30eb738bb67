// ModelBackend: what the engine needs from a model implementation — the forward over a batch of chunks, and the
// paged KV cache it keeps that forward's state in. The scheduler and the cache manager never see a tensor; the
// backend owns the bytes behind the manager's block tables (host memory for the CPU backend, one device arena
// for the CUDA one) and executes the manager's block copies there.
#pragma once
#include <memory>
#include <span>
#include <string>

#include "cache/hybrid_kv_cache_manager.h"
#include "core/error.h"
#include "engine/paged_sequence_state.h"
#include "engine/sampler.h"
#include "model/deepseek_v4.h"

namespace dsv4 {

// One request to sample on the device after the forward (ModelBackend::forward_and_sample).
struct DeviceSampleRow {
  size_t batch_index = 0;                  // the batch entry whose last-position logits it samples
  const SamplingParams* params = nullptr;  // nullptr: greedy
  RequestSamplerState* state = nullptr;    // the request's generator (with params)
  std::span<const int32_t> context;        // prompt + output so far (penalties, min_tokens)
};

class ModelBackend {
 public:
  virtual ~ModelBackend() = default;

  virtual const ModelConfig& config() const = 0;
  virtual const char* device_name() const = 0;  // "cpu", "cuda:0"
  // The storage formats this backend keeps in the cache (they size the manager's blocks).
  virtual KvStorage kv_storage() const = 0;
  virtual IndexStorage index_storage() const = 0;
  // Called once, by the engine, when its manager exists: allocates the arena behind the manager's pool.
  virtual void bind_cache(const HybridKvCacheManager& manager) = 0;
  // The model state of an admitted request in the arena (num_tokens() = its prefix hit).
  virtual std::unique_ptr<SequenceState> make_state(RequestId id) = 0;
  // Executes the manager's snapshot / restore copies in the arena.
  virtual void copy_blocks(std::span<const BlockCopy> copies) = 0;
  // One step (DeepseekV4Model::forward's contract); logits come back in host memory.
  virtual Tensor forward(std::span<const SequenceChunk> batch, LogitsMode mode) = 0;
  // A backend that samples where its logits are (engine/sampler.h semantics, the same tokens for the same
  // generator draws) runs the step and the sampling together: only results[i] for rows[i] come back (the token
  // always; logprob, rank and top when params->logprobs). The runner samples forward()'s logits otherwise.
  virtual bool samples_on_device() const { return false; }
  virtual void forward_and_sample(std::span<const SequenceChunk> batch, std::span<const DeviceSampleRow> rows,
                                  std::vector<SampleResult>& results) {
    (void)batch, (void)rows, (void)results;
    throw Error("this backend samples on the host");
  }
  // This rank's step failed: release the ranks it shares collectives with (an expert-parallel group), which
  // would otherwise wait for it forever. No-op for a backend that shares none.
  virtual void abort_collectives(const std::string& reason) { (void)reason; }
};

// The exact fp32 CPU backend: DeepseekV4Model over PagedSequenceState in a host arena.
class CpuModelBackend final : public ModelBackend {
 public:
  explicit CpuModelBackend(DeepseekV4Model& model) : model_(model) {}

  const ModelConfig& config() const override { return model_.config(); }
  const char* device_name() const override { return "cpu"; }
  KvStorage kv_storage() const override { return KvStorage::kF32; }
  IndexStorage index_storage() const override { return IndexStorage::kF32; }
  void bind_cache(const HybridKvCacheManager& manager) override {
    manager_ = &manager;
    arena_ = std::make_unique<KvArena>(manager.pool().num_pages() * manager.pool().page_bytes());
  }
  std::unique_ptr<SequenceState> make_state(RequestId id) override {
    return std::make_unique<PagedSequenceState>(model_.config(), *manager_, *arena_, id);
  }
  void copy_blocks(std::span<const BlockCopy> copies) override { arena_->execute(copies); }
  Tensor forward(std::span<const SequenceChunk> batch, LogitsMode mode) override { return model_.forward(batch, mode); }
  void abort_collectives(const std::string& reason) override { model_.abort_expert_parallel(reason); }

 private:
  DeepseekV4Model& model_;
  const HybridKvCacheManager* manager_ = nullptr;
  std::unique_ptr<KvArena> arena_;
};

}  // namespace dsv4
