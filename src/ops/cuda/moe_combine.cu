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
      const int32_t slot = slots[t * p.top_k + k];
      if (slot >= 0) sum += weights[t * p.top_k + k] * expert_rows[slot * p.hidden + j];
    }
    if (shared_rows) sum += shared_rows[t * p.hidden + j];
    out[t * p.hidden + j] = sum;
  }
}

}  // namespace

cudaError_t combine_expert_rows(const ExpertCombineParams& p, const int32_t* slots, const float* weights,
                                const float* expert_rows, const float* shared_rows, float* out, cudaStream_t stream) {
  if (p.tokens == 0) return cudaSuccess;
  launch_dependent(combine_expert_rows_kernel, static_cast<unsigned>(p.tokens), 256, 0, stream, p, slots,
                   weights, expert_rows, shared_rows, out);
  return cudaGetLastError();
}

}  // namespace dsv4::ops::cuda
