#include "ops/cuda/embedding.h"

#include <algorithm>

#include "ops/cuda/bf16.cuh"
#include "ops/cuda/launch.cuh"

namespace dsv4::ops::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float widen(float v) { return v; }
__device__ __forceinline__ float widen(uint16_t bits) { return bf16_bits_to_f32(bits); }

// Four consecutive table values of row `row` from column 4·c (the caller checked alignment).
__device__ __forceinline__ float4 load4(const float* row, int64_t c) { return reinterpret_cast<const float4*>(row)[c]; }
__device__ __forceinline__ float4 load4(const uint16_t* row, int64_t c) {
  const uint2 w = reinterpret_cast<const uint2*>(row)[c];
  return make_float4(__uint_as_float(w.x << 16), __uint_as_float(w.x & 0xffff0000u), __uint_as_float(w.y << 16),
                     __uint_as_float(w.y & 0xffff0000u));
}

// grid (tokens, column blocks).
template <typename T, bool kVec4>
__global__ void embedding_kernel(const T* __restrict__ table, const int32_t* __restrict__ token_ids,
                                 float* __restrict__ out, int64_t vocab, int64_t D, int64_t hc) {
  wait_for_prior_grid();
  allow_dependents();
  const int64_t t = blockIdx.x;
  const int64_t id = token_ids[t];
  const bool valid = id >= 0 && id < vocab;
  const T* row = table + (valid ? id : 0) * D;
  float* dst = out + t * hc * D;
  const int64_t stride = int64_t{gridDim.y} * kThreads;
  if constexpr (kVec4) {
    const int64_t n4 = D / 4;
    const float nan = __int_as_float(0x7fc00000);
    for (int64_t c = blockIdx.y * int64_t{kThreads} + threadIdx.x; c < n4; c += stride) {
      const float4 v = valid ? load4(row, c) : make_float4(nan, nan, nan, nan);
      for (int64_t s = 0; s < hc; ++s) reinterpret_cast<float4*>(dst + s * D)[c] = v;
    }
  } else {
    for (int64_t c = blockIdx.y * int64_t{kThreads} + threadIdx.x; c < D; c += stride) {
      const float v = valid ? widen(row[c]) : __int_as_float(0x7fc00000);
      for (int64_t s = 0; s < hc; ++s) dst[s * D + c] = v;
    }
  }
}

template <typename T>
cudaError_t launch(const EmbeddingParams& p, const T* table, const int32_t* token_ids, float* out,
                   cudaStream_t stream) {
  if (p.tokens < 0 || p.vocab < 0 || p.hidden < 0 || p.hc < 1 || p.tokens > 0x7fffffff) return cudaErrorInvalidValue;
  if (p.tokens == 0 || p.hidden == 0) return cudaSuccess;
  const bool vec4 = p.hidden % 4 == 0 && reinterpret_cast<uintptr_t>(table) % (4 * sizeof(T)) == 0 &&
                    reinterpret_cast<uintptr_t>(out) % 16 == 0;
  const int64_t per_row = vec4 ? p.hidden / 4 : p.hidden;
  const dim3 grid(static_cast<unsigned>(p.tokens),
                  static_cast<unsigned>(std::min<int64_t>((per_row + kThreads - 1) / kThreads, 65535)));
  if (vec4)
    launch_dependent(embedding_kernel<T, true>, grid, kThreads, 0, stream, table, token_ids, out, p.vocab,
                     p.hidden, p.hc);
  else
    launch_dependent(embedding_kernel<T, false>, grid, kThreads, 0, stream, table, token_ids, out, p.vocab,
                     p.hidden, p.hc);
  return cudaGetLastError();
}

}  // namespace

cudaError_t embedding(const EmbeddingParams& p, const float* table, const int32_t* token_ids, float* out,
                      cudaStream_t stream) {
  return launch(p, table, token_ids, out, stream);
}

cudaError_t embedding_bf16(const EmbeddingParams& p, const uint16_t* table, const int32_t* token_ids, float* out,
                           cudaStream_t stream) {
  return launch(p, table, token_ids, out, stream);
}

}  // namespace dsv4::ops::cuda
