// --expert-bits on the GPU: the routed experts requantized to kQ3G32 / kQ2G32 by the device twins of
// LinearWeight::requantized (ops/cuda/weight_quantize.h, bitwise the host's). The host pass costs 0.76 s of a
// core per V4-Flash expert matrix (2048 × 4096 from MXFP4, measured on the CPU machine), so the release's 33K
// of them take ~26 minutes of 16 cores; here each is two copies and two kernels.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "core/linear_weight.h"
#include "model/cuda/device_scratch.h"
#include "model/weights.h"

namespace dsv4 {

class DeviceExpertRequantizer {
 public:
  // `target`: kQ3G32 or kQ2G32 (dsv4::Error otherwise, or when `device` is not usable).
  DeviceExpertRequantizer(WeightEncoding target, int device = 0);
  DeviceExpertRequantizer(const DeviceExpertRequantizer&) = delete;
  DeviceExpertRequantizer& operator=(const DeviceExpertRequantizer&) = delete;

  // weight.requantized(target), bitwise: MXFP4 is decoded on the device, other encodings on the host.
  LinearWeight requantize(const LinearWeight& weight);
  // The fp32 [rows, cols] matrix at device address `values` (left unchanged) in the target encoding.
  LinearWeight requantize_on_device(const float* values, int64_t rows, int64_t cols);

 private:
  WeightEncoding target_;
  int device_;
  DeviceScratch scratch_;
};

// RequantizedExpertsSource with the requantization on the GPU: the same layers, bit for bit.
class DeviceRequantizedExpertsSource final : public ModelWeightSource {
 public:
  DeviceRequantizedExpertsSource(std::unique_ptr<ModelWeightSource> source, WeightEncoding expert_encoding,
                                 int device = 0);
  const ModelConfig& config() const override { return source_->config(); }
  ModelWeights globals() override { return source_->globals(); }
  LayerWeights layer(int64_t index) override;

 private:
  std::unique_ptr<ModelWeightSource> source_;
  DeviceExpertRequantizer requantizer_;
};

}  // namespace dsv4
