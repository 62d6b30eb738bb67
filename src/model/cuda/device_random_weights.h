// --load-format dummy on the CUDA backend: RandomWeightSource's model (model/random_init.h — the same tensors,
// values and layouts) with its values drawn on the GPU (ops/cuda/random_fill.h) and the routed experts
// quantized there (ops/cuda/weight_quantize.h). The host generator draws 17 M values/s per core (CPU
// machine), so V4-Flash's 284 B parameters are ~17 minutes of 16 cores before the MXFP4 quantization and the
// --expert-bits requantization (0.76 core-s per expert matrix, 33K of them: ~26 more); on the device a layer is
// drawn and quantized in under 3 s, most of it the copies back (docs/PERF.md), and only the encoded experts come
// back to the host (2.5–4.25 bits a value instead of 32).
//
// The values equal the host's up to the last ulp of glibc's and CUDA's double log / cos (core/random_fill.h:
// about one element in 10^8 differs, by one fp32 ulp); the quantizers are bitwise the host's
// (core/weight_quantizer.h). The FP8 projections of a config with fp8_block_weights are quantized on the host
// after assembly, as RandomWeightSource does (they are 2 % of V4-Flash and w1 ‖ w3 blocks straddle the seam).
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "core/linear_weight.h"
#include "model/cuda/device_expert_requantizer.h"
#include "model/cuda/device_scratch.h"
#include "model/weights.h"

namespace dsv4 {

class DeviceRandomWeightSource final : public ModelWeightSource {
 public:
  // `expert_encoding`: the --expert-bits requantization of the routed experts (kQ3G32 / kQ2G32), applied as
  // RequantizedExpertsSource does (to the MXFP4 values when the config stores the experts so), on the device
  // (model/cuda/device_expert_requantizer.h). `device`: the CUDA device to draw on. Throws dsv4::Error when it
  // is not usable or the encoding is another.
  DeviceRandomWeightSource(ModelConfig config, uint64_t seed, std::optional<WeightEncoding> expert_encoding = {},
                           int device = 0);
  ~DeviceRandomWeightSource() override;
  DeviceRandomWeightSource(const DeviceRandomWeightSource&) = delete;
  DeviceRandomWeightSource& operator=(const DeviceRandomWeightSource&) = delete;

  const ModelConfig& config() const override { return config_; }
  ModelWeights globals() override;
  LayerWeights layer(int64_t index) override;

 private:
  // The fp32 tensor of `name` (drawn on the device, copied back; the hash table drawn on the host).
  Tensor generate(const std::string& name);
  // A routed expert's matrix in the encoding the model holds it in.
  LinearWeight generate_expert(const std::string& name);
  // The tensor of `name` drawn into the device scratch; returns its spec.
  const TensorSpec& draw(const std::string& name);

  ModelConfig config_;
  uint64_t seed_;
  std::optional<WeightEncoding> expert_encoding_;
  int device_;
  std::map<std::string, TensorSpec> specs_;  // checkpoint_tensors(config_) by name
  DeviceScratch scratch_;  // device buffers, grown to the largest tensor
  std::unique_ptr<DeviceExpertRequantizer> requantizer_;  // with expert_encoding_
};

}  // namespace dsv4
