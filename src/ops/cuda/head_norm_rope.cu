#include "ops/cuda/head_norm_rope.h"

#include <algorithm>

#include "ops/cuda/bf16.cuh"
#include "ops/cuda/launch.cuh"
#include "ops/cuda/rope_table.cuh"

namespace dsv4::ops::cuda {
namespace {

constexpr int kMaxWarps = 8;


// Block (row, group of up to 8 heads), one warp per head: lane l owns the channel pairs l, l + 32, … of its head,
// so the two channels a rotation mixes are in one thread and the norm is a warp reduction (no block barrier after
// the rope table). The table — the same angles for every head of a row — is computed once per block. One block per
// (row, head) recomputed it for each of q's 64 heads and ran 262,144 blocks of 2 KB at a 4K prefill (397 µs a
// call, ~2 TB/s of its 805 MB, ncu 2026-12-06).
__global__ void head_norm_rope_kernel(float* x, const float* __restrict__ norm_weight,
                                      const int32_t* __restrict__ positions, const float* __restrict__ inv_freq,
                                      uint16_t* x_bf16, int heads, int head_dim, int rope_pairs, bool normalize,
                                      float eps, float attention_scaling, bool keep_fp32, bool deepseek) {
  wait_for_prior_grid();
  allow_dependents();
  extern __shared__ float table[];  // cos [rope_pairs], then sin [rope_pairs]
  const int64_t row = blockIdx.x;
  const int head = static_cast<int>(blockIdx.y) * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  const int pairs = head_dim / 2, first_rope_pair = pairs - rope_pairs;
  fill_rope_table(inv_freq, static_cast<float>(positions[row]), rope_pairs, attention_scaling, 1.0f, blockDim.x,
                  table, table + rope_pairs);
  __syncthreads();
  if (head >= heads) return;
  const int64_t head_index = row * heads + head;
  float2* values = reinterpret_cast<float2*>(x + head_index * head_dim);
  float scale = 1.0f;
  if (normalize) {
    const bool bf16_norm = deepseek && norm_weight == nullptr;
    float sum = 0.0f;
#pragma unroll 4
    for (int j = lane; j < pairs; j += 32) {
      const float2 v = values[j];
      if (bf16_norm)
        sum = __fadd_rn(__fadd_rn(sum, bf16_round(__fmul_rn(v.x, v.x))), bf16_round(__fmul_rn(v.y, v.y)));
      else
        sum += v.x * v.x + v.y * v.y;
    }
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (bf16_norm) {
      const float mean = bf16_round(__fdiv_rn(sum, static_cast<float>(head_dim)));
      scale = bf16_round(__fdiv_rn(1.0f, __fsqrt_rn(bf16_round(__fadd_rn(mean, eps)))));
    } else {
      scale = rsqrtf(sum / static_cast<float>(head_dim) + eps);
    }
  }
  uint32_t* out_bf16 = x_bf16 ? reinterpret_cast<uint32_t*>(x_bf16 + head_index * head_dim) : nullptr;
#pragma unroll 4
  for (int j = lane; j < pairs; j += 32) {
    float2 v = values[j];
    if (normalize) {
      const float w0 = norm_weight ? norm_weight[2 * j] : 1.0f, w1 = norm_weight ? norm_weight[2 * j + 1] : 1.0f;
      v.x = w0 * (v.x * scale);
      v.y = w1 * (v.y * scale);
      if (deepseek) {
        v.x = bf16_round(v.x);
        v.y = bf16_round(v.y);
      }
    }
    if (j >= first_rope_pair) {
      const int i = j - first_rope_pair;
      const float c = table[i], s = table[rope_pairs + i];
      const float a = v.x, b = v.y;
      v.x = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
      v.y = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
    }
    if (deepseek) {
      v.x = bf16_round(v.x);
      v.y = bf16_round(v.y);
    }
    if (keep_fp32) values[j] = v;
    if (out_bf16)
      out_bf16[j] = static_cast<uint32_t>(f32_to_bf16_bits(v.x)) | (static_cast<uint32_t>(f32_to_bf16_bits(v.y)) << 16);
  }
}

}  // namespace

cudaError_t head_norm_rope(const HeadNormRopeParams& p, float* x, const float* norm_weight, const int32_t* positions,
                           const float* inv_freq, uint16_t* x_bf16, cudaStream_t stream) {
  if (p.rows < 0 || p.heads < 1 || p.head_dim < 2 || p.head_dim % 2 != 0 || p.rope_dim < 0 || p.rope_dim % 2 != 0 ||
      p.rope_dim > p.head_dim || p.head_dim > 0x7fffffff || p.rows * p.heads > 0x7fffffff ||
      (p.heads + kMaxWarps - 1) / kMaxWarps > 65535 ||
      (!p.keep_fp32 && x_bf16 == nullptr))
    return cudaErrorInvalidValue;
  if (p.rows == 0) return cudaSuccess;
  // float2 / packed-bf16 accesses: every head starts on an 8-byte (fp32) and 4-byte (bf16) boundary.
  if (reinterpret_cast<uintptr_t>(x) % 8 != 0 || reinterpret_cast<uintptr_t>(x_bf16) % 4 != 0)
    return cudaErrorInvalidValue;
  const int rope_pairs = static_cast<int>(p.rope_dim / 2);
  const size_t shared = 2 * static_cast<size_t>(rope_pairs) * sizeof(float);
  const int warps = static_cast<int>(std::min<int64_t>(kMaxWarps, p.heads));
  const dim3 grid(static_cast<unsigned>(p.rows), static_cast<unsigned>((p.heads + warps - 1) / warps));
  launch_dependent(head_norm_rope_kernel, grid, 32 * warps, shared, stream,
                   x, norm_weight, positions, inv_freq, x_bf16, static_cast<int>(p.heads),
                   static_cast<int>(p.head_dim), rope_pairs, p.normalize, p.eps, p.attention_scaling, p.keep_fp32,
                   p.deepseek_roundings);
  return cudaGetLastError();
}

}  // namespace dsv4::ops::cuda
