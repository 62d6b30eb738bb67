// kbench suite "moe": the routed + shared experts of one MoE layer (ops/cuda/moe_experts.h), bf16 weights, at
// the V4-Flash shape (D 4096, I 2048, top-k 6, E 256; also E 16, the test model): decode batch 1 / 8 / 32 /
// 128 and a 4096-token prefill, each with the automatic tile choice and some forced ones, plus batch 1
// replayed from a CUDA graph. Routing: random distinct experts per token (host mt19937), copied to the device
// before timing. Bytes = the unique expert weight bytes the call must read ((distinct chosen experts + the
// shared one) · 3·D·I·2), FLOPs = 2 · (tokens · (top_k + 1)) · 3·D·I. The L2 is flushed before every timed
// call (kbench.h). "mxfp4" / "q3" / "q2" cases: the routed experts as the release stores them (packed e2m1 +
// UE8M0 per 32) or requantized by --expert-bits (3.5 / 2.5 bits/param with bf16 scales), decoded in the
// kernel, the shared expert bf16; bytes = distinct routed experts · 3·D·I · bits/param / 8 + the shared bf16
// one.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <cuda_bf16.h>

#include "../../tests/ops/cuda/device_problem.h"
#include "kbench.h"
#include "ops/cuda/device.h"
#include "ops/cuda/moe_experts.h"

namespace dsv4::kbench {
namespace {

constexpr int64_t kD = 4096, kI = 2048, kTopK = 6, kMaxExperts = 256, kMaxTokens = 4096;

// Random bf16 in [-scale, scale): an integer hash per element (never zeros, no host round trip).
__global__ void fill_bf16(__nv_bfloat16* out, size_t n, uint32_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 0x9E3779B1u ^ seed ^ static_cast<uint32_t>(i >> 32) * 0x85EBCA6Bu;
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
    out[i] = __float2bfloat16((static_cast<float>(h) * 0x1p-31f - 1.0f) * scale);
  }
}

// Random bytes lo + (hash % span): e2m1 code pairs (span 256) or UE8M0 scales near 2^-6.
__global__ void fill_bytes(uint8_t* out, size_t n, uint32_t seed, uint32_t lo, uint32_t span) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 0x9E3779B1u ^ seed ^ static_cast<uint32_t>(i >> 32) * 0x85EBCA6Bu;
    h ^= h >> 15;
    h *= 0x2C1B3C6Du;
    h ^= h >> 12;
    out[i] = static_cast<uint8_t>(lo + h % span);
  }
}

struct MoeBench {
  __nv_bfloat16 *w13 = nullptr, *w2 = nullptr;  // experts 0..255 then the shared one (index 256)
  const void** w13_table = nullptr;
  const void** w2_table = nullptr;
  struct Grouped {  // routed experts in one grouped format
    uint8_t *codes13 = nullptr, *codes2 = nullptr, *scales13 = nullptr, *scales2 = nullptr;
    const void** code13_table = nullptr;
    const void** code2_table = nullptr;
    const void** scale13_table = nullptr;
    const void** scale2_table = nullptr;
  };
  Grouped grouped[3];  // MXFP4, Q3, Q2 (format 1, 2, 3)
  float *x = nullptr, *routing = nullptr, *out = nullptr;
  int32_t* chosen = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;

