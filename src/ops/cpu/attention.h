// Shared-K=V multi-query attention with a per-head sink over a gathered key set (docs/MODEL.md "Attention
// sublayer"): for one query token, logits_j = q_h · kv_j · scale over the selected keys; the sink logit
// sinks[h] joins the softmax denominator only; o_h = Σ_j p_j · kv_j (the key vector is also the value).
// The key set is the union of the raw window and the selected compressed entries: one softmax over both.
#pragma once
#include <cstdint>

namespace dsv4::ops::cpu {

struct SinkAttentionParams {
  int64_t heads = 0;
  int64_t head_dim = 0;
  float scale = 1.0f;  // head_dim^-0.5
};

// q [heads, head_dim]; keys: num_keys pointers to head_dim floats; sinks [heads]; out [heads, head_dim].
// With no keys every head outputs zero (its only mass is the sink).
void sink_attention(const SinkAttentionParams& p, const float* q, const float* const* keys, int64_t num_keys,
                    const float* sinks, float* out);

}  // namespace dsv4::ops::cpu
