// Storage dtypes of checkpoint tensors and their conversion to fp32 (the CPU backend computes in fp32).
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>

#include "core/host_device.h"

namespace dsv4 {

enum class DType { kF32, kF16, kBF16, kI64, kI32, kF8E4M3, kF8E8M0, kI8, kU8 };

// Name as safetensors writes it ("F32", "BF16", "F8_E4M3", ...).
std::string_view dtype_name(DType dtype);
std::optional<DType> dtype_from_name(std::string_view name);
size_t dtype_size(DType dtype);

DSV4_HOST_DEVICE inline float bf16_to_f32(uint16_t bits) {
  uint32_t word = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof value);
  return value;
}

// Round-to-nearest-even, NaN kept quiet (matches torch's float -> bfloat16 cast).
DSV4_HOST_DEVICE inline uint16_t f32_to_bf16(float value) {
  uint32_t word;
  std::memcpy(&word, &value, sizeof word);
  if ((word & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((word >> 16) | 0x40);
  word += 0x7fffu + ((word >> 16) & 1u);
  return static_cast<uint16_t>(word >> 16);
}

// v rounded to the nearest bf16, as an fp32 value: where DeepSeek's reference holds a bf16 tensor (one copy for
// the CPU recipe and the device kernels).
DSV4_HOST_DEVICE inline float bf16_round(float v) { return bf16_to_f32(f32_to_bf16(v)); }

float f16_to_f32(uint16_t bits);
// OCP FP8 E4M3 (finite-only, 0x7f/0xff are NaN), as torch.float8_e4m3fn.
float f8e4m3_to_f32(uint8_t bits);
// UE8M0 scale byte: 2^(bits - 127); 0xff is NaN.
float e8m0_to_f32(uint8_t bits);

// Converts `count` elements of `dtype` at `src` to fp32. Integer dtypes are converted by value.
void convert_to_f32(DType dtype, const void* src, size_t count, float* dst);

}  // namespace dsv4
