#include "model/cuda/device_expert_requantizer.h"

#include <cuda_runtime.h>

#include <cmath>
#include <vector>

#include "core/error.h"
#include "ops/cuda/weight_quantize.h"

namespace dsv4 {

#define DSV4_CU(call) check_load_cuda((call), "requantizing the routed experts", #call)

DeviceExpertRequantizer::DeviceExpertRequantizer(WeightEncoding target, int device)
    : target_(target), device_(device), scratch_(device) {
  DSV4_CHECK(target == WeightEncoding::kQ3G32 || target == WeightEncoding::kQ2G32,
             "the experts' requantization target must be kQ3G32 or kQ2G32");
  DSV4_CU(cudaSetDevice(device_));
}

LinearWeight DeviceExpertRequantizer::requantize_on_device(const float* values, int64_t rows, int64_t cols) {
  DSV4_CHECK(cols % 32 == 0, "cannot requantize a [" + std::to_string(rows) + ", " + std::to_string(cols) +
                                 "] weight in groups of 32 columns");
  const int bits = target_ == WeightEncoding::kQ3G32 ? 3 : 2;
  const int64_t groups = rows * (cols / 32), code_bytes = groups * 4 * bits;
  auto* codes = static_cast<uint8_t*>(scratch_.get("requantized_codes", static_cast<size_t>(code_bytes)));
  auto* scale_bits =
      static_cast<uint16_t*>(scratch_.get("requantized_scales", static_cast<size_t>(groups) * 2));
  DSV4_CU(ops::cuda::quantize_low_bit_groups(values, rows, cols, bits, codes, scale_bits, nullptr));
  std::vector<uint8_t> host_codes(static_cast<size_t>(code_bytes));
  std::vector<uint16_t> host_scales(static_cast<size_t>(groups));
  DSV4_CU(cudaMemcpy(host_codes.data(), codes, host_codes.size(), cudaMemcpyDeviceToHost));
  DSV4_CU(cudaMemcpy(host_scales.data(), scale_bits, host_scales.size() * 2, cudaMemcpyDeviceToHost));
  return LinearWeight::low_bit_grouped(target_, rows, cols, std::move(host_codes), std::move(host_scales));
}

LinearWeight DeviceExpertRequantizer::requantize(const LinearWeight& weight) {
  DSV4_CU(cudaSetDevice(device_));
  const int64_t rows = weight.rows(), cols = weight.cols();
  DSV4_CHECK(cols % 32 == 0, "cannot requantize a " + weight.shape_string() + " weight in groups of 32 columns");
  auto* values =
      static_cast<float*>(scratch_.get("requantize_values", static_cast<size_t>(rows * cols) * sizeof(float)));
  if (weight.encoding() == WeightEncoding::kFp4E2M1) {
    // 4.25 bits a value over the bus instead of 32; the device decode is exact, as dequantize_rows.
    const std::vector<uint8_t>& packed = weight.codes();
    const std::vector<uint8_t>& exponents = weight.fp4_exponents();
    std::vector<float> scales(exponents.size());
    for (size_t i = 0; i < scales.size(); ++i) scales[i] = std::ldexp(1.0f, static_cast<int>(exponents[i]) - 127);
    auto* device_packed = static_cast<uint8_t*>(scratch_.get("requantize_packed", packed.size()));
    auto* device_scales =
        static_cast<float*>(scratch_.get("requantize_fp4_scales", scales.size() * sizeof(float)));
    DSV4_CU(cudaMemcpy(device_packed, packed.data(), packed.size(), cudaMemcpyHostToDevice));
    DSV4_CU(cudaMemcpy(device_scales, scales.data(), scales.size() * sizeof(float), cudaMemcpyHostToDevice));
    DSV4_CU(ops::cuda::dequantize_mxfp4_groups(device_packed, device_scales, rows, cols, values, nullptr));
  } else {
    const Tensor dense = weight.dequantized();
    DSV4_CU(cudaMemcpy(values, dense.ptr(), dense.data.size() * sizeof(float), cudaMemcpyHostToDevice));
  }
  return requantize_on_device(values, rows, cols);
}

DeviceRequantizedExpertsSource::DeviceRequantizedExpertsSource(std::unique_ptr<ModelWeightSource> source,
                                                               WeightEncoding expert_encoding, int device)
    : source_(std::move(source)), requantizer_(expert_encoding, device) {}

LayerWeights DeviceRequantizedExpertsSource::layer(int64_t index) {
  LayerWeights layer = source_->layer(index);
  for (auto* experts : {&layer.experts_w13, &layer.experts_w2})
    for (LinearWeight& w : *experts) w = requantizer_.requantize(w);
  return layer;
}

}  // namespace dsv4
