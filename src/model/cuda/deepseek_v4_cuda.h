// The DeepSeek-V4 forward on one CUDA device (docs/gpu.md): the same computation as DeepseekV4Model
// (model/deepseek_v4.h, the slow twin), layer by layer, with every op on the device (ops/cuda/) and every
// request's state in one device arena behind the hybrid cache manager's block tables.
//
// Precision:
//   kF32   fp32 weights, fp32 GEMMs (no TF32), fp32 cache: matches the CPU backend to accumulation order.
//   kBf16  bf16 weights and bf16 GEMM operands with fp32 accumulation, bf16 K=V window / compressed entries and
//          index keys (with ModelConfig::fp8_kv_cache the K=V entries are DeepSeek's 584-byte FP8 entries,
//          docs/gpu.md "The FP8 K=V cache"); activations between ops stay fp32. The serving mode.
// Where the shapes are V4's (64·k heads × 512, indexer 64 × 128) the bf16 mode runs the tuned attention and
// indexer kernels (ops/cuda/sparse_attention.h, indexer_scores.h); other shapes and kF32 use the general ones
// (ops/cuda/paged_attention.h).
#pragma once
#include <memory>
#include <string>

#include "engine/model_backend.h"
#include "model/weights.h"

namespace dsv4 {
namespace parallel {
class Communicator;
}  // namespace parallel

enum class CudaPrecision { kF32, kBf16 };

struct CudaModelOptions {
  CudaPrecision precision = CudaPrecision::kBf16;
  int device = 0;
  bool cuda_graphs = true;   // capture decode steps per batch-size bucket
  bool indexer_stream = true;  // the CSA indexer on its own stream, joined before attention
  bool kv_stream = true;  // the K=V projection, norm + RoPE and main compressor beside the query path
  bool shared_expert_stream = true;  // the MoE shared expert beside the router and the routed experts
  // Opt-in decode paths written 2026-12-06 (session 25) whose device time ran out before they ran on a GPU; the
  // CLI turns each on with its variable = 1, and CudaModel.Bf16BatchOneDecodeTracksCpu runs them all. To become
  // the default once the GPU suite passes with them and `bench latency` measures the gain (docs/PERF.md).
  // - the shared expert on its stream at ≤ 8 rows as two GEMVs (ops/cuda/skinny_gemm) and the SwiGLU instead of
  //   the grouped expert kernel's permutation, tiles and combine for one expert (DSV4_SHARED_EXPERT_GEMV);
  bool shared_expert_gemv = false;
  // - one token (batch-1 decode), bf16 routed experts: the K chosen experts as gathered GEMVs (skinny_gemm
  //   w_batch_index), the SwiGLU and a weighted combine, instead of the grouped kernel (DSV4_ROUTED_EXPERT_GEMV);
  bool routed_expert_gemv = false;
  // - a pure decode step's window write on the K=V stream before its join, off the query's chain
  //   (DSV4_EARLY_WINDOW_WRITE).
  bool early_window_write = false;
  bool device_sampling = true;  // sample next to the logits (ops/cuda/sampling.h); false: logits to the host
  // The dense projections a checkpoint stores FP8 (wq_a, wq_b, wkv, wo_b, indexer wq_b) stay FP8 on the
  // device and run DeepSeek's FP8 linear (per-128 activation quantization, block-scaled GEMM, ops/cuda/gemm.h
  // linear_fp8), as vLLM serves block-FP8 checkpoints; false: they are decoded to the weight dtype at upload.
  // dsv4's CLI turns it on in bf16 mode with DSV4_FP8_WEIGHTS=1 (opt-in: prefill is slower, docs/gpu.md "FP8
  // weights on the device").
  bool fp8_weights = false;
  // Routed experts in a grouped low-bit encoding — MXFP4 as the release stores them (4.25 bits/param), or
  // requantized by --expert-bits (3.5 / 2.5) — stay so on the device in bf16 mode and are decoded inside the
  // grouped expert GEMM (ops/cuda/moe_experts.h); bitwise the same results as decoding them to bf16 at
  // upload, which false does (DSV4_LOW_BIT_EXPERTS=0).
  bool low_bit_experts = true;
  // Expert parallelism (set_expert_parallel): with expert_parallel_size > 1 only this rank's partition of the
  // routed experts (parallel::ExpertPartition: contiguous blocks, the first ranks one larger) is uploaded, and
  // the model then runs only over a group of that size at that rank. 1: every expert.
  int expert_parallel_size = 1;
  int expert_parallel_rank = 0;
  // Steps of at least this many tokens run the MoE (bf16 / fp32 experts) as one cuBLASLt GEMM pair per expert;
  // 0: DSV4_HOST_GROUPED_MOE_MIN_TOKENS, else 1,024. Those pairs are spread over per_expert_moe_lanes streams
  // (1-4; 0: DSV4_MOE_EXPERT_LANES, else 4) so that one expert's last wave of tiles overlaps the next one's.
  int64_t per_expert_moe_min_tokens = 0;
  int per_expert_moe_lanes = 0;
};

class DeepseekV4CudaModel final : public ModelBackend {
 public:
  // Uploads the weights (converting to the precision's dtype). Throws dsv4::Error when no device is usable or
  // the weights do not fit.
  DeepseekV4CudaModel(ModelConfig config, const ModelWeights& weights, CudaModelOptions options = {});
  // The same model from a source read piece by piece: the globals, then each layer, each piece's host copy
  // dropped once it is on the device, so host memory peaks at about one layer (a model whose fp32 copy does not
  // fit in host memory loads). Same device contents and layout as the constructor above.
  DeepseekV4CudaModel(ModelConfig config, ModelWeightSource& weights, CudaModelOptions options = {});
  ~DeepseekV4CudaModel() override;

