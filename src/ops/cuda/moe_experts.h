// The routed + shared experts of one MoE layer on the device: the CUDA twin of the kHf expert loop of
// DeepseekV4Model::moe (ops/cpu/linear.h + ops/cpu/moe.h swiglu_clamped), routing already computed.
//
//   out[t] = Σ_k weights[t, k] · expert_{chosen[t, k]}(x[t]) + shared(x[t])
//   expert(x) = w2 · (silu(min(g, limit)) · clamp(u, −limit, limit)),  g = w13[0 : I] · x,  u = w13[I : 2I] · x
//
// Steps, all on the device, no host synchronisation, no allocation (CUDA-graph capturable):
//   1. prep: one CTA counts the rows per expert, scans them into offsets, lists the GEMM work items
//      (expert, 16/64/128-row block) and permutes the (token, k) rows expert by expert, stable in token order;
//      the shared expert is expert E with every token; further CTAs convert x to bf16 (bf16 mode).
//   2. gate/up GEMM with the clamped SwiGLU fused in its epilogue -> h [rows, I] (bf16 in bf16 mode).
//   3. down GEMM -> y [rows, D] fp32, one row per (token, k) and per token for the shared expert.
//   4. combine: out[t] = Σ_k weights[t, k] · y[row(t, k)] in k order, then + y[shared row of t]
//      (fixed order, no float atomics: bitwise repeatable).
// The GEMMs run on a grid sized from host-known numbers only (tokens, top_k, E, D, I); CTAs whose work item
// is past the device-computed item count exit at once.
//
// bf16 mode (serving): weights bf16, x rounded to bf16, mma.sync m16n8k16 with fp32 accumulation, h rounded to
// bf16 before the down projection; each CTA streams its weight columns once through a cp.async pipeline
// (16-byte loads, 64-wide k tiles, swizzled shared memory), one CTA per (work item, column tile). Tiles (rows ×
// weight rows): 16 × 64 (4 warps, 4 stages) for decode, 64 × 64 (4 warps) for mid batches, 128 × 128 (8 warps,
// 3 stages) for prefill; the gate/up tile pairs 8 gate rows with the 8 matching up rows so SwiGLU stays in
// registers. Grid: x = column tiles (fastest, so a work item's A rows stay in L2), y = the work-item bound.
// fp32 mode (exact): plain fp32 FMA, one warp per output dot product; for correctness, not speed.
#pragma once
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace dsv4::ops::cuda {

enum class MoeWeightDtype { kBf16, kFp32 };

struct MoeExpertsParams {
  int64_t tokens = 0;        // rows of x and out
  int64_t top_k = 0;         // routed experts per token, 1..16
  int64_t experts = 0;       // E routed experts (1 ≤ E ≤ 1023)
  int64_t hidden = 0;        // D (multiple of 8)
  int64_t intermediate = 0;  // I (multiple of 8)
  float swiglu_limit = 10.0f;
  MoeWeightDtype dtype = MoeWeightDtype::kBf16;
  // bf16 mode: rows per GEMM tile. 0 chooses from host-known numbers: tokens > 256: 128 × 128 tiles; else
  // 16-row tiles when tokens ≤ 16 or tokens·top_k / E ≤ 8 rows per expert, 64 otherwise. 16, 64 or 128 forces one
  // (tests, kbench).
  int tile_rows = 0;
};

// Expert weights in the checkpoint's [out, in] row-major layout, bf16 (uint16_t bits) or fp32 per `dtype`.
// w13 and w2 are DEVICE arrays of `experts` device pointers (one per expert; entries may alias), so the
// experts need not be contiguous. Every pointer 16-byte aligned.
struct MoeExpertWeights {
  const void* const* w13 = nullptr;  // [E] -> [2I, D]: gate rows 0..I-1, then up rows I..2I-1
  const void* const* w2 = nullptr;   // [E] -> [D, I]
  const void* shared_w13 = nullptr;  // [2I, D]
  const void* shared_w2 = nullptr;   // [D, I]
};

// Device workspace for one call: the routing tables, x in bf16, h [(tokens·(top_k + 1)), I] and
// y [(tokens·(top_k + 1)), D] fp32 (the largest part: tokens · (top_k + 1) · D · 4 bytes).
size_t moe_experts_workspace_bytes(const MoeExpertsParams& p);

// x: device fp32 [tokens, D]; chosen: device int32 [tokens, top_k] (an id outside [0, E) contributes nothing);
// weights: device fp32 [tokens, top_k]; out: device fp32 [tokens, D] (must not alias x). All on `stream`.
// Returns cudaErrorInvalidValue for unsupported shapes or a short workspace, else the launch status.
cudaError_t moe_experts(const MoeExpertsParams& p, const MoeExpertWeights& w, const float* x,
                        const int32_t* chosen, const float* weights, float* out, void* workspace,
                        size_t workspace_bytes, cudaStream_t stream);

}  // namespace dsv4::ops::cuda
