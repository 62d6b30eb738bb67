// kbench suite "hc": the small per-layer ops of a V4-Flash layer that a prefill pays in bandwidth (docs/PERF.md
// "HF on the same H100, and the prefill's small ops"): mHC hc_pre (the mixes and the collapse with the sublayer's
// RMSNorm fused; from 512 tokens the tensor-core mixes, and the split-K kernel beside them via DSV4_HC_MIX_KERNEL),
// hc_post, hc_post fused with the next hc_pre (beside the two calls), and the per-head norm + RoPE of q (ops/cuda/head_norm_rope). Random N(0, 1) inputs (fn scaled as the
// tests draw it), L2 flushed; bytes are the unique bytes read and written.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "../../tests/ops/cuda/cuda_ok.h"
#include "kbench.h"
#include "ops/cuda/device.h"
#include "ops/cuda/head_norm_rope.h"
#include "ops/cuda/hyper_connection.h"
#include "ops/cuda/random_fill.h"

namespace dsv4::kbench {
namespace {

constexpr int64_t kHc = 4, kHidden = 4096;         // V4-Flash
constexpr int64_t kHeads = 64, kHeadDim = 512, kRopeDim = 64;

// A device buffer of `count` floats drawn N(0, scale²) (or uniform in [lo, lo + scale) for `uniform`).
float* random_floats(int64_t count, uint64_t seed, double scale = 1.0, bool uniform = false, double lo = 0.0) {
  float* p = nullptr;
  DSV4_CUDA_OK(cudaMalloc(&p, static_cast<size_t>(std::max<int64_t>(count, 1)) * sizeof(float)));
  RandomFill fill;
  fill.kind = uniform ? RandomFill::Kind::kUniform : RandomFill::Kind::kNormal;
  fill.start = seed;
  fill.offset = lo;
  fill.scale = scale;
  DSV4_CUDA_OK(ops::cuda::fill_random(fill, p, count, nullptr));
  return p;
}

std::string shape(const char* what, int64_t tokens) { return std::string(what) + " t=" + std::to_string(tokens); }

// What an hc_pre call reads besides the streams and writes, at V4-Flash widths for `tokens`: fn, base, scale and
// the fused norm's weight drawn from seeds `seed` … `seed` + 3; the collapsed row (fp32 and bf16), post, comb
// and the workspace. Freed with the case.
struct PreOperands {
  static constexpr int64_t kWidth = kHc * kHidden, kMixes = (2 + kHc) * kHc;
  float *fn, *base, *scale, *norm_weight;
  float *collapsed = nullptr, *post = nullptr, *comb = nullptr;
  uint16_t* bf16 = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes;
  ops::cuda::HyperConnectionParams params;
  ops::cuda::CollapseNorm norm;

