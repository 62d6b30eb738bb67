// The last step of the host-grouped MoE path of the GPU model (prefill chunks, where every expert has hundreds of
// rows and cuBLASLt's per-expert GEMMs beat the graph-safe grouped kernel of ops/cuda/moe_experts.h): each token's
// routed expert rows, weighted, plus its shared-expert row.
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

namespace dsv4::ops::cuda {

struct ExpertCombineParams {
  int64_t tokens = 0, top_k = 0, hidden = 0;
};

// out[t, :] = Σ_k weights[t, k] · expert_rows[slots[t, k], :] (k in order; a slot < 0 adds nothing)
//             + shared_rows[t, :] (nullptr: none). fp32; slots int32 [tokens, top_k], or nullptr for row t·top_k + k
//             (the rows already in token-major order).
cudaError_t combine_expert_rows(const ExpertCombineParams& p, const int32_t* slots, const float* weights,
                                const float* expert_rows, const float* shared_rows, float* out, cudaStream_t stream);

}  // namespace dsv4::ops::cuda
