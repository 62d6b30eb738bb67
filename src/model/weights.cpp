#include "model/weights.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include "core/error.h"
#include "model/safetensors.h"

namespace dsv4 {
namespace {

bool starts_with(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }
bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

// Lists at most `limit` names, then "... and N more".
std::string list_names(const std::vector<std::string>& names, size_t limit = 12) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < limit; ++i) out += "\n    " + names[i];
  if (names.size() > limit) out += "\n    ... and " + std::to_string(names.size() - limit) + " more";
  return out;
}

// FP4 e2m1 code -> value (docs research/model_spec.md §2.1; low nibble is the even element).
constexpr float kFp4Values[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                  -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// Whether a stored tensor (with its scale companion when `scale_info` is set) can become the fp32 tensor `spec`
// describes: block-scaled FP8 ([out, in] e4m3 with [ceil(out/128), ceil(in/128)] scales), packed FP4 ([out, in/2]
// bytes with [out, in/32] scales) or a plain dtype of the logical shape. Appends the reason to `errors` when not.
// Header fields only: no data is touched.
bool check_stored_tensor(const std::string& stored_name, const TensorInfo& info, const std::string& scale_name,
                         const TensorInfo* scale_info, const TensorSpec& spec, std::vector<std::string>& errors) {
  const std::vector<int64_t>& expected = spec.shape;
  // Expert ids must be integers; everything else a float dtype (or FP8/FP4 bytes with a scale tensor).
  const bool integer = info.dtype == DType::kI64 || info.dtype == DType::kI32;
  const bool plain_float = info.dtype == DType::kF32 || info.dtype == DType::kBF16 || info.dtype == DType::kF16;
  if ((spec.role == TensorRole::kHashTable) != integer || (!integer && !plain_float && !scale_info)) {
    errors.push_back(stored_name + ": dtype " + std::string(dtype_name(info.dtype)) + " is not valid for this tensor" +
                     (spec.role == TensorRole::kHashTable ? " (expected I64 or I32)" : " (expected F32, BF16 or F16)"));
    return false;
  }
  auto mismatch = [&](const std::vector<int64_t>& shape) {
    errors.push_back(stored_name + ": shape " + shape_string(shape) + " (" + std::string(dtype_name(info.dtype)) +
                     "), expected " + shape_string(expected));
    return false;
  };
  const bool packed_fp4 = scale_info && (info.dtype == DType::kI8 || info.dtype == DType::kU8);
  if (!packed_fp4 && info.shape != expected) return mismatch(info.shape);
  if (packed_fp4 && (expected.size() != 2 || info.shape.size() != 2 || info.shape[0] != expected[0] ||
                     info.shape[1] * 2 != expected[1]))
    return mismatch(info.shape);
  if (!scale_info) return true;
  const auto& scale_shape = scale_info->shape;
  const int64_t rows = expected[0], cols = expected[1];
  if (packed_fp4) {
    const int64_t groups = (cols + 31) / 32;
    if (scale_shape != std::vector<int64_t>{rows, groups}) {
      errors.push_back(scale_name + ": shape " + shape_string(scale_shape) + ", expected " +
                       shape_string({rows, groups}) + " for FP4 weight " + stored_name);
      return false;
    }
    return true;
  }
  if (info.dtype != DType::kF8E4M3) {
    errors.push_back(stored_name + ": has scale " + scale_name + " but dtype " + std::string(dtype_name(info.dtype)));
    return false;
  }
  const int64_t block_rows = (rows + 127) / 128, block_cols = (cols + 127) / 128;
  if (scale_shape != std::vector<int64_t>{block_rows, block_cols}) {
    errors.push_back(scale_name + ": shape " + shape_string(scale_shape) + ", expected " +
                     shape_string({block_rows, block_cols}) + " (128x128 blocks of " + stored_name + ")");
    return false;
  }
  return true;
}

// Reads a tensor check_stored_tensor accepted as fp32 of its logical shape, dequantizing FP8 / FP4.
Tensor read_tensor(const SafetensorsArchive& archive, const std::string& stored_name, const std::string& scale_name,
                   const TensorSpec& spec) {
  if (scale_name.empty()) {
    Tensor tensor;
    tensor.shape = spec.shape;
    tensor.data = archive.read_f32(stored_name);
    return tensor;
  }
  Tensor tensor(spec.shape);
  const SafetensorsArchive::Entry& entry = *archive.find(stored_name);
  const std::vector<float> scales = archive.read_f32(scale_name);
  const int64_t rows = spec.shape[0], cols = spec.shape[1];
  const uint8_t* raw = entry.file->data(*entry.info);
  if (entry.info->dtype == DType::kI8 || entry.info->dtype == DType::kU8) {  // packed FP4
    const int64_t groups = (cols + 31) / 32;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const uint8_t byte = raw[r * (cols / 2) + c / 2];
        const uint8_t code = (c % 2 == 0) ? (byte & 0xf) : (byte >> 4);
        tensor.data[r * cols + c] = kFp4Values[code] * scales[r * groups + c / 32];
      }
    return tensor;
  }
  const int64_t block_cols = (cols + 127) / 128;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      tensor.data[r * cols + c] = f8e4m3_to_f32(raw[r * cols + c]) * scales[(r / 128) * block_cols + c / 128];
  return tensor;
}

