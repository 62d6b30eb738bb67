#include "model/random_init.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>

#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "model/safetensors.h"

namespace dsv4 {
namespace {

uint64_t hash_name(const std::string& name, uint64_t seed) {
  uint64_t h = 1469598103934665603ull ^ seed;  // FNV-1a
  for (const unsigned char ch : name) h = (h ^ ch) * 1099511628211ull;
  return h;
}

// Elements per parallel chunk: large enough that the jump-ahead and scheduling are noise.
constexpr int64_t kFillGrain = int64_t{1} << 15;

// data[i] = element i of `fill`, over the thread pool: each chunk jumps to its first element's generator, so the
// result is the sequential loop's bit for bit, whatever the thread count.
void parallel_fill(std::vector<float>& data, const RandomFill& fill) {
  ThreadPool::global().parallel_for(static_cast<int64_t>(data.size()), [&](int64_t begin, int64_t end) {
    SplitMix64 generator = fill.generator_at(static_cast<uint64_t>(begin));
    for (int64_t i = begin; i < end; ++i) data[static_cast<size_t>(i)] = fill.draw(generator);
  }, kFillGrain);
}

}  // namespace

std::optional<RandomFill> random_fill(const TensorSpec& spec, uint64_t seed) {
  const uint64_t start = hash_name(spec.name, seed);
  auto normal = [&](double stddev, double mean = 0.0) {
    return RandomFill{RandomFill::Kind::kNormal, start, mean, stddev};
  };
  switch (spec.role) {
    case TensorRole::kLinear: return normal(1.0 / std::sqrt(static_cast<double>(spec.shape.back())));
    case TensorRole::kEmbedding: return normal(1.0);
    case TensorRole::kNormWeight: return normal(0.1, 1.0);
    case TensorRole::kHcFn: return normal(1.0 / std::sqrt(static_cast<double>(spec.shape.back())));
    case TensorRole::kHcBase: return normal(0.5);
    case TensorRole::kHcScale: return RandomFill{RandomFill::Kind::kUniform, start, 0.5, 1.0};
    case TensorRole::kSink: return normal(0.5);
    case TensorRole::kPositionBias: return normal(0.5);
    case TensorRole::kRouterBias: return normal(0.1);
    case TensorRole::kHashTable: return std::nullopt;
  }
  return std::nullopt;
}

Tensor random_tensor(const ModelConfig& config, const TensorSpec& spec, uint64_t seed) {
  Tensor tensor(spec.shape);
  if (const std::optional<RandomFill> fill = random_fill(spec, seed)) {
    parallel_fill(tensor.data, *fill);
    return tensor;
  }
  // The hash table: each row top_k distinct experts (a partial Fisher-Yates shuffle). Sequential: [vocab,
  // top_k] is small.
  SplitMix64 random{hash_name(spec.name, seed)};
  const int64_t experts = config.n_routed_experts, top_k = spec.shape[1];
  std::vector<int32_t> ids(static_cast<size_t>(experts));
  for (int64_t row = 0; row < spec.shape[0]; ++row) {
    std::iota(ids.begin(), ids.end(), 0);
    for (int64_t k = 0; k < top_k; ++k) {
      const auto pick = k + static_cast<int64_t>(random.next() % static_cast<uint64_t>(experts - k));
      std::swap(ids[k], ids[pick]);
      tensor.data[row * top_k + k] = static_cast<float>(ids[k]);
    }
  }
  return tensor;
}

namespace {

void copy_tokenizer(const std::string& tokenizer_path, const std::filesystem::path& out_dir) {
  namespace fs = std::filesystem;
  const fs::path source(tokenizer_path);
  const fs::path dir = fs::is_directory(source) ? source : source.parent_path();
  const fs::path json = fs::is_directory(source) ? dir / "tokenizer.json" : source;
  DSV4_CHECK(fs::is_regular_file(json), "tokenizer '" + json.string() + "' not found");
  fs::copy_file(json, out_dir / "tokenizer.json", fs::copy_options::overwrite_existing);
  if (fs::is_regular_file(dir / "tokenizer_config.json"))
    fs::copy_file(dir / "tokenizer_config.json", out_dir / "tokenizer_config.json", fs::copy_options::overwrite_existing);
}

}  // namespace

std::vector<std::pair<std::string, Tensor>> random_tensors(const ModelConfig& config, uint64_t seed) {
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const auto& spec : checkpoint_tensors(config)) tensors.emplace_back(spec.name, random_tensor(config, spec, seed));
  return tensors;
}

