#include "cache/kv_entry_format_cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp8.h>

namespace dsv4::cuda {
namespace {

constexpr int kWarpsPerBlock = 8;

// e4m3 RNE with saturation, as the CPU's f32_to_e4m3_rne (inputs are already clamped to ±448).
__device__ inline uint8_t to_e4m3(float v) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

__device__ inline float from_e4m3(uint8_t code) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3);
  return __half2float(__half(h));
}

__global__ void write_kv_entries_kernel(KvWriteParams p, const uint16_t* __restrict__ kv) {
  const int lane = threadIdx.x % 32;
  const int64_t token = int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32;
  if (token >= p.tokens) return;
  const int64_t row = p.rows ? p.rows[token] : token;
  if (!kv_write_wanted(p, row, p.entry_indices[token])) return;
  const KvEntryAddress address = kv_entry_address(p.pool, p.format, row, p.entry_indices[token]);
  if (address.data == nullptr) return;
  const uint16_t* in = kv + token * kKvHeadDim;
  // Rope channels 448..511: 2 per lane, stored bf16 unchanged in both formats.
  const uint32_t rope_pair = reinterpret_cast<const uint32_t*>(in + kKvNopeDim)[lane];
  if (p.format == KvEntryFormat::kBf16) {
    reinterpret_cast<uint32_t*>(address.data + 2 * kKvNopeDim)[lane] = rope_pair;
  } else {
    reinterpret_cast<uint32_t*>(address.data + kKvNopeDim)[lane] = rope_pair;
  }
  for (int b = 0; b < kKvNumScales; ++b) {
    const int c = b * kKvScaleBlock + 2 * lane;
    const uint32_t pair = *reinterpret_cast<const uint32_t*>(in + c);
    if (p.format == KvEntryFormat::kBf16 && !p.fake_quantize_nope) {
      reinterpret_cast<uint32_t*>(address.data)[c / 2] = pair;
      continue;
    }
    const float x0 = __uint_as_float(pair << 16), x1 = __uint_as_float(pair & 0xffff0000u);
    float amax = fmaxf(fabsf(x0), fabsf(x1));
    for (int offset = 16; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    // Scale 2^ceil(log2(max(amax, 1e-4) / 448)) from the fp32 bits (model_spec.md §3.3).
    const uint32_t bits = __float_as_uint(fmaxf(amax, 1e-4f) / kE4m3Max);
    const int exponent = static_cast<int>((bits >> 23) & 0xffu) - 127 + ((bits & 0x7fffffu) != 0 ? 1 : 0);
    const float inverse_scale = __uint_as_float(static_cast<uint32_t>(127 - exponent) << 23);
    const uint8_t q0 = to_e4m3(fminf(fmaxf(x0 * inverse_scale, -kE4m3Max), kE4m3Max));
    const uint8_t q1 = to_e4m3(fminf(fmaxf(x1 * inverse_scale, -kE4m3Max), kE4m3Max));
    if (p.format == KvEntryFormat::kFp8) {
      *reinterpret_cast<uint16_t*>(address.data + c) = static_cast<uint16_t>(q0 | (q1 << 8));
      if (lane == 0) address.scales[b] = static_cast<uint8_t>(exponent + 127);
    } else {
      const float scale = __uint_as_float(static_cast<uint32_t>(exponent + 127) << 23);
      const __nv_bfloat162 dequantized = __floats2bfloat162_rn(from_e4m3(q0) * scale, from_e4m3(q1) * scale);
      *reinterpret_cast<__nv_bfloat162*>(address.data + 2 * c) = dequantized;
    }
  }
  if (p.format == KvEntryFormat::kFp8 && lane == 0) address.scales[kKvNumScales] = 0;
}

}  // namespace

cudaError_t write_kv_entries(const KvWriteParams& p, const uint16_t* kv, cudaStream_t stream) {
  if (p.tokens == 0) return cudaSuccess;
  const auto blocks = static_cast<unsigned>((p.tokens + kWarpsPerBlock - 1) / kWarpsPerBlock);
  write_kv_entries_kernel<<<blocks, kWarpsPerBlock * 32, 0, stream>>>(p, kv);
  return cudaGetLastError();
}

}  // namespace dsv4::cuda