// Reads a LinearWeight field check_stored_tensor accepted: FP8 codes with their 128×128 block scales and
// packed FP4 with its per-32 scales are copied as stored (issue 7: no fp32 blow-up of the checkpoint); plain
// dtypes become fp32.
LinearWeight read_linear_weight(const SafetensorsArchive& archive, const std::string& stored_name,
                                const std::string& scale_name, const TensorSpec& spec) {
  if (scale_name.empty()) return LinearWeight(read_tensor(archive, stored_name, scale_name, spec));
  const SafetensorsArchive::Entry& entry = *archive.find(stored_name);
  const uint8_t* raw = entry.file->data(*entry.info);
  const int64_t rows = spec.shape[0], cols = spec.shape[1];
  std::vector<float> scales = archive.read_f32(scale_name);
  if (entry.info->dtype == DType::kI8 || entry.info->dtype == DType::kU8)
    return LinearWeight::fp4_group_scaled(rows, cols, std::vector<uint8_t>(raw, raw + rows * cols / 2),
                                          scales, stored_name);
  return LinearWeight::fp8_block_scaled(rows, cols, std::vector<uint8_t>(raw, raw + rows * cols), scales);
}

size_t tensor_bytes(const Tensor& t) { return t.data.size() * sizeof(float); }

}  // namespace

size_t LayerWeights::host_bytes() const {
  size_t bytes = 0;
  for (const Tensor* t :
       {&hc_attn_fn, &hc_attn_base, &hc_attn_scale, &hc_ffn_fn, &hc_ffn_base, &hc_ffn_scale, &attn_norm,
        &ffn_norm, &q_norm, &kv_norm, &attn_sink, &indexer_weights_proj, &gate, &gate_bias})
    bytes += tensor_bytes(*t);
  for (const CompressorWeights* c : {&compressor, &indexer_compressor})
    for (const Tensor* t : {&c->wkv, &c->wgate, &c->ape, &c->norm}) bytes += tensor_bytes(*t);
  for (const LinearWeight* w : {&wq_a, &wq_b, &wkv, &wo_a, &wo_b, &indexer_wq_b, &shared_w13, &shared_w2})
    bytes += w->storage_bytes();
  for (const auto* experts : {&experts_w13, &experts_w2})
    for (const LinearWeight& w : *experts) bytes += w.storage_bytes();
  return bytes + tid2eid.size() * sizeof(int32_t);
}

size_t ModelWeights::host_bytes() const {
  size_t bytes = 0;
  for (const Tensor* t : {&embed, &head, &norm, &hc_head_fn, &hc_head_base, &hc_head_scale})
    bytes += tensor_bytes(*t);
  for (const LayerWeights& layer : layers) bytes += layer.host_bytes();
  return bytes;
}

