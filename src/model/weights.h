// The weights of a DeepSeek-V4 checkpoint as the CPU backend holds them — fp32, except the projections stored
// FP8 / FP4, which stay in their encoding (core/linear_weight.h) — the list of tensors a config implies (the
// on-disk names of transformers 5.17 save_pretrained, docs/MODEL.md "Tensor names on disk"), and the sources
// that hand the weights out a layer at a time (the GPU backend streams them to the device).
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/linear_weight.h"
#include "core/tensor.h"
#include "model/model_config.h"

namespace dsv4 {

enum class TensorRole {
  kLinear,       // [out, in] projection
  kEmbedding,    // token embedding rows
  kNormWeight,   // RMSNorm weight
  kHcFn, kHcBase, kHcScale,
  kSink, kPositionBias, kRouterBias,
  kHashTable,    // tid2eid, integer expert ids
};

struct TensorSpec {
  std::string name;  // on-disk name as save_pretrained writes it ("model.layers.3.attn.wq_a.weight")
  std::vector<int64_t> shape;
  TensorRole role;
};

// Every tensor of the checkpoint, in a stable order.
std::vector<TensorSpec> checkpoint_tensors(const ModelConfig& config);

// Maps a name of the official DeepSeek checkpoint layout ("layers.3.attn.kv_norm.weight", "embed.weight",
// "hc_head_fn") to the save_pretrained name; names already in that form come back unchanged.
std::string canonical_tensor_name(const std::string& name);

struct CompressorWeights {
  Tensor wkv, wgate, ape, norm;  // [coff·d, D], [coff·d, D], [ratio, coff·d], [d]
};

struct LayerWeights {
  Tensor hc_attn_fn, hc_attn_base, hc_attn_scale, hc_ffn_fn, hc_ffn_base, hc_ffn_scale;
  Tensor attn_norm, ffn_norm;
  // attention. The projections the released checkpoints store FP8 (and the MXFP4 routed experts) are
  // LinearWeights: kept quantized when loaded so; every other tensor is fp32.
  LinearWeight wq_a, wq_b, wkv, wo_a, wo_b;
  Tensor q_norm, kv_norm, attn_sink;
  CompressorWeights compressor;          // CSA / HCA layers
  CompressorWeights indexer_compressor;  // CSA layers
  LinearWeight indexer_wq_b;
  Tensor indexer_weights_proj;
  // MoE
  Tensor gate, gate_bias;                // gate_bias empty on hash layers
  std::vector<int32_t> tid2eid;          // [vocab, top_k], hash layers only
  std::vector<LinearWeight> experts_w13;  // per expert [2·I, D]: gate rows then up rows (w1 ‖ w3)
  std::vector<LinearWeight> experts_w2;   // per expert [D, I]
  LinearWeight shared_w13, shared_w2;

  // Host bytes of every tensor of the layer (quantized ones as stored).
  size_t host_bytes() const;
};

class ModelWeightSource;

struct ModelWeights {
  Tensor embed, head, norm, hc_head_fn, hc_head_base, hc_head_scale;
  std::vector<LayerWeights> layers;

  // Host bytes of every tensor (quantized projections as stored): what holding the model costs.
  size_t host_bytes() const;

