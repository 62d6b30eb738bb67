#include "model/cuda/deepseek_v4_cuda.h"

#include <cstdio>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <span>

#include "core/dtype.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "cache/kv_entry_format_cuda.h"
#include "ops/cuda/compressor.h"
#include "ops/cuda/elementwise.h"
#include "ops/cuda/embedding.h"
#include "ops/cuda/fp8_quantize.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/hadamard_fp4.h"
#include "ops/cuda/head_norm_rope.h"
#include "ops/cuda/hyper_connection.h"
#include "ops/cuda/indexer_scores.h"
#include "ops/cuda/moe_combine.h"
#include "ops/cuda/moe_experts.h"
#include "ops/cuda/moe_routing.h"
#include "ops/cuda/paged_attention.h"
#include "ops/cuda/rms_norm.h"
#include "ops/cuda/rope.h"
#include "ops/cuda/sampling.h"
#include "ops/cuda/skinny_gemm.h"
#include "ops/cuda/sparse_attention.h"
#include "ops/cuda/top_k.h"
#include "parallel/communicator.h"
#include "parallel/expert_dispatch.h"

namespace dsv4 {

namespace cu = ops::cuda;

namespace {

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw Error(std::string("CUDA: ") + what + ": " + cudaGetErrorString(status));
}
#define DSV4_CU(call) check_cuda((call), #call)

// A request's state on the device: only its id and length live on the host; every byte is in the arena.
class CudaSequenceState final : public SequenceState {
 public:
  CudaSequenceState(RequestId id, int64_t num_tokens, const ModelConfig& config) : id_(id), num_tokens_(num_tokens) {
    for (int64_t layer = 0; layer < config.num_hidden_layers; ++layer) {
      const int64_t ratio = config.compress_rate(layer);
      entries_.push_back(ratio > 0 ? num_tokens / ratio : 0);
    }
  }
  RequestId id() const { return id_; }
  int64_t num_tokens() const override { return num_tokens_; }
  void set_num_tokens(int64_t tokens) override { num_tokens_ = tokens; }
  // The host-memory interface of the CPU model does not apply: the state is device memory.
  float* window_kv(int64_t, int64_t) override { throw host_access(); }
  float* compressor_kv_state(int64_t, EntryKind) override { throw host_access(); }
  float* compressor_gate_state(int64_t, EntryKind) override { throw host_access(); }
  int64_t num_entries(int64_t layer, EntryKind) const override { return entries_[static_cast<size_t>(layer)]; }
  const float* entry(int64_t, EntryKind, int64_t) const override { throw host_access(); }
  float* append_entry(int64_t, EntryKind) override { throw host_access(); }

 private:
  static Error host_access() { return Error("the CUDA backend's sequence state lives in device memory"); }
  RequestId id_;
  int64_t num_tokens_;
  std::vector<int64_t> entries_;
};

// Device memory owned by the model, freed together.
class DeviceAllocations {
 public:
  ~DeviceAllocations() {
    for (void* p : blocks_) cudaFree(p);
  }
  void* allocate(size_t bytes) {
    void* p = nullptr;
    if (cudaMalloc(&p, std::max<size_t>(bytes, 16)) != cudaSuccess)
      throw Error("out of device memory allocating " + std::to_string(bytes) + " bytes for the model");
    blocks_.push_back(p);
    total_ += bytes;
    return p;
  }
  int64_t total() const { return static_cast<int64_t>(total_); }

 private:
  std::vector<void*> blocks_;
  size_t total_ = 0;
};

// A growable device scratch buffer (activations of a step). Growing it frees the old memory, which a captured
// CUDA graph may reference: `generation` counts reallocations so the model drops stale graphs, and a growth
// while a graph is being captured is a bug (the eager run of the same shapes sized every buffer first).
struct Scratch {
  void* ptr = nullptr;
  size_t bytes = 0;
  ~Scratch() { cudaFree(ptr); }
  template <typename T>
  T* get(size_t count, int64_t& generation, bool capturing) {
    const size_t need = std::max<size_t>(count * sizeof(T), 16);
    if (need > bytes) {
      if (capturing) throw Error("a scratch buffer grew during CUDA graph capture");
      ++generation;
      cudaFree(ptr);
      ptr = nullptr;
      bytes = 0;
      check_cuda(cudaMalloc(&ptr, need), "scratch allocation");
      bytes = need;
    }
    return static_cast<T*>(ptr);
  }
};

struct CompressorDevice {
  // wkv then wgate, stacked [2, coff·d, D]: one strided-batched GEMM computes both projections of the same input.
  cu::GemmWeight wkv_gate;
  float *ape = nullptr, *norm = nullptr;
};

struct LayerDevice {
  float *hc_attn_fn, *hc_attn_base, *hc_attn_scale, *hc_ffn_fn, *hc_ffn_base, *hc_ffn_scale;
  float *attn_norm, *ffn_norm, *q_norm, *kv_norm, *attn_sink;
  cu::GemmWeight wq_a, wq_b, wkv, wo_a, wo_b;
  CompressorDevice compressor, indexer_compressor;
  cu::GemmWeight indexer_wq_b, indexer_weights_proj;
  cu::GemmWeight gate;
  float* gate_bias = nullptr;
  int32_t* tid2eid = nullptr;
  void *experts_w13 = nullptr, *experts_w2 = nullptr;  // [E, 2I, D], [E, D, I] in the weight dtype
  const void* const* expert_w13_pointers = nullptr;      // device [E]: expert e's w13 / w2 (ops/cuda/moe_experts.h)
  const void* const* expert_w2_pointers = nullptr;
  // Routed experts kept in a grouped low-bit format (CudaModelOptions::low_bit_experts): the pointers above
  // address their codes in the kernel's order, these their tile-major scales.
  cu::MoeWeightDtype routed_dtype = cu::MoeWeightDtype::kBf16;
  bool low_bit_experts() const {
    return routed_dtype != cu::MoeWeightDtype::kBf16 && routed_dtype != cu::MoeWeightDtype::kFp32;
  }
  const void* const* expert_w13_scale_pointers = nullptr;
  const void* const* expert_w2_scale_pointers = nullptr;
  void *shared_w13 = nullptr, *shared_w2 = nullptr;
};

// Steps of at least this many tokens run the bf16 MoE as per-expert cuBLASLt GEMMs (moe_host_grouped), the rest
// the grouped mma.sync kernel. Per-expert cuBLASLt measured faster once its plans stopped paying a heuristic
// query per expert load (ops/cuda/gemm.h's row buckets): 4-layer V4-Flash cut, 16 experts, H100, whole
// prefill 37.5 → 34.8 ms at 4K tokens, 18.3 → 16.9 at 2K and 10.59 → 10.25 ms at 1K, but 5.8 → 6.6 ms at 512
// (docs/PERF.md): the host sync and the small per-expert GEMMs lose below ~1K tokens.
// DSV4_HOST_GROUPED_MOE_MIN_TOKENS=N moves the threshold (0 turns the host-grouped path off);
// CudaModelOptions::per_expert_moe_min_tokens overrides both.
int64_t host_grouped_moe_min_tokens() {
  static const int64_t value = [] {
    const char* text = std::getenv("DSV4_HOST_GROUPED_MOE_MIN_TOKENS");
    if (text == nullptr || *text == 0) return int64_t{1024};
    const int64_t tokens = std::atoll(text);
    return tokens <= 0 ? std::numeric_limits<int64_t>::max() : tokens;
  }();
  return value;
}

// The streams moe_host_grouped spreads its expert GEMM pairs over. An expert's GEMM of ~1.5K rows (a 4K-token
// prefill of V4-Flash's cut: 6 of 16 experts a token) is a few waves of output tiles with the last one part empty
// (e.g. 192 tiles of 128 × 256 on 132 SMs), unless the next expert's GEMM, on another stream, fills the idle SMs.
// Measured (H100, 4K prefill of the 4-layer cut, two rounds): 1 lane 27.98 / 28.04 ms, 2 lanes 26.72 / 26.94,
// 4 lanes 26.61 / 26.55 (docs/PERF.md "The per-expert MoE on four streams").
constexpr int kMaxExpertLanes = 4;
// DSV4_MOE_EXPERT_LANES=N (1-4; CudaModelOptions::per_expert_moe_lanes overrides it).
int default_expert_lanes() {
  static const int value = [] {
    const char* text = std::getenv("DSV4_MOE_EXPERT_LANES");
    if (text == nullptr || *text == 0) return kMaxExpertLanes;
    return std::clamp(std::atoi(text), 1, kMaxExpertLanes);
  }();
  return value;
}

}  // namespace

struct DeepseekV4CudaModel::Impl {
  ModelConfig config;
  CudaModelOptions options;
  std::string device_label;
  bool bf16 = true;
  // Numerics::kDeepSeek (docs/numerics.md "kDeepSeek on the GPU"): the reference's bf16 roundings and FP8 / FP4
  // simulations at the points the CPU's kDeepSeek applies them, on the bf16 mode's kernels.
  bool deepseek = false;
  // The main K=V entries' format (window and compressed): kFp8 with ModelConfig::fp8_kv_cache, else kBf16 (bf16
  // mode; the fp32 mode's entries are fp32 and never read through this).
  KvEntryFormat kv_format = KvEntryFormat::kBf16;
  cudaStream_t stream = nullptr, index_stream = nullptr, kv_stream = nullptr, shared_expert_stream = nullptr;
  cudaEvent_t index_fork = nullptr, index_join = nullptr, kv_fork = nullptr, kv_join = nullptr;
  cudaEvent_t shared_expert_fork = nullptr, shared_expert_join = nullptr;
  std::unique_ptr<cu::Gemm> gemm, index_gemm, kv_gemm, shared_gemm;
  // moe_host_grouped's expert lanes (lane 0 is `stream`): the fork after the gather, each other lane's join.
  cudaEvent_t expert_lanes_fork = nullptr;
  std::array<cudaEvent_t, kMaxExpertLanes> expert_lane_join{};
  DeviceAllocations weights_memory;
  int multiprocessors = 0;

  // Weights.
  void* embed = nullptr;  // [vocab, D] fp32 or bf16
  cu::GemmWeight head;
  float *norm = nullptr, *hc_head_fn = nullptr, *hc_head_base = nullptr, *hc_head_scale = nullptr;
  std::vector<LayerDevice> layers;
  float *inv_freq_main = nullptr, *inv_freq_compress = nullptr;
  float scaling_main = 1.0f, scaling_compress = 1.0f;

  // The cache.
  const HybridKvCacheManager* manager = nullptr;
  std::byte* arena = nullptr;
  int64_t arena_bytes = 0;

  // Per-step scratch.
  std::map<std::string, Scratch> scratch;
  template <typename T>
  T* buffer(const char* name, size_t count) {
    return scratch[name].get<T>(count, memory_generation, capturing);
  }
  int64_t memory_generation = 0;  // bumps when scratch or metadata memory moves
  bool capturing = false;
  struct Graph {
    cudaGraphExec_t exec = nullptr;
    int64_t generation = -1;
    float* logits = nullptr;
  };
  std::map<std::vector<int64_t>, Graph> graphs;  // by Step::graph_key
  std::map<std::vector<int64_t>, bool> seen_keys;  // keys run eagerly once (sizing every buffer)
  int64_t graph_replays = 0, graph_captures = 0;
  // Step profile (sums; DeepseekV4CudaModel::step_profile averages).
  DeepseekV4CudaModel::StepProfile profile;
  cudaEvent_t forward_start = nullptr, forward_end = nullptr, sampling_end = nullptr;
  // After the step's sync: adds the events' times to the profile.
  void account(bool sampled) {
    float forward_ms = 0, sampling_ms = 0;
    if (cudaEventElapsedTime(&forward_ms, forward_start, forward_end) == cudaSuccess)
      profile.device_forward_ms += forward_ms;
    if (sampled && cudaEventElapsedTime(&sampling_ms, forward_end, sampling_end) == cudaSuccess)
      profile.device_sampling_ms += sampling_ms;
    ++profile.steps;
  }
  std::vector<int32_t> host_meta;
  int32_t* device_meta = nullptr;
  size_t device_meta_capacity = 0;
  // The grid-barrier words of hc_post_pre's one-launch hand-over (ops/cuda/hyper_connection.h): zeroed once, left
  // zero by every call; allocated by the first eager step (never during graph capture).
  unsigned* hc_handover_sync = nullptr;

  ~Impl() {
    cudaSetDevice(options.device);  // the model's memory, streams and events, whatever thread ends it
    for (cudaEvent_t e : {forward_start, forward_end, sampling_end})
      if (e) cudaEventDestroy(e);
    for (auto& [key, graph] : graphs)
      if (graph.exec) cudaGraphExecDestroy(graph.exec);
    cudaFree(arena);
    cudaFree(device_meta);
    cudaFree(hc_handover_sync);
    if (index_fork) cudaEventDestroy(index_fork);
    if (index_join) cudaEventDestroy(index_join);
    if (index_stream) cudaStreamDestroy(index_stream);
    if (kv_fork) cudaEventDestroy(kv_fork);
    if (kv_join) cudaEventDestroy(kv_join);
    if (kv_stream) cudaStreamDestroy(kv_stream);
    if (shared_expert_fork) cudaEventDestroy(shared_expert_fork);
    if (shared_expert_join) cudaEventDestroy(shared_expert_join);
    if (shared_expert_stream) cudaStreamDestroy(shared_expert_stream);
    if (expert_lanes_fork) cudaEventDestroy(expert_lanes_fork);
    for (cudaEvent_t e : expert_lane_join)
      if (e) cudaEventDestroy(e);
    if (stream) cudaStreamDestroy(stream);
  }

  cu::GemmDtype weight_dtype() const { return bf16 ? cu::GemmDtype::kBf16 : cu::GemmDtype::kF32; }

