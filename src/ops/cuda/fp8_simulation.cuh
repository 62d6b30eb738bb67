// DeepSeek's e4m3 block quantization on the device (research model_spec.md §3.2, §3.3), shared by the activation
// quantizer and its in-place simulation (fp8_quantize.cu) and the compressor's kBf16DeepSeekMain entries: the twins
// of ops/cpu/quantize.cpp ue8m0_scale(amax, 448, 1e-4) and e4m3_round. The includer provides <cuda_fp8.h>'s
// __nv_cvt_float_to_fp8 (the host emulation maps it to core's f32_to_e4m3_rne).
#pragma once
#include <cmath>
#include <cstdint>

#include "core/weight_quantizer.h"

namespace dsv4::ops::cuda {

inline constexpr float kE4m3Largest = 448.0f;

// 2^ceil(log2(max(amax, 1e-4) / 448)), the ceil-log2 read off the fp32 quotient's exponent and mantissa bits; +inf
// past fp32's range.
__device__ inline float e4m3_block_scale(float amax) {
  const uint32_t bits = __float_as_uint(__fdiv_rn(fmaxf(amax, 1e-4f), kE4m3Largest));
  const int exponent = static_cast<int>((bits >> 23) & 0xffu) - 127 + ((bits & 0x7fffffu) != 0 ? 1 : 0);
  return exponent <= 127 ? __uint_as_float(static_cast<uint32_t>(exponent + 127) << 23) : INFINITY;
}

// The e4m3 code of v / scale: IEEE division by the power-of-two scale, clamp to ±448 (NaN passes through, as
// std::clamp lets it), round to nearest even with saturation (the hardware cvt.rn.satfinite).
__device__ inline uint32_t e4m3_scaled_code(float v, float scale) {
  float q = __fdiv_rn(v, scale);
  if (q == q) q = fminf(fmaxf(q, -kE4m3Largest), kE4m3Largest);
  return static_cast<uint32_t>(__nv_cvt_float_to_fp8(q, __NV_SATFINITE, __NV_E4M3));
}

// v through the e4m3 round trip at `scale`: its code's value times the scale (exact), NaN for the NaN code.
__device__ inline float e4m3_simulate(float v, float scale) {
  const uint32_t code = e4m3_scaled_code(v, scale);
  if ((code & 0x7fu) == 0x7fu) return NAN;
  const float magnitude = quantizer::e4m3_magnitude(static_cast<int>(code & 0x7fu));
  return __fmul_rn((code & 0x80u) != 0 ? -magnitude : magnitude, scale);
}

}  // namespace dsv4::ops::cuda
