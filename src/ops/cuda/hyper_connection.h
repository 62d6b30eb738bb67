// mHC on the device: the twins of ops/cpu/hyper_connection.h hc_pre, hc_post and hc_head (same formulas, same
// constants and order of operations; fp32). hc = 1, 2 or 4 (V4: 4); hidden up to any size.
//
// hc_pre / hc_head are two launches: (1) split-K mixes — grid (token groups of 4, column splits), each CTA
// accumulates Σ h·fn[o] for every mix output o and Σ h² over its slice of the flattened streams, reduced in a
// fixed order into `workspace` (from 512 tokens: 64-token tiles on the tensor cores, mma.sync TF32 in three passes
// — "3xTF32", fp32-class products — with the accumulator restarted every 64 columns; DSV4_HC_MIX_KERNEL=simt keeps
// the first kernel); (2) one CTA per token sums the splits in order, applies the RMS scale
// (mix = rsqrt(mean h² + norm_eps) · Σ h·fn), then pre / post / Sinkhorn comb (one warp, the CPU's sequential
// sums) and the collapse Σ_s pre[s]·h[s] (optionally followed by the sublayer's RMSNorm). Deterministic: the same inputs give bit-identical outputs.
#pragma once
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace dsv4::ops::cuda {

struct HyperConnectionParams {
  int64_t tokens = 0;
  int64_t hc = 4;              // streams
  int64_t hidden = 0;          // D
  int64_t sinkhorn_iters = 20;
  float hc_eps = 1e-6f;        // Sinkhorn floor and the `pre` offset
  float norm_eps = 1e-6f;      // the unweighted RMSNorm over the flattened streams
  // Numerics::kDeepSeek. hc_post: model.py's order (the weighted streams summed first, the sublayer term added
  // last: ops::cpu::hc_post_deepseek) and the new streams rounded to bf16, as the reference holds them. hc_pre /
  // hc_head: pre, post and the Sinkhorn comb evaluated in double from the fp32 mixes and rounded once, with the
  // double hc_eps below (ops::cpu::hc_pre_deepseek / hc_head_deepseek). hc_post_pre refuses it.
  bool deepseek = false;
  double deepseek_hc_eps = 1e-6;  // the config's hc_eps as model.py's Python float
};

// The RMSNorm that follows every collapse in the model (attn_norm / ffn_norm after hc_pre, the final norm after
// hc_head), fused into the collapse's CTA: collapsed = weight ⊙ c · rsqrt(mean(c²) + eps) of the collapsed row c
// (ops/cpu/norm.h rms_norm, weight nullptr = unweighted), and, when `bf16` is set, its bf16 copy [tokens, D] (round
// to nearest even), the next GEMM's operand.
struct CollapseNorm {
  const float* weight = nullptr;
  float eps = 1e-6f;
  uint16_t* bf16 = nullptr;
};

// Device memory hc_post_pre's one-launch hand-over uses as its grid barriers' words: per token group (one token
// each, up to 8) and barrier (2), a count and a generation, each on its own 128-byte line.
constexpr size_t kHcHandoverSyncBytes = 4096;
// The word index of barrier `barrier`'s generation for token group `group` (its count is 32 words before); tests
// read it to see that a call took the hand-over.
__host__ __device__ constexpr size_t hc_handover_generation_word(int group, int barrier) {
  return static_cast<size_t>(group * 2 + barrier) * 64 + 32;
}

// Workspace bytes that hc_pre, hc_head and hc_post_pre need for any tokens <= max_tokens at this hc.
size_t hc_workspace_bytes(int64_t max_tokens, int64_t hc);

// streams [tokens, hc, D] -> collapsed [tokens, D] = Σ_s pre[s]·h[s]; post [tokens, hc]; comb [tokens, hc, hc]
// (row j, column k: the weight of input stream j in output stream k). fn fp32 [(2+hc)·hc, hc·D], base
// [(2+hc)·hc], scale [3], all device pointers. collapsed may not alias streams.
// `norm` (optional): the fused RMSNorm above, applied to `collapsed`. `handover_sync`: as hc_post_pre's below (the
// one-launch form, on the streams as they are).
cudaError_t hc_pre(const HyperConnectionParams& p, const float* streams, const float* fn, const float* base,
                   const float* scale, float* collapsed, float* post, float* comb, void* workspace,
                   size_t workspace_bytes, cudaStream_t stream, const CollapseNorm* norm = nullptr,
                   unsigned* handover_sync = nullptr);

// out[t, k] = post[t, k]·y[t] + Σ_j comb[t, j, k]·streams[t, j]; y [tokens, D], out [tokens, hc, D]
// (out may not alias streams). One launch, float4 when D % 4 == 0.
cudaError_t hc_post(const HyperConnectionParams& p, const float* y, const float* streams, const float* post,
                    const float* comb, float* out, cudaStream_t stream);

// hc_post, then the next sublayer's hc_pre on its output `out` (the same results as the two calls; `out` bitwise
// hc_post's). With DSV4_HC_POST_MIX=1 one kernel makes the new streams and their mix partial sums together (from
// 512 tokens on the tensor cores, below in split-K as hc_pre's mixes): the streams are read once fewer at
// prefill, and a decode step has one dependent kernel fewer. Opt-in until measured on a GPU (the first tensor-core
// version was slower than the two calls at 4K tokens, docs/PERF.md); otherwise the two calls. post / comb are read
// before next_post / next_comb are written, which may alias them.
//
// `handover_sync` (optional, kHcHandoverSyncBytes of device memory, zeroed once when allocated; every call leaves
// it zero; one per stream running hand-overs at the same time): with it, the fused norm, fp32 numerics and up to 8
// tokens (DSV4_HC_HANDOVER=0: never), one launch does it all, its token groups' split CTAs meeting at two grid
// barriers: the new streams are hc_post's bit for bit, pre / post / comb and the collapse equal the kernels' to fp32
// rounding (wider splits, summed in another fixed order).
cudaError_t hc_post_pre(const HyperConnectionParams& p, const float* y, const float* streams, const float* post,
                        const float* comb, float* out, const float* fn, const float* base, const float* scale,
                        float* collapsed, float* next_post, float* next_comb, void* workspace, size_t workspace_bytes,
                        cudaStream_t stream, const CollapseNorm* norm = nullptr, unsigned* handover_sync = nullptr);

// Final collapse: out[t] = Σ_s (σ(mix[s]·scale[0] + base[s]) + hc_eps)·h[t, s], mix = rms(h)·fnᵀ.
// fn [hc, hc·D], base [hc], scale [1]; out [tokens, D].
// `handover_sync`: as hc_pre's.
cudaError_t hc_head(const HyperConnectionParams& p, const float* streams, const float* fn, const float* base,
                    const float* scale, float* out, void* workspace, size_t workspace_bytes, cudaStream_t stream,
                    const CollapseNorm* norm = nullptr, unsigned* handover_sync = nullptr);

}  // namespace dsv4::ops::cuda
