// The routed + shared experts of one MoE layer on the device: the CUDA twin of the kHf expert loop of
// DeepseekV4Model::moe (ops/cpu/linear.h + ops/cpu/moe.h swiglu_clamped), routing already computed.
//
//   out[t] = Σ_k weights[t, k] · expert_{chosen[t, k]}(x[t]) + shared(x[t])
//   expert(x) = w2 · (silu(min(g, limit)) · clamp(u, −limit, limit)),  g = w13[0 : I] · x,  u = w13[I : 2I] ·
//   x
//
// Steps, all on the device, no host synchronisation, no allocation (CUDA-graph capturable):
//   1. prep: one CTA counts the rows per expert, scans them into offsets, lists the GEMM work items
//      (expert, 16/64/128-row block) and permutes the (token, k) rows expert by expert, stable in token
//      order; the shared expert is expert E with every token; further CTAs convert x to bf16 (bf16 mode).
//   2. gate/up GEMM with the clamped SwiGLU fused in its epilogue -> h [rows, I] (bf16 in bf16 mode).
//   3. down GEMM -> y [rows, D] fp32, one row per (token, k) and per token for the shared expert.
//   4. combine: out[t] = Σ_k weights[t, k] · y[row(t, k)] in k order, then + y[shared row of t]
//      (fixed order, no float atomics: bitwise repeatable).
// The GEMMs run on a grid sized from host-known numbers only (tokens, top_k, E, D, I); CTAs whose work item
// is past the device-computed item count exit at once.
//
// bf16 mode (serving): weights bf16, x rounded to bf16, mma.sync m16n8k16 with fp32 accumulation, h rounded
// to bf16 before the down projection; each CTA streams its weight columns once through a cp.async pipeline
// (16-byte loads, 64-wide k tiles, swizzled shared memory), one CTA per (work item, column tile). Tiles (rows
// × weight rows): 16 × 64 (4 warps, 4 stages) for decode, 64 × 64 (4 warps) for mid batches, 128 × 128 (8
// warps, 3 stages) for prefill; the gate/up tile pairs 8 gate rows with the 8 matching up rows so SwiGLU
// stays in registers. Grid: x = column tiles (fastest, so a work item's A rows stay in L2), y = the work-item
// bound. fp32 mode (exact): plain fp32 FMA, one warp per output dot product; for correctness, not speed.
//
// MXFP4 mode (the released checkpoints' routed experts, kept 4.25 bits/param on the device): the bf16 mode
// with the routed experts' weights read as e2m1 codes + one UE8M0 scale per 32 inputs and decoded in the
// kernel (Hopper has no FP4 tensor cores; vLLM's Marlin path does the same, W4A16). Each k tile's codes and
// scales come in through the same cp.async pipeline (a quarter of the bf16 bytes); every lane turns its own
// codes straight into its mma B-fragment registers (a shift, two masks and one exact power-of-two bf16
// multiply per pair: the codes are stored in the fragment order, moe_kernel_codes). Every decoded value is
// exact in bf16 and the mma order is the bf16 mode's, so the result is bitwise the bf16 mode's over the
// decoded weights. The shared expert stays bf16.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace dsv4::ops::cuda {

// kMxfp4 / kQ3G32 / kQ2G32: the routed experts in that grouped low-bit format (the release's MXFP4, or
// --expert-bits 3.5 / 2.5: per 32 inputs a bf16 scale s and codes c, value (c − 4)·s / (c − 1.5)·s), decoded
// in the kernel; bf16 arithmetic otherwise, the shared expert bf16.
enum class MoeWeightDtype { kBf16, kFp32, kMxfp4, kQ3G32, kQ2G32 };

// The shared expert in this call (kWith), alone (kOnly: out = shared(x); chosen, weights and the routed
// tables unused), or left out with its output added by the combine (kAdded: moe_experts' shared_out, from a
// kOnly call, usually on another stream so that its GEMMs overlap the router and this call's routed GEMMs).
// kOnly then kAdded with the same params otherwise is bitwise kWith: the same tiles, rows and combine order.
enum class MoeSharedExpert { kWith, kOnly, kAdded };

struct MoeExpertsParams {
  int64_t tokens = 0;        // rows of x and out
  int64_t top_k = 0;         // routed experts per token, 1..16
  int64_t experts = 0;       // E routed experts (1 ≤ E ≤ 1023)
  int64_t hidden = 0;        // D (multiple of 8)
  int64_t intermediate = 0;  // I (multiple of 8)
  float swiglu_limit = 10.0f;
  MoeWeightDtype dtype = MoeWeightDtype::kBf16;
  MoeSharedExpert shared = MoeSharedExpert::kWith;
  // bf16 mode: rows per GEMM tile. 0 chooses from host-known numbers: tokens > 256: 128 × 128 tiles; else
  // 16-row tiles when tokens ≤ 16 or tokens·top_k / E ≤ 8 rows per expert, 64 otherwise. 16, 64 or 128 forces one
  // (tests, kbench).
  int tile_rows = 0;
  // Numerics::kDeepSeek (bf16 weights or grouped formats): model.py's Expert and MoE order (research model_spec.md
  // §9; ops::cpu in DeepseekV4Model::moe_deepseek) — the gate/up outputs rounded to bf16 before the SwiGLU, the
  // routing weight applied to the SwiGLU output before its bf16 rounding, that input of w2 through e4m3 per 128
  // (simulate_e4m3_blocks), w2's output rounded to bf16, the combine a plain sum in expert order, the shared expert
  // last. x is expected FP8-simulated already (the model does it once for the router-free experts' input).
  bool deepseek = false;
};