ModelWeights random_weights(const ModelConfig& config, uint64_t seed) {
  return ModelWeights::from_tensors(config, random_tensors(config, seed));
}

RandomWeightSource::RandomWeightSource(ModelConfig config, uint64_t seed) : config_(std::move(config)), seed_(seed) {
  for (const auto& spec : checkpoint_tensors(config_)) specs_.emplace(spec.name, spec);
}

Tensor RandomWeightSource::generate(const std::string& name) const {
  return random_tensor(config_, specs_.at(name), seed_);
}

ModelWeights RandomWeightSource::globals() {
  return assemble_global_weights([this](const std::string& name) { return generate(name); });
}

LayerWeights RandomWeightSource::layer(int64_t index) {
  DSV4_CHECK(index >= 0 && index < config_.num_hidden_layers,
             "layer " + std::to_string(index) + " outside the config's " + std::to_string(config_.num_hidden_layers) +
                 " layers");
  LayerWeights layer =
      assemble_layer_weights(config_, index, [this](const std::string& name) { return generate(name); });
  if (config_.fp8_block_weights)  // the projections the release stores FP8, in its layout
    for (LinearWeight* w : {&layer.wq_a, &layer.wq_b, &layer.wkv, &layer.wo_b, &layer.indexer_wq_b,
                            &layer.shared_w13, &layer.shared_w2})
      if (!w->empty()) *w = LinearWeight::quantize_fp8_blocks(w->dense());
  if (config_.fp4_routed_experts)  // the release's MXFP4 routed experts
    for (auto* experts : {&layer.experts_w13, &layer.experts_w2})
      for (LinearWeight& w : *experts) w = LinearWeight::quantize_mxfp4_groups(w.dense());
  return layer;
}

void write_random_model(const ModelConfig& config, uint64_t seed, StorageDType dtype, const std::string& out_dir,
                        const std::string& tokenizer_path) {
  namespace fs = std::filesystem;
  fs::create_directories(out_dir);
  ModelConfig saved = config;
  saved.torch_dtype = dtype == StorageDType::kBF16 ? "bfloat16" : "float32";
  {
    std::ofstream out(fs::path(out_dir) / "config.json");
    DSV4_CHECK(out.good(), "cannot write " + (fs::path(out_dir) / "config.json").string());
    out << saved.to_json().dump(2) << "\n";
  }
  std::vector<TensorToWrite> files;
  for (const auto& spec : checkpoint_tensors(config)) {
    const Tensor tensor = random_tensor(config, spec, seed);
    TensorToWrite entry{spec.name, DType::kF32, spec.shape, {}};
    if (spec.role == TensorRole::kHashTable) {  // int64, as HF keeps tid2eid
      entry.dtype = DType::kI64;
      entry.bytes.resize(tensor.data.size() * sizeof(int64_t));
      for (size_t i = 0; i < tensor.data.size(); ++i) {
        const auto id = static_cast<int64_t>(tensor.data[i]);
        std::memcpy(&entry.bytes[i * sizeof(int64_t)], &id, sizeof id);
      }
    } else if (dtype == StorageDType::kBF16) {
      entry.dtype = DType::kBF16;
      entry.bytes.resize(tensor.data.size() * 2);
      ThreadPool::global().parallel_for(static_cast<int64_t>(tensor.data.size()), [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          const uint16_t bits = f32_to_bf16(tensor.data[static_cast<size_t>(i)]);
          std::memcpy(&entry.bytes[static_cast<size_t>(i) * 2], &bits, 2);
        }
      }, kFillGrain);
    } else {
      entry.bytes.resize(tensor.data.size() * sizeof(float));
      std::memcpy(entry.bytes.data(), tensor.data.data(), entry.bytes.size());
    }
    files.push_back(std::move(entry));
  }
  write_safetensors((fs::path(out_dir) / "model.safetensors").string(), files);
  if (!tokenizer_path.empty()) copy_tokenizer(tokenizer_path, out_dir);
}

}  // namespace dsv4