std::string canonical_tensor_name(const std::string& name) {
  std::string out = name;
  if (!starts_with(out, "model.") && out != "head.weight" && out != "lm_head.weight") out = "model." + out;
  if (out == "lm_head.weight") out = "head.weight";
  if (out == "model.embed.weight") out = "model.embed_tokens.weight";
  for (const char* part : {"fn", "base", "scale"})
    if (out == std::string("model.hc_head_") + part) out = std::string("model.hc_head.hc_") + part;
  const std::string kv_norm = ".attn.kv_norm.";
  if (const auto pos = out.find(kv_norm); pos != std::string::npos) out.replace(pos, kv_norm.size(), ".attn.norm.");
  return out;
}

std::vector<TensorSpec> checkpoint_tensors(const ModelConfig& c) {
  const int64_t D = c.hidden_size, H = c.num_attention_heads, d = c.head_dim, hc = c.hc_mult;
  const int64_t mix = (2 + hc) * hc, I = c.moe_intermediate_size, E = c.n_routed_experts;
  std::vector<TensorSpec> specs = {
      {"model.embed_tokens.weight", {c.vocab_size, D}, TensorRole::kEmbedding},
      {"head.weight", {c.vocab_size, D}, TensorRole::kLinear},
      {"model.norm.weight", {D}, TensorRole::kNormWeight},
      {"model.hc_head.hc_fn", {hc, hc * D}, TensorRole::kHcFn},
      {"model.hc_head.hc_base", {hc}, TensorRole::kHcBase},
      {"model.hc_head.hc_scale", {1}, TensorRole::kHcScale},
  };
  for (int64_t layer = 0; layer < c.num_hidden_layers; ++layer) {
    const std::string p = "model.layers." + std::to_string(layer) + ".";
    auto add = [&](const std::string& name, std::vector<int64_t> shape, TensorRole role) {
      specs.push_back({p + name, std::move(shape), role});
    };
    for (const char* site : {"attn", "ffn"}) {
      add(std::string("hc_") + site + "_fn", {mix, hc * D}, TensorRole::kHcFn);
      add(std::string("hc_") + site + "_base", {mix}, TensorRole::kHcBase);
      add(std::string("hc_") + site + "_scale", {3}, TensorRole::kHcScale);
    }
    add("attn_norm.weight", {D}, TensorRole::kNormWeight);
    add("ffn_norm.weight", {D}, TensorRole::kNormWeight);
    add("attn.wq_a.weight", {c.q_lora_rank, D}, TensorRole::kLinear);
    add("attn.q_norm.weight", {c.q_lora_rank}, TensorRole::kNormWeight);
    add("attn.wq_b.weight", {H * d, c.q_lora_rank}, TensorRole::kLinear);
    add("attn.wkv.weight", {d, D}, TensorRole::kLinear);
    add("attn.norm.weight", {d}, TensorRole::kNormWeight);
    add("attn.wo_a.weight", {c.o_groups * c.o_lora_rank, H * d / c.o_groups}, TensorRole::kLinear);
    add("attn.wo_b.weight", {D, c.o_groups * c.o_lora_rank}, TensorRole::kLinear);
    add("attn.attn_sink", {H}, TensorRole::kSink);
    const AttentionType type = c.layer_types[static_cast<size_t>(layer)];
    if (type != AttentionType::kSlidingWindow) {
      const int64_t coff = type == AttentionType::kCompressedSparse ? 2 : 1;
      add("attn.compressor.wkv.weight", {coff * d, D}, TensorRole::kLinear);
      add("attn.compressor.wgate.weight", {coff * d, D}, TensorRole::kLinear);
      add("attn.compressor.ape", {c.compress_rate(layer), coff * d}, TensorRole::kPositionBias);
      add("attn.compressor.norm.weight", {d}, TensorRole::kNormWeight);
    }
    if (type == AttentionType::kCompressedSparse) {
      const int64_t cI = c.index_head_dim;
      add("attn.indexer.compressor.wkv.weight", {2 * cI, D}, TensorRole::kLinear);
      add("attn.indexer.compressor.wgate.weight", {2 * cI, D}, TensorRole::kLinear);
      add("attn.indexer.compressor.ape", {c.compress_rate_csa, 2 * cI}, TensorRole::kPositionBias);
      add("attn.indexer.compressor.norm.weight", {cI}, TensorRole::kNormWeight);
      add("attn.indexer.wq_b.weight", {c.index_n_heads * cI, c.q_lora_rank}, TensorRole::kLinear);
      add("attn.indexer.weights_proj.weight", {c.index_n_heads, D}, TensorRole::kLinear);
    }
    add("ffn.gate.weight", {E, D}, TensorRole::kLinear);
    if (c.mlp_layer_types[static_cast<size_t>(layer)] == MlpType::kHashMoe)
      add("ffn.gate.tid2eid", {c.vocab_size, c.num_experts_per_tok}, TensorRole::kHashTable);
    else
      add("ffn.gate.bias", {E}, TensorRole::kRouterBias);
    for (int64_t e = 0; e < E; ++e) {
      const std::string expert = "ffn.experts." + std::to_string(e) + ".";
      add(expert + "w1.weight", {I, D}, TensorRole::kLinear);
      add(expert + "w2.weight", {D, I}, TensorRole::kLinear);
      add(expert + "w3.weight", {I, D}, TensorRole::kLinear);
    }
    add("ffn.shared_experts.w1.weight", {I, D}, TensorRole::kLinear);
    add("ffn.shared_experts.w2.weight", {D, I}, TensorRole::kLinear);
    add("ffn.shared_experts.w3.weight", {I, D}, TensorRole::kLinear);
  }
  return specs;
}

