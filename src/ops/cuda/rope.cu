#include "ops/cuda/rope.h"

#include "ops/cuda/launch.cuh"
#include "ops/cuda/rope_table.cuh"

namespace dsv4::ops::cuda {
namespace {

constexpr int kThreads = 128;

template <bool kVec2>
__global__ void rope_kernel(float* x, const int32_t* __restrict__ positions, const float* __restrict__ inv_freq,
                            int64_t row_stride, int heads, int head_dim, int pairs, float attention_scaling,
                            float sin_sign) {
  wait_for_prior_grid();
  allow_dependents();
  extern __shared__ float table[];  // cos [pairs], then sin [pairs]
  float* cos_table = table;
  float* sin_table = table + pairs;
  const int64_t row = blockIdx.x;
  const float position = static_cast<float>(positions[row]);
  fill_rope_table(inv_freq, position, pairs, attention_scaling, sin_sign, kThreads, cos_table, sin_table);
  __syncthreads();
  float* base = x + row * row_stride + (head_dim - 2 * pairs);
  for (int e = threadIdx.x; e < heads * pairs; e += kThreads) {
    const int h = e / pairs, i = e - h * pairs;
    float* rope = base + static_cast<int64_t>(h) * head_dim + 2 * i;
    float a, b;
    if constexpr (kVec2) {
      const float2 v = *reinterpret_cast<const float2*>(rope);
      a = v.x;
      b = v.y;
    } else {
      a = rope[0];
      b = rope[1];
    }
    const float c = cos_table[i], s = sin_table[i];
    const float ra = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    const float rb = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
    if constexpr (kVec2) {
      *reinterpret_cast<float2*>(rope) = make_float2(ra, rb);
    } else {
      rope[0] = ra;
      rope[1] = rb;
    }
  }
}

}  // namespace

cudaError_t apply_rope(const RopeParams& p, float* x, const int32_t* positions, const float* inv_freq,
                       cudaStream_t stream) {
  if (p.rows < 0 || p.heads < 0 || p.rope_dim < 0 || p.rope_dim % 2 != 0 || p.rope_dim > p.head_dim ||
      p.rows > 0x7fffffff || p.head_dim > 0x7fffffff || p.heads * p.head_dim > 0x7fffffff ||
      p.row_stride < p.heads * p.head_dim)
    return cudaErrorInvalidValue;
  const int pairs = static_cast<int>(p.rope_dim / 2);
  if (p.rows == 0 || p.heads == 0 || pairs == 0) return cudaSuccess;
  const bool vec2 = p.row_stride % 2 == 0 && p.head_dim % 2 == 0 && reinterpret_cast<uintptr_t>(x) % 8 == 0;
  const size_t shared = 2 * static_cast<size_t>(pairs) * sizeof(float);
  if (shared > 48 * 1024) return cudaErrorInvalidValue;
  const float sin_sign = p.inverse ? -1.0f : 1.0f;
  const auto heads = static_cast<int>(p.heads), head_dim = static_cast<int>(p.head_dim);
  if (vec2)
    launch_dependent(rope_kernel<true>, static_cast<unsigned>(p.rows), kThreads, shared, stream, x, positions,
                     inv_freq, p.row_stride, heads, head_dim, pairs, p.attention_scaling, sin_sign);
  else
    launch_dependent(rope_kernel<false>, static_cast<unsigned>(p.rows), kThreads, shared, stream, x,
                     positions, inv_freq, p.row_stride, heads, head_dim, pairs, p.attention_scaling,
                     sin_sign);
  return cudaGetLastError();
}

}  // namespace dsv4::ops::cuda
