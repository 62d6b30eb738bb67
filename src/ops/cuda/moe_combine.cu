#include "ops/cuda/moe_combine.h"

#include "ops/cuda/launch.cuh"

namespace dsv4::ops::cuda {
namespace {

__global__ void combine_expert_rows_kernel(ExpertCombineParams p, const int32_t* slots, const float* weights,
                                           const float* expert_rows, const float* shared_rows, float* out) {
  wait_for_prior_grid();
  allow_dependents();
  const int64_t t = blockIdx.x;
  for (int64_t j = threadIdx.x; j < p.hidden; j += blockDim.x) {
    float sum = 0.0f;
    for (int64_t k = 0; k < p.top_k; ++k) {
      const int32_t slot = slots ? slots[t * p.top_k + k] : static_cast<int32_t>(t * p.top_k + k);
      if (slot >= 0) sum += weights[t * p.top_k + k] * expert_rows[slot * p.hidden + j];
    }
    if (shared_rows) sum += shared_rows[t * p.hidden + j];
    out[t * p.hidden + j] = sum;
  }
}

// The same sums four columns at a time (hidden % 4 == 0, 16-byte aligned rows): every row of a token is read as
// float4s, so each thread has its k + 1 loads in flight together (the scalar kernel reached ~2.1 TB/s on a 4K-token
// prefill, 257 µs a call). Per element the same operations in the same order: bitwise the scalar kernel's result.
__global__ void combine_expert_rows_vec4_kernel(ExpertCombineParams p, const int32_t* slots, const float* weights,
                                                const float4* expert_rows, const float4* shared_rows, float4* out) {
  wait_for_prior_grid();
  allow_dependents();
  const int64_t t = blockIdx.x, columns = p.hidden / 4;
  for (int64_t j = threadIdx.x; j < columns; j += blockDim.x) {
    float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int64_t k = 0; k < p.top_k; ++k) {
      const int32_t slot = slots ? slots[t * p.top_k + k] : static_cast<int32_t>(t * p.top_k + k);
      if (slot < 0) continue;
      const float w = weights[t * p.top_k + k];
      const float4 v = expert_rows[slot * columns + j];
      sum.x += w * v.x;
      sum.y += w * v.y;
      sum.z += w * v.z;
      sum.w += w * v.w;
    }
    if (shared_rows) {
      const float4 v = shared_rows[t * columns + j];
      sum.x += v.x;
      sum.y += v.y;
      sum.z += v.z;
      sum.w += v.w;
    }
    out[t * columns + j] = sum;
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

cudaError_t combine_expert_rows(const ExpertCombineParams& p, const int32_t* slots, const float* weights,
                                const float* expert_rows, const float* shared_rows, float* out, cudaStream_t stream) {
  if (p.tokens == 0) return cudaSuccess;
  if (p.hidden % 4 == 0 && aligned16(expert_rows) && aligned16(shared_rows) && aligned16(out)) {
    launch_dependent(combine_expert_rows_vec4_kernel, static_cast<unsigned>(p.tokens), 256, 0, stream, p, slots,
                     weights, reinterpret_cast<const float4*>(expert_rows),
                     reinterpret_cast<const float4*>(shared_rows), reinterpret_cast<float4*>(out));
    return cudaGetLastError();
  }
  launch_dependent(combine_expert_rows_kernel, static_cast<unsigned>(p.tokens), 256, 0, stream, p, slots,
                   weights, expert_rows, shared_rows, out);
  return cudaGetLastError();
}

}  // namespace dsv4::ops::cuda
