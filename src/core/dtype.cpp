#include "core/dtype.h"

#include <cmath>
#include <limits>

namespace dsv4 {
namespace {
struct DTypeInfo {
  DType dtype;
  std::string_view name;
  size_t size;
};
constexpr DTypeInfo kDTypes[] = {
    {DType::kF32, "F32", 4},   {DType::kF16, "F16", 2},         {DType::kBF16, "BF16", 2},
    {DType::kI64, "I64", 8},   {DType::kI32, "I32", 4},         {DType::kF8E4M3, "F8_E4M3", 1},
    {DType::kF8E8M0, "F8_E8M0", 1}, {DType::kI8, "I8", 1},      {DType::kU8, "U8", 1},
};
}  // namespace

std::string_view dtype_name(DType dtype) {
  for (const auto& info : kDTypes)
    if (info.dtype == dtype) return info.name;
  return "?";
}

std::optional<DType> dtype_from_name(std::string_view name) {
  for (const auto& info : kDTypes)
    if (info.name == name) return info.dtype;
  return std::nullopt;
}

size_t dtype_size(DType dtype) {
  for (const auto& info : kDTypes)
    if (info.dtype == dtype) return info.size;
  return 0;
}

float f16_to_f32(uint16_t bits) {
  const uint32_t sign = (bits >> 15) & 1u, exponent = (bits >> 10) & 0x1fu, mantissa = bits & 0x3ffu;
  float magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -24);
  } else if (exponent == 31) {
    magnitude = mantissa ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else {
    magnitude = std::ldexp(static_cast<float>(mantissa | 0x400u), static_cast<int>(exponent) - 25);
  }
  return sign ? -magnitude : magnitude;
}

float f8e4m3_to_f32(uint8_t bits) {
  const uint32_t sign = bits >> 7, exponent = (bits >> 3) & 0xfu, mantissa = bits & 0x7u;
  float magnitude;
  if (exponent == 0xf && mantissa == 0x7) {
    magnitude = std::numeric_limits<float>::quiet_NaN();
  } else if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -9);  // subnormal: m/8 * 2^-6
  } else {
    magnitude = std::ldexp(static_cast<float>(mantissa | 0x8u), static_cast<int>(exponent) - 10);
  }
  return sign ? -magnitude : magnitude;
}

float e8m0_to_f32(uint8_t bits) {
  if (bits == 0xff) return std::numeric_limits<float>::quiet_NaN();
  return std::ldexp(1.0f, static_cast<int>(bits) - 127);
}

void convert_to_f32(DType dtype, const void* src, size_t count, float* dst) {
  const auto* bytes = static_cast<const uint8_t*>(src);
  switch (dtype) {
    case DType::kF32:
      std::memcpy(dst, src, count * sizeof(float));
      return;
    case DType::kBF16:
      for (size_t i = 0; i < count; ++i) {
        uint16_t bits;
        std::memcpy(&bits, bytes + 2 * i, 2);
        dst[i] = bf16_to_f32(bits);
      }
      return;
    case DType::kF16:
      for (size_t i = 0; i < count; ++i) {
        uint16_t bits;
        std::memcpy(&bits, bytes + 2 * i, 2);
        dst[i] = f16_to_f32(bits);
      }
      return;
    case DType::kI64:
      for (size_t i = 0; i < count; ++i) {
        int64_t value;
        std::memcpy(&value, bytes + 8 * i, 8);
        dst[i] = static_cast<float>(value);
      }
      return;
    case DType::kI32:
      for (size_t i = 0; i < count; ++i) {
        int32_t value;
        std::memcpy(&value, bytes + 4 * i, 4);
        dst[i] = static_cast<float>(value);
      }
      return;
    case DType::kF8E4M3:
      for (size_t i = 0; i < count; ++i) dst[i] = f8e4m3_to_f32(bytes[i]);
      return;
    case DType::kF8E8M0:
      for (size_t i = 0; i < count; ++i) dst[i] = e8m0_to_f32(bytes[i]);
      return;
    case DType::kI8:
      for (size_t i = 0; i < count; ++i) dst[i] = static_cast<float>(static_cast<int8_t>(bytes[i]));
      return;
    case DType::kU8:
      for (size_t i = 0; i < count; ++i) dst[i] = static_cast<float>(bytes[i]);
      return;
  }
}

}  // namespace dsv4
