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

// ---- Numerics::kDeepSeek: the mHC of DeepSeek's inference/model.py (Block.hc_pre / hc_post, ParallelHead.hc_head)
// with the oracle's canonical accumulation (docs/numerics.md "The oracle", "Canonical accumulation in kDeepSeek").
// Same arguments and outputs as above; the streams hold bf16 values.

// mixes = fp32(Σ_double h·fn) · rsqrt(mean(h²) + norm_eps): model.py:683 applies the mixing linear to the raw streams
// and scales after (kHf normalises first; the two differ in the last fp32 bit). hc_split_sinkhorn evaluated in double
// from the fp32 mixes and rounded once per output (kernel_standin.hc_split_sinkhorn, EXACT; eps in double, as the
// Python float model.py passes). collapsed = Σ_s pre[s]·h[s] in fp32, in stream order.
void hc_pre_deepseek(const HyperConnectionParams& p, double hc_eps, const float* streams, int64_t tokens,
                     const float* fn, const float* base, const float* scale, float* collapsed, float* post,
                     float* comb);

// out[t, k] = post[t, k]·y[t] + (Σ_j comb[t, j, k]·streams[t, j]): model.py:690 sums the weighted streams first
// (fp32, j in order) and adds the sublayer term last.
void hc_post_deepseek(const HyperConnectionParams& p, const float* y, const float* streams, int64_t tokens,
                      const float* post, const float* comb, float* out);

// mixes as hc_pre_deepseek; pre = fp32(sigmoid_double(fp32(mixes·scale + base))) + eps in fp32 (model.py:738, with
// the oracle's one-rounding sigmoid); out = Σ_s pre[s]·h[s] in fp32.
void hc_head_deepseek(const HyperConnectionParams& p, const float* streams, int64_t tokens, const float* fn,
                      const float* base, const float* scale, float* out);

}  // namespace dsv4::ops::cpu
