// Fault injectors for the data-parallel engine and server tests, not models: every call goes to the real CPU
// backend, except the forward the test picks, which throws (FaultInjectingBackend: a device error or a failed
// kernel) or blocks until released (HangingBackend: a deadlocked rank, or a killed peer process as the others see
// it).
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>

#include "core/error.h"
#include "engine/model_backend.h"
#include "model/deepseek_v4.h"

namespace dsv4::testing {

// Forwards every call to a CpuModelBackend over `model`; subclasses intercept forward.
class ForwardingBackend : public ModelBackend {
 public:
  explicit ForwardingBackend(DeepseekV4Model& model) : inner_(model) {}
  const ModelConfig& config() const override { return inner_.config(); }
  const char* device_name() const override { return inner_.device_name(); }
  KvStorage kv_storage() const override { return inner_.kv_storage(); }
  IndexStorage index_storage() const override { return inner_.index_storage(); }
  void bind_cache(const HybridKvCacheManager& manager) override { inner_.bind_cache(manager); }
  std::unique_ptr<SequenceState> make_state(RequestId id) override { return inner_.make_state(id); }
  void copy_blocks(std::span<const BlockCopy> copies) override { inner_.copy_blocks(copies); }
  Tensor forward(std::span<const SequenceChunk> batch, LogitsMode mode) override {
    return inner_.forward(batch, mode);
  }
  void abort_collectives(const std::string& reason) override { inner_.abort_collectives(reason); }

 private:
  CpuModelBackend inner_;
};

// The `fail_at`-th forward (counting from 1) throws "injected fault in forward N".
class FaultInjectingBackend final : public ForwardingBackend {
 public:
  FaultInjectingBackend(DeepseekV4Model& model, int64_t fail_at) : ForwardingBackend(model), fail_at_(fail_at) {}
  Tensor forward(std::span<const SequenceChunk> batch, LogitsMode mode) override {
    if (++forwards_ == fail_at_) throw Error("injected fault in forward " + std::to_string(forwards_));
    return ForwardingBackend::forward(batch, mode);
  }
  int64_t forwards() const { return forwards_; }

 private:
  int64_t fail_at_ = 0;
  std::atomic<int64_t> forwards_{0};
};

// The `hang_at`-th forward blocks until release(); then it runs.
class HangingBackend final : public ForwardingBackend {
 public:
  HangingBackend(DeepseekV4Model& model, int64_t hang_at) : ForwardingBackend(model), hang_at_(hang_at) {}
  Tensor forward(std::span<const SequenceChunk> batch, LogitsMode mode) override {
    if (++forwards_ == hang_at_) {
      std::unique_lock lock(mutex_);
      hanging_ = true;
      released_cv_.wait(lock, [&] { return released_; });
    }
    return ForwardingBackend::forward(batch, mode);
  }
  bool hanging() {
    std::lock_guard lock(mutex_);
    return hanging_ && !released_;
  }
  void release() {
    {
      std::lock_guard lock(mutex_);
      released_ = true;
    }
    released_cv_.notify_all();
  }

 private:
  int64_t hang_at_ = 0;
  std::atomic<int64_t> forwards_{0};
  std::mutex mutex_;
  std::condition_variable released_cv_;
  bool hanging_ = false, released_ = false;
};

}  // namespace dsv4::testing