// Expert weights in the checkpoint's [out, in] row-major layout, bf16 (uint16_t bits) or fp32 per `dtype`.
// w13 and w2 are DEVICE arrays of `experts` device pointers (one per expert; entries may alias), so the
// experts need not be contiguous. Every pointer 16-byte aligned.
//
// Grouped formats: w13 / w2 point at each routed expert's codes in the kernel's order (moe_kernel_codes
// below), w13_scales / w2_scales at its scales in the kernel's k-tile-major layout (mxfp4_tile_scales: UE8M0
// bytes, every exponent ≤ 128, mxfp4_kernel_scales_supported; grouped_tile_scales: bf16,
// grouped_kernel_scales_supported); D and I multiples of 32. The shared expert is bf16.
struct MoeExpertWeights {
  const void* const* w13 = nullptr;  // [E] -> [2I, D]: gate rows 0..I-1, then up rows I..2I-1
  const void* const* w2 = nullptr;   // [E] -> [D, I]
  const void* shared_w13 = nullptr;  // [2I, D]
  const void* shared_w2 = nullptr;   // [D, I]
  const void* const* w13_scales = nullptr;  // grouped formats: [E] -> the tile scales of [2I, D]
  const void* const* w2_scales = nullptr;   // grouped formats: [E] -> the tile scales of [D, I]
};

// The codes of a grouped [rows, cols] matrix (cols a multiple of 32) as the host keeps them — bits 4: MXFP4,
// [rows, cols / 2] bytes, the even input in the low nibble; 3 / 2: kQ3G32 / kQ2G32, per row and group of 32 a
// little-endian bit stream of 4·bits bytes (core/linear_weight.h) — rearranged k-tile-major into the mma
// B-fragment order: per 64-wide k tile (a last 32-wide half tile zero padded) and row 32 / 24 / 16 bytes,
// lane t's share (0..3) at 8t (MXFP4: one u32 per group g, pair i's nibbles at bits 12 − 4i, 28 − 4i) or at
// 4t (Q: the low 2 bits, group g pair i at bits 8g + 2i and 16 + 8g + 2i) plus, Q3, 2 bytes at 16 + 2t (the
// third bits at 4g + i and 8 + 4g + i); pair i of group g = inputs 32g + 8i + 2t and + 1.
std::vector<uint8_t> moe_kernel_codes(int bits, int64_t rows, int64_t cols, const uint8_t* codes);
size_t moe_kernel_code_bytes(int bits, int64_t rows, int64_t cols);
// The scales, given row-major [rows, cols / 32], rearranged [ceil(cols / 64)][rows][2 groups] (a missing
// second group of a last half tile is 0): MXFP4 UE8M0 bytes, Q3 / Q2 bf16 bits. rows a multiple of 8.
std::vector<uint8_t> mxfp4_tile_scales(int64_t rows, int64_t cols, const uint8_t* row_major_exponents);
size_t mxfp4_tile_scale_bytes(int64_t rows, int64_t cols);
std::vector<uint8_t> grouped_tile_scales(int64_t rows, int64_t cols, const uint16_t* row_major_scales);
size_t grouped_tile_scale_bytes(int64_t rows, int64_t cols);
// MXFP4: the kernel applies 2^(e − 127) as a bf16 factor 2^(e − 1) (the decoded pairs carry 2^-126): exact
// for e ≤ 128, i.e. scales ≤ 2 (real weights sit far below). Q3 / Q2: the scales must be 0 or normal above
// 2^-120 (Q2 multiplies by s / 2). False: decode such a matrix at upload.
bool mxfp4_kernel_scales_supported(size_t count, const uint8_t* exponents);
bool grouped_kernel_scales_supported(size_t count, const uint16_t* scales);

// Device workspace for one call: the routing tables, x in bf16, h [(tokens·(top_k + 1)), I] and
// y [(tokens·(top_k + 1)), D] fp32 (the largest part: tokens · (top_k + 1) · D · 4 bytes).
size_t moe_experts_workspace_bytes(const MoeExpertsParams& p);

// x: device fp32 [tokens, D]; chosen: device int32 [tokens, top_k] (an id outside [0, E) contributes nothing);
// weights: device fp32 [tokens, top_k]; out: device fp32 [tokens, D] (must not alias x). All on `stream`.
// kAdded: shared_out, device fp32 [tokens, D], the kOnly call's out; shared_ready (optional) an event
// recorded after it, which only the final combine waits for. Returns cudaErrorInvalidValue for unsupported
// shapes, a short workspace or a shared_out that does not match p.shared, else the launch status.
cudaError_t moe_experts(const MoeExpertsParams& p, const MoeExpertWeights& w, const float* x,
                        const int32_t* chosen, const float* weights, float* out, void* workspace,
                        size_t workspace_bytes, cudaStream_t stream, const float* shared_out = nullptr,
                        cudaEvent_t shared_ready = nullptr);

}  // namespace dsv4::ops::cuda