  float* upload_f32(const Tensor& t) {
    if (t.empty()) return nullptr;
    auto* p = static_cast<float*>(weights_memory.allocate(t.data.size() * sizeof(float)));
    DSV4_CU(cudaMemcpy(p, t.ptr(), t.data.size() * sizeof(float), cudaMemcpyHostToDevice));
    return p;
  }
  // Copies `count` floats to `dst` in the weight dtype.
  void upload_as_weight(const float* src, size_t count, void* dst) {
    if (!bf16) {
      DSV4_CU(cudaMemcpy(dst, src, count * sizeof(float), cudaMemcpyHostToDevice));
      return;
    }
    std::vector<uint16_t> converted(count);
    ThreadPool::global().parallel_for(static_cast<int64_t>(count), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) converted[i] = f32_to_bf16(src[i]);
    }, 1 << 16);
    DSV4_CU(cudaMemcpy(dst, converted.data(), count * sizeof(uint16_t), cudaMemcpyHostToDevice));
  }
  size_t weight_element_bytes() const { return bf16 ? 2 : 4; }
  void* upload_weight(const Tensor& t) {
    void* p = weights_memory.allocate(t.data.size() * weight_element_bytes());
    upload_as_weight(t.ptr(), t.data.size(), p);
    return p;
  }
  cu::GemmWeight linear(const Tensor& t) {
    if (t.empty()) return {};
    return {upload_weight(t), weight_dtype(), t.dim(0), t.dim(1), 0};
  }
  // An FP8 / FP4 host weight is decoded a panel of rows at a time (exact values) into the device weight
  // dtype: the device GEMMs are bf16 / fp32 (FP8 on the device is issue 7's next step), the host never holds
  // it in fp32.
  void upload_as_weight(const LinearWeight& w, void* dst) {
    if (!w.quantized()) {
      upload_as_weight(w.dense().ptr(), w.dense().data.size(), dst);
      return;
    }
    const int64_t panel = std::max<int64_t>(1, (int64_t{1} << 22) / std::max<int64_t>(w.cols(), 1));
    std::vector<float> decoded;
    for (int64_t row = 0; row < w.rows(); row += panel) {
      const int64_t count = std::min(panel, w.rows() - row);
      decoded.resize(static_cast<size_t>(count * w.cols()));
      ThreadPool::global().parallel_for(count, [&](int64_t begin, int64_t end) {
        w.dequantize_rows(row + begin, end - begin, decoded.data() + begin * w.cols());
      });
      upload_as_weight(decoded.data(), decoded.size(),
                       static_cast<std::byte*>(dst) + row * w.cols() * weight_element_bytes());
    }
  }
  void* upload_weight(const LinearWeight& w) {
    void* p = weights_memory.allocate(static_cast<size_t>(w.rows() * w.cols()) * weight_element_bytes());
    upload_as_weight(w, p);
    return p;
  }
  cu::GemmWeight linear(const LinearWeight& w) {
    if (w.empty()) return {};
    return {upload_weight(w), weight_dtype(), w.rows(), w.cols(), 0};
  }
  // An FP8 projection kept FP8 on the device (CudaModelOptions::fp8_weights, bf16 mode): the codes and the
  // checkpoint's 128×128 block scales as they are. Anything else (or rows whose scales are not one per
  // 128-row block, e.g. a w1 ‖ w3 stack of I % 128 ≠ 0) goes through linear() above.
  cu::GemmWeight fp8_linear(const LinearWeight& w) {
    std::vector<float> block_scales;
    if (!options.fp8_weights || w.encoding() != WeightEncoding::kF8E4M3 || !w.fp8_block_scales(block_scales))
      return linear(w);
    const std::vector<uint8_t>& codes = w.codes();
    void* device_codes = weights_memory.allocate(codes.size());
    DSV4_CU(cudaMemcpy(device_codes, codes.data(), codes.size(), cudaMemcpyHostToDevice));
    auto* device_scales = static_cast<float*>(weights_memory.allocate(block_scales.size() * sizeof(float)));
    DSV4_CU(cudaMemcpy(device_scales, block_scales.data(), block_scales.size() * sizeof(float),
                       cudaMemcpyHostToDevice));
    cu::GemmWeight g{device_codes, cu::GemmDtype::kF8E4M3, w.rows(), w.cols(), 0};
    g.scales = device_scales;
    return g;
  }
  // y [rows, w.out] = operand · Wᵀ: the weight dtype's GEMM, or for an FP8 weight DeepSeek's FP8 linear — the
  // bf16 operand quantized per row and 128 columns into `scratch` (a model buffer, so CUDA graphs see its
  // moves), then the block-scaled product.
  void project(cu::Gemm& with, const cu::GemmWeight& w, const void* operand, int64_t rows, float* y,
               cudaStream_t on, const char* scratch = "fp8_activation") {
    if (w.dtype != cu::GemmDtype::kF8E4M3) {
      with.linear(w, operand, rows, y, on);
      if (deepseek) DSV4_CU(cu::round_to_bf16(y, rows * w.out, on));  // a bf16 F.linear's output
      return;
    }
    const int64_t code_stride = (w.in + 15) / 16 * 16;  // 16-byte rows, the FP8 kernels' alignment
    const std::string codes_name = std::string(scratch) + "_codes",
                      scales_name = std::string(scratch) + "_scales";
    auto* codes = buffer<uint8_t>(codes_name.c_str(), static_cast<size_t>(rows * code_stride));
    float* scales =
        buffer<float>(scales_name.c_str(), static_cast<size_t>(cu::fp8_activation_scale_count(rows, w.in)));
    cu::Fp8QuantizeParams q;
    q.rows = rows;
    q.cols = w.in;
    q.code_stride = code_stride;
    q.bf16_input = bf16;  // the operand is in the weight dtype: bf16, or fp32 in the exact mode
    DSV4_CU(cu::quantize_e4m3_rows(q, operand, codes, scales, on));
    with.linear_fp8(w, cu::Fp8Activation{codes, scales, code_stride}, rows, y, on);
    if (deepseek) DSV4_CU(cu::round_to_bf16(y, rows * w.out, on));  // the reference's FP8 linear returns bf16
  }
  // kDeepSeek: the FP8 simulation of the leading `cols` of each row (per `block`), in place.
  void simulate_fp8(void* x, bool bf16_values, int64_t rows, int64_t cols, int64_t stride, int64_t block,
                    cudaStream_t on) {
    cu::Fp8SimulateParams p;
    p.rows = rows;
    p.cols = cols;
    p.stride = stride;
    p.block = block;
    p.bf16 = bf16_values;
    DSV4_CU(cu::simulate_e4m3_blocks(p, x, on));
  }
  // Stacks same-shaped tensors [count, ...] in the weight dtype.
  void* upload_stacked(const std::vector<Tensor>& tensors) {
    if (tensors.empty()) return nullptr;
    const size_t each = tensors[0].data.size();
    auto* base = static_cast<std::byte*>(weights_memory.allocate(each * tensors.size() * weight_element_bytes()));
    for (size_t i = 0; i < tensors.size(); ++i)
      upload_as_weight(tensors[i].ptr(), each, base + i * each * weight_element_bytes());
    return base;
  }
  void* upload_stacked(std::span<const LinearWeight> weights) {
    if (weights.empty()) return nullptr;
    const auto each = static_cast<size_t>(weights[0].rows() * weights[0].cols());
    auto* base =
        static_cast<std::byte*>(weights_memory.allocate(each * weights.size() * weight_element_bytes()));
    for (size_t i = 0; i < weights.size(); ++i) {
      DSV4_CHECK(weights[i].shape() == weights[0].shape(), "stacked weights of different shapes");
      upload_as_weight(weights[i], base + i * each * weight_element_bytes());
    }
    return base;
  }

  // ---- per-step metadata (built on the host once, one upload) ----
  struct Step {
    int64_t tokens = 0, rows = 0, max_chunk = 0;
    // The largest position the step's kernels are sized for (≥ every token's): the exact one eagerly, rounded up
    // to a power of two under a CUDA graph so one capture serves many steps (the kernels mask per token).
    int64_t max_position = 0;
    std::vector<int64_t> graph_key;  // decode under a graph: batch, position cap, table strides
    std::vector<int64_t> offset, start, length;
    // device pointers into device_meta
    const int32_t *token_ids, *positions, *token_row, *chunk_start, *row_end, *last_rows, *csa_visible,
        *chunk_table, *token_chunk_start, *token_chunk_index, *csa_row_entries;
    const int32_t* row_offsets;  // [rows + 1]: row r's tokens are [row_offsets[r], row_offsets[r + 1])
    std::map<CacheGroupKind, std::pair<const int32_t*, int64_t>> tables;  // device table, stride
  };
  Step prepare(std::span<const SequenceChunk> batch, bool for_graph);
  PagedGroupView view(const Step& step, CacheGroupKind kind, int64_t layer) const;
  PagedKvPool kv_pool(const Step& step, CacheGroupKind kind, int64_t layer) const;
  // This step's own K=V rows in `entries` (kv_format's entries, or bf16 rows) as a pool of one-entry blocks: row
  // r's entry j is block offset[r] + j, the token's index (the tuned attention's chunk pool).
  PagedKvPool chunk_pool(const Step& step, uint8_t* entries) const;

  // ---- the forward ----
  Tensor forward(std::span<const SequenceChunk> batch, LogitsMode mode);
  Tensor forward_empty();
  void forward_and_sample(std::span<const SequenceChunk> batch, std::span<const DeviceSampleRow> rows,
                          std::vector<SampleResult>& results);
  // The step (eager or a graph replay) without waiting: the device logits [R, vocab]; advances the states.
  float* device_logits(std::span<const SequenceChunk> batch, LogitsMode mode, Step& step);
  cu::SamplingBatch sampling_batch;
  std::vector<cu::SamplingOutput> sampling_outputs;
  // Every kernel of one step on `stream` (capturable); returns the device logits [R, vocab].
  float* run(const Step& step, LogitsMode mode);
  void attention(int64_t layer, const Step& step, const void* x_operand, float* out);
  void compress(int64_t layer, EntryKind kind, const Step& step, const void* x_operand, cudaStream_t on,
                cu::Gemm& with);
  void moe(int64_t layer, const Step& step, const float* x, const void* x_operand, float* out);
  // Steps of per_expert_moe_min_tokens() or more tokens: the routing copied to the host, rows permuted expert by
  // expert, one cuBLASLt GEMM pair per expert on per_expert_moe_lanes() streams, the weighted combine on the
  // device. Not capturable (a host sync).
  int64_t per_expert_moe_min_tokens() const {
    return options.per_expert_moe_min_tokens > 0 ? options.per_expert_moe_min_tokens : host_grouped_moe_min_tokens();
  }
  int per_expert_moe_lanes() const {
    return options.per_expert_moe_lanes > 0 ? std::min(options.per_expert_moe_lanes, kMaxExpertLanes)
                                            : default_expert_lanes();
  }
  void moe_host_grouped(int64_t layer, const Step& step, const void* x_operand, const int32_t* chosen,
                        const float* weights, float* out);
  std::vector<int32_t> host_chosen, host_moe_index;
  void routed_experts_gemv(int64_t layer, const void* x_operand, const int32_t* chosen, const float* weights,
                           const float* shared_out, float* out);
  // One local expert (or the shared expert) over `n` operand rows: w13, the clamped SwiGLU, w2 into `output`.
  // `shared_lane`: on the shared expert's stream with its own Gemm and scratch (beside the routed experts).
  void run_expert(const void* w13, const void* w2, const void* input, int64_t n, float* output,
                  bool shared_lane = false);
  // run_expert's three kernels with the caller's scratch (gate_up [n, 2I] fp32, activated [n, I] in the GEMM
  // operand's dtype), Gemm and stream.
  void run_expert_on(const void* w13, const void* w2, const void* input, int64_t n, float* output, float* gate_up,
                     void* activated, cu::Gemm& with, cudaStream_t on);
  // Sizes run_expert's scratch for up to `n` rows at once, so a sublayer's experts do not grow it one by one.
  void reserve_expert_scratch(int64_t n) {
    buffer<float>("moe_gate_up", n * 2 * config.moe_intermediate_size);
    if (bf16)
      buffer<uint16_t>("moe_activated_in", n * config.moe_intermediate_size);
    else
      buffer<float>("moe_activated", n * config.moe_intermediate_size);
  }
  // Expert parallelism (set_expert_parallel): this rank's partition of the routed experts, the others' reached
  // through `expert_parallel`'s all-to-alls. Host plans (parallel/expert_dispatch.h), device rows.
  parallel::Communicator* expert_parallel = nullptr;
  std::optional<parallel::ExpertPartition> expert_partition;
  void moe_expert_parallel(int64_t layer, const Step& step, const void* x_operand, const int32_t* chosen,
                           const float* weights, float* out);
  std::vector<float> host_router_weights;
  // RMSNorm of x in place, returning it as the next GEMM's operand: x itself (kF32), or the bf16 copy in `name`
  // the same kernel writes (kBf16).
  const void* norm_operand(float* x, int64_t rows, int64_t dim, const float* weight, const char* name, cudaStream_t on) {
    const cu::RmsNormParams params{rows, dim, static_cast<float>(config.rms_norm_eps)};
    if (!bf16) {
      DSV4_CU(cu::rms_norm(params, x, weight, x, on));
      return x;
    }
    uint16_t* converted = buffer<uint16_t>(name, rows * dim);
    DSV4_CU(cu::rms_norm_with_bf16(params, x, weight, x, converted, on));
    return converted;
  }
  // x (fp32) as a GEMM operand of the weight dtype: x itself (kF32) or its bf16 copy in `name`.
  const void* operand(const float* x, size_t count, const char* name, cudaStream_t on) {
    if (!bf16) return x;
    uint16_t* converted = buffer<uint16_t>(name, count);
    DSV4_CU(cu::f32_to_bf16(x, converted, static_cast<int64_t>(count), on));
    return converted;
  }
};

DeepseekV4CudaModel::DeepseekV4CudaModel(ModelConfig config, const ModelWeights& weights, CudaModelOptions options)
    : impl_(std::make_unique<Impl>()), device_sampling_(options.device_sampling) {
  open_device(std::move(config), options);
  upload_globals(weights);
  for (int64_t layer = 0; layer < impl_->config.num_hidden_layers; ++layer)
    upload_layer(weights.layers[static_cast<size_t>(layer)]);
  upload_rope_tables();
}

DeepseekV4CudaModel::DeepseekV4CudaModel(ModelConfig config, ModelWeightSource& weights, CudaModelOptions options)
    : impl_(std::make_unique<Impl>()), device_sampling_(options.device_sampling) {
  DSV4_CHECK(weights.config().num_hidden_layers == config.num_hidden_layers,
             "the weight source has " + std::to_string(weights.config().num_hidden_layers) + " layers, the config " +
                 std::to_string(config.num_hidden_layers));
  open_device(std::move(config), options);
  // DSV4_LOAD_PROGRESS=1: one stderr line per layer, the source's time (reading or drawing it) apart from the
  // upload's (conversion, rearrangement, copies) — where a large model's load goes.
  const char* progress_env = std::getenv("DSV4_LOAD_PROGRESS");
  const bool progress = progress_env != nullptr && std::string(progress_env) == "1";
  using Clock = std::chrono::steady_clock;
  const auto seconds_since = [](Clock::time_point t) {
    return std::chrono::duration<double>(Clock::now() - t).count();
  };
  auto start = Clock::now();
  {
    const ModelWeights globals = weights.globals();
    const double source_s = seconds_since(start);
    start = Clock::now();
    upload_globals(globals);  // the temporary (embedding and LM head) is freed here
    if (progress) std::fprintf(stderr, "load: globals: source %.2f s, upload %.2f s\n", source_s, seconds_since(start));
  }
  for (int64_t layer = 0; layer < impl_->config.num_hidden_layers; ++layer) {
    start = Clock::now();
    const LayerWeights host = weights.layer(layer);  // likewise: one layer's host copy at a time
    const double source_s = seconds_since(start);
    start = Clock::now();
    upload_layer(host);
    if (progress)
      std::fprintf(stderr, "load: layer %lld/%lld: source %.2f s, upload %.2f s\n", static_cast<long long>(layer + 1),
                   static_cast<long long>(impl_->config.num_hidden_layers), source_s, seconds_since(start));
  }
  upload_rope_tables();
}

