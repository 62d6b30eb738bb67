// DeepSeek's FP4 (e2m1) simulation on the device, shared by the indexer's query path (hadamard_fp4.cu) and the
// index keys of the compressor (compressor.cu, kBf16DeepSeekIndex): the twins of ops/cpu/quantize.cpp e2m1_round
// and ue8m0_scale(amax, 6, 6·2^-126).
#pragma once
#include <cstdint>

namespace dsv4::ops::cuda {

// Round to nearest even on the grid {0, 0.5, 1, 1.5, 2, 3, 4, 6}, saturating; NaN stays NaN.
__device__ inline float e2m1_round(float x) {
  if (x != x) return x;
  const float magnitude = fabsf(x);
  const float quantum = magnitude >= 1.0f ? ldexpf(1.0f, ilogbf(magnitude) - 1) : 0.5f;
  const float rounded = fminf(rintf(magnitude / quantum) * quantum, 6.0f);  // x / 2^k is exact
  return copysignf(rounded, x);
}

// 2^ceil(log2(max(amax, 6·2^-126) / 6)), the ceil-log2 read off the quotient's bits.
__device__ inline float e2m1_block_scale(float amax) {
  const float ratio = __fdiv_rn(fmaxf(amax, 6.0f * ldexpf(1.0f, -126)), 6.0f);
  const uint32_t bits = __float_as_uint(ratio);
  const int exponent = static_cast<int>((bits >> 23) & 0xffu) - 127;
  return ldexpf(1.0f, exponent + ((bits & 0x7fffffu) != 0 ? 1 : 0));
}

}  // namespace dsv4::ops::cuda