  const ModelConfig& config() const override;
  const char* device_name() const override;
  KvStorage kv_storage() const override;
  IndexStorage index_storage() const override;
  void bind_cache(const HybridKvCacheManager& manager) override;
  std::unique_ptr<SequenceState> make_state(RequestId id) override;
  void copy_blocks(std::span<const BlockCopy> copies) override;
  Tensor forward(std::span<const SequenceChunk> batch, LogitsMode mode) override;
  bool samples_on_device() const override { return device_sampling_; }
  void forward_and_sample(std::span<const SequenceChunk> batch, std::span<const DeviceSampleRow> rows,
                          std::vector<SampleResult>& results) override;

  // Device bytes free for the KV cache once weights and a step's activations at `max_tokens` batched tokens are
  // resident, scaled so the process uses at most `utilization` of the device (vLLM's --gpu-memory-utilization).
  // `sharing_processes` > 1: other processes' ranks share this device; this one takes 1/sharing_processes of
  // utilization · total, less its own weights (not the device's whole use, which counts theirs).
  int64_t cache_bytes_for_utilization(double utilization, int64_t max_tokens, int sharing_processes = 1) const;
  int64_t weight_bytes() const;
  // Decode steps replayed from a captured CUDA graph, and captures made (for tests and logs).
  int64_t graph_replays() const;
  int64_t graph_captures() const;
  // Expert parallelism over the ranks of `communicator` (docs/parallel.md; the CPU model's set_expert_parallel):
  // this rank runs the routed experts of its partition (parallel::ExpertPartition) for every rank's tokens, and
  // each MoE sublayer dispatches its own tokens' rows to the experts' owners and combines what comes back (five
  // collectives: counts, rows, routes, weights, return). Device-memory transports: NCCL
  // (parallel/nccl_communicator.h) or ranks on one GPU (parallel/device_in_process_group.h). Every rank must run
  // the same number of steps. Steps then run eagerly (the plan is made on the host: no CUDA graphs), and the
  // routed experts must be bf16 / fp32 (not a low-bit encoding). With CudaModelOptions::expert_parallel_size > 1
  // the communicator's size and rank must be those options'. Throws dsv4::Error otherwise, or for more ranks than
  // experts. `communicator` must outlive the model.
  void set_expert_parallel(parallel::Communicator* communicator);

  // Where a step's time goes, averaged over the steps since the last reset: host preparation (metadata, tables,
  // upload), the device time of the forward (events around the graph or the eager launches) and of sampling.
  struct StepProfile {
    int64_t steps = 0;
    double host_prepare_ms = 0, device_forward_ms = 0, device_sampling_ms = 0;
  };
  StepProfile step_profile() const;
  void reset_step_profile();

 private:
  // Construction, shared by both constructors in this order: the device, streams and GEMM handles; the global
  // weights; each layer; the RoPE tables.
  void open_device(ModelConfig config, const CudaModelOptions& options);
  void upload_globals(const ModelWeights& globals);
  void upload_layer(const LayerWeights& layer);
  void upload_rope_tables();

  struct Impl;
  std::unique_ptr<Impl> impl_;
  bool device_sampling_ = true;
};

// True when a CUDA device is usable by this process.
bool cuda_device_available();

}  // namespace dsv4