CheckpointWeightSource::CheckpointWeightSource(ModelConfig config, const std::string& path)
    : config_(std::move(config)), archive_(std::make_unique<SafetensorsArchive>(path)) {
  const SafetensorsArchive& archive = *archive_;
  // canonical name -> stored name; scale companions and the MTP block are set aside.
  std::map<std::string, std::string> stored;
  std::set<std::string> consumed;
  const std::vector<std::string> names = archive.names();
  const std::set<std::string> name_set(names.begin(), names.end());
  for (const auto& name : names) {
    if (starts_with(name, "mtp.") || starts_with(name, "model.mtp.")) {
      consumed.insert(name);  // the MTP block is not run by this engine yet
      continue;
    }
    stored[canonical_tensor_name(name)] = name;
  }
  auto scale_of = [&](const std::string& weight_name) -> std::string {
    if (!ends_with(weight_name, ".weight")) return {};
    const std::string stem = weight_name.substr(0, weight_name.size() - 7);
    for (const std::string& candidate : {stem + ".scale", weight_name + "_scale_inv", stem + ".weight_scale_inv"})
      if (name_set.count(candidate)) return candidate;
    return {};
  };
  std::vector<std::string> missing, errors;
  for (const auto& spec : checkpoint_tensors(config_)) {
    const auto it = stored.find(spec.name);
    if (it == stored.end()) {
      missing.push_back(spec.name + " " + shape_string(spec.shape));
      continue;
    }
    const std::string& stored_name = it->second;
    consumed.insert(stored_name);
    const std::string scale_name = scale_of(stored_name);
    if (!scale_name.empty()) consumed.insert(scale_name);
    const TensorInfo* scale_info = scale_name.empty() ? nullptr : archive.find(scale_name)->info;
    if (check_stored_tensor(stored_name, *archive.find(stored_name)->info, scale_name, scale_info, spec, errors))
      stored_[spec.name] = StoredTensor{spec, stored_name, scale_name};
  }
  std::vector<std::string> unexpected;
  for (const auto& name : names)
    if (!consumed.count(name)) unexpected.push_back(name);
  if (!missing.empty() || !unexpected.empty() || !errors.empty()) {
    std::string message = "checkpoint '" + path + "' does not match its config:";
    if (!missing.empty()) message += "\n  missing " + std::to_string(missing.size()) + " tensors:" + list_names(missing);
    if (!unexpected.empty())
      message += "\n  unexpected " + std::to_string(unexpected.size()) + " tensors:" + list_names(unexpected);
    if (!errors.empty()) message += "\n  " + std::to_string(errors.size()) + " bad tensors:" + list_names(errors);
    throw Error(message);
  }
}

CheckpointWeightSource::~CheckpointWeightSource() = default;

