#include "ops/cpu/norm.h"

#include <cmath>

#include "core/dtype.h"

namespace dsv4::ops::cpu {

void rms_norm(const float* x, int64_t rows, int64_t dim, int64_t stride, const float* weight, float eps, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * stride;
    float* out = y + r * stride;
    double sum = 0.0;  // double accumulation: order-independent to well below fp32 resolution
    for (int64_t i = 0; i < dim; ++i) sum += static_cast<double>(row[i]) * row[i];
    const float scale = 1.0f / std::sqrt(static_cast<float>(sum / static_cast<double>(dim)) + eps);
    if (weight) {
      for (int64_t i = 0; i < dim; ++i) out[i] = weight[i] * (row[i] * scale);
    } else {
      for (int64_t i = 0; i < dim; ++i) out[i] = row[i] * scale;
    }
  }
}

void head_rms_norm_bf16(float* q, int64_t rows, int64_t dim, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = q + r * dim;
    float sum = 0;
    for (int64_t i = 0; i < dim; ++i) sum += bf16_round(row[i] * row[i]);
    const float mean = bf16_round(sum / static_cast<float>(dim));
    const float inv = bf16_round(1.0f / std::sqrt(bf16_round(mean + eps)));
    for (int64_t i = 0; i < dim; ++i) row[i] = bf16_round(row[i] * inv);
  }
}

}  // namespace dsv4::ops::cpu
