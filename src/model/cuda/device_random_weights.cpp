#include "model/cuda/device_random_weights.h"

#include <cuda_runtime.h>

#include "core/error.h"
#include "model/random_init.h"
#include "ops/cuda/random_fill.h"
#include "ops/cuda/weight_quantize.h"

namespace dsv4 {
namespace {

#define DSV4_CU(call) check_load_cuda((call), "drawing the dummy weights", #call)

int64_t element_count(const std::vector<int64_t>& shape) {
  int64_t count = 1;
  for (const int64_t extent : shape) count *= extent;
  return count;
}

bool routed_expert(const std::string& name) { return name.find(".ffn.experts.") != std::string::npos; }

}  // namespace

DeviceRandomWeightSource::DeviceRandomWeightSource(ModelConfig config, uint64_t seed,
                                                   std::optional<WeightEncoding> expert_encoding, int device)
    : config_(std::move(config)), seed_(seed), expert_encoding_(expert_encoding), device_(device), scratch_(device) {
  for (const auto& spec : checkpoint_tensors(config_)) specs_.emplace(spec.name, spec);
  DSV4_CU(cudaSetDevice(device_));
  if (expert_encoding_) requantizer_ = std::make_unique<DeviceExpertRequantizer>(*expert_encoding_, device_);
}

DeviceRandomWeightSource::~DeviceRandomWeightSource() = default;

const TensorSpec& DeviceRandomWeightSource::draw(const std::string& name) {
  const TensorSpec& spec = specs_.at(name);
  const std::optional<RandomFill> fill = random_fill(spec, seed_);
  DSV4_CHECK(fill.has_value(), name + " is not drawn from a distribution");
  const int64_t count = element_count(spec.shape);
  auto* values = static_cast<float*>(scratch_.get("values", static_cast<size_t>(count) * sizeof(float)));
  DSV4_CU(ops::cuda::fill_random(*fill, values, count, nullptr));
  return spec;
}

Tensor DeviceRandomWeightSource::generate(const std::string& name) {
  const TensorSpec& spec = specs_.at(name);
  if (spec.role == TensorRole::kHashTable) return random_tensor(config_, spec, seed_);
  draw(name);
  Tensor tensor(spec.shape);
  DSV4_CU(cudaMemcpy(tensor.ptr(), scratch_.existing("values"), tensor.data.size() * sizeof(float),
                     cudaMemcpyDeviceToHost));
  return tensor;
}

LinearWeight DeviceRandomWeightSource::generate_expert(const std::string& name) {
  if (!config_.fp4_routed_experts && !expert_encoding_) return LinearWeight(generate(name));
  const TensorSpec& spec = draw(name);
  const int64_t rows = spec.shape[0], cols = spec.shape[1], groups = rows * (cols / 32);
  DSV4_CHECK(cols % 32 == 0, name + ": " + std::to_string(cols) + " columns do not split into groups of 32");
  auto* values = static_cast<float*>(scratch_.existing("values"));
  if (config_.fp4_routed_experts) {  // the release's MXFP4 (RandomWeightSource::layer)
    auto* packed = static_cast<uint8_t*>(scratch_.get("mxfp4_codes", static_cast<size_t>(rows * cols / 2)));
    auto* scales = static_cast<float*>(scratch_.get("mxfp4_scales", static_cast<size_t>(groups) * sizeof(float)));
    DSV4_CU(ops::cuda::quantize_mxfp4_groups(values, rows, cols, packed, scales, nullptr));
    if (!expert_encoding_) {
      std::vector<uint8_t> host_packed(static_cast<size_t>(rows * cols / 2));
      std::vector<float> host_scales(static_cast<size_t>(groups));
      DSV4_CU(cudaMemcpy(host_packed.data(), packed, host_packed.size(), cudaMemcpyDeviceToHost));
      DSV4_CU(cudaMemcpy(host_scales.data(), scales, host_scales.size() * sizeof(float), cudaMemcpyDeviceToHost));
      return LinearWeight::fp4_group_scaled(rows, cols, std::move(host_packed), host_scales, name);
    }
    // --expert-bits requantizes what the checkpoint holds: the MXFP4 values (RequantizedExpertsSource).
    DSV4_CU(ops::cuda::dequantize_mxfp4_groups(packed, scales, rows, cols, values, nullptr));
  }
  return requantizer_->requantize_on_device(values, rows, cols);
}

ModelWeights DeviceRandomWeightSource::globals() {
  DSV4_CU(cudaSetDevice(device_));
  return assemble_global_weights([this](const std::string& name) { return generate(name); });
}

LayerWeights DeviceRandomWeightSource::layer(int64_t index) {
  DSV4_CHECK(index >= 0 && index < config_.num_hidden_layers,
             "layer " + std::to_string(index) + " outside the config's " + std::to_string(config_.num_hidden_layers) +
                 " layers");
  DSV4_CU(cudaSetDevice(device_));
  LayerWeights layer = assemble_layer_weights(
      config_, index, [this](const std::string& name) { return generate(name); },
      [this](const std::string& name) {
        return routed_expert(name) ? generate_expert(name) : LinearWeight(generate(name));
      });
  if (config_.fp8_block_weights)  // as RandomWeightSource::layer: the projections the release stores FP8
    for (LinearWeight* w : {&layer.wq_a, &layer.wq_b, &layer.wkv, &layer.wo_b, &layer.indexer_wq_b,
                            &layer.shared_w13, &layer.shared_w2})
      if (!w->empty()) *w = LinearWeight::quantize_fp8_blocks(w->dense());
  return layer;
}

}  // namespace dsv4
