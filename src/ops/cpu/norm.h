// RMSNorm: y = weight ⊙ x · rsqrt(mean(x²) + eps), fp32 (transformers DeepseekV4RMSNorm; weight = nullptr
// is DeepseekV4UnweightedRMSNorm, used for the per-head query norm and the mHC input norm).
#pragma once
#include <cstdint>

namespace dsv4::ops::cpu {

// x [rows, dim] (row stride `stride`) -> y (same layout; y == x allowed).
void rms_norm(const float* x, int64_t rows, int64_t dim, int64_t stride, const float* weight, float eps, float* y);

// Numerics::kDeepSeek's per-head query norm, in place on q [rows, dim]: model.py's
// `q *= rsqrt(q.square().mean(-1) + eps)` on a bf16 tensor (research model_spec.md §6.1 step 3) — every
// intermediate rounded to bf16, the mean accumulated in fp32.
void head_rms_norm_bf16(float* q, int64_t rows, int64_t dim, float eps);

}  // namespace dsv4::ops::cpu
