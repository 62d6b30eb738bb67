// Random-weight DeepSeek-V4 models: the embedded default model and `dsv4 init-random`. Every tensor gets a
// random value, also those HF initialises to zero or one (sinks, position bias, router bias, mHC base/scale),
// so tests exercise every term; hash tables get distinct experts per row.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/random_fill.h"
#include "core/tensor.h"
#include "model/model_config.h"
#include "model/weights.h"

namespace dsv4 {

// Tensors keyed by on-disk name, deterministic in (config, seed) on every platform.
std::vector<std::pair<std::string, Tensor>> random_tensors(const ModelConfig& config, uint64_t seed);
// How random_tensors draws the tensor of `spec` (core/random_fill.h; the device generator of
// model/cuda/device_random_weights.h draws the same); nullopt for the integer hash table.
std::optional<RandomFill> random_fill(const TensorSpec& spec, uint64_t seed);
// One tensor of random_tensors, the hash table included.
Tensor random_tensor(const ModelConfig& config, const TensorSpec& spec, uint64_t seed);
// The same values as fp32 weights in memory (the embedded default model, tests, benchmarks).
ModelWeights random_weights(const ModelConfig& config, uint64_t seed);

// The same tensors again (names, values), generated a piece at a time when asked for: a random model of any
// size with host memory for one layer (`--load-format dummy` on the GPU backend). A config with
// ModelConfig::fp8_block_weights gets the projections the release stores FP8 in its FP8 layout
// (LinearWeight::quantize_fp8_blocks of the same values), one with fp4_routed_experts the routed experts as
// MXFP4 (LinearWeight::quantize_mxfp4_groups).
class RandomWeightSource final : public ModelWeightSource {
 public:
  RandomWeightSource(ModelConfig config, uint64_t seed);
  const ModelConfig& config() const override { return config_; }
  ModelWeights globals() override;
  LayerWeights layer(int64_t index) override;

 private:
  Tensor generate(const std::string& name) const;

  ModelConfig config_;
  uint64_t seed_;
  std::map<std::string, TensorSpec> specs_;  // checkpoint_tensors(config_) by name
};

enum class StorageDType { kF32, kBF16 };

// Writes an HF model directory: config.json and model.safetensors (on-disk names), plus tokenizer.json /
// tokenizer_config.json copied from `tokenizer_path` (a tokenizer.json file or a directory holding it) if given.
void write_random_model(const ModelConfig& config, uint64_t seed, StorageDType dtype, const std::string& out_dir,
                        const std::string& tokenizer_path = "");

}  // namespace dsv4
