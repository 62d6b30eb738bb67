// MoE pieces (docs/MODEL.md "MoE sublayer"; transformers DeepseekV4TopKRouter / HashRouter / Experts / MLP).
#pragma once
#include <cstdint>

namespace dsv4::ops::cpu {

enum class RouterScore { kSqrtSoftplus, kSoftmax, kSigmoid };

// In place over logits [tokens, experts]: sqrt(softplus(x)), softmax over experts, or sigmoid.
void router_scores(float* logits, int64_t tokens, int64_t experts, RouterScore func);

// For one token: chooses `top_k` experts by score + bias (bias may be nullptr; ties -> lower expert id)
// unless `fixed_experts` is given (hash routing), then weights = score[e] / (Σ score + 1e-20) · scaling.
void route_token(const float* scores, const float* bias, int64_t experts, int64_t top_k, const int32_t* fixed_experts,
                 float routed_scaling_factor, int32_t* chosen, float* weights);

// gate_up [rows, 2·inter] (gate = first half, up = second) -> out [rows, inter] =
// silu(min(gate, limit)) · clamp(up, −limit, limit).
void swiglu_clamped(const float* gate_up, int64_t rows, int64_t inter, float limit, float* out);

}  // namespace dsv4::ops::cpu