void DeepseekV4CudaModel::open_device(ModelConfig config, const CudaModelOptions& options) {
  Impl& m = *impl_;
  m.config = std::move(config);
  m.options = options;
  m.bf16 = options.precision == CudaPrecision::kBf16;
  DSV4_CHECK(options.expert_parallel_size >= 1 && options.expert_parallel_rank >= 0 &&
                 options.expert_parallel_rank < options.expert_parallel_size &&
                 options.expert_parallel_size <= std::max<int64_t>(1, m.config.n_routed_experts),
             "expert parallel rank " + std::to_string(options.expert_parallel_rank) + " of " +
                 std::to_string(options.expert_parallel_size) + " ranks (" +
                 std::to_string(m.config.n_routed_experts) + " routed experts)");
  DSV4_CHECK(m.config.hidden_size % 8 == 0 && m.config.moe_intermediate_size % 8 == 0,
             "the CUDA backend needs hidden_size and moe_intermediate_size in multiples of 8 (the grouped expert "
             "GEMM's 16-byte rows), got " + std::to_string(m.config.hidden_size) + " and " +
                 std::to_string(m.config.moe_intermediate_size));
  m.deepseek = m.config.numerics == Numerics::kDeepSeek;
  if (m.deepseek) {
    m.options.fp8_weights = true;  // the reference's FP8 linears: activations quantized per 128 (§3.2)
    // The FP8 cache's entries are the reference's simulated values only where its roundings are bf16's; this mode
    // keeps bf16 entries holding the simulated values instead (docs/numerics.md).
    const bool csa = std::count(m.config.layer_types.begin(), m.config.layer_types.end(),
                                AttentionType::kCompressedSparse) > 0;
    const int64_t rope = m.config.rope_dim(RopeKind::kMain), index_dim = m.config.index_head_dim;
    DSV4_CHECK(m.bf16 && !m.config.fp8_kv_cache,
               "--numerics deepseek on CUDA runs in --dtype bf16 and simulates DeepSeek's FP8 K=V entries in a bf16 "
               "cache (drop --kv-cache-dtype fp8)");
    DSV4_CHECK((m.config.head_dim - rope) % 64 == 0 && m.config.rope_dim(RopeKind::kCompress) == rope &&
                   (!csa || index_dim == 64 || index_dim == 128 || index_dim == 256),
               "--numerics deepseek on CUDA needs head_dim - rope_dim a multiple of 64 (the FP8 simulation's "
               "blocks) and an indexer head_dim of 64, 128 or 256 (its Hadamard rotation); got head_dim " +
                   std::to_string(m.config.head_dim) + ", rope " + std::to_string(rope) + ", indexer head_dim " +
                   std::to_string(index_dim));
  }
  if (m.config.fp8_kv_cache) {
    // The FP8 entry is V4's 512-wide one and only the tuned attention kernel reads it (attention() `tuned`); the
    // FP8 index keys only the tuned scores kernel (64 heads × 128).
    const int64_t rope_main = m.config.rope_dim(RopeKind::kMain), rope_compress = m.config.rope_dim(RopeKind::kCompress);
    const bool csa = std::count(m.config.layer_types.begin(), m.config.layer_types.end(),
                                AttentionType::kCompressedSparse) > 0;
    DSV4_CHECK(m.bf16 && m.config.num_attention_heads % 64 == 0 && m.config.head_dim == kKvHeadDim &&
                   rope_main == kKvRopeDim && rope_compress == kKvRopeDim &&
                   (!csa || (m.config.index_n_heads == 64 && m.config.index_head_dim == 128)),
               "--kv-cache-dtype fp8 needs --dtype bf16 and V4's attention shapes (heads a multiple of 64, head_dim "
               "512, 64 rope channels, an indexer of 64 heads x 128); got " +
                   std::to_string(m.config.num_attention_heads) + " heads, head_dim " +
                   std::to_string(m.config.head_dim) + ", rope " + std::to_string(rope_main) + " / " +
                   std::to_string(rope_compress) + ", indexer " + std::to_string(m.config.index_n_heads) + " x " +
                   std::to_string(m.config.index_head_dim));
    m.kv_format = KvEntryFormat::kFp8;
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) throw Error("no CUDA device is available");
  DSV4_CHECK(options.device >= 0 && options.device < count,
             "CUDA device " + std::to_string(options.device) + " does not exist (" + std::to_string(count) + " visible)");
  DSV4_CU(cudaSetDevice(options.device));
  cudaDeviceProp prop{};
  DSV4_CU(cudaGetDeviceProperties(&prop, options.device));
  m.multiprocessors = prop.multiProcessorCount;
  m.device_label = "cuda:" + std::to_string(options.device) + " (" + prop.name + ")";
  DSV4_CU(cudaStreamCreateWithFlags(&m.stream, cudaStreamNonBlocking));
  DSV4_CU(cudaStreamCreateWithFlags(&m.index_stream, cudaStreamNonBlocking));
  DSV4_CU(cudaEventCreateWithFlags(&m.index_fork, cudaEventDisableTiming));
  DSV4_CU(cudaEventCreateWithFlags(&m.index_join, cudaEventDisableTiming));
  DSV4_CU(cudaStreamCreateWithFlags(&m.kv_stream, cudaStreamNonBlocking));
  DSV4_CU(cudaEventCreateWithFlags(&m.kv_fork, cudaEventDisableTiming));
  DSV4_CU(cudaEventCreateWithFlags(&m.kv_join, cudaEventDisableTiming));
  DSV4_CU(cudaStreamCreateWithFlags(&m.shared_expert_stream, cudaStreamNonBlocking));
  DSV4_CU(cudaEventCreateWithFlags(&m.shared_expert_fork, cudaEventDisableTiming));
  DSV4_CU(cudaEventCreateWithFlags(&m.shared_expert_join, cudaEventDisableTiming));
  DSV4_CU(cudaEventCreateWithFlags(&m.expert_lanes_fork, cudaEventDisableTiming));
  for (cudaEvent_t& e : m.expert_lane_join) DSV4_CU(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  DSV4_CU(cudaEventCreate(&m.forward_start));
  DSV4_CU(cudaEventCreate(&m.forward_end));
  DSV4_CU(cudaEventCreate(&m.sampling_end));
  m.gemm = std::make_unique<cu::Gemm>();
  m.index_gemm = std::make_unique<cu::Gemm>();
  m.kv_gemm = std::make_unique<cu::Gemm>();
  m.shared_gemm = std::make_unique<cu::Gemm>();
}

void DeepseekV4CudaModel::upload_globals(const ModelWeights& weights) {
  Impl& m = *impl_;
  m.embed = m.upload_weight(weights.embed);
  m.head = m.linear(weights.head);
  m.norm = m.upload_f32(weights.norm);
  m.hc_head_fn = m.upload_f32(weights.hc_head_fn);
  m.hc_head_base = m.upload_f32(weights.hc_head_base);
  m.hc_head_scale = m.upload_f32(weights.hc_head_scale);
}

void DeepseekV4CudaModel::upload_layer(const LayerWeights& l) {
  Impl& m = *impl_;
  LayerDevice d{};
  d.hc_attn_fn = m.upload_f32(l.hc_attn_fn);
  d.hc_attn_base = m.upload_f32(l.hc_attn_base);
  d.hc_attn_scale = m.upload_f32(l.hc_attn_scale);
  d.hc_ffn_fn = m.upload_f32(l.hc_ffn_fn);
  d.hc_ffn_base = m.upload_f32(l.hc_ffn_base);
  d.hc_ffn_scale = m.upload_f32(l.hc_ffn_scale);
  d.attn_norm = m.upload_f32(l.attn_norm);
  d.ffn_norm = m.upload_f32(l.ffn_norm);
  d.q_norm = m.upload_f32(l.q_norm);
  d.kv_norm = m.upload_f32(l.kv_norm);
  d.attn_sink = m.upload_f32(l.attn_sink);
  d.wq_a = m.fp8_linear(l.wq_a);
  d.wq_b = m.fp8_linear(l.wq_b);
  d.wkv = m.fp8_linear(l.wkv);
  d.wo_a = m.linear(l.wo_a);  // a bf16 einsum in the reference (numerics.md), batched over groups here
  d.wo_b = m.fp8_linear(l.wo_b);
  auto compressor = [&](const CompressorWeights& w) {
    CompressorDevice out;
    if (w.wkv.empty()) return out;
    out.wkv_gate = {m.upload_stacked({w.wkv, w.wgate}), m.weight_dtype(), w.wkv.dim(0), w.wkv.dim(1), 0};
    out.ape = m.upload_f32(w.ape);
    out.norm = m.upload_f32(w.norm);
    return out;
  };
  d.compressor = compressor(l.compressor);
  d.indexer_compressor = compressor(l.indexer_compressor);
  d.indexer_wq_b = m.fp8_linear(l.indexer_wq_b);
  // The head weights' H_I^-1/2 (transformers: weights_proj(x) · n_heads^-0.5) folded into the matrix: exact
  // when H_I is a power of 4 (V4: 64), otherwise one fp32 rounding of each weight. kDeepSeek scales the bf16
  // output instead (attention()).
  if (!l.indexer_weights_proj.empty()) {
    Tensor scaled = l.indexer_weights_proj;
    const float head_scale = m.deepseek ? 1.0f : 1.0f / std::sqrt(static_cast<float>(m.config.index_n_heads));
    for (float& value : scaled.data) value *= head_scale;
    d.indexer_weights_proj = m.linear(scaled);
  }
  // The router stays fp32 in bf16 mode too: DeepSeek's reference computes the gate logits as x_fp32 · W_fp32ᵀ
  // (model_spec.md §9.1), and a bf16 product flips near-tied experts (a flipped expert is most of the bf16
  // greedy disagreement, docs/PERF.md). Costs E·D·2 more bytes a layer (2 MB on V4-Flash).
  d.gate = {m.upload_f32(l.gate), cu::GemmDtype::kF32, l.gate.dim(0), l.gate.dim(1), 0};
  d.gate_bias = m.upload_f32(l.gate_bias);
  if (!l.tid2eid.empty()) {
    d.tid2eid = static_cast<int32_t*>(m.weights_memory.allocate(l.tid2eid.size() * sizeof(int32_t)));
    DSV4_CU(cudaMemcpy(d.tid2eid, l.tid2eid.data(), l.tid2eid.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  }
  auto pointers = [&](void* stacked, size_t each_bytes, size_t count) -> const void* const* {
    std::vector<const void*> host;
    for (size_t e = 0; e < count; ++e)
      host.push_back(static_cast<const std::byte*>(stacked) + e * each_bytes);
    auto* device = static_cast<const void**>(m.weights_memory.allocate(host.size() * sizeof(void*)));
    DSV4_CU(cudaMemcpy(device, host.data(), host.size() * sizeof(void*), cudaMemcpyHostToDevice));
    return device;
  };
  // Expert parallelism with a partition: only this rank's block of routed experts comes to the device.
  std::span<const LinearWeight> experts_w13 = l.experts_w13, experts_w2 = l.experts_w2;
  if (m.options.expert_parallel_size > 1 && !l.experts_w13.empty()) {
    const parallel::ExpertPartition partition(static_cast<int64_t>(l.experts_w13.size()),
                                              m.options.expert_parallel_size);
    const auto first = static_cast<size_t>(partition.first_expert(m.options.expert_parallel_rank));
    const auto count = static_cast<size_t>(partition.num_local(m.options.expert_parallel_rank));
    experts_w13 = experts_w13.subspan(first, count);
    experts_w2 = experts_w2.subspan(first, count);
  }
  const size_t experts = experts_w13.size();
  // Routed experts in a grouped low-bit encoding (the release's MXFP4, or --expert-bits' Q3 / Q2) stay so and
  // are decoded inside the expert GEMM (CudaModelOptions::low_bit_experts, bf16 mode).
  const WeightEncoding encoding = experts ? experts_w13[0].encoding() : WeightEncoding::kF32;
  const bool grouped_encoding = encoding == WeightEncoding::kFp4E2M1 || encoding == WeightEncoding::kQ3G32 ||
                                encoding == WeightEncoding::kQ2G32;
  const auto kernel_can_read = [&](std::span<const LinearWeight> weights) {
    return std::all_of(weights.begin(), weights.end(), [&](const LinearWeight& w) {
      if (w.encoding() != encoding) return false;
      return encoding == WeightEncoding::kFp4E2M1
                 ? cu::mxfp4_kernel_scales_supported(w.fp4_exponents().size(), w.fp4_exponents().data())
                 : cu::grouped_kernel_scales_supported(w.group_scales().size(), w.group_scales().data());
    });
  };
  d.routed_dtype = m.bf16 ? cu::MoeWeightDtype::kBf16 : cu::MoeWeightDtype::kFp32;
  if (m.bf16 && m.options.low_bit_experts && grouped_encoding && m.config.hidden_size % 32 == 0 &&
      m.config.moe_intermediate_size % 32 == 0 && kernel_can_read(experts_w13) &&
      kernel_can_read(experts_w2))
    d.routed_dtype = encoding == WeightEncoding::kFp4E2M1 ? cu::MoeWeightDtype::kMxfp4
                     : encoding == WeightEncoding::kQ3G32 ? cu::MoeWeightDtype::kQ3G32
                                                          : cu::MoeWeightDtype::kQ2G32;
  if (d.low_bit_experts()) {
    // Codes and scales rearranged for the kernel (ops/cuda/moe_experts.h moe_kernel_codes, *_tile_scales).
    const int bits = encoding == WeightEncoding::kFp4E2M1 ? 4 : encoding == WeightEncoding::kQ3G32 ? 3 : 2;
    auto upload_grouped = [&](std::span<const LinearWeight> weights, void*& codes,
                              const void* const*& code_table, const void* const*& scale_table) {
      const int64_t rows = weights[0].rows(), cols = weights[0].cols();
      const size_t code_bytes = cu::moe_kernel_code_bytes(bits, rows, cols);
      const size_t scale_bytes =
          bits == 4 ? cu::mxfp4_tile_scale_bytes(rows, cols) : cu::grouped_tile_scale_bytes(rows, cols);
      codes = m.weights_memory.allocate(code_bytes * weights.size());
      void* scales = m.weights_memory.allocate(scale_bytes * weights.size());
      for (size_t e = 0; e < weights.size(); ++e)
        DSV4_CHECK(weights[e].shape() == weights[0].shape(), "stacked weights of different shapes");
      // The rearrangement is a host pass over every code (V4-Flash: 277 B of them), so experts are rearranged
      // in parallel over the thread pool, a bounded batch at a time (host memory: one batch of copies).
      const auto batch = static_cast<size_t>(std::max(1, 2 * ThreadPool::global().num_threads()));
      std::vector<std::vector<uint8_t>> ordered(batch), tiled(batch);
      for (size_t first = 0; first < weights.size(); first += batch) {
        const size_t count = std::min(batch, weights.size() - first);
        ThreadPool::global().parallel_for(static_cast<int64_t>(count), [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i) {
            const LinearWeight& w = weights[first + static_cast<size_t>(i)];
            ordered[i] = cu::moe_kernel_codes(bits, rows, cols, w.codes().data());
            tiled[i] = bits == 4 ? cu::mxfp4_tile_scales(rows, cols, w.fp4_exponents().data())
                                 : cu::grouped_tile_scales(rows, cols, w.group_scales().data());
          }
        });
        for (size_t i = 0; i < count; ++i) {
          DSV4_CU(cudaMemcpy(static_cast<std::byte*>(codes) + (first + i) * code_bytes, ordered[i].data(),
                             code_bytes, cudaMemcpyHostToDevice));
          DSV4_CU(cudaMemcpy(static_cast<std::byte*>(scales) + (first + i) * scale_bytes, tiled[i].data(),
                             scale_bytes, cudaMemcpyHostToDevice));
        }
      }
      code_table = pointers(codes, code_bytes, weights.size());
      scale_table = pointers(scales, scale_bytes, weights.size());
    };
    upload_grouped(experts_w13, d.experts_w13, d.expert_w13_pointers, d.expert_w13_scale_pointers);
    upload_grouped(experts_w2, d.experts_w2, d.expert_w2_pointers, d.expert_w2_scale_pointers);
  } else {
    d.experts_w13 = m.upload_stacked(experts_w13);
    d.experts_w2 = m.upload_stacked(experts_w2);
    const auto each = [&](std::span<const LinearWeight> weights) {
      return weights.empty()
                 ? size_t{0}
                 : static_cast<size_t>(weights[0].rows() * weights[0].cols()) * m.weight_element_bytes();
    };
    d.expert_w13_pointers = pointers(d.experts_w13, each(experts_w13), experts);
    d.expert_w2_pointers = pointers(d.experts_w2, each(experts_w2), experts);
  }
  d.shared_w13 = m.upload_weight(l.shared_w13);
  d.shared_w2 = m.upload_weight(l.shared_w2);
  m.layers.push_back(d);
}

void DeepseekV4CudaModel::upload_rope_tables() {
  Impl& m = *impl_;
  const ModelConfig& c = m.config;
  auto upload_vector = [&](const std::vector<float>& v) {
    auto* p = static_cast<float*>(m.weights_memory.allocate(v.size() * sizeof(float)));
    DSV4_CU(cudaMemcpy(p, v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice));
    return p;
  };
  m.inv_freq_main = upload_vector(c.inv_freq(RopeKind::kMain));
  m.inv_freq_compress = upload_vector(c.inv_freq(RopeKind::kCompress));
  m.scaling_main = static_cast<float>(c.rope_for(RopeKind::kMain).attention_factor);
  m.scaling_compress = static_cast<float>(c.rope_for(RopeKind::kCompress).attention_factor);
}

DeepseekV4CudaModel::~DeepseekV4CudaModel() = default;

const ModelConfig& DeepseekV4CudaModel::config() const { return impl_->config; }
const char* DeepseekV4CudaModel::device_name() const { return impl_->device_label.c_str(); }
KvStorage DeepseekV4CudaModel::kv_storage() const {
  if (impl_->kv_format == KvEntryFormat::kFp8) return KvStorage::kFp8;
  return impl_->bf16 ? KvStorage::kBf16 : KvStorage::kF32;
}
IndexStorage DeepseekV4CudaModel::index_storage() const {
  if (impl_->kv_format == KvEntryFormat::kFp8) return IndexStorage::kFp8;
  return impl_->bf16 ? IndexStorage::kBf16 : IndexStorage::kF32;
}
int64_t DeepseekV4CudaModel::weight_bytes() const { return impl_->weights_memory.total(); }
int64_t DeepseekV4CudaModel::graph_replays() const { return impl_->graph_replays; }
int64_t DeepseekV4CudaModel::graph_captures() const { return impl_->graph_captures; }
DeepseekV4CudaModel::StepProfile DeepseekV4CudaModel::step_profile() const {
  StepProfile p = impl_->profile;
  if (p.steps > 0) {
    p.host_prepare_ms /= static_cast<double>(p.steps);
    p.device_forward_ms /= static_cast<double>(p.steps);
    p.device_sampling_ms /= static_cast<double>(p.steps);
  }
  return p;
}
void DeepseekV4CudaModel::reset_step_profile() { impl_->profile = {}; }

int64_t DeepseekV4CudaModel::cache_bytes_for_utilization(double utilization, int64_t max_tokens,
                                                         int sharing_processes) const {
  DSV4_CU(cudaSetDevice(impl_->options.device));  // cudaMemGetInfo reports the current device
  size_t free_bytes = 0, total_bytes = 0;
  DSV4_CU(cudaMemGetInfo(&free_bytes, &total_bytes));
  const ModelConfig& c = impl_->config;
  // A step's activations: the residual streams and the widest projections, a few copies each, plus the CSA
  // scores of a long context (generous: this is headroom, not an allocation).
  const int64_t width = std::max({c.hidden_size * c.hc_mult, c.num_attention_heads * c.head_dim,
                                  c.index_n_heads * c.index_head_dim, 2 * c.moe_intermediate_size * 8});
  const int64_t activations = max_tokens * width * 4 * 12 + c.vocab_size * 4 * 256 + (int64_t{1} << 30);
  const int64_t used = sharing_processes > 1 ? weight_bytes() : static_cast<int64_t>(total_bytes - free_bytes);
  const int64_t budget = static_cast<int64_t>(utilization * static_cast<double>(total_bytes) /
                                              std::max(sharing_processes, 1)) -
                         used - activations;
  return std::max<int64_t>(budget, 0);
}

void DeepseekV4CudaModel::bind_cache(const HybridKvCacheManager& manager) {
  Impl& m = *impl_;
  DSV4_CU(cudaSetDevice(m.options.device));
  m.manager = &manager;
  m.arena_bytes = manager.pool().num_pages() * manager.pool().page_bytes();
  void* arena = nullptr;
  if (cudaMalloc(&arena, static_cast<size_t>(std::max<int64_t>(m.arena_bytes, 16))) != cudaSuccess)
    throw Error("cannot allocate a device KV cache arena of " + std::to_string(m.arena_bytes) + " bytes");
  m.arena = static_cast<std::byte*>(arena);
  // Blocks are handed out uninitialised, as on the CPU; a poisoned arena makes a read of a never-written entry
  // show up as NaN instead of plausible zeros.
  DSV4_CU(cudaMemset(m.arena, 0xff, static_cast<size_t>(m.arena_bytes)));
}

std::unique_ptr<SequenceState> DeepseekV4CudaModel::make_state(RequestId id) {
  DSV4_CHECK(impl_->manager != nullptr, "the CUDA model has no cache bound (bind_cache)");
  return std::make_unique<CudaSequenceState>(id, impl_->manager->num_computed(id), impl_->config);
}

void DeepseekV4CudaModel::copy_blocks(std::span<const BlockCopy> copies) {
  Impl& m = *impl_;
  DSV4_CU(cudaSetDevice(m.options.device));
  for (const BlockCopy& copy : copies) {
    DSV4_CHECK(copy.src_offset >= 0 && copy.dst_offset >= 0 && copy.src_offset + copy.bytes <= m.arena_bytes &&
                   copy.dst_offset + copy.bytes <= m.arena_bytes,
               "block copy outside the KV arena");
    DSV4_CU(cudaMemcpyAsync(m.arena + copy.dst_offset, m.arena + copy.src_offset, static_cast<size_t>(copy.bytes),
                            cudaMemcpyDeviceToDevice, m.stream));
  }
}

// Every entry point that touches the device makes the model's device current first: the data-parallel engine
// drives each rank's model from its own thread, and ranks of one process may sit on different GPUs.
Tensor DeepseekV4CudaModel::forward(std::span<const SequenceChunk> batch, LogitsMode mode) {
  DSV4_CU(cudaSetDevice(impl_->options.device));
  if (batch.empty()) return impl_->forward_empty();
  return impl_->forward(batch, mode);
}

void DeepseekV4CudaModel::forward_and_sample(std::span<const SequenceChunk> batch,
                                             std::span<const DeviceSampleRow> rows, std::vector<SampleResult>& results) {
  DSV4_CU(cudaSetDevice(impl_->options.device));
  if (batch.empty()) {
    impl_->forward_empty();
    results.clear();
    return;
  }
  impl_->forward_and_sample(batch, rows, results);
}

void DeepseekV4CudaModel::set_expert_parallel(parallel::Communicator* communicator) {
  Impl& m = *impl_;
  DSV4_CHECK(communicator != nullptr, "set_expert_parallel needs a communicator");
  DSV4_CHECK(!m.deepseek, "expert parallelism runs the hf numerics (--numerics deepseek is one rank's)");
  for (const LayerDevice& l : m.layers)
    DSV4_CHECK(l.experts_w13 != nullptr && l.experts_w2 != nullptr && !l.low_bit_experts(),
               "expert parallelism on the CUDA backend needs bf16 / fp32 routed experts (DSV4_LOW_BIT_EXPERTS=0 "
               "decodes a low-bit checkpoint's experts at upload)");
  DSV4_CHECK(m.options.expert_parallel_size == 1 || (communicator->size() == m.options.expert_parallel_size &&
                                                      communicator->rank() == m.options.expert_parallel_rank),
             "the model holds rank " + std::to_string(m.options.expert_parallel_rank) + " of " +
                 std::to_string(m.options.expert_parallel_size) + "'s experts, the communicator is rank " +
                 std::to_string(communicator->rank()) + " of " + std::to_string(communicator->size()));
  m.expert_partition.emplace(m.config.n_routed_experts, communicator->size());
  m.expert_parallel = communicator;
  m.options.cuda_graphs = false;  // the dispatch plan is made on the host every sublayer
}

bool cuda_device_available() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

// ---------------------------------------------------------------------------------------------------------------

// Smallest power of two ≥ value (≥ 1).
int64_t round_up_pow2(int64_t value) {
  int64_t p = 1;
  while (p < value) p *= 2;
  return p;
}

DeepseekV4CudaModel::Impl::Step DeepseekV4CudaModel::Impl::prepare(std::span<const SequenceChunk> batch,
                                                                    bool for_graph) {
  const ModelConfig& c = config;
  DSV4_CHECK(manager != nullptr, "the CUDA model has no cache bound (bind_cache)");
  Step step;
  step.rows = static_cast<int64_t>(batch.size());
  std::vector<const CudaSequenceState*> states;
  for (size_t r = 0; r < batch.size(); ++r) {
    const auto* state = dynamic_cast<const CudaSequenceState*>(batch[r].state);
    DSV4_CHECK(state != nullptr, "batch entry " + std::to_string(r) + " has no CUDA sequence state");
    DSV4_CHECK(!batch[r].token_ids.empty(), "batch entry " + std::to_string(r) + " has no tokens");
    for (const int32_t id : batch[r].token_ids)
      DSV4_CHECK(id >= 0 && id < c.vocab_size, "token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                                                   std::to_string(c.vocab_size) + ")");
    states.push_back(state);
    step.offset.push_back(step.tokens);
    step.start.push_back(state->num_tokens());
    step.length.push_back(static_cast<int64_t>(batch[r].token_ids.size()));
    step.tokens += step.length.back();
    step.max_chunk = std::max(step.max_chunk, step.length.back());
    step.max_position = std::max(step.max_position, step.start.back() + step.length.back() - 1);
  }
  if (for_graph) {
    step.max_position = round_up_pow2(step.max_position + 1) - 1;
    step.graph_key = {step.rows, step.max_position};
  }
  // Layout of the metadata block (int32): token ids, positions, token rows, csa visible, chunk start, index in
  // the chunk [N]; chunk starts, ends, last rows, CSA entries in the cache (end div ratio, the indexer's
  // per-request bound) [B]; the chunk table [B, max_chunk]; row offsets [B + 1]; then every group's block table
  // [B, stride].
  const int64_t N = step.tokens, B = step.rows;
  host_meta.clear();
  auto reserve = [&](int64_t count) {
    const size_t at = host_meta.size();
    host_meta.resize(at + static_cast<size_t>(count), -1);
    return at;
  };
  const size_t ids_at = reserve(N), pos_at = reserve(N), row_at = reserve(N), vis_at = reserve(N),
               tcs_at = reserve(N), tci_at = reserve(N);
  const size_t cs_at = reserve(B), end_at = reserve(B), last_at = reserve(B), csa_entries_at = reserve(B);
  const size_t chunk_table_at = reserve(B * step.max_chunk), row_offsets_at = reserve(B + 1);
  for (int64_t r = 0; r < B; ++r) {
    for (int64_t i = 0; i < step.length[r]; ++i) {
      const int64_t t = step.offset[r] + i, position = step.start[r] + i;
      host_meta[ids_at + t] = batch[r].token_ids[i];
      host_meta[pos_at + t] = static_cast<int32_t>(position);
      host_meta[row_at + t] = static_cast<int32_t>(r);
      host_meta[vis_at + t] = static_cast<int32_t>(c.compress_rate_csa > 0 ? (position + 1) / c.compress_rate_csa : 0);
      host_meta[tcs_at + t] = static_cast<int32_t>(step.start[r]);
      host_meta[tci_at + t] = static_cast<int32_t>(i);
      host_meta[chunk_table_at + r * step.max_chunk + i] = static_cast<int32_t>(t);
    }
    host_meta[cs_at + r] = static_cast<int32_t>(step.start[r]);
    host_meta[row_offsets_at + r] = static_cast<int32_t>(step.offset[r]);
    host_meta[end_at + r] = static_cast<int32_t>(step.start[r] + step.length[r]);
    host_meta[csa_entries_at + r] =
        static_cast<int32_t>(c.compress_rate_csa > 0 ? (step.start[r] + step.length[r]) / c.compress_rate_csa : 0);
    host_meta[last_at + r] = static_cast<int32_t>(step.offset[r] + step.length[r] - 1);
  }
  host_meta[row_offsets_at + B] = static_cast<int32_t>(N);
  std::map<CacheGroupKind, std::pair<size_t, int64_t>> table_at;
  for (const CacheGroupSpec& group : manager->layout().groups) {
    int64_t stride = 1;
    for (const auto* state : states)
      stride = std::max<int64_t>(stride, static_cast<int64_t>(manager->block_table(state->id(), group.kind).size()));
    if (for_graph) {
      stride = round_up_pow2(stride);
      step.graph_key.push_back(stride);
    }
    const size_t at = reserve(B * stride);
    for (int64_t r = 0; r < B; ++r) {
      const std::vector<BlockId>& table = manager->block_table(states[r]->id(), group.kind);
      std::copy(table.begin(), table.end(), host_meta.begin() + static_cast<std::ptrdiff_t>(at + r * stride));
    }
    table_at[group.kind] = {at, stride};
  }
  if (host_meta.size() > device_meta_capacity) {
    cudaFree(device_meta);
    device_meta = nullptr;
    device_meta_capacity = 0;
    DSV4_CU(cudaMalloc(&device_meta, host_meta.size() * 2 * sizeof(int32_t)));
    device_meta_capacity = host_meta.size() * 2;
    ++memory_generation;
  }
  DSV4_CU(cudaMemcpyAsync(device_meta, host_meta.data(), host_meta.size() * sizeof(int32_t), cudaMemcpyHostToDevice,
                          stream));
  step.token_ids = device_meta + ids_at;
  step.positions = device_meta + pos_at;
  step.token_row = device_meta + row_at;
  step.csa_visible = device_meta + vis_at;
  step.token_chunk_start = device_meta + tcs_at;
  step.token_chunk_index = device_meta + tci_at;
  step.chunk_start = device_meta + cs_at;
  step.csa_row_entries = device_meta + csa_entries_at;
  step.row_end = device_meta + end_at;
  step.last_rows = device_meta + last_at;
  step.chunk_table = device_meta + chunk_table_at;
  step.row_offsets = device_meta + row_offsets_at;
  for (const auto& [kind, at] : table_at) step.tables[kind] = {device_meta + at.first, at.second};
  return step;
}

PagedGroupView DeepseekV4CudaModel::Impl::view(const Step& step, CacheGroupKind kind, int64_t layer) const {
  const CacheGroupSpec* spec = manager->layout().find(kind);
  DSV4_CHECK(spec != nullptr, std::string("the cache has no ") + cache_group_name(kind) + " group");
  PagedGroupView v;
  v.arena = arena;
  v.page_bytes = manager->pool().page_bytes();
  v.max_blocks_per_page = manager->pool().max_blocks_per_page();
  v.block_bytes = spec->block_bytes();
  v.entry_bytes = spec->entry_bytes;
  v.entries_per_block = spec->entries_per_block;
  const auto it = std::find(spec->layers.begin(), spec->layers.end(), layer);
  DSV4_CHECK(it != spec->layers.end(), "layer " + std::to_string(layer) + " is not in the " + cache_group_name(kind) +
                                           " group");
  v.layer_index = it - spec->layers.begin();
  const auto& table = step.tables.at(kind);
  v.block_table = table.first;
  v.block_table_stride = table.second;
  return v;
}

// The tuned attention kernel's view of a main-entry group in the cache's format (cache/kv_entry_format.h).
PagedKvPool DeepseekV4CudaModel::Impl::kv_pool(const Step& step, CacheGroupKind kind, int64_t layer) const {
  const PagedGroupView v = view(step, kind, layer);
  PagedKvPool pool;
  pool.arena = reinterpret_cast<uint8_t*>(v.arena);
  pool.page_bytes = v.page_bytes;
  pool.blocks_per_page = v.max_blocks_per_page;
  pool.block_bytes = v.block_bytes;
  pool.region_offset = v.layer_index * kv_region_bytes(kv_format, v.entries_per_block);
  pool.entries_per_block = static_cast<int32_t>(v.entries_per_block);
  pool.block_table = v.block_table;
  pool.block_table_stride = v.block_table_stride;
  return pool;
}

PagedKvPool DeepseekV4CudaModel::Impl::chunk_pool(const Step& step, uint8_t* entries) const {
  const int64_t block_bytes =
      kv_format == KvEntryFormat::kFp8 ? kv_region_bytes(KvEntryFormat::kFp8, 1) : int64_t{kKvBf16EntryBytes};
  PagedKvPool pool;
  pool.arena = entries;
  pool.page_bytes = block_bytes;
  pool.blocks_per_page = 1;
  pool.block_bytes = block_bytes;
  pool.region_offset = 0;
  pool.entries_per_block = 1;
  pool.block_table = step.chunk_table;
  pool.block_table_stride = step.max_chunk;
  return pool;
}

// Decode steps (one token per request) replay a CUDA graph per (batch size, position cap, table strides): the
// first step of a key runs eagerly (sizing every buffer), the next one captures, later ones replay. Prefill and
// mixed steps run eagerly.
float* DeepseekV4CudaModel::Impl::device_logits(std::span<const SequenceChunk> batch, LogitsMode mode, Step& step) {
  bool decode = options.cuda_graphs && mode == LogitsMode::kLastPerSequence;
  for (const SequenceChunk& chunk : batch) decode = decode && chunk.token_ids.size() == 1;
  const auto host_start = std::chrono::steady_clock::now();
  step = prepare(batch, decode);
  profile.host_prepare_ms +=
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - host_start).count();
  DSV4_CU(cudaEventRecord(forward_start, stream));
  float* logits_device = nullptr;
  if (!decode || !seen_keys[step.graph_key]) {
    logits_device = run(step, mode);
    if (decode) seen_keys[step.graph_key] = true;
  } else {
    Graph& graph = graphs[step.graph_key];
    if (graph.exec == nullptr || graph.generation != memory_generation) {
      if (graph.exec) cudaGraphExecDestroy(graph.exec);
      graph.exec = nullptr;
      const int64_t generation = memory_generation;
      cudaGraph_t captured = nullptr;
      DSV4_CU(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      capturing = true;
      try {
        graph.logits = run(step, mode);
      } catch (...) {
        capturing = false;
        cudaStreamEndCapture(stream, &captured);
        if (captured) cudaGraphDestroy(captured);
        throw;
      }
      capturing = false;
      DSV4_CU(cudaStreamEndCapture(stream, &captured));
      const cudaError_t instantiated = cudaGraphInstantiate(&graph.exec, captured, 0);
      cudaGraphDestroy(captured);
      DSV4_CU(instantiated);
      DSV4_CHECK(generation == memory_generation, "device memory moved during CUDA graph capture");
      graph.generation = memory_generation;
      ++graph_captures;
    }
    DSV4_CU(cudaGraphLaunch(graph.exec, stream));
    ++graph_replays;
    logits_device = graph.logits;
  }
  DSV4_CU(cudaEventRecord(forward_end, stream));
  for (size_t r = 0; r < batch.size(); ++r) batch[r].state->set_num_tokens(step.start[r] + step.length[r]);
  return logits_device;
}

// An empty batch: a data-parallel rank with nothing scheduled this step (EngineConfig::forward_every_step). With
// expert parallelism it still takes part in every MoE sublayer's collectives and serves the rows the other ranks
// send to its experts (the CPU model does the same); otherwise there is nothing to run.
Tensor DeepseekV4CudaModel::Impl::forward_empty() {
  if (expert_parallel != nullptr) {
    const Step step{};  // no tokens
    for (int64_t layer = 0; layer < config.num_hidden_layers; ++layer)
      moe_expert_parallel(layer, step, nullptr, nullptr, nullptr, nullptr);
  }
  return Tensor({0, config.vocab_size});
}

Tensor DeepseekV4CudaModel::Impl::forward(std::span<const SequenceChunk> batch, LogitsMode mode) {
  const ModelConfig& c = config;
  Step step;
  const float* logits_device = device_logits(batch, mode, step);
  const int64_t R = mode == LogitsMode::kAllPositions ? step.tokens : step.rows;
  Tensor logits({R, c.vocab_size});
  DSV4_CU(cudaMemcpyAsync(logits.ptr(), logits_device, logits.data.size() * sizeof(float), cudaMemcpyDeviceToHost,
                          stream));
  DSV4_CU(cudaStreamSynchronize(stream));
  account(false);
  return logits;
}

// The sampled rows' logits gathered to a dense block, then ops/cuda/sampling (engine/sampler.h's semantics with
// the host's generator draws, packed by pack_sampling_row); only the results come back.
void DeepseekV4CudaModel::Impl::forward_and_sample(std::span<const SequenceChunk> batch,
                                                   std::span<const DeviceSampleRow> rows,
                                                   std::vector<SampleResult>& results) {
  const ModelConfig& c = config;
  Step step;
  const float* logits_device = device_logits(batch, LogitsMode::kLastPerSequence, step);
  results.assign(rows.size(), SampleResult{});
  if (rows.empty()) {
    DSV4_CU(cudaStreamSynchronize(stream));
    account(false);
    return;
  }
  const auto n = static_cast<int64_t>(rows.size());
  sampling_batch.clear();
  std::vector<int32_t> row_index;
  for (const DeviceSampleRow& row : rows) {
    row_index.push_back(static_cast<int32_t>(row.batch_index));
    if (row.params) {
      cu::pack_sampling_row(sampling_batch, *row.params, *row.state, row.context);
    } else {
      sampling_batch.rows.push_back(cu::SamplingRow{});  // greedy
    }
  }
  // One upload: row indices, parameters, history, stop ids.
  std::vector<std::byte> packed;
  auto append = [&packed](const void* data, size_t bytes) {
    const size_t at = (packed.size() + 15) / 16 * 16;
    packed.resize(at + bytes);
    if (bytes) std::memcpy(packed.data() + at, data, bytes);
    return at;
  };
  const size_t index_at = append(row_index.data(), row_index.size() * sizeof(int32_t));
  const size_t params_at = append(sampling_batch.rows.data(), sampling_batch.rows.size() * sizeof(cu::SamplingRow));
  const size_t history_at = append(sampling_batch.history.data(), sampling_batch.history.size() * sizeof(int32_t));
  const size_t stop_at = append(sampling_batch.stop_ids.data(), sampling_batch.stop_ids.size() * sizeof(int32_t));
  auto* device = buffer<std::byte>("sampling_inputs", packed.size());
  DSV4_CU(cudaMemcpyAsync(device, packed.data(), packed.size(), cudaMemcpyHostToDevice, stream));
  float* dense = buffer<float>("sampling_logits", n * c.vocab_size);
  DSV4_CU(cu::gather_rows({n, c.vocab_size}, logits_device, reinterpret_cast<const int32_t*>(device + index_at), dense,
                          stream));
  cu::SamplingArgs args;
  args.logits = dense;
  args.rows = n;
  args.vocab = c.vocab_size;
  args.logits_stride = c.vocab_size;
  args.params = reinterpret_cast<const cu::SamplingRow*>(device + params_at);
  args.history = sampling_batch.history.empty() ? nullptr : reinterpret_cast<const int32_t*>(device + history_at);
  args.stop_ids = sampling_batch.stop_ids.empty() ? nullptr : reinterpret_cast<const int32_t*>(device + stop_at);
  args.full_path = sampling_batch.needs_full_path;
  args.logprobs = sampling_batch.needs_logprobs;
  auto* outputs = buffer<cu::SamplingOutput>("sampling_outputs", n);
  args.out = outputs;
  const size_t workspace_bytes = cu::sampling_workspace_bytes(n, c.vocab_size);
  void* workspace = buffer<std::byte>("sampling_workspace", workspace_bytes);
  DSV4_CU(cu::sample_tokens(args, workspace, workspace_bytes, stream));
  DSV4_CU(cudaEventRecord(sampling_end, stream));
  sampling_outputs.resize(rows.size());
  DSV4_CU(cudaMemcpyAsync(sampling_outputs.data(), outputs, rows.size() * sizeof(cu::SamplingOutput),
                          cudaMemcpyDeviceToHost, stream));
  DSV4_CU(cudaStreamSynchronize(stream));
  account(true);
  for (size_t j = 0; j < rows.size(); ++j) results[j] = cu::to_sample_result(sampling_outputs[j]);
}

float* DeepseekV4CudaModel::Impl::run(const Step& step, LogitsMode mode) {
  const ModelConfig& c = config;
  const int64_t N = step.tokens, D = c.hidden_size, hc = c.hc_mult;
  float* streams = buffer<float>("streams", N * hc * D);
  float* next_streams = buffer<float>("next_streams", N * hc * D);
  const cu::EmbeddingParams ep{N, c.vocab_size, D, hc};
  if (bf16) DSV4_CU(cu::embedding_bf16(ep, static_cast<const uint16_t*>(embed), step.token_ids, streams, stream));
  else DSV4_CU(cu::embedding(ep, static_cast<const float*>(embed), step.token_ids, streams, stream));

  cu::HyperConnectionParams hp{N, hc, D, c.hc_sinkhorn_iters, static_cast<float>(c.hc_eps),
                               static_cast<float>(c.rms_norm_eps)};
  // kDeepSeek: hc_post in model.py's order with the new streams bf16; hc_pre / hc_head's pre, post and comb in
  // double with the config's hc_eps (hc_post_pre, which refuses the flag, runs only without it).
  hp.deepseek = deepseek;
  hp.deepseek_hc_eps = c.hc_eps;
  const size_t hc_workspace_bytes = cu::hc_workspace_bytes(std::max<int64_t>(N, step.rows), hc);
  void* hc_workspace = buffer<std::byte>("hc_workspace", hc_workspace_bytes);
  if (hc_handover_sync == nullptr && !capturing) {
    DSV4_CU(cudaMalloc(&hc_handover_sync, cu::kHcHandoverSyncBytes));
    DSV4_CU(cudaMemset(hc_handover_sync, 0, cu::kHcHandoverSyncBytes));
  }
  float* collapsed = buffer<float>("collapsed", N * D);
  float* sublayer_out = buffer<float>("sublayer_out", N * D);
  float* post = buffer<float>("post", N * hc);
  float* comb = buffer<float>("comb", N * hc * hc);
  const float eps = static_cast<float>(c.rms_norm_eps);
  // hc_pre of a sublayer (its hc fn / base / scale and its norm weight) with the RMSNorm fused (collapsed ends
  // normalised); returns the next GEMM's operand. `after_post`: first the previous sublayer's hc_post, in one call
  // (ops/cuda/hyper_connection.h hc_post_pre: the two kernels, or with DSV4_HC_POST_MIX=1 one that writes the new
  // streams and their mixes' partial sums); post and comb are overwritten by this sublayer's.
  auto collapse_and_norm = [&](bool after_post, const float* fn, const float* base, const float* scale,
                               const float* norm_weight, const char* name) -> const void* {
    const cu::CollapseNorm fused{norm_weight, eps, bf16 ? buffer<uint16_t>(name, N * D) : nullptr};
    if (deepseek) {
      // model.py's Block: the streams are bf16 after hc_post, hc_pre's collapsed row is bf16, RMSNorm computes in
      // fp32 and returns bf16 (the fp32 `collapsed`, which the router reads, then holds the operand's values).
      if (after_post) {
        DSV4_CU(cu::hc_post(hp, sublayer_out, streams, post, comb, next_streams, stream));
        std::swap(streams, next_streams);
      }
      DSV4_CU(cu::hc_pre(hp, streams, fn, base, scale, collapsed, post, comb, hc_workspace, hc_workspace_bytes,
                         stream, nullptr));
      DSV4_CU(cu::round_to_bf16(collapsed, N * D, stream));
      DSV4_CU(cu::rms_norm_with_bf16({N, D, eps}, collapsed, norm_weight, collapsed, fused.bf16, stream));
      DSV4_CU(cu::round_to_bf16(collapsed, N * D, stream));
      return fused.bf16;
    }
    if (after_post) {
      DSV4_CU(cu::hc_post_pre(hp, sublayer_out, streams, post, comb, next_streams, fn, base, scale, collapsed, post,
                              comb, hc_workspace, hc_workspace_bytes, stream, &fused, hc_handover_sync));
      std::swap(streams, next_streams);
    } else {
      DSV4_CU(cu::hc_pre(hp, streams, fn, base, scale, collapsed, post, comb, hc_workspace, hc_workspace_bytes,
                         stream, &fused, hc_handover_sync));
    }
    return bf16 ? static_cast<const void*>(fused.bf16) : collapsed;
  };
  const LayerDevice& first = layers.front();
  const void* attn_operand = collapse_and_norm(false, first.hc_attn_fn, first.hc_attn_base, first.hc_attn_scale,
                                               first.attn_norm, "attn_in");
  for (int64_t layer = 0; layer < c.num_hidden_layers; ++layer) {
    const LayerDevice& l = layers[static_cast<size_t>(layer)];
    attention(layer, step, attn_operand, sublayer_out);
    const void* ffn_operand =
        collapse_and_norm(true, l.hc_ffn_fn, l.hc_ffn_base, l.hc_ffn_scale, l.ffn_norm, "moe_in");
    moe(layer, step, collapsed, ffn_operand, sublayer_out);
    if (deepseek) DSV4_CU(cu::round_to_bf16(sublayer_out, N * D, stream));  // MoE.forward returns bf16
    if (layer + 1 < c.num_hidden_layers) {
      const LayerDevice& next = layers[static_cast<size_t>(layer + 1)];
      attn_operand = collapse_and_norm(true, next.hc_attn_fn, next.hc_attn_base, next.hc_attn_scale, next.attn_norm,
                                       "attn_in");
    } else {
      DSV4_CU(cu::hc_post(hp, sublayer_out, streams, post, comb, next_streams, stream));
      std::swap(streams, next_streams);
    }
  }

  // Head: the rows asked for, hc_head collapse, final norm, LM head.
  const int64_t R = mode == LogitsMode::kAllPositions ? N : step.rows;
  const float* selected = streams;
  if (mode == LogitsMode::kLastPerSequence) {
    float* gathered = buffer<float>("head_rows", R * hc * D);
    DSV4_CU(cu::gather_rows({R, hc * D}, streams, step.last_rows, gathered, stream));
    selected = gathered;
  }
  float* final_hidden = buffer<float>("final_hidden", R * D);
  cu::HyperConnectionParams head_params = hp;
  head_params.tokens = R;
  const cu::CollapseNorm final_norm{norm, eps, bf16 ? buffer<uint16_t>("head_in", R * D) : nullptr};
  if (deepseek) {  // ParallelHead: the collapsed row bf16, the norm's output bf16 (the LM head's operand)
    DSV4_CU(cu::hc_head(head_params, selected, hc_head_fn, hc_head_base, hc_head_scale, final_hidden, hc_workspace,
                        hc_workspace_bytes, stream, nullptr));
    DSV4_CU(cu::round_to_bf16(final_hidden, R * D, stream));
    DSV4_CU(cu::rms_norm_with_bf16({R, D, eps}, final_hidden, norm, final_hidden, final_norm.bf16, stream));
  } else {
    DSV4_CU(cu::hc_head(head_params, selected, hc_head_fn, hc_head_base, hc_head_scale, final_hidden, hc_workspace,
                        hc_workspace_bytes, stream, &final_norm, hc_handover_sync));
  }
  const void* head_operand = bf16 ? static_cast<const void*>(final_norm.bf16) : final_hidden;
  float* logits_device = buffer<float>("logits", R * c.vocab_size);
  gemm->linear(head, head_operand, R, logits_device, stream);
  return logits_device;
}

void DeepseekV4CudaModel::Impl::compress(int64_t layer, EntryKind kind, const Step& step, const void* x_operand,
                                         cudaStream_t on, cu::Gemm& with) {
  const ModelConfig& c = config;
  const LayerDevice& l = layers[static_cast<size_t>(layer)];
  const CompressorDevice& w = kind == EntryKind::kMain ? l.compressor : l.indexer_compressor;
  const AttentionType type = c.layer_types[static_cast<size_t>(layer)];
  const bool csa = type == AttentionType::kCompressedSparse;
  const int64_t N = step.tokens, head_dim = kind == EntryKind::kMain ? c.head_dim : c.index_head_dim;
  const int64_t ratio = kind == EntryKind::kMain ? c.compress_rate(layer) : c.compress_rate_csa;
  const int64_t width = (csa ? 2 : 1) * head_dim;
  const char* kv_name = kind == EntryKind::kMain ? "compress_kv" : "index_compress_kv";
  // kv rows then gate rows: the two projections as a batch of 2 over the same input (x batch stride 0).
  float* kv = buffer<float>(kv_name, 2 * N * width);
  float* gate = kv + N * width;
  with.linear_batched(w.wkv_gate, 2, width * c.hidden_size, x_operand, c.hidden_size, 0, N, kv, width, N * width, on);
  const CacheGroupKind state_kind = kind == EntryKind::kIndex ? CacheGroupKind::kC4IndexState
                                    : csa                     ? CacheGroupKind::kC4MainState
                                                              : CacheGroupKind::kC128State;
  const CacheGroupKind history_kind = kind == EntryKind::kIndex ? CacheGroupKind::kC4Index
                                      : csa                     ? CacheGroupKind::kC4Main
                                                                : CacheGroupKind::kC128Main;
  cu::CompressorStepParams p;
  p.ratio = static_cast<int32_t>(ratio);
  p.head_dim = static_cast<int32_t>(head_dim);
  p.overlap = csa;
  p.rope_dim = static_cast<int32_t>(c.inv_freq(RopeKind::kCompress).size() * 2);
  p.attention_scaling = scaling_compress;
  p.eps = static_cast<float>(c.rms_norm_eps);
  const bool fp8 = kv_format == KvEntryFormat::kFp8;
  p.format = !bf16 ? cu::CompressorEntryFormat::kF32
             : fp8 ? (kind == EntryKind::kMain ? cu::CompressorEntryFormat::kFp8Main : cu::CompressorEntryFormat::kFp8Index)
             : deepseek
                 ? (kind == EntryKind::kMain ? cu::CompressorEntryFormat::kBf16DeepSeekMain
                                             : cu::CompressorEntryFormat::kBf16DeepSeekIndex)
                 : cu::CompressorEntryFormat::kBf16;
  p.num_requests = static_cast<int32_t>(step.rows);
  p.num_tokens = static_cast<int32_t>(N);
  p.kv = kv;
  p.gate = gate;
  p.ape = w.ape;
  p.norm_weight = w.norm;
  p.inv_freq = inv_freq_compress;
  p.start_positions = step.chunk_start;
  p.token_offsets = step.row_offsets;
  p.state = view(step, state_kind, layer);
  p.history = view(step, history_kind, layer);
  DSV4_CU(cu::compressor_step(p, on));
}

void DeepseekV4CudaModel::Impl::attention(int64_t layer, const Step& step, const void* x_operand, float* out) {
  const ModelConfig& c = config;
  const LayerDevice& l = layers[static_cast<size_t>(layer)];
  const AttentionType type = c.layer_types[static_cast<size_t>(layer)];
  const bool main_rope = c.rope_kind(layer) == RopeKind::kMain;
  const float* inv_freq = main_rope ? inv_freq_main : inv_freq_compress;
  const float rope_scaling = main_rope ? scaling_main : scaling_compress;
  const int64_t rope_dim = static_cast<int64_t>(c.inv_freq(c.rope_kind(layer)).size()) * 2;
  const int64_t N = step.tokens, H = c.num_attention_heads, d = c.head_dim;
  const float eps = static_cast<float>(c.rms_norm_eps);

  // The K=V path (wkv, its norm + RoPE, the main compressor) needs only the input: on its own stream it runs
  // beside the query's chain of small dependent kernels (wq_a, q_norm, wq_b, per-head norm), and joins before
  // attention. The CSA indexer needs the input and q_residual: on the index stream, also joined before attention.
  const bool tuned = bf16 && H % 64 == 0 && d == kKvHeadDim && rope_dim == kKvRopeDim;
  const bool kv_overlap = options.kv_stream;
  cudaStream_t kvs = kv_overlap ? kv_stream : stream;
  if (kv_overlap) {
    DSV4_CU(cudaEventRecord(kv_fork, stream));
    DSV4_CU(cudaStreamWaitEvent(kv_stream, kv_fork));
  }
  // The shared K=V vector of each token.
  float* kv = buffer<float>("kv", N * d);
  project(kv_overlap ? *kv_gemm : *gemm, l.wkv, x_operand, N, kv, kvs, "fp8_kv_activation");
  uint16_t* kv_bf16 = tuned ? buffer<uint16_t>("kv_bf16", N * d) : nullptr;
  DSV4_CU(cu::head_norm_rope({N, 1, d, rope_dim, true, eps, rope_scaling, /*keep_fp32=*/true, deepseek}, kv,
                             l.kv_norm, step.positions, inv_freq, deepseek ? nullptr : kv_bf16, kvs));
  if (deepseek) {
    // The reference's K=V vector (bf16 from head_norm_rope): its non-rope channels through e4m3 per 64 (what its
    // FP8 cache stores, here in bf16 entries), then its bf16 copy; the step's own rows and the window read the
    // same values.
    simulate_fp8(kv, false, N, d - rope_dim, d, 64, kvs);
    if (kv_bf16) DSV4_CU(cu::f32_to_bf16(kv, kv_bf16, N * d, kvs));
  }
  // With the FP8 cache the attention reads this step's own K=V rows as FP8 entries too (one format for every
  // pool, and what a later step will read back from the window): entry j of request r's chunk, in one-entry
  // blocks numbered by token (the chunk pool below).
  const bool fp8_entries = tuned && kv_format == KvEntryFormat::kFp8;
  uint8_t* chunk_entries = nullptr;
  if (fp8_entries) {
    chunk_entries = buffer<uint8_t>("kv_fp8_chunk", N * kv_region_bytes(KvEntryFormat::kFp8, 1));
    KvWriteParams wp;
    wp.tokens = N;
    wp.format = KvEntryFormat::kFp8;
    wp.pool = chunk_pool(step, chunk_entries);
    wp.entry_indices = step.token_chunk_index;
    wp.rows = step.token_row;
    DSV4_CU(dsv4::cuda::write_kv_entries(wp, kv_bf16, kvs));
  }
  // The window keeps the last W raw K=V vectors of every request. A chunk's later rows replace window slots that
  // its earlier queries read, so in general the write follows the attention. In a pure decode step (one token a
  // request) token t's slot held position t − W, outside its window (t itself is read from the step's own rows),
  // so the write runs here on the K=V stream, off the query's chain (3.8 µs a layer at batch 1, H100 ncu).
  auto write_window_rows = [&](cudaStream_t on) {
    if (fp8_entries) {
      KvWriteParams wp;
      wp.tokens = N;
      wp.format = KvEntryFormat::kFp8;
      wp.pool = kv_pool(step, CacheGroupKind::kSwaKv, layer);
      wp.entry_indices = step.positions;
      wp.rows = step.token_row;
      wp.row_end = step.row_end;
      wp.window_size = c.sliding_window;
      DSV4_CU(dsv4::cuda::write_kv_entries(wp, kv_bf16, on));
    } else {
      cu::WindowWriteParams wp;
      wp.tokens = N;
      wp.head_dim = d;
      wp.window_size = c.sliding_window;
      wp.bf16_entries = bf16;
      wp.window = view(step, CacheGroupKind::kSwaKv, layer);
      wp.kv = kv;
      wp.token_row = step.token_row;
      wp.positions = step.positions;
      wp.row_end = step.row_end;
      DSV4_CU(cu::write_window(wp, on));
    }
  };
  const bool window_early = options.early_window_write && step.max_chunk == 1;
  if (window_early) write_window_rows(kvs);
  // Compressed entries first: a query sees the entries its own chunk completes.
  if (type != AttentionType::kSlidingWindow)
    compress(layer, EntryKind::kMain, step, x_operand, kvs, kv_overlap ? *kv_gemm : *gemm);
  if (kv_overlap) DSV4_CU(cudaEventRecord(kv_join, kv_stream));

  // Query: low-rank, weighted norm, up-projection, per-head unweighted norm, RoPE.
  float* q_residual = buffer<float>("q_residual", N * c.q_lora_rank);
  project(*gemm, l.wq_a, x_operand, N, q_residual, stream);
  const void* q_residual_operand = norm_operand(q_residual, N, c.q_lora_rank, l.q_norm, "q_residual_in", stream);
  float* q = buffer<float>("q", N * H * d);
  project(*gemm, l.wq_b, q_residual_operand, N, q, stream);
  // The tuned attention kernel reads bf16 q and this step's K=V rows; the norm + RoPE passes write them.
  uint16_t* q_bf16 = tuned ? buffer<uint16_t>("q_bf16", N * H * d) : nullptr;
  // The tuned attention reads only q_bf16: the fp32 q is not written back.
  DSV4_CU(cu::head_norm_rope({N, H, d, rope_dim, true, eps, rope_scaling, /*keep_fp32=*/!tuned, deepseek}, q,
                             nullptr, step.positions, inv_freq, q_bf16, stream));

  // Indexer (CSA): its compressor, q_I, weights, scores and top-k on the index stream.
  const bool csa = type == AttentionType::kCompressedSparse;
  const int64_t topk = c.index_topk;
  int32_t* topk_indices = nullptr;
  int32_t* topk_lengths = nullptr;
  if (csa) {
    const bool overlap = options.indexer_stream;
    cudaStream_t is = overlap ? index_stream : stream;
    cu::Gemm& ig = overlap ? *index_gemm : *gemm;
    if (overlap) {
      DSV4_CU(cudaEventRecord(index_fork, stream));
      DSV4_CU(cudaStreamWaitEvent(index_stream, index_fork));
    }
    compress(layer, EntryKind::kIndex, step, x_operand, is, ig);
    const int64_t IH = c.index_n_heads, ID = c.index_head_dim;
    float* index_q = buffer<float>("index_q", N * IH * ID);
    project(ig, l.indexer_wq_b, q_residual_operand, N, index_q, is, "fp8_index_activation");
    const PagedGroupView keys = view(step, CacheGroupKind::kC4Index, layer);
    const bool tuned_scores = bf16 && IH == 64 && ID == 128 && keys.entries_per_block % 32 == 0;
    const bool fp8_keys = kv_format == KvEntryFormat::kFp8;
    DSV4_CHECK(tuned_scores || !fp8_keys, "FP8 index keys need the tuned scores kernel (64 x 128, 32-entry blocks)");
    uint16_t* index_q_bf16 = tuned_scores ? buffer<uint16_t>("index_q_bf16", N * IH * ID) : nullptr;
    const int64_t index_rope = static_cast<int64_t>(c.inv_freq(RopeKind::kCompress).size()) * 2;
    DSV4_CU(cu::head_norm_rope({N, IH, ID, index_rope, false, eps, scaling_compress,
                                /*keep_fp32=*/!tuned_scores || deepseek},
                               index_q, nullptr, step.positions, inv_freq_compress, deepseek ? nullptr : index_q_bf16,
                               is));
    if (deepseek) {
      // The reference's indexer query: bf16 after RoPE, the Hadamard rotation, FP4 per 32 (ops/cuda/hadamard_fp4.h,
      // the CPU's kDeepSeek bit for bit); the index keys get the same from the compressor (kBf16DeepSeekIndex).
      cu::HadamardFp4Params hp;
      hp.rows = N * IH;
      hp.dim = ID;
      hp.block = 32;
      hp.scale = static_cast<float>(std::pow(static_cast<double>(ID), -0.5));
      DSV4_CU(cu::hadamard_fp4_rows(hp, index_q, is));
      if (index_q_bf16) DSV4_CU(cu::f32_to_bf16(index_q, index_q_bf16, N * IH * ID, is));
    }
    float* index_weights = buffer<float>("index_weights", N * IH);
    ig.linear(l.indexer_weights_proj, x_operand, N, index_weights, is);  // H_I^-1/2 is in the weights
    if (deepseek) {
      // model.py: weights_proj(x) (bf16) · (softmax_scale · n_heads^-1/2), a Python double applied to a bf16 tensor;
      // the scores then take no further scale.
      const float head_scale = static_cast<float>(std::pow(static_cast<double>(ID), -0.5) *
                                                  std::pow(static_cast<double>(IH), -0.5));
      DSV4_CU(cu::round_to_bf16(index_weights, N * IH, is));
      DSV4_CU(cu::scale_inplace(index_weights, head_scale, N * IH, is));
      DSV4_CU(cu::round_to_bf16(index_weights, N * IH, is));
    }
    const int64_t max_entries = (step.max_position + 1) / c.compress_rate_csa;
    topk_indices = buffer<int32_t>("topk_indices", N * topk);
    topk_lengths = buffer<int32_t>("topk_lengths", N);
    if (max_entries == 0) {
      DSV4_CU(cudaMemsetAsync(topk_lengths, 0, N * sizeof(int32_t), is));
    } else {
      float* scores = buffer<float>("index_scores", N * max_entries);
      const float softmax_scale = deepseek ? 1.0f : 1.0f / std::sqrt(static_cast<float>(ID));
      if (tuned_scores) {
        ops::IndexerScoresParams ip;
        ip.num_tokens = N;
        ip.heads = IH;
        ip.max_entries = max_entries;
        ip.compress_ratio = c.compress_rate_csa;
        ip.softmax_scale = softmax_scale;
        ip.deepseek_roundings = deepseek;
        ip.keys = IndexKeyPagedLayout{fp8_keys ? IndexKeyDtype::kFp8 : IndexKeyDtype::kBf16, static_cast<int32_t>(ID),
                                      static_cast<int32_t>(keys.entries_per_block), static_cast<int32_t>(keys.layer_index),
                                      keys.block_bytes, keys.page_bytes, keys.max_blocks_per_page};
        ip.pool = keys.arena;
        ip.block_tables = keys.block_table;
        ip.block_table_stride = keys.block_table_stride;
        ip.request_entries = step.csa_row_entries;
        ip.token_request = step.token_row;
        ip.token_position = step.positions;
        ip.q = index_q_bf16;
        ip.weights = index_weights;
        ip.scores = scores;
        DSV4_CU(cu::indexer_scores(ip, is));
      } else {
        cu::PagedIndexerScoresParams ip;
        ip.tokens = N;
        ip.heads = IH;
        ip.head_dim = ID;
        ip.max_entries = max_entries;
        ip.ratio = c.compress_rate_csa;
        ip.softmax_scale = softmax_scale;
        ip.bf16_keys = bf16;
        ip.deepseek_roundings = deepseek;
        ip.keys = keys;
        ip.token_row = step.token_row;
        ip.positions = step.positions;
        ip.q = index_q;
        ip.weights = index_weights;
        ip.scores = scores;
        DSV4_CU(cu::paged_indexer_scores(ip, is));
      }
      ops::TopKParams tp;
      tp.rows = N;
      tp.columns = max_entries;
      tp.row_stride = max_entries;
      tp.k = topk;
      tp.scores = scores;
      tp.row_lengths = step.csa_visible;
      tp.indices = topk_indices;
      tp.lengths = topk_lengths;
      const size_t workspace_bytes = cu::top_k_workspace_bytes(N, max_entries, topk);
      void* workspace = buffer<std::byte>("topk_workspace", workspace_bytes);
      DSV4_CU(cu::top_k(tp, workspace, workspace_bytes, is));
    }
    if (overlap) {
      DSV4_CU(cudaEventRecord(index_join, index_stream));
    }
  }

  if (kv_overlap) DSV4_CU(cudaStreamWaitEvent(stream, kv_join));
  if (csa && options.indexer_stream) DSV4_CU(cudaStreamWaitEvent(stream, index_join));

  const int64_t G = c.o_groups, group_width = H * d / G, o_lora = c.o_lora_rank;
  const void* attended_operand = nullptr;
  // head_dim^-1/2: kDeepSeek as model.py's Python double rounded to fp32 (the CPU's inverse_sqrt_f64).
  const float softmax_scale = deepseek ? static_cast<float>(std::pow(static_cast<double>(d), -0.5))
                                       : 1.0f / std::sqrt(static_cast<float>(d));
  if (tuned) {
    ops::SparseAttentionParams ap;
    ap.tokens = N;
    ap.heads = H;
    ap.scale = softmax_scale;
    ap.format = kv_format;
    ap.window = kv_pool(step, CacheGroupKind::kSwaKv, layer);
    ap.window_size = c.sliding_window;
    if (type != AttentionType::kSlidingWindow) {
      const CacheGroupKind kind = csa ? CacheGroupKind::kC4Main : CacheGroupKind::kC128Main;
      ap.compressed = kv_pool(step, kind, layer);
      if (csa) {
        ap.compressed_indices = topk_indices;
        ap.compressed_lengths = topk_lengths;
        ap.compressed_stride = topk;
      } else {
        const int64_t stride = std::max<int64_t>(1, (step.max_position + 1) / c.compress_rate(layer));
        int32_t* indices = buffer<int32_t>("hca_indices", N * stride);
        int32_t* lengths = buffer<int32_t>("hca_lengths", N);
        DSV4_CU(cu::dense_entry_indices(N, step.positions, c.compress_rate(layer), stride, indices, lengths, stream));
        ap.compressed_indices = indices;
        ap.compressed_lengths = lengths;
        ap.compressed_stride = stride;
      }
    }
    ap.positions = step.positions;
    ap.rows = step.token_row;
    ap.sinks = l.attn_sink;
    ap.rope_inv_freq = inv_freq;
    ap.rope_attention_scaling = rope_scaling;
    ap.chunk = chunk_pool(step, fp8_entries ? chunk_entries : reinterpret_cast<uint8_t*>(kv_bf16));
    ap.chunk_starts = step.token_chunk_start;
    uint16_t* attended = buffer<uint16_t>("attended_bf16", N * H * d);
    const size_t workspace_bytes = cu::sparse_attention_workspace_bytes(ap, multiprocessors);
    void* workspace = buffer<std::byte>("attention_workspace", workspace_bytes);
    DSV4_CU(cu::sparse_attention(ap, q_bf16, attended, workspace, workspace_bytes, stream));
    attended_operand = attended;
  } else {
    float* attended = buffer<float>("attended", N * H * d);
    cu::PagedSinkAttentionParams ap;
    ap.tokens = N;
    ap.heads = H;
    ap.head_dim = d;
    ap.scale = softmax_scale;
    ap.bf16_entries = bf16;
    ap.deepseek_softmax = deepseek;
    ap.window = view(step, CacheGroupKind::kSwaKv, layer);
    ap.window_size = c.sliding_window;
    if (type == AttentionType::kHeavilyCompressed) {
      ap.compressed = view(step, CacheGroupKind::kC128Main, layer);
      ap.dense_ratio = c.compress_rate(layer);
    } else if (csa) {
      ap.compressed = view(step, CacheGroupKind::kC4Main, layer);
      ap.compressed_indices = topk_indices;
      ap.compressed_lengths = topk_lengths;
      ap.compressed_stride = topk;
    }
    ap.chunk_kv = kv;
    ap.token_row = step.token_row;
    ap.positions = step.positions;
    ap.chunk_start = step.chunk_start;
    ap.chunk_offset = step.row_offsets;
    ap.sinks = l.attn_sink;
    ap.q = q;
    ap.out = attended;
    DSV4_CU(cu::paged_sink_attention(ap, stream));
    // K=V carried RoPE into the values: rotate the output back by −t.
    DSV4_CU(cu::apply_rope({N, H * d, H, d, rope_dim, rope_scaling, true}, attended, step.positions, inv_freq, stream));
    attended_operand = operand(attended, N * H * d, "attended_in", stream);
  }
  if (!window_early) write_window_rows(stream);  // after every read of this step

  // Grouped output projection: group g's heads → o_lora_rank through rows [g·o_lora, (g+1)·o_lora) of wo_a.
  // One strided-batched GEMM: group g reads columns [g·gw, (g+1)·gw) of the attended rows and rows
  // [g·o_lora, (g+1)·o_lora) of wo_a, and writes columns [g·o_lora, (g+1)·o_lora) of `grouped` — in bf16 mode
  // straight as wo_b's bf16 operand.
  cu::GemmWeight wg = l.wo_a;
  wg.out = o_lora;
  wg.in = group_width;
  void* grouped = bf16 ? static_cast<void*>(buffer<uint16_t>("grouped_in", N * G * o_lora))
                       : static_cast<void*>(buffer<float>("grouped", N * G * o_lora));
  gemm->linear_batched(wg, G, o_lora * group_width, attended_operand, H * d, group_width, N, grouped, G * o_lora, o_lora,
                       stream, weight_dtype());
  project(*gemm, l.wo_b, grouped, N, out, stream);
}

void DeepseekV4CudaModel::Impl::moe_host_grouped(int64_t layer, const Step& step, const void* x_operand,
                                                 const int32_t* chosen, const float* weights, float* out) {
  const ModelConfig& c = config;
  const LayerDevice& l = layers[static_cast<size_t>(layer)];
  const int64_t N = step.tokens, D = c.hidden_size, E = c.n_routed_experts, K = c.num_experts_per_tok;
  const int64_t I = c.moe_intermediate_size, rows = N * K;
  host_chosen.resize(static_cast<size_t>(rows));
  DSV4_CU(cudaMemcpyAsync(host_chosen.data(), chosen, rows * sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
  DSV4_CU(cudaStreamSynchronize(stream));
  // Expert-major order, stable in token order: offsets per expert, then each (token, k)'s slot.
  std::vector<int64_t> offset(static_cast<size_t>(E) + 1, 0);
  for (const int32_t e : host_chosen) {
    DSV4_CHECK(e >= 0 && e < E, "router chose expert " + std::to_string(e) + " of " + std::to_string(E));
    ++offset[static_cast<size_t>(e) + 1];
  }
  for (int64_t e = 0; e < E; ++e) offset[e + 1] += offset[e];
  host_moe_index.assign(static_cast<size_t>(2 * rows), 0);  // [0, rows): source token per slot; then slot per (t, k)
  std::vector<int64_t> fill(offset.begin(), offset.end() - 1);
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t slot = fill[host_chosen[i]]++;
    host_moe_index[slot] = static_cast<int32_t>(i / K);
    host_moe_index[rows + i] = static_cast<int32_t>(slot);
  }
  int32_t* index = buffer<int32_t>("moe_index", 2 * rows);
  DSV4_CU(cudaMemcpyAsync(index, host_moe_index.data(), 2 * rows * sizeof(int32_t), cudaMemcpyHostToDevice, stream));
  // Gather the operand rows (bf16 rows move as pairs of fp32 words: a copy, no arithmetic).
  const size_t element = weight_element_bytes();
  const int64_t words = D * static_cast<int64_t>(element) / 4;
  float* gathered = buffer<float>("moe_gathered", rows * words);
  DSV4_CU(cu::gather_rows({rows, words}, static_cast<const float*>(x_operand), index, gathered, stream));
  float* expert_rows = buffer<float>("moe_expert_rows", rows * D);
  float* shared_rows = buffer<float>("moe_shared_rows", N * D);
  // Every expert's scratch rows at once (its rows at offset[e], the shared expert's after them), so that experts
  // on different lanes never share a buffer.
  float* gate_up = buffer<float>("moe_lane_gate_up", (rows + N) * 2 * I);
  std::byte* activated = buffer<std::byte>("moe_lane_activated", (rows + N) * I * element);
  // The lanes: lane 0 is `stream`, the others borrow streams and Gemms that are idle during this sublayer (the
  // split shared expert runs only below host_grouped's sizes; the K=V and indexer streams joined before the
  // attention). Each expert goes to the lane with the fewest rows so far, the shared expert first.
  struct Lane {
    cudaStream_t on;
    cu::Gemm* with;
    int64_t rows = 0;
  };
  std::array<Lane, kMaxExpertLanes> lane = {{{stream, gemm.get()},
                                             {shared_expert_stream, shared_gemm.get()},
                                             {kv_stream, kv_gemm.get()},
                                             {index_stream, index_gemm.get()}}};
  const int lanes = per_expert_moe_lanes();
  if (lanes > 1) {
    DSV4_CU(cudaEventRecord(expert_lanes_fork, stream));  // after the gather
    for (int i = 1; i < lanes; ++i) DSV4_CU(cudaStreamWaitEvent(lane[i].on, expert_lanes_fork));
  }
  auto least_loaded = [&] {
    return &*std::min_element(lane.begin(), lane.begin() + lanes,
                              [](const Lane& a, const Lane& b) { return a.rows < b.rows; });
  };
  auto run_on_lane = [&](const void* w13, const void* w2, const void* input, int64_t n, float* output,
                         int64_t scratch_row) {
    Lane* to = least_loaded();
    to->rows += n;
    run_expert_on(w13, w2, input, n, output, gate_up + scratch_row * 2 * I,
                  activated + scratch_row * I * element, *to->with, to->on);
  };
  run_on_lane(l.shared_w13, l.shared_w2, x_operand, N, shared_rows, rows);
  const size_t w13_bytes = static_cast<size_t>(2 * I * D) * element, w2_bytes = static_cast<size_t>(D * I) * element;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = offset[e + 1] - offset[e];
    if (n == 0) continue;
    run_on_lane(static_cast<const std::byte*>(l.experts_w13) + e * w13_bytes,
                static_cast<const std::byte*>(l.experts_w2) + e * w2_bytes,
                reinterpret_cast<const std::byte*>(gathered) + offset[e] * words * 4, n, expert_rows + offset[e] * D,
                offset[e]);
  }
  for (int i = 1; i < lanes; ++i) {
    DSV4_CU(cudaEventRecord(expert_lane_join[i], lane[i].on));
    DSV4_CU(cudaStreamWaitEvent(stream, expert_lane_join[i]));
  }
  DSV4_CU(cu::combine_expert_rows({N, K, D}, index + rows, weights, expert_rows, shared_rows, out, stream));
}

// Batch-1 decode with bf16 routed experts: a decode token's K experts are K weight streams (V4-Flash: 302 MB),
// so they run as two gathered GEMVs (ops/cuda/skinny_gemm, batch k reading expert chosen[k] after the PDL wait),
// the clamped SwiGLU between them, and the weighted sum with the shared expert's row; the grouped kernel paid a
// permutation, its tiles' ramp and a combine (ncu, H100, one row: 4.8 + 74.1 + 38.4 + 5.6 µs, 2.7 TB/s).
// `shared_out`: the shared expert's row from its stream (joined here), or nullptr to run it here.
void DeepseekV4CudaModel::Impl::routed_experts_gemv(int64_t layer, const void* x_operand, const int32_t* chosen,
                                                    const float* weights, const float* shared_out, float* out) {
  const ModelConfig& c = config;
  const LayerDevice& l = layers[static_cast<size_t>(layer)];
  const int64_t D = c.hidden_size, I = c.moe_intermediate_size, K = c.num_experts_per_tok;
  float* gate_up = buffer<float>("moe_routed_gate_up", K * 2 * I);
  auto* activated = buffer<uint16_t>("moe_routed_activated_in", K * I);
  float* expert_rows = buffer<float>("moe_routed_rows", K * D);
  cu::SkinnyGemmParams up;
  up.rows = 1;
  up.out = 2 * I;
  up.in = D;
  up.w_stride = D;
  up.x_stride = D;
  up.y_stride = 2 * I;
  up.batch = K;
  up.w_batch_stride = 2 * I * D;
  up.x_batch_stride = 0;  // every expert reads the token's row
  up.y_batch_stride = 2 * I;
  up.w_batch_index = chosen;
  up.w_batch_count = c.n_routed_experts;
  DSV4_CU(cu::skinny_gemm(up, l.experts_w13, x_operand, gate_up, stream));
  DSV4_CU(cu::swiglu_clamped_bf16({K, I, static_cast<float>(c.swiglu_limit)}, gate_up, activated, stream));
  cu::SkinnyGemmParams down = up;
  down.out = D;
  down.in = I;
  down.w_stride = I;
  down.x_stride = I;
  down.y_stride = D;
  down.w_batch_stride = D * I;
  down.x_batch_stride = I;  // expert k's activated row
  down.y_batch_stride = D;
  DSV4_CU(cu::skinny_gemm(down, l.experts_w2, activated, expert_rows, stream));
  if (shared_out != nullptr) {
    DSV4_CU(cudaStreamWaitEvent(stream, shared_expert_join));
  } else {
    float* shared_rows = buffer<float>("moe_shared_rows", D);
    run_expert(l.shared_w13, l.shared_w2, x_operand, 1, shared_rows);
    shared_out = shared_rows;
  }
  DSV4_CU(cu::combine_expert_rows({1, K, D}, nullptr, weights, expert_rows, shared_out, out, stream));
}

void DeepseekV4CudaModel::Impl::run_expert(const void* w13, const void* w2, const void* input, int64_t n,
                                           float* output, bool shared_lane) {
  const int64_t I = config.moe_intermediate_size;
  const cudaStream_t on = shared_lane ? shared_expert_stream : stream;
  cu::Gemm& with = shared_lane ? *shared_gemm : *gemm;
  float* gate_up = buffer<float>(shared_lane ? "moe_shared_gate_up" : "moe_gate_up", n * 2 * I);
  // The down projection's operand: bf16 straight from the SwiGLU in bf16 mode (one pass instead of an fp32
  // write, a read and a conversion; the same bits), fp32 otherwise.
  void* activated = bf16 ? static_cast<void*>(buffer<uint16_t>(shared_lane ? "moe_shared_activated_in"
                                                                           : "moe_activated_in", n * I))
                         : static_cast<void*>(buffer<float>(shared_lane ? "moe_shared_activated" : "moe_activated",
                                                            n * I));
  run_expert_on(w13, w2, input, n, output, gate_up, activated, with, on);
}

void DeepseekV4CudaModel::Impl::run_expert_on(const void* w13, const void* w2, const void* input, int64_t n,
                                              float* output, float* gate_up, void* activated, cu::Gemm& with,
                                              cudaStream_t on) {
  const ModelConfig& c = config;
  const int64_t D = c.hidden_size, I = c.moe_intermediate_size;
  with.linear({w13, weight_dtype(), 2 * I, D, 0}, input, n, gate_up, on);
  const cu::SwigluParams swiglu{n, I, static_cast<float>(c.swiglu_limit)};
  DSV4_CU(bf16 ? cu::swiglu_clamped_bf16(swiglu, gate_up, static_cast<uint16_t*>(activated), on)
               : cu::swiglu_clamped(swiglu, gate_up, static_cast<float*>(activated), on));
  with.linear({w2, weight_dtype(), D, I, 0}, activated, n, output, on);
}

// The expert-parallel sublayer (docs/parallel.md), the device twin of parallel/expert_parallel_moe.cpp: the plans
// on the host, the rows in device memory. Every rank calls the same five collectives per sublayer, in this order.
void DeepseekV4CudaModel::Impl::moe_expert_parallel(int64_t layer, const Step& step, const void* x_operand,
                                                    const int32_t* chosen, const float* weights, float* out) {
  const ModelConfig& c = config;
  const LayerDevice& l = layers[static_cast<size_t>(layer)];
  parallel::Communicator& comm = *expert_parallel;
  const parallel::ExpertPartition& partition = *expert_partition;
  const int64_t N = step.tokens, D = c.hidden_size, K = c.num_experts_per_tok;
  const int ranks = comm.size();
  // 1. The router's choices to the host, the dispatch plan (rows grouped by destination rank, then token).
  host_chosen.resize(static_cast<size_t>(N * K));
  host_router_weights.resize(static_cast<size_t>(N * K));
  if (N > 0) {  // none on an idle rank (forward_empty), which still serves the other ranks' rows
    DSV4_CU(cudaMemcpyAsync(host_chosen.data(), chosen, N * K * sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
    DSV4_CU(cudaMemcpyAsync(host_router_weights.data(), weights, N * K * sizeof(float), cudaMemcpyDeviceToHost,
                            stream));
  }
  DSV4_CU(cudaStreamSynchronize(stream));
  const parallel::DispatchPlan plan = parallel::plan_dispatch(host_chosen, host_router_weights, N, K, partition);
  const int64_t sent = plan.num_rows();
  // 2. The send rows (the operand rows: bf16 in bf16 mode, moved as fp32 words), their routes and weights.
  const size_t element = weight_element_bytes();
  const int64_t words = D * static_cast<int64_t>(element) / 4, row_bytes = words * 4;
  std::vector<int32_t> send_token(plan.row_token.begin(), plan.row_token.end());
  int32_t* send_index = buffer<int32_t>("ep_send_index", sent);
  float* send_rows = buffer<float>("ep_send_rows", sent * words);
  int32_t* send_routes = buffer<int32_t>("ep_send_routes", sent * K);
  float* send_weights = buffer<float>("ep_send_weights", sent * K);
  if (sent > 0) {
    DSV4_CU(cudaMemcpyAsync(send_index, send_token.data(), sent * sizeof(int32_t), cudaMemcpyHostToDevice, stream));
    DSV4_CU(cudaMemcpyAsync(send_routes, plan.row_local_expert.data(), sent * K * sizeof(int32_t),
                            cudaMemcpyHostToDevice, stream));
    DSV4_CU(cudaMemcpyAsync(send_weights, plan.row_weight.data(), sent * K * sizeof(float), cudaMemcpyHostToDevice,
                            stream));
    DSV4_CU(cu::gather_rows({sent, words}, static_cast<const float*>(x_operand), send_index, send_rows, stream));
  }
  DSV4_CU(cudaStreamSynchronize(stream));  // the send buffers are complete before any transport reads them
  // 3. Counts, then rows, routes and weights.
  const std::vector<int64_t> recv_counts = comm.exchange_counts(plan.send_counts);
  int64_t received = 0;
  for (const int64_t n : recv_counts) received += n;
  const auto bytes = [](const std::vector<int64_t>& counts, int64_t each) {
    std::vector<int64_t> out(counts.size());
    for (size_t i = 0; i < counts.size(); ++i) out[i] = counts[i] * each;
    return out;
  };
  float* recv_rows = buffer<float>("ep_recv_rows", received * words);
  int32_t* recv_routes = buffer<int32_t>("ep_recv_routes", received * K);
  float* recv_weights = buffer<float>("ep_recv_weights", received * K);
  comm.all_to_all_v(send_rows, bytes(plan.send_counts, row_bytes), recv_rows, bytes(recv_counts, row_bytes));
  comm.all_to_all_v(send_routes, bytes(plan.send_counts, K * 4), recv_routes, bytes(recv_counts, K * 4));
  comm.all_to_all_v(send_weights, bytes(plan.send_counts, K * 4), recv_weights, bytes(recv_counts, K * 4));
  comm.synchronize();
  std::vector<int32_t> routes(static_cast<size_t>(received * K));
  std::vector<float> route_weights(static_cast<size_t>(received * K));
  if (received > 0) {
    DSV4_CU(cudaMemcpy(routes.data(), recv_routes, received * K * sizeof(int32_t), cudaMemcpyDeviceToHost));
    DSV4_CU(cudaMemcpy(route_weights.data(), recv_weights, received * K * sizeof(float), cudaMemcpyDeviceToHost));
  }
  // 4. Each local expert over the received rows that chose it (expert-major slots, rows ascending), then each
  // received row's weighted sum over its routes in route order (combine_expert_rows, no shared term).
  const int rank = comm.rank();
  const int64_t num_local = partition.num_local(rank), first = partition.first_expert(rank);
  const parallel::ExpertWork work = parallel::plan_expert_work(routes, route_weights, received, K, num_local);
  const int64_t slots_used = work.expert_offsets.back();
  std::vector<int32_t> host_rows(work.row.begin(), work.row.end());
  std::vector<int32_t> row_slots(static_cast<size_t>(received * K), -1);
  {
    std::vector<int64_t> cursor(work.expert_offsets.begin(), work.expert_offsets.end() - 1);
    for (int64_t r = 0; r < received; ++r)  // ascending rows: the order plan_expert_work lists them in
      for (int64_t k = 0; k < K; ++k) {
        const int32_t e = routes[static_cast<size_t>(r * K + k)];
        if (e >= 0) row_slots[static_cast<size_t>(r * K + k)] = static_cast<int32_t>(cursor[static_cast<size_t>(e)]++);
      }
  }
  int32_t* work_rows = buffer<int32_t>("ep_work_rows", slots_used);
  int32_t* slots = buffer<int32_t>("ep_row_slots", received * K);
  float* work_inputs = buffer<float>("ep_work_inputs", slots_used * words);
  float* expert_rows = buffer<float>("ep_expert_rows", slots_used * D);
  float* row_sums = buffer<float>("ep_row_sums", received * D);
  if (received > 0) {
    DSV4_CU(cudaMemcpyAsync(slots, row_slots.data(), received * K * sizeof(int32_t), cudaMemcpyHostToDevice, stream));
    if (slots_used > 0) {
      DSV4_CU(cudaMemcpyAsync(work_rows, host_rows.data(), slots_used * sizeof(int32_t), cudaMemcpyHostToDevice,
                              stream));
      DSV4_CU(cu::gather_rows({slots_used, words}, recv_rows, work_rows, work_inputs, stream));
    }
    const size_t w13_bytes = static_cast<size_t>(2 * c.moe_intermediate_size * D) * element,
                 w2_bytes = static_cast<size_t>(D * c.moe_intermediate_size) * element;
    reserve_expert_scratch(std::max(slots_used, N));
    for (int64_t e = 0; e < num_local; ++e) {
      const int64_t begin = work.expert_offsets[static_cast<size_t>(e)];
      const int64_t n = work.expert_offsets[static_cast<size_t>(e) + 1] - begin;
      if (n == 0) continue;
      // Position in the uploaded stack: a partitioned model holds only its own experts (upload_layer).
      const int64_t stacked = options.expert_parallel_size > 1 ? e : first + e;
      run_expert(static_cast<const std::byte*>(l.experts_w13) + stacked * w13_bytes,
                 static_cast<const std::byte*>(l.experts_w2) + stacked * w2_bytes,
                 reinterpret_cast<const std::byte*>(work_inputs) + begin * row_bytes, n, expert_rows + begin * D);
    }
    DSV4_CU(cu::combine_expert_rows({received, K, D}, slots, recv_weights, expert_rows, nullptr, row_sums, stream));
  }
  DSV4_CU(cudaStreamSynchronize(stream));
  // 5. The summed rows go back in the order they came; out = the shared expert + the returned rows in rank order
  // (combine_expert_rows again: weight 1 is exact, a token's rows sit in rank order in the plan).
  float* returned = buffer<float>("ep_returned", sent * D);
  comm.all_to_all_v(row_sums, bytes(recv_counts, D * 4), returned, bytes(plan.send_counts, D * 4));
  comm.synchronize();
  if (N == 0) return;
  float* shared_rows = buffer<float>("moe_shared_rows", N * D);
  run_expert(l.shared_w13, l.shared_w2, x_operand, N, shared_rows);
  std::vector<int32_t> token_slots(static_cast<size_t>(N * ranks), -1);
  {
    std::vector<int32_t> filled(static_cast<size_t>(N), 0);
    for (int64_t i = 0; i < sent; ++i) {
      const int64_t t = plan.row_token[static_cast<size_t>(i)];
      token_slots[static_cast<size_t>(t * ranks + filled[static_cast<size_t>(t)]++)] = static_cast<int32_t>(i);
    }
  }
  const std::vector<float> ones(static_cast<size_t>(N * ranks), 1.0f);
  int32_t* final_slots = buffer<int32_t>("ep_token_slots", N * ranks);
  float* final_weights = buffer<float>("ep_token_weights", N * ranks);
  DSV4_CU(cudaMemcpyAsync(final_slots, token_slots.data(), N * ranks * sizeof(int32_t), cudaMemcpyHostToDevice,
                          stream));
  DSV4_CU(cudaMemcpyAsync(final_weights, ones.data(), N * ranks * sizeof(float), cudaMemcpyHostToDevice, stream));
  DSV4_CU(cu::combine_expert_rows({N, ranks, D}, final_slots, final_weights, returned, shared_rows, out, stream));
  // The host vectors above must outlive their asynchronous uploads.
  DSV4_CU(cudaStreamSynchronize(stream));
}

void DeepseekV4CudaModel::Impl::moe(int64_t layer, const Step& step, const float* x, const void* x_operand,
                                    float* out) {
  const ModelConfig& c = config;
  const LayerDevice& l = layers[static_cast<size_t>(layer)];
  const int64_t N = step.tokens, D = c.hidden_size, E = c.n_routed_experts, K = c.num_experts_per_tok;
  const bool hash = c.mlp_layer_types[static_cast<size_t>(layer)] == MlpType::kHashMoe;
  cu::MoeExpertsParams mp;
  mp.tokens = N;
  mp.top_k = K;
  mp.experts = E;
  mp.hidden = D;
  mp.intermediate = c.moe_intermediate_size;
  mp.swiglu_limit = static_cast<float>(c.swiglu_limit);
  mp.dtype = l.routed_dtype;
  mp.deepseek = deepseek;
  const cu::MoeExpertWeights ew{
      l.expert_w13_pointers, l.expert_w2_pointers,        l.shared_w13,
      l.shared_w2,           l.expert_w13_scale_pointers, l.expert_w2_scale_pointers};
  // kDeepSeek: every expert (routed FP4, shared FP8) reads its input quantized to e4m3 per 128 (one quantization
  // serves w1 and w3, §9); the router reads x itself. Only the grouped kernel runs in that mode, and it reads fp32.
  const float* expert_x = x;
  if (deepseek) {
    float* simulated = buffer<float>("moe_expert_in", N * D);
    DSV4_CU(cudaMemcpyAsync(simulated, x, N * D * sizeof(float), cudaMemcpyDeviceToDevice, stream));
    simulate_fp8(simulated, false, N, D, D, 128, stream);
    expert_x = simulated;
  }
  // Decode: the shared expert needs no routing, so on its own stream its GEMMs stream their 50 MB (V4-Flash)
  // while the router GEMM, route and the routed prep run (a few µs each, HBM idle), and the routed call's
  // combine waits for it. Bitwise the fused call's result (MoeSharedExpert). Measured on the 4-layer model:
  // −10 µs a step at batch 1 and 8, but prefill 5 % slower (the two grids contend), hence decode-sized steps.
  // (Low-bit experts: cuBLASLt cannot read them; the grouped kernel decodes them at every size.)
  // (kDeepSeek runs the grouped kernel always: its roundings live there.)
  const bool host_grouped = N >= per_expert_moe_min_tokens() && !capturing && !l.low_bit_experts() &&
                            expert_parallel == nullptr && !deepseek;
  constexpr int64_t kSplitSharedMaxTokens = 64;
  const bool split_shared =
      options.shared_expert_stream && N <= kSplitSharedMaxTokens && !host_grouped && expert_parallel == nullptr;
  float* shared_out = nullptr;
  if (split_shared) {
    DSV4_CU(cudaEventRecord(shared_expert_fork, stream));
    DSV4_CU(cudaStreamWaitEvent(shared_expert_stream, shared_expert_fork));
    shared_out = buffer<float>("moe_shared_out", N * D);
    // At ≤ 8 rows the shared expert is a pair of weight streams: two GEMVs (ops/cuda/skinny_gemm through
    // Gemm::linear) and the SwiGLU, where the grouped kernel paid a permutation, its tiles' ramp and a combine
    // for one expert (ncu, H100, one row: 4.0 + 23.2 + 13.1 + 4.1 µs for 50 MB).
    if (options.shared_expert_gemv && N <= 8 && !deepseek) {
      run_expert(l.shared_w13, l.shared_w2, x_operand, N, shared_out, /*shared_lane=*/true);
    } else {
      cu::MoeExpertsParams sp = mp;
      sp.shared = cu::MoeSharedExpert::kOnly;
      const size_t shared_workspace_bytes = cu::moe_experts_workspace_bytes(sp);
      void* shared_workspace = buffer<std::byte>("moe_shared_workspace", shared_workspace_bytes);
      DSV4_CU(cu::moe_experts(sp, ew, expert_x, nullptr, nullptr, shared_out, shared_workspace,
                              shared_workspace_bytes, shared_expert_stream));
    }
    DSV4_CU(cudaEventRecord(shared_expert_join, shared_expert_stream));
    mp.shared = cu::MoeSharedExpert::kAdded;
  }
  float* logits = buffer<float>("router_logits", N * E);
  gemm->linear(l.gate, x, N, logits, stream);  // fp32 x and weights in either mode (see the upload)
  int32_t* chosen = buffer<int32_t>("router_chosen", N * K);
  float* weights = buffer<float>("router_weights", N * K);
  cu::RouteParams rp;
  rp.tokens = N;
  rp.experts = E;
  rp.top_k = K;
  rp.func = c.scoring_func == ScoringFunc::kSoftmax   ? cu::RouterScoreFunc::kSoftmax
            : c.scoring_func == ScoringFunc::kSigmoid ? cu::RouterScoreFunc::kSigmoid
                                                       : cu::RouterScoreFunc::kSqrtSoftplus;
  rp.routed_scaling_factor = static_cast<float>(c.routed_scaling_factor);
  DSV4_CU(cu::route(rp, logits, hash ? nullptr : l.gate_bias, hash ? l.tid2eid : nullptr, step.token_ids, chosen,
                    weights, nullptr, stream));
  if (expert_parallel != nullptr) {
    moe_expert_parallel(layer, step, x_operand, chosen, weights, out);
    return;
  }
  DSV4_CHECK(options.expert_parallel_size == 1,
             "this model holds one rank's partition of the routed experts: it runs only with set_expert_parallel");
  if (host_grouped) {
    moe_host_grouped(layer, step, x_operand, chosen, weights, out);
    return;
  }
  if (options.routed_expert_gemv && bf16 && N == 1 && l.routed_dtype == cu::MoeWeightDtype::kBf16 && !deepseek) {
    routed_experts_gemv(layer, x_operand, chosen, weights, shared_out, out);
    return;
  }
  const size_t workspace_bytes = cu::moe_experts_workspace_bytes(mp);
  void* workspace = buffer<std::byte>("moe_workspace", workspace_bytes);
  DSV4_CU(cu::moe_experts(mp, ew, expert_x, chosen, weights, out, workspace, workspace_bytes, stream, shared_out,
                          split_shared ? shared_expert_join : nullptr));
}

}  // namespace dsv4
