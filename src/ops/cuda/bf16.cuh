// bf16 <-> fp32 on the device, bitwise core/dtype.h's f32_to_bf16 / bf16_to_f32 (round to nearest even on the bit
// pattern, NaN made quiet): the one copy the kernels that store or read bf16 bits share.
#pragma once
#include <cstdint>

#include "core/dtype.h"  // bf16_round, shared with the CPU recipe

namespace dsv4::ops::cuda {

__device__ __forceinline__ uint16_t f32_to_bf16_bits(float value) {
  uint32_t word = __float_as_uint(value);
  if ((word & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((word >> 16) | 0x40);
  word += 0x7fffu + ((word >> 16) & 1u);
  return static_cast<uint16_t>(word >> 16);
}

__device__ __forceinline__ float bf16_bits_to_f32(uint16_t bits) {
  return __uint_as_float(static_cast<uint32_t>(bits) << 16);
}

}  // namespace dsv4::ops::cuda
