// MoE routing and the expert activation on the device: the twins of ops/cpu/moe.h. route() fuses router_scores
// (sqrt∘softplus / softmax / sigmoid over the experts of a token) with route_token (top_k of score + bias, equal keys
// to the lower expert id, or hash routing from tid2eid), one warp per token; swiglu_clamped is elementwise.
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

namespace dsv4::ops::cuda {

inline constexpr int64_t kRouteMaxExperts = 384;
inline constexpr int64_t kRouteMaxTopK = 8;

enum class RouterScoreFunc { kSqrtSoftplus, kSoftmax, kSigmoid };  // ops::cpu::RouterScore

struct RouteParams {
  int64_t tokens = 0;
  int64_t experts = 0;  // <= kRouteMaxExperts
  int64_t top_k = 0;    // <= min(kRouteMaxTopK, experts)
  RouterScoreFunc func = RouterScoreFunc::kSqrtSoftplus;
  float routed_scaling_factor = 1.0f;
};

// logits: fp32 device [tokens, experts] (x · W_gateᵀ; not modified). Learned routing (tid2eid == nullptr): the
// top_k experts by score + bias (bias: device [experts] or nullptr), in descending key order, equal keys to the lower
// id (a NaN key ranks as −inf). Hash routing (tid2eid: int32 device [vocab, top_k], token_ids: int32 device
// [tokens]): chosen = tid2eid[token_ids[t]]. Either way weights[i] = score[chosen[i]] / (Σ_i score[chosen[i]] +
// 1e-20) · routed_scaling_factor, summed in chosen order as the twin. chosen: int32 [tokens, top_k], weights: fp32
// [tokens, top_k]. scores_out (fp32 [tokens, experts], may be nullptr or alias logits) receives router_scores.
cudaError_t route(const RouteParams& p, const float* logits, const float* bias, const int32_t* tid2eid,
                  const int32_t* token_ids, int32_t* chosen, float* weights, float* scores_out,
                  cudaStream_t stream);

struct SwigluParams {
  int64_t rows = 0;
  int64_t inter = 0;
  float limit = 0.0f;
};

// gate_up [rows, 2·inter] (gate = first half, up = second) -> out [rows, inter] =
// silu(min(gate, limit)) · clamp(up, −limit, limit), every operation rounded as the twin (out may not alias).
cudaError_t swiglu_clamped(const SwigluParams& p, const float* gate_up, float* out, cudaStream_t stream);
// The same values stored as bf16 bits (f32_to_bf16 of each fp32 result): the down projection's bf16 operand in
// one pass, bitwise what swiglu_clamped then f32_to_bf16 give.
cudaError_t swiglu_clamped_bf16(const SwigluParams& p, const float* gate_up, uint16_t* out, cudaStream_t stream);

}  // namespace dsv4::ops::cuda
