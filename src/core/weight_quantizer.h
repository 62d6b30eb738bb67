// The weight quantizers' arithmetic, one copy for the host (core/linear_weight.cpp: LinearWeight's
// quantize_fp8_blocks, quantize_mxfp4_groups, requantized) and the device (ops/cuda/weight_quantize.h, the
// GPU-side dummy weights): the same IEEE operations in the same order on both sides (the device's products
// and sums spelt as __fmul_rn / __fadd_rn so nvcc cannot fuse them), so a code or scale never depends on
// where it was computed.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/dtype.h"
#include "core/host_device.h"

namespace dsv4::quantizer {

DSV4_HOST_DEVICE inline float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
DSV4_HOST_DEVICE inline float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
DSV4_HOST_DEVICE inline float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
DSV4_HOST_DEVICE inline float bits_to_float(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// The non-negative e4m3 values, code 0..126 (126 = 448): m · 2^-9 below the first binade, (8 + m) · 2^(e − 10)
// above (OCP FP8 E4M3, as f8e4m3_to_f32).
DSV4_HOST_DEVICE inline float e4m3_magnitude(int code) {
  const int exponent = code >> 3, mantissa = code & 7;
  if (exponent == 0) return static_cast<float>(mantissa) * 0x1p-9f;  // exact
  return bits_to_float(static_cast<uint32_t>(exponent + 120) << 23 | static_cast<uint32_t>(mantissa) << 20);
}
// The non-negative e2m1 values, code 0..7: {0, 0.5, 1, 1.5, 2, 3, 4, 6} (research/model_spec.md §2.1).
DSV4_HOST_DEVICE inline float e2m1_magnitude(int code) {
  if (code < 2) return static_cast<float>(code) * 0.5f;
  return bits_to_float(static_cast<uint32_t>((code >> 1) + 126) << 23 | static_cast<uint32_t>(code & 1) << 22);
}

struct E4m3Grid {
  DSV4_HOST_DEVICE float operator()(int code) const { return e4m3_magnitude(code); }
};
struct E2m1Grid {
  DSV4_HOST_DEVICE float operator()(int code) const { return e2m1_magnitude(code); }
};

// The code of a magnitude on a grid whose values ascend with the code (e4m3: codes 0..126, e2m1: 0..7): round to
// nearest, ties to the even code (the even mantissa), saturating at `last`. Binary search.
template <typename Magnitude>
DSV4_HOST_DEVICE int nearest_code(Magnitude value_of, int last, float magnitude) {
  const float top = value_of(last);
  magnitude = magnitude < top ? magnitude : top;
  int lo = 0, hi = last;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    (value_of(mid) <= magnitude ? lo : hi) = mid;
  }
  const float to_below = sub_rn(magnitude, value_of(lo)), to_above = sub_rn(value_of(hi), magnitude);
  return to_below < to_above ? lo : to_above < to_below ? hi : (lo % 2 == 0 ? lo : hi);
}

DSV4_HOST_DEVICE inline bool sign_bit(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return (bits >> 31) != 0;
}

// v (finite, |v| ≤ 448 after the block scale) to its e4m3 code; sign in bit 7, a zero code unsigned.
DSV4_HOST_DEVICE inline uint8_t e4m3_code(float v) {
  const int code = nearest_code(E4m3Grid{}, 126, fabsf(v));
  return static_cast<uint8_t>(code | (sign_bit(v) && code != 0 ? 0x80 : 0));
}

// v (|v| ≤ 6 after the group scale) to its e2m1 code; sign in bit 3, a zero code unsigned.
DSV4_HOST_DEVICE inline uint8_t e2m1_code(float v) {
  const int code = nearest_code(E2m1Grid{}, 7, fabsf(v));
  return static_cast<uint8_t>(code | (sign_bit(v) && code != 0 ? 8 : 0));
}

// The UE8M0 scale of a block whose values must fit ±max_code: 2^ceil(log2(amax / max_code)) (frexp gives
// amax / max_code = m · 2^e with m in [0.5, 1); m = 0.5 is the exact power 2^(e − 1)).
DSV4_HOST_DEVICE inline float ue8m0_scale_for(float amax, float max_code) {
  int exponent = 0;
#if defined(__CUDA_ARCH__)
  const float mantissa = frexpf(amax / max_code, &exponent);
  return ldexpf(1.0f, mantissa == 0.5f ? exponent - 1 : exponent);
#else
  const float mantissa = std::frexp(amax / max_code, &exponent);
  return std::ldexp(1.0f, mantissa == 0.5f ? exponent - 1 : exponent);
#endif
}

// The FP8 block quantizer's floor on a block's amax, and the MXFP4 group quantizer's (the recipe's floors,
// ops/cpu/quantize.h).
inline constexpr float kFp8AmaxFloor = 1e-4f;
inline constexpr float kMxfp4AmaxFloor = 6.0f * 0x1p-126f;

// One MXFP4 group of 32 values: its UE8M0 scale and 16 packed bytes (the even element in the low nibble).
DSV4_HOST_DEVICE inline float quantize_mxfp4_group(const float* values, uint8_t* packed) {
  float amax = kMxfp4AmaxFloor;
  for (int i = 0; i < 32; ++i) amax = fabsf(values[i]) > amax ? fabsf(values[i]) : amax;
  const float scale = ue8m0_scale_for(amax, 6.0f);
  for (int i = 0; i < 32; i += 2)
    packed[i / 2] = static_cast<uint8_t>(e2m1_code(values[i] / scale) | e2m1_code(values[i + 1] / scale) << 4);
  return scale;
}

// The grouped low-bit formats kQ3G32 / kQ2G32 (core/linear_weight.h): bits per code; the level of code c is
// (c − offset)·s.
struct LowBitFormat {
  int bits;
  float offset;
  DSV4_HOST_DEVICE int group_bytes() const { return 32 * bits / 8; }
  DSV4_HOST_DEVICE int codes() const { return 1 << bits; }
  DSV4_HOST_DEVICE float max_level() const { return static_cast<float>(codes() - 1) - offset; }  // 3 / 1.5
};
inline constexpr LowBitFormat kQ3Format{3, 4.0f};
inline constexpr LowBitFormat kQ2Format{2, 1.5f};

// Code i (0..31) of one group's little-endian bit stream of 4·bits bytes.
DSV4_HOST_DEVICE inline int group_code(const uint8_t* group, int bits, int i) {
  const int bit = i * bits;
  const unsigned word = group[bit / 8] | (bit / 8 + 1 < 4 * bits ? unsigned{group[bit / 8 + 1]} << 8 : 0u);
  return static_cast<int>((word >> (bit % 8)) & ((1u << bits) - 1));
}
DSV4_HOST_DEVICE inline void write_group_code(uint8_t* group, int bits, int i, int code) {
  const int bit = i * bits;
  const unsigned shifted = static_cast<unsigned>(code) << (bit % 8);
  group[bit / 8] |= static_cast<uint8_t>(shifted & 0xff);
  if (shifted >> 8) group[bit / 8 + 1] |= static_cast<uint8_t>(shifted >> 8);
}

// The nearest level's code, clamped in float before the conversion: a float → int conversion out of range is
// undefined in C++ and differs in practice (x86 gives INT_MIN, CUDA saturates), so it must never happen.
DSV4_HOST_DEVICE inline int low_bit_code(float x, float scale, LowBitFormat format) {
  const float level = floorf(add_rn(add_rn(x / scale, format.offset), 0.5f));
  const float top = static_cast<float>(format.codes() - 1);
  return !(level >= 0.0f) ? 0 : level > top ? static_cast<int>(top) : static_cast<int>(level);
}

// One group of 32 values: the bf16 scale and codes of least squared error (nearest level per value) among the
// candidates s = amax / k, k from 1 to 1.5 times the largest level magnitude (the clipping trade-off: a
// smaller scale resolves the bulk better and saturates the few largest values).
DSV4_HOST_DEVICE inline void quantize_low_bit_group(const float* x, LowBitFormat format, uint16_t* scale_bits,
                                                    uint8_t* group) {
  float amax = 0.0f;
  for (int i = 0; i < 32; ++i) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
  for (int b = 0; b < format.group_bytes(); ++b) group[b] = 0;
  if (amax == 0.0f) {
    *scale_bits = 0;
    return;
  }
  // Largest level magnitude: 4 for Q3 (−4 … 3), 1.5 for Q2.
  const float reach = format.offset > format.max_level() ? format.offset : format.max_level();
  bool found = false;
  float best_error = 0.0f, best_scale = 0.0f;
  constexpr int kCandidates = 16;
  for (int candidate = 0; candidate < kCandidates; ++candidate) {
    const float k = mul_rn(reach, add_rn(1.0f, mul_rn(0.5f, static_cast<float>(candidate)) / (kCandidates - 1)));
    const float scale = bf16_to_f32(f32_to_bf16(amax / k));
    if (scale == 0.0f) continue;
    float error = 0.0f;
    for (int i = 0; i < 32; ++i) {
      const int code = low_bit_code(x[i], scale, format);
      const float d = sub_rn(x[i], mul_rn(static_cast<float>(code) - format.offset, scale));
      error = add_rn(error, mul_rn(d, d));
    }
    if (!found || error < best_error) {  // the first candidate even at an overflowing (inf) error
      found = true;
      best_error = error;
      best_scale = scale;
    }
  }
  // No candidate scale survives the bf16 rounding (amax below ~2^-133 flushes to zero): the group decodes to
  // zeros, with zero codes.
  *scale_bits = f32_to_bf16(best_scale);
  if (!found) return;
  for (int i = 0; i < 32; ++i) write_group_code(group, format.bits, i, low_bit_code(x[i], best_scale, format));
}

}  // namespace dsv4::quantizer