  MoeBench() {
    const size_t w13_elems = size_t{2} * kI * kD, w2_elems = size_t{kD} * kI;
    DSV4_CUDA_OK(cudaMalloc(&w13, (kMaxExperts + 1) * w13_elems * 2));
    DSV4_CUDA_OK(cudaMalloc(&w2, (kMaxExperts + 1) * w2_elems * 2));
    fill_bf16<<<4096, 256>>>(w13, (kMaxExperts + 1) * w13_elems, 11, 2.0f / 64);
    fill_bf16<<<4096, 256>>>(w2, (kMaxExperts + 1) * w2_elems, 12, 2.0f / 45);
    DSV4_CUDA_OK(cudaGetLastError());
    std::vector<const void*> t13, t2;
    for (int64_t e = 0; e < kMaxExperts; ++e) {
      t13.push_back(w13 + e * w13_elems);
      t2.push_back(w2 + e * w2_elems);
    }
    w13_table = to_device_ptrs(t13);
    w2_table = to_device_ptrs(t2);
    // Routed experts in the grouped formats: random code bytes (any byte is a valid code), scales near 2^-6.
    for (int f = 0; f < 3; ++f) {
      const int bits = 4 - f;
      Grouped& g = grouped[f];
      const size_t code13 = ops::cuda::moe_kernel_code_bytes(bits, 2 * kI, kD);
      const size_t code2 = ops::cuda::moe_kernel_code_bytes(bits, kD, kI);
      const size_t scale13 = bits == 4 ? ops::cuda::mxfp4_tile_scale_bytes(2 * kI, kD)
                                       : ops::cuda::grouped_tile_scale_bytes(2 * kI, kD);
      const size_t scale2 =
          bits == 4 ? ops::cuda::mxfp4_tile_scale_bytes(kD, kI) : ops::cuda::grouped_tile_scale_bytes(kD, kI);
      DSV4_CUDA_OK(cudaMalloc(&g.codes13, kMaxExperts * code13));
      DSV4_CUDA_OK(cudaMalloc(&g.codes2, kMaxExperts * code2));
      DSV4_CUDA_OK(cudaMalloc(&g.scales13, kMaxExperts * scale13));
      DSV4_CUDA_OK(cudaMalloc(&g.scales2, kMaxExperts * scale2));
      fill_bytes<<<4096, 256>>>(g.codes13, kMaxExperts * code13, 21 + f, 0, 256);
      fill_bytes<<<4096, 256>>>(g.codes2, kMaxExperts * code2, 22 + f, 0, 256);
      if (bits == 4) {
        fill_bytes<<<1024, 256>>>(g.scales13, kMaxExperts * scale13, 23, 119, 3);
        fill_bytes<<<1024, 256>>>(g.scales2, kMaxExperts * scale2, 24, 119, 3);
      } else {
        fill_bf16<<<1024, 256>>>(reinterpret_cast<__nv_bfloat16*>(g.scales13), kMaxExperts * scale13 / 2, 25,
                                 0.02f);
        fill_bf16<<<1024, 256>>>(reinterpret_cast<__nv_bfloat16*>(g.scales2), kMaxExperts * scale2 / 2, 26,
                                 0.02f);
      }
      DSV4_CUDA_OK(cudaGetLastError());
      std::vector<const void*> c13, c2, s13, s2;
      for (int64_t e = 0; e < kMaxExperts; ++e) {
        c13.push_back(g.codes13 + e * code13);
        c2.push_back(g.codes2 + e * code2);
        s13.push_back(g.scales13 + e * scale13);
        s2.push_back(g.scales2 + e * scale2);
      }
      g.code13_table = to_device_ptrs(c13);
      g.code2_table = to_device_ptrs(c2);
      g.scale13_table = to_device_ptrs(s13);
      g.scale2_table = to_device_ptrs(s2);
    }
    std::mt19937 rng(5);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> hx(static_cast<size_t>(kMaxTokens * kD));
    for (auto& v : hx) v = normal(rng);
    x = testing::to_device(hx);
    DSV4_CUDA_OK(cudaMalloc(&out, hx.size() * 4));
    DSV4_CUDA_OK(cudaMalloc(&routing, kMaxTokens * kTopK * 4));
    DSV4_CUDA_OK(cudaMalloc(&chosen, kMaxTokens * kTopK * 4));
    ops::cuda::MoeExpertsParams p = params(kMaxTokens, kMaxExperts, 0);
    workspace_bytes = ops::cuda::moe_experts_workspace_bytes(p);
    DSV4_CUDA_OK(cudaMalloc(&workspace, workspace_bytes));
    DSV4_CUDA_OK(cudaDeviceSynchronize());
  }
  ~MoeBench() {
    for (void* p : {static_cast<void*>(w13), static_cast<void*>(w2), static_cast<void*>(w13_table),
                    static_cast<void*>(w2_table), static_cast<void*>(x), static_cast<void*>(routing),
                    static_cast<void*>(out), static_cast<void*>(chosen), workspace})
      cudaFree(p);
    for (const Grouped& g : grouped)
      for (void* p : {static_cast<void*>(g.codes13), static_cast<void*>(g.codes2),
                      static_cast<void*>(g.scales13), static_cast<void*>(g.scales2),
                      static_cast<void*>(g.code13_table), static_cast<void*>(g.code2_table),
                      static_cast<void*>(g.scale13_table), static_cast<void*>(g.scale2_table)})
        cudaFree(p);
  }
  static const void** to_device_ptrs(const std::vector<const void*>& host) {
    const void** d = nullptr;
    DSV4_CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&d), host.size() * sizeof(void*)));
    DSV4_CUDA_OK(cudaMemcpy(d, host.data(), host.size() * sizeof(void*), cudaMemcpyHostToDevice));
    return d;
  }
  // format: 0 bf16, 1 MXFP4, 2 Q3, 3 Q2 (routed experts).
  static ops::cuda::MoeExpertsParams params(int64_t tokens, int64_t experts, int tile_rows, int format = 0) {
    ops::cuda::MoeExpertsParams p;
    p.tokens = tokens;
    p.top_k = kTopK;
    p.experts = experts;
    p.hidden = kD;
    p.intermediate = kI;
    p.swiglu_limit = 10.0f;
    constexpr ops::cuda::MoeWeightDtype kFormats[4] = {
        ops::cuda::MoeWeightDtype::kBf16, ops::cuda::MoeWeightDtype::kMxfp4,
        ops::cuda::MoeWeightDtype::kQ3G32, ops::cuda::MoeWeightDtype::kQ2G32};
    p.dtype = kFormats[format];
    p.tile_rows = tile_rows;
    return p;
  }
  ops::cuda::MoeExpertWeights weights(int format = 0) const {
    ops::cuda::MoeExpertWeights w;
    w.w13 = format ? grouped[format - 1].code13_table : w13_table;
    w.w2 = format ? grouped[format - 1].code2_table : w2_table;
    if (format) {
      w.w13_scales = grouped[format - 1].scale13_table;
      w.w2_scales = grouped[format - 1].scale2_table;
    }
    w.shared_w13 = w13 + kMaxExperts * size_t{2} * kI * kD;
    w.shared_w2 = w2 + kMaxExperts * size_t{kD} * kI;
    return w;
  }
  // Random distinct experts per token; returns how many distinct experts were chosen.
  int64_t route(int64_t tokens, int64_t experts, uint32_t seed) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> weight(0.05f, 0.5f);
    std::vector<int32_t> ids(static_cast<size_t>(experts)), hc;
    std::vector<float> hw;
    std::set<int32_t> distinct;
    for (int64_t e = 0; e < experts; ++e) ids[e] = static_cast<int32_t>(e);
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t k = 0; k < kTopK; ++k) {
        std::swap(ids[k], ids[k + rng() % (experts - k)]);  // partial Fisher-Yates
        hc.push_back(ids[k]);
        distinct.insert(ids[k]);
        hw.push_back(weight(rng));
      }
    }
    DSV4_CUDA_OK(cudaMemcpy(chosen, hc.data(), hc.size() * 4, cudaMemcpyHostToDevice));
    DSV4_CUDA_OK(cudaMemcpy(routing, hw.data(), hw.size() * 4, cudaMemcpyHostToDevice));
    return static_cast<int64_t>(distinct.size());
  }
};

