// RMSNorm: y = weight ⊙ x · rsqrt(mean(x²) + eps), fp32 (transformers DeepseekV4RMSNorm; weight = nullptr
// is DeepseekV4UnweightedRMSNorm, used for the per-head query norm and the mHC input norm).
#pragma once
#include <cstdint>

namespace dsv4::ops::cpu {

// x [rows, dim] (row stride `stride`) -> y (same layout; y == x allowed).
void rms_norm(const float* x, int64_t rows, int64_t dim, int64_t stride, const float* weight, float eps, float* y);

}  // namespace dsv4::ops::cpu