  PreOperands(int64_t tokens, uint64_t seed)
      : fn(random_floats(kMixes * kWidth, seed, 0.02)),
        base(random_floats(kMixes, seed + 1, 0.5)),
        scale(random_floats(3, seed + 2, 1.5, /*uniform=*/true, 0.5)),
        norm_weight(random_floats(kHidden, seed + 3, 1.0, true, 0.5)),
        workspace_bytes(ops::cuda::hc_workspace_bytes(tokens, kHc)),
        params{tokens, kHc, kHidden, 20, 1e-6f, 1e-6f} {
    DSV4_CUDA_OK(cudaMalloc(&collapsed, tokens * kHidden * sizeof(float)));
    DSV4_CUDA_OK(cudaMalloc(&bf16, tokens * kHidden * sizeof(uint16_t)));
    DSV4_CUDA_OK(cudaMalloc(&post, tokens * kHc * sizeof(float)));
    DSV4_CUDA_OK(cudaMalloc(&comb, tokens * kHc * kHc * sizeof(float)));
    DSV4_CUDA_OK(cudaMalloc(&workspace, workspace_bytes));
    norm = {norm_weight, 1e-6f, bf16};
  }
  PreOperands(const PreOperands&) = delete;
  PreOperands& operator=(const PreOperands&) = delete;
  ~PreOperands() {
    for (void* ptr : {static_cast<void*>(fn), static_cast<void*>(base), static_cast<void*>(scale),
                      static_cast<void*>(norm_weight), static_cast<void*>(collapsed), static_cast<void*>(bf16),
                      static_cast<void*>(post), static_cast<void*>(comb), workspace})
      cudaFree(ptr);
  }
};

CaseResult hc_pre_case(int64_t tokens, const char* mix_kernel, int iterations) {
  const int64_t width = PreOperands::kWidth, mixes = PreOperands::kMixes;
  float* streams = random_floats(tokens * width, 1);
  PreOperands pre(tokens, 2);
  if (mix_kernel != nullptr)
    setenv("DSV4_HC_MIX_KERNEL", mix_kernel, 1);
  else
    unsetenv("DSV4_HC_MIX_KERNEL");
  const double us = time_kernel_us(
      [&] {
        DSV4_CUDA_OK(ops::cuda::hc_pre(pre.params, streams, pre.fn, pre.base, pre.scale, pre.collapsed, pre.post,
                                     pre.comb, pre.workspace, pre.workspace_bytes, nullptr, &pre.norm));
      },
      iterations);
  unsetenv("DSV4_HC_MIX_KERNEL");
  CaseResult r;
  r.name = shape(mix_kernel ? "hc_pre (split-K mixes)" : "hc_pre", tokens);
  r.microseconds = us;
  r.flops = 2.0 * tokens * width * (mixes + 1);
  // The streams twice (the mixes, then the collapse), fn, the collapsed row in fp32 and bf16.
  r.bytes = 2.0 * tokens * width * 4 + mixes * width * 4.0 + tokens * kHidden * 6.0;
  r.note = "streams read twice";
  cudaFree(streams);
  return r;
}

CaseResult hc_post_case(int64_t tokens, int iterations) {
  const int64_t width = kHc * kHidden;
  float* y = random_floats(tokens * kHidden, 11);
  float* streams = random_floats(tokens * width, 12);
  float* post = random_floats(tokens * kHc, 13, 2.0, true, 0.0);
  float* comb = random_floats(tokens * kHc * kHc, 14, 1.0, true, 0.0);
  float* out = nullptr;
  DSV4_CUDA_OK(cudaMalloc(&out, tokens * width * sizeof(float)));
  const ops::cuda::HyperConnectionParams p{tokens, kHc, kHidden, 20, 1e-6f, 1e-6f};
  const double us =
      time_kernel_us([&] { DSV4_CUDA_OK(ops::cuda::hc_post(p, y, streams, post, comb, out, nullptr)); }, iterations);
  CaseResult r;
  r.name = shape("hc_post", tokens);
  r.microseconds = us;
  r.bytes = tokens * kHidden * 4.0 + 2.0 * tokens * width * 4;
  for (void* ptr : {static_cast<void*>(y), static_cast<void*>(streams), static_cast<void*>(post),
                    static_cast<void*>(comb), static_cast<void*>(out)})
    cudaFree(ptr);
  return r;
}

// hc_post then the next hc_pre (norm fused), as the model calls them between sublayers: one kernel for the new
// streams and their mixes (`fused`: DSV4_HC_POST_MIX=1), or the two calls; `handover`: the one-launch decode
// hand-over (≤ 8 tokens, the default where barrier words are passed; the two calls get none).
CaseResult hc_post_pre_case(int64_t tokens, bool fused, int iterations, bool handover = false) {
  const int64_t width = PreOperands::kWidth, mixes = PreOperands::kMixes;
  float* y = random_floats(tokens * kHidden, 31);
  float* streams = random_floats(tokens * width, 32);
  float* post = random_floats(tokens * kHc, 33, 2.0, true, 0.0);
  float* comb = random_floats(tokens * kHc * kHc, 34, 1.0, true, 0.0);
  PreOperands next(tokens, 35);  // the next sublayer's hc_pre
  float* out = nullptr;
  DSV4_CUDA_OK(cudaMalloc(&out, tokens * width * sizeof(float)));
  // Opt-in (ops/cuda/hyper_connection.h): "1" fuses; a caller's "3" (the 3-CTA build) is kept.
  const char* before = std::getenv("DSV4_HC_POST_MIX");
  const std::string saved = before ? before : "";
  if (!fused) unsetenv("DSV4_HC_POST_MIX");
  else if (saved != "3") setenv("DSV4_HC_POST_MIX", "1", 1);
  unsigned* sync = nullptr;
  if (handover) {
    DSV4_CUDA_OK(cudaMalloc(&sync, ops::cuda::kHcHandoverSyncBytes));
    DSV4_CUDA_OK(cudaMemset(sync, 0, ops::cuda::kHcHandoverSyncBytes));
  }
  const double us = time_kernel_us(
      [&] {
        DSV4_CUDA_OK(ops::cuda::hc_post_pre(next.params, y, streams, post, comb, out, next.fn, next.base, next.scale,
                                          next.collapsed, next.post, next.comb, next.workspace, next.workspace_bytes,
                                          nullptr, &next.norm, sync));
      },
      iterations);
  if (before) setenv("DSV4_HC_POST_MIX", saved.c_str(), 1);
  else unsetenv("DSV4_HC_POST_MIX");
  cudaFree(sync);
  CaseResult r;
  r.name = shape(handover ? "hc_post + hc_pre (one-launch hand-over)"
                 : fused  ? "hc_post + hc_pre"
                          : "hc_post + hc_pre (two calls)",
                 tokens);
  r.microseconds = us;
  r.flops = 2.0 * tokens * width * (mixes + 1);
  // What one kernel must move: y and the old streams read, the new streams written and read back by the
  // collapse, fn, the collapsed row in fp32 and bf16.
  r.bytes = tokens * kHidden * 4.0 + 3.0 * tokens * width * 4 + mixes * width * 4.0 + tokens * kHidden * 6.0;
  r.note = fused ? "" : "the new streams read twice";
  for (void* ptr : {static_cast<void*>(y), static_cast<void*>(streams), static_cast<void*>(post),
                    static_cast<void*>(comb), static_cast<void*>(out)})
    cudaFree(ptr);
  return r;
}

CaseResult q_norm_rope_case(int64_t tokens, int iterations) {
  float* q = random_floats(tokens * kHeads * kHeadDim, 21);
  float* inv_freq = random_floats(kRopeDim / 2, 22, 1.0, true, 0.0);
  std::vector<int32_t> host_positions(static_cast<size_t>(tokens));
  for (int64_t t = 0; t < tokens; ++t) host_positions[static_cast<size_t>(t)] = static_cast<int32_t>(t);
  int32_t* positions = nullptr;
  uint16_t* bf16 = nullptr;
  DSV4_CUDA_OK(cudaMalloc(&positions, tokens * sizeof(int32_t)));
  DSV4_CUDA_OK(cudaMemcpy(positions, host_positions.data(), tokens * sizeof(int32_t), cudaMemcpyHostToDevice));
  DSV4_CUDA_OK(cudaMalloc(&bf16, tokens * kHeads * kHeadDim * sizeof(uint16_t)));
  // The tuned attention reads only the bf16 q: no fp32 write-back (the model's call at V4 shapes).
  const ops::cuda::HeadNormRopeParams p{tokens, kHeads, kHeadDim, kRopeDim, true, 1e-6f, 1.0f, /*keep_fp32=*/false};
  const double us = time_kernel_us(
      [&] { DSV4_CUDA_OK(ops::cuda::head_norm_rope(p, q, nullptr, positions, inv_freq, bf16, nullptr)); }, iterations);
  CaseResult r;
  r.name = shape("q norm + rope (64 x 512)", tokens);
  r.microseconds = us;
  r.bytes = tokens * kHeads * kHeadDim * 6.0;
  for (void* ptr : {static_cast<void*>(q), static_cast<void*>(inv_freq), static_cast<void*>(positions),
                    static_cast<void*>(bf16)})
    cudaFree(ptr);
  return r;
}

std::vector<CaseResult> hc_suite(const Ceilings&, const Options& options) {
  std::vector<CaseResult> results;
  if (ops::cuda::list_devices().empty()) return results;
  const int iterations = options.quick ? 5 : 20;
  const std::vector<int64_t> token_counts =
      options.quick ? std::vector<int64_t>{1, 1024} : std::vector<int64_t>{1, 8, 32, 128, 1024, 2048, 4096};
  // The two decode hand-over forms: hc_post and hc_pre as two calls, and as one launch (≤ 8 tokens).
  auto hand_over_forms = [&](int64_t tokens) {
    if (options.wants(shape("hc_post + hc_pre (two calls)", tokens)))
      results.push_back(hc_post_pre_case(tokens, false, iterations));
    if (tokens <= 8 && options.wants(shape("hc_post + hc_pre (one-launch hand-over)", tokens)))
      results.push_back(hc_post_pre_case(tokens, false, iterations, true));
  };
  for (const int64_t tokens : token_counts) {
    if (options.wants(shape("hc_pre", tokens))) results.push_back(hc_pre_case(tokens, nullptr, iterations));
    if (tokens >= 512 && options.wants(shape("hc_pre (split-K mixes)", tokens)))
      results.push_back(hc_pre_case(tokens, "simt", iterations));
    if (options.wants(shape("hc_post", tokens))) results.push_back(hc_post_case(tokens, iterations));
    if (options.wants(shape("hc_post + hc_pre", tokens))) results.push_back(hc_post_pre_case(tokens, true, iterations));
    hand_over_forms(tokens);
    if (options.wants(shape("q norm + rope (64 x 512)", tokens)))
      results.push_back(q_norm_rope_case(tokens, iterations));
  }
  // The two forms at the batch sizes between 1 and 8 too (the one launch, default up to 8 tokens, measured faster
  // at each: docs/PERF.md "One token a hand-over group, timed").
  if (!options.quick)
    for (const int64_t tokens : {int64_t{2}, int64_t{4}}) hand_over_forms(tokens);
  return results;
}

const bool registered = register_suite("hc", hc_suite);

}  // namespace
}  // namespace dsv4::kbench
