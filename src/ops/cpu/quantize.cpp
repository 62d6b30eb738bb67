#include "ops/cpu/quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/dtype.h"

namespace dsv4::ops::cpu {
namespace {

// Rounds |x| to a multiple of `quantum` (a power of two, so x / quantum is exact), ties to even (the default
// floating-point rounding mode of nearbyint).
float round_to_quantum(float magnitude, float quantum) { return std::nearbyint(magnitude / quantum) * quantum; }

}  // namespace

float e4m3_round(float x) {
  if (std::isnan(x)) return x;
  const float magnitude = std::fabs(x);
  // e4m3: 3 mantissa bits, smallest normal 2^-6, subnormal step 2^-9.
  float quantum = std::ldexp(1.0f, -9);
  if (magnitude >= std::ldexp(1.0f, -6)) quantum = std::ldexp(1.0f, std::ilogb(magnitude) - 3);
  const float rounded = std::min(round_to_quantum(magnitude, quantum), kE4m3Max);
  return std::copysign(rounded, x);
}

float e2m1_round(float x) {
  if (std::isnan(x)) return x;
  const float magnitude = std::fabs(x);
  // e2m1: 1 mantissa bit, smallest normal 1, subnormal step 0.5.
  float quantum = 0.5f;
  if (magnitude >= 1.0f) quantum = std::ldexp(1.0f, std::ilogb(magnitude) - 1);
  const float rounded = std::min(round_to_quantum(magnitude, quantum), kE2m1Max);
  return std::copysign(rounded, x);
}

float ue8m0_scale(float amax, float max_code, float min_amax) {
  const float ratio = std::max(amax, min_amax) / max_code;
  uint32_t bits;
  std::memcpy(&bits, &ratio, sizeof bits);
  const int exponent = static_cast<int>((bits >> 23) & 0xffu) - 127;
  const int ceil_log2 = exponent + ((bits & 0x7fffffu) != 0 ? 1 : 0);
  return std::ldexp(1.0f, ceil_log2);
}

void quantize_e4m3_blocks(float* x, int64_t n, int64_t block) {
  for (int64_t begin = 0; begin < n; begin += block) {
    const int64_t end = std::min(n, begin + block);
    float amax = 0;
    for (int64_t i = begin; i < end; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float scale = ue8m0_scale(amax, kE4m3Max, 1e-4f);
    for (int64_t i = begin; i < end; ++i)
      x[i] = e4m3_round(std::clamp(x[i] / scale, -kE4m3Max, kE4m3Max)) * scale;
  }
}

void quantize_e2m1_blocks(float* x, int64_t n, int64_t block) {
  for (int64_t begin = 0; begin < n; begin += block) {
    const int64_t end = std::min(n, begin + block);
    float amax = 0;
    for (int64_t i = begin; i < end; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float scale = ue8m0_scale(amax, kE2m1Max, kE2m1Max * std::ldexp(1.0f, -126));
    for (int64_t i = begin; i < end; ++i)
      x[i] = e2m1_round(std::clamp(x[i] / scale, -kE2m1Max, kE2m1Max)) * scale;
  }
}

void hadamard_transform(float* x, int64_t n, float scale) {
  // Butterflies in double, one rounding to fp32 (kernel_standin.hadamard_transform, EXACT): for bf16 inputs the
  // double sums are exact unless a row spans more than ~2^38 in magnitude, so this is the correctly rounded H·x.
  std::vector<double> v(x, x + n);
  for (int64_t half = 1; half < n; half *= 2)
    for (int64_t begin = 0; begin < n; begin += 2 * half)
      for (int64_t i = begin; i < begin + half; ++i) {
        const double a = v[i], b = v[i + half];
        v[i] = a + b;
        v[i + half] = a - b;
      }
  for (int64_t i = 0; i < n; ++i) x[i] = static_cast<float>(v[i]) * scale;
}

void round_to_bf16(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = bf16_round(x[i]);
}

void hadamard_fp4(float* x, int64_t n, float scale, int64_t block) {
  round_to_bf16(x, n);
  hadamard_transform(x, n, scale);
  round_to_bf16(x, n);
  quantize_e2m1_blocks(x, n, block);
  round_to_bf16(x, n);
}

}  // namespace dsv4::ops::cpu
