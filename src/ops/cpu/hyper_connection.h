// mHC, manifold-constrained hyper-connections (docs/MODEL.md "One model step", transformers
// DeepseekV4HyperConnection / DeepseekV4HyperHead). The residual is `hc` streams per token.
#pragma once
#include <cstdint>

namespace dsv4::ops::cpu {

struct HyperConnectionParams {
  int64_t hc = 4;              // streams
  int64_t hidden = 0;          // D
  int64_t sinkhorn_iters = 20;
  float hc_eps = 1e-6f;        // Sinkhorn floor and the `pre` offset
  float norm_eps = 1e-6f;      // the unweighted RMSNorm over the flattened streams
};

// streams [tokens, hc, D] -> collapsed [tokens, D] = Σ_s pre[s]·h[s]; post [tokens, hc]; comb [tokens, hc, hc]
// (comb row j, column k: the weight of input stream j in output stream k, doubly stochastic by Sinkhorn).
// fn [(2+hc)·hc, hc·D], base [(2+hc)·hc], scale [3].
void hc_pre(const HyperConnectionParams& p, const float* streams, int64_t tokens, const float* fn, const float* base,
            const float* scale, float* collapsed, float* post, float* comb);

// out[t, k] = post[t, k]·y[t] + Σ_j comb[t, j, k]·streams[t, j]   (out may not alias streams)
void hc_post(const HyperConnectionParams& p, const float* y, const float* streams, int64_t tokens,
             const float* post, const float* comb, float* out);

// Final collapse: out[t] = Σ_s (σ(rms(h)·fnᵀ·scale + base) + eps)[s]·h[t, s]. fn [hc, hc·D], base [hc], scale [1].
void hc_head(const HyperConnectionParams& p, const float* streams, int64_t tokens, const float* fn, const float* base,
             const float* scale, float* out);

}  // namespace dsv4::ops::cpu
