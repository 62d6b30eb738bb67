#include <cuda_fp8.h>

#include "cache/index_key_writer.h"

namespace dsv4 {
namespace {

constexpr int kWarpsPerBlock = 8;

// Lane l holds channels [4l, 4l + 4) of the key: 8 bytes of bf16 in, 4 bytes of e4m3 (or 8 of bf16) out.
__global__ void write_index_keys_kernel(IndexKeyPagedLayout layout, const uint2* __restrict__ keys,
                                        const int64_t* __restrict__ slots, int64_t count, unsigned char* pool) {
  const int64_t key = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (key >= count) return;
  const int lane = threadIdx.x % 32;
  const uint2 packed = keys[key * 32 + lane];
  const auto block = static_cast<int32_t>(slots[key] / layout.entries_per_block);
  const auto e = static_cast<int32_t>(slots[key] % layout.entries_per_block);
  unsigned char* values = pool + layout.value_offset(block, e);
  if (layout.dtype == IndexKeyDtype::kBf16) {
    reinterpret_cast<uint2*>(values)[lane] = packed;
    return;
  }
  const float x[4] = {__uint_as_float(packed.x << 16), __uint_as_float(packed.x & 0xffff0000u),
                      __uint_as_float(packed.y << 16), __uint_as_float(packed.y & 0xffff0000u)};
  float amax = fmaxf(fmaxf(fabsf(x[0]), fabsf(x[1])), fmaxf(fabsf(x[2]), fabsf(x[3])));
  for (int offset = 16; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  const float scale = index_key_fp8_scale(amax);
  const float inverse = 1.0f / scale;
  uint32_t out = 0;
  for (int i = 0; i < 4; ++i) {
    const float v = fminf(fmaxf(x[i] * inverse, -kIndexKeyFp8Max), kIndexKeyFp8Max);
    out |= static_cast<uint32_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3)) << (8 * i);
  }
  reinterpret_cast<uint32_t*>(values)[lane] = out;
  if (lane == 0) *reinterpret_cast<float*>(pool + layout.scale_offset(block, e)) = scale;
}

}  // namespace

cudaError_t write_index_keys_cuda(const IndexKeyPagedLayout& layout, const uint16_t* keys_bf16, const int64_t* slots,
                                  int64_t count, std::byte* pool, cudaStream_t stream) {
  if (layout.head_dim != 128) return cudaErrorInvalidValue;
  if (count == 0) return cudaSuccess;
  const auto blocks = static_cast<unsigned>((count + kWarpsPerBlock - 1) / kWarpsPerBlock);
  write_index_keys_kernel<<<blocks, kWarpsPerBlock * 32, 0, stream>>>(
      layout, reinterpret_cast<const uint2*>(keys_bf16), slots, count, reinterpret_cast<unsigned char*>(pool));
  return cudaGetLastError();
}

}  // namespace dsv4