void keep_busy(const std::function<void()>& launch) {
  // The GPU idles while the host builds a case and its clock drops; ~100 ms of back-to-back calls first.
  cudaEvent_t start, stop;
  DSV4_CUDA_OK(cudaEventCreate(&start));
  DSV4_CUDA_OK(cudaEventCreate(&stop));
  for (float busy_ms = 0; busy_ms < 100.0f;) {
    DSV4_CUDA_OK(cudaEventRecord(start));
    for (int i = 0; i < 20; ++i) launch();
    DSV4_CUDA_OK(cudaEventRecord(stop));
    DSV4_CUDA_OK(cudaEventSynchronize(stop));
    float ms = 0;
    DSV4_CUDA_OK(cudaEventElapsedTime(&ms, start, stop));
    busy_ms += ms;
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

bool output_finite(const MoeBench& b, int64_t tokens) {
  std::vector<float> host(static_cast<size_t>(tokens * kD));
  DSV4_CUDA_OK(cudaMemcpy(host.data(), b.out, host.size() * 4, cudaMemcpyDeviceToHost));
  for (const float v : host)
    if (!std::isfinite(v)) return false;
  return true;
}

CaseResult run_case(MoeBench& b, const Ceilings& ceilings, int64_t tokens, int64_t experts, int tile_rows,
                    bool graph, int iterations, int format) {
  const int64_t active = b.route(tokens, experts, static_cast<uint32_t>(tokens * 1000 + experts));
  const ops::cuda::MoeExpertsParams p = MoeBench::params(tokens, experts, tile_rows, format);
  const ops::cuda::MoeExpertWeights w = b.weights(format);
  cudaStream_t stream = nullptr;
  cudaGraphExec_t exec = nullptr;
  cudaGraph_t g = nullptr;
  auto direct = [&] {
    DSV4_CUDA_OK(ops::cuda::moe_experts(p, w, b.x, b.chosen, b.routing, b.out, b.workspace, b.workspace_bytes,
                                        stream));
  };
  std::function<void()> launch = direct;
  if (graph) {
    DSV4_CUDA_OK(cudaStreamCreate(&stream));  // blocking: ordered with the legacy stream the timer records on
    DSV4_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    direct();
    DSV4_CUDA_OK(cudaStreamEndCapture(stream, &g));
    DSV4_CUDA_OK(cudaGraphInstantiate(&exec, g, 0));
    launch = [&] { DSV4_CUDA_OK(cudaGraphLaunch(exec, stream)); };
  }
  keep_busy(launch);
  const double us = time_kernel_us(launch, iterations);
  DSV4_CUDA_OK(cudaDeviceSynchronize());
  const bool finite = output_finite(b, tokens);
  if (graph) {
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(g);
    cudaStreamDestroy(stream);
  }
  const double expert_bytes = 3.0 * kD * kI * 2;
  constexpr double kBitsPerParam[4] = {16.0, 4.25, 3.5, 2.5};  // scales included
  const double routed_bytes = 3.0 * kD * kI * kBitsPerParam[format] / 8.0;
  constexpr const char* kFormatNames[4] = {"", " mxfp4", " q3", " q2"};
  CaseResult r;
  char name[128];
  std::snprintf(name, sizeof name, "moe%s E=%lld %s=%lld tiles=%s%s", kFormatNames[format],
                static_cast<long long>(experts), tokens > 128 ? "prefill" : "b",
                static_cast<long long>(tokens), tile_rows == 0 ? "auto" : std::to_string(tile_rows).c_str(),
                graph ? " graph" : "");
  r.name = name;
  r.microseconds = us;
  r.bytes = static_cast<double>(active) * routed_bytes + expert_bytes;
  r.flops = 2.0 * static_cast<double>(tokens * (kTopK + 1)) * 3.0 * kD * kI;
  char note[160];
  std::snprintf(note, sizeof note, "%lld+1 experts, %.0f MB weights, %.1f%% of copy bw%s",
                static_cast<long long>(active), r.bytes / 1e6,
                100.0 * r.bytes / (us * 1e-6) / ceilings.copy_bytes_per_second, finite ? "" : " NON-FINITE OUTPUT");
  r.note = note;
  return r;
}

std::vector<CaseResult> moe_suite(const Ceilings& ceilings, const Options& options) {
  std::vector<CaseResult> results;
  if (ops::cuda::list_devices().empty()) return results;
  const int iterations = options.quick ? 5 : 30;
  MoeBench b;
  struct Case {
    int64_t tokens, experts;
    int tile_rows;
    bool graph;
    int format = 0;
  };
  std::vector<Case> cases = {{1, 256, 0, false},   {1, 256, 0, true},    {8, 256, 0, false},
                             {32, 256, 0, false},  {32, 256, 16, false}, {128, 256, 0, false},
                             {128, 256, 16, false}, {128, 256, 128, false}, {1, 16, 0, false},
                             {32, 16, 0, false},   {128, 16, 0, false},  {128, 16, 16, false},
                             {4096, 256, 0, false}, {4096, 256, 64, false}};
  // Grouped routed experts beside their bf16 twins above: MXFP4 (1), Q3 (2), Q2 (3).
  for (int format = 1; format <= 3; ++format)
    for (const Case c : std::vector<Case>{{1, 256, 0, false},
                                          {1, 256, 0, true},
                                          {8, 256, 0, false},
                                          {32, 256, 0, false},
                                          {128, 256, 0, false},
                                          {1, 16, 0, false},
                                          {128, 16, 0, false},
                                          {4096, 256, 0, false}})
      cases.push_back({c.tokens, c.experts, c.tile_rows, c.graph, format});
  if (options.quick)
    cases = {{1, 256, 0, false},      {128, 256, 0, false},     {4096, 256, 0, false}, {1, 256, 0, false, 1},
             {128, 256, 0, false, 1}, {4096, 256, 0, false, 1}, {1, 256, 0, false, 3}};
  for (const Case& c : cases)
    results.push_back(run_case(b, ceilings, c.tokens, c.experts, c.tile_rows, c.graph,
                               c.tokens > 128 ? std::max(5, iterations / 3) : iterations, c.format));
  return results;
}

const bool registered = register_suite("moe", moe_suite);

}  // namespace
}  // namespace dsv4::kbench