  // Loads a model directory or .safetensors file. Missing, unexpected and mis-shaped tensors are reported in
  // one dsv4::Error that lists them all. F8_E4M3 weights with a `.scale`/`.weight_scale_inv` companion
  // (128×128 blocks) and packed FP4 experts (I8 + per-32 UE8M0 scales) stay quantized where the field is a
  // LinearWeight and are dequantized to fp32 elsewhere.
  static ModelWeights load(const ModelConfig& config, const std::string& path);
  // Takes ownership of tensors keyed by on-disk name (validated like load()).
  static ModelWeights from_tensors(const ModelConfig& config, std::vector<std::pair<std::string, Tensor>> tensors);
  // Every piece of `source`: its globals, then each layer in order.
  static ModelWeights from_source(ModelWeightSource& source);
};

// The one place that knows which on-disk tensor becomes which field, shared by from_tensors and every weight
// source. `take(name)` hands over the tensor of that on-disk name (checkpoint_tensors' names and shapes).
using TakeTensor = std::function<Tensor(const std::string& name)>;
// The same for the LinearWeight fields; a source that stores them quantized hands them over as they are.
using TakeLinear = std::function<LinearWeight(const std::string& name)>;
// embed, head, norm, hc_head_*; `layers` left empty.
ModelWeights assemble_global_weights(const TakeTensor& take);
// Layer `layer`: fuses each expert's w1 ‖ w3 and turns tid2eid into expert ids (throws dsv4::Error on an
// entry that is not one). `take_linear` empty: the LinearWeight fields are take()'s fp32 tensors.
LayerWeights assemble_layer_weights(const ModelConfig& config, int64_t layer, const TakeTensor& take,
                                    const TakeLinear& take_linear = {});

// The weights one piece at a time, so a backend can upload a layer and free it before asking for the next: host
// memory stays at about one layer instead of the whole fp32 model (the GPU backend, docs/gpu.md).
class ModelWeightSource {
 public:
  virtual ~ModelWeightSource() = default;
  // The config the pieces are shaped by.
  virtual const ModelConfig& config() const = 0;
  // embed, head, norm, hc_head_*; `layers` empty.
  virtual ModelWeights globals() = 0;
  // Layer `index`, in [0, config().num_hidden_layers).
  virtual LayerWeights layer(int64_t index) = 0;
};

// Routed experts requantized to fewer bits as each layer is handed out (issue 7 item 5: V4-Flash's MXFP4
// experts are 137 GiB, research/perf_anchors.md §6.2; at 3.5 / 2.5 bits/param they are 113 / 81 GiB).
// Everything else passes through unchanged. `expert_encoding`: WeightEncoding::kQ3G32 or kQ2G32.
class RequantizedExpertsSource final : public ModelWeightSource {
 public:
  RequantizedExpertsSource(std::unique_ptr<ModelWeightSource> source, WeightEncoding expert_encoding);
  const ModelConfig& config() const override { return source_->config(); }
  ModelWeights globals() override { return source_->globals(); }
  LayerWeights layer(int64_t index) override;

 private:
  std::unique_ptr<ModelWeightSource> source_;
  WeightEncoding expert_encoding_;
};

// --expert-bits of the loading commands: "auto" (as the checkpoint stores them: nullopt), "3.5" or "q3"
// (kQ3G32), "2.5" or "q2" (kQ2G32); anything else throws dsv4::Error naming `what`.
std::optional<WeightEncoding> parse_expert_requantization(const std::string& text, const std::string& what);

class SafetensorsArchive;

// A checkpoint kept open (memory-mapped). The constructor checks every tensor's name, dtype and shape against the
// config from the headers alone and throws one dsv4::Error listing every problem (ModelWeights::load's message),
// so a bad checkpoint fails before anything is read or uploaded; each call then reads (and dequantizes) only the
// tensors it returns.
class CheckpointWeightSource final : public ModelWeightSource {
 public:
  CheckpointWeightSource(ModelConfig config, const std::string& path);
  ~CheckpointWeightSource() override;
  const ModelConfig& config() const override { return config_; }
  ModelWeights globals() override;
  LayerWeights layer(int64_t index) override;

 private:
  struct StoredTensor {
    TensorSpec spec;          // the tensor as the config wants it
    std::string stored_name;  // its name in the checkpoint
    std::string scale_name;   // FP8/FP4 scale companion; empty when stored as a plain dtype
  };
  Tensor read(const std::string& name) const;
  // A LinearWeight field: FP8 / FP4 stored tensors as stored, others as read() gives them.
  LinearWeight read_linear(const std::string& name) const;

  ModelConfig config_;
  std::unique_ptr<SafetensorsArchive> archive_;
  std::map<std::string, StoredTensor> stored_;  // by save_pretrained name
};

}  // namespace dsv4
