// The DeepSeek-V4 forward pass over a batch of requests (docs/MODEL.md, transformers DeepseekV4ForCausalLM):
// what is computed, layer by layer. The math lives in ops/cpu; per-request state in SequenceState.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "model/model_config.h"
#include "model/sequence_state.h"
#include "model/weights.h"
#include "ops/cpu/rope.h"

namespace dsv4 {

namespace parallel {
class Communicator;
}

// One request's slice of a forward step: `token_ids` are appended at positions state->num_tokens() onwards.
struct SequenceChunk {
  SequenceState* state = nullptr;
  std::span<const int32_t> token_ids;
};

enum class LogitsMode {
  kAllPositions,     // [sum of chunk lengths, vocab]
  kLastPerSequence,  // [batch, vocab]: the next-token distribution of every request
};

class DeepseekV4Model {
 public:
  DeepseekV4Model(ModelConfig config, ModelWeights weights);

  const ModelConfig& config() const { return config_; }
  std::unique_ptr<SequenceState> new_sequence_state() const;

  // One step for several requests at different positions; each state advances by its chunk length.
  // Throws dsv4::Error for an out-of-vocabulary id or an empty chunk (nothing is modified then). An empty batch
  // gives empty logits; with expert parallelism it still serves the other ranks' rows in every MoE sublayer.
  Tensor forward(std::span<const SequenceChunk> batch, LogitsMode mode);

  // Expert parallelism (docs/parallel.md): with a communicator, the routed experts of every MoE sublayer run
  // over its ranks (parallel/expert_parallel_moe.h), this model computing the experts of its partition for the
  // rows every rank sends it. Every rank's model must then run each forward step together with the others (the
  // sublayers' all-to-alls are collectives). nullptr (the default): all experts here. Numerics::kHf only.
  void set_expert_parallel(parallel::Communicator* communicator);
  // This rank is failing (its step threw): aborts the expert-parallel group, so the other ranks' forwards throw
  // instead of waiting in a collective for this one (Communicator::abort). No-op without expert parallelism.
  void abort_expert_parallel(const std::string& reason);
  // With expert parallelism set: frees the routed experts of the other ranks' partitions, so this rank holds only
  // its own (what splitting the experts is for). Expert parallelism can then no longer be turned off.
  void drop_remote_experts();

 private:
  struct StepLayout;  // token -> request / position bookkeeping of one step
  void attention(int64_t layer, const StepLayout& step, std::span<const SequenceChunk> batch, const float* x,
                 float* out);
  void compress(int64_t layer, EntryKind kind, const StepLayout& step, std::span<const SequenceChunk> batch,
                const float* x);
  void moe(int64_t layer, const StepLayout& step, const float* x, float* out);
  // Buffers of one routed-expert call, reused across the experts of a sublayer.
  struct ExpertScratch {
    std::vector<float> gate_up, activated, out;
  };
  // Routed expert e over n rows [n, hidden]: scratch.out [n, hidden] = W2 · swiglu_clamped(W13 · row_i), unweighted
  // (the caller applies the routing weight as it accumulates).
  void routed_expert(int64_t layer, int64_t e, const float* rows, int64_t n, ExpertScratch& scratch) const;
  // The layer's routed experts over the expert-parallel ranks (tokens may be 0: an idle rank's part).
  void routed_experts_parallel(int64_t layer, const float* x, int64_t tokens, std::span<const int32_t> chosen,
                               std::span<const float> weights, float* out);
  // The routed and shared experts under Numerics::kDeepSeek (`assigned`: per expert, (token, routing weight)).
  void moe_deepseek(int64_t layer, int64_t tokens, const float* x,
                    const std::vector<std::vector<std::pair<int64_t, float>>>& assigned, float* out);

  ModelConfig config_;
  ModelWeights weights_;
  parallel::Communicator* expert_parallel_ = nullptr;
  bool remote_experts_dropped_ = false;
  ops::cpu::RopeTable rope_main_, rope_compress_;
};

}  // namespace dsv4