Tensor CheckpointWeightSource::read(const std::string& name) const {
  const StoredTensor& tensor = stored_.at(name);
  return read_tensor(*archive_, tensor.stored_name, tensor.scale_name, tensor.spec);
}

LinearWeight CheckpointWeightSource::read_linear(const std::string& name) const {
  const StoredTensor& tensor = stored_.at(name);
  return read_linear_weight(*archive_, tensor.stored_name, tensor.scale_name, tensor.spec);
}

ModelWeights CheckpointWeightSource::globals() {
  return assemble_global_weights([this](const std::string& name) { return read(name); });
}

LayerWeights CheckpointWeightSource::layer(int64_t index) {
  DSV4_CHECK(index >= 0 && index < config_.num_hidden_layers,
             "layer " + std::to_string(index) + " outside the checkpoint's " +
                 std::to_string(config_.num_hidden_layers) + " layers");
  return assemble_layer_weights(
      config_, index, [this](const std::string& name) { return read(name); },
      [this](const std::string& name) { return read_linear(name); });
}

ModelWeights ModelWeights::load(const ModelConfig& config, const std::string& path) {
  CheckpointWeightSource source(config, path);
  return from_source(source);
}

ModelWeights ModelWeights::from_source(ModelWeightSource& source) {
  ModelWeights weights = source.globals();
  for (int64_t layer = 0; layer < source.config().num_hidden_layers; ++layer)
    weights.layers.push_back(source.layer(layer));
  return weights;
}

ModelWeights ModelWeights::from_tensors(const ModelConfig& config, std::vector<std::pair<std::string, Tensor>> list) {
  std::map<std::string, Tensor> by_name;
  for (auto& [name, tensor] : list) by_name[name] = std::move(tensor);
  std::vector<std::string> problems;
  for (const auto& spec : checkpoint_tensors(config)) {
    const auto it = by_name.find(spec.name);
    if (it == by_name.end()) problems.push_back(spec.name + ": missing");
    else if (it->second.shape != spec.shape)
      problems.push_back(spec.name + ": shape " + it->second.shape_string() + ", expected " + shape_string(spec.shape));
  }
  if (!problems.empty()) throw Error("weights do not match the config:" + list_names(problems));
  const TakeTensor take = [&](const std::string& name) { return std::move(by_name.at(name)); };
  ModelWeights w = assemble_global_weights(take);
  for (int64_t layer = 0; layer < config.num_hidden_layers; ++layer)
    w.layers.push_back(assemble_layer_weights(config, layer, take));
  return w;
}

ModelWeights assemble_global_weights(const TakeTensor& take) {
  ModelWeights w;
  w.embed = take("model.embed_tokens.weight");
  w.head = take("head.weight");
  w.norm = take("model.norm.weight");
  w.hc_head_fn = take("model.hc_head.hc_fn");
  w.hc_head_base = take("model.hc_head.hc_base");
  w.hc_head_scale = take("model.hc_head.hc_scale");
  return w;
}

LayerWeights assemble_layer_weights(const ModelConfig& config, int64_t layer, const TakeTensor& take,
                                    const TakeLinear& take_linear_weight) {
  const TakeLinear take_linear = take_linear_weight ? take_linear_weight : [&take](const std::string& name) {
    return LinearWeight(take(name));
  };
  auto fuse_gate_up = [&](const std::string& prefix) {
    LinearWeight w1 = take_linear(prefix + "w1.weight"), w3 = take_linear(prefix + "w3.weight");
    if (w1.encoding() != w3.encoding()) {  // a mixed-precision checkpoint: fuse in fp32
      w1 = LinearWeight(w1.dequantized());
      w3 = LinearWeight(w3.dequantized());
    }
    return LinearWeight::concat_rows(w1, w3);
  };
  const std::string p = "model.layers." + std::to_string(layer) + ".";
  LayerWeights l;
  l.hc_attn_fn = take(p + "hc_attn_fn");
  l.hc_attn_base = take(p + "hc_attn_base");
  l.hc_attn_scale = take(p + "hc_attn_scale");
  l.hc_ffn_fn = take(p + "hc_ffn_fn");
  l.hc_ffn_base = take(p + "hc_ffn_base");
  l.hc_ffn_scale = take(p + "hc_ffn_scale");
  l.attn_norm = take(p + "attn_norm.weight");
  l.ffn_norm = take(p + "ffn_norm.weight");
  l.wq_a = take_linear(p + "attn.wq_a.weight");
  l.q_norm = take(p + "attn.q_norm.weight");
  l.wq_b = take_linear(p + "attn.wq_b.weight");
  l.wkv = take_linear(p + "attn.wkv.weight");
  l.kv_norm = take(p + "attn.norm.weight");
  l.wo_a = take_linear(p + "attn.wo_a.weight");
  l.wo_b = take_linear(p + "attn.wo_b.weight");
  l.attn_sink = take(p + "attn.attn_sink");
  const AttentionType type = config.layer_types[static_cast<size_t>(layer)];
  auto take_compressor = [&](const std::string& q) {
    return CompressorWeights{take(q + "wkv.weight"), take(q + "wgate.weight"), take(q + "ape"), take(q + "norm.weight")};
  };
  if (type != AttentionType::kSlidingWindow) l.compressor = take_compressor(p + "attn.compressor.");
  if (type == AttentionType::kCompressedSparse) {
    l.indexer_compressor = take_compressor(p + "attn.indexer.compressor.");
    l.indexer_wq_b = take_linear(p + "attn.indexer.wq_b.weight");
    l.indexer_weights_proj = take(p + "attn.indexer.weights_proj.weight");
  }
  l.gate = take(p + "ffn.gate.weight");
  if (config.mlp_layer_types[static_cast<size_t>(layer)] == MlpType::kHashMoe) {
    const Tensor table = take(p + "ffn.gate.tid2eid");
    l.tid2eid.resize(table.data.size());
    for (size_t i = 0; i < table.data.size(); ++i) {
      const float expert = table.data[i];
      if (!(expert >= 0 && expert < static_cast<float>(config.n_routed_experts)) || std::floor(expert) != expert)
        throw Error(p + "ffn.gate.tid2eid: entry " + std::to_string(i) + " = " + std::to_string(expert) +
                    " is not an expert id in [0, " + std::to_string(config.n_routed_experts) + ")");
      l.tid2eid[i] = static_cast<int32_t>(expert);
    }
  } else {
    l.gate_bias = take(p + "ffn.gate.bias");
  }
  for (int64_t e = 0; e < config.n_routed_experts; ++e) {
    const std::string expert = p + "ffn.experts." + std::to_string(e) + ".";
    l.experts_w13.push_back(fuse_gate_up(expert));
    l.experts_w2.push_back(take_linear(expert + "w2.weight"));
  }
  l.shared_w13 = fuse_gate_up(p + "ffn.shared_experts.");
  l.shared_w2 = take_linear(p + "ffn.shared_experts.w2.weight");
  return l;
}

RequantizedExpertsSource::RequantizedExpertsSource(std::unique_ptr<ModelWeightSource> source,
                                                   WeightEncoding expert_encoding)
    : source_(std::move(source)), expert_encoding_(expert_encoding) {
  DSV4_CHECK(expert_encoding == WeightEncoding::kQ3G32 || expert_encoding == WeightEncoding::kQ2G32,
             "routed experts requantize to kQ3G32 or kQ2G32 only");
}

LayerWeights RequantizedExpertsSource::layer(int64_t index) {
  LayerWeights layer = source_->layer(index);
  for (auto* experts : {&layer.experts_w13, &layer.experts_w2})
    for (LinearWeight& w : *experts) w = w.requantized(expert_encoding_);
  return layer;
}

std::optional<WeightEncoding> parse_expert_requantization(const std::string& text, const std::string& what) {
  if (text == "auto") return std::nullopt;
  if (text == "3.5" || text == "q3") return WeightEncoding::kQ3G32;
  if (text == "2.5" || text == "q2") return WeightEncoding::kQ2G32;
  throw Error(what + " '" + text + "': expected auto (as stored), 3.5 (q3) or 2.5 (q2) bits per parameter");
}

}  // namespace dsv4
