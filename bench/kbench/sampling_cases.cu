// kbench suite "sampling": the device sampler (ops/cuda/sampling.h) on rows of the real vocabulary (129,280), random
// N(0, 2) logits, at 1 / 32 / 128 rows:
//   greedy        argmax (passes 1-2)
//   top_k 50      temperature 0.7, top_k 50 (passes 1-2: per-chunk candidates by bisection, one sort of their union)
//   temp 1.0      temperature only (passes 1-4: weights summed per chunk, the draw walks one chunk)
//   top_p 0.9     temperature 1.0, top_p 0.9 (passes 1-4: binned weights, gather + sort of the boundary bins)
//   top_p 0.9 lp  the same with logprobs = 5 (+ top-N, log-sum-exp and the rank pass)
//   [passes 1-2 only]  top_p 0.9 without passes 3-4 (no token: a diagnostic, their cost by difference)
// Bytes: the logits read once (rows · vocab · 4); the passes that re-read them come from L2 at small batch. The L2
// is flushed before every timed call (kbench.h), so the first read comes from HBM.
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "kbench.h"
#include "ops/cuda/device.h"
#include "ops/cuda/sampling.h"

namespace dsv4::kbench {
namespace {

constexpr int64_t kVocab = 129280;

void ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) std::fprintf(stderr, "kbench sampling: %s: %s\n", what, cudaGetErrorString(e));
}

struct SamplingCase {
  const char* name;
  double temperature;  // 0: greedy
  int top_k;
  double top_p;
  int logprobs;  // -1: none
  bool diagnostic = false;  // passes 1-2 only (the token is not drawn): the cost of passes 3-4 by difference
};

std::vector<CaseResult> sampling_suite(const Ceilings&, const Options& options) {
  std::vector<CaseResult> results;
  if (ops::cuda::list_devices().empty()) return results;
  const int iterations = options.quick ? 5 : 50;
  const int64_t max_rows = 128;
  std::vector<float> host(static_cast<size_t>(max_rows * kVocab));
  std::mt19937 rng(1234);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  for (auto& v : host) v = normal(rng);
  float* logits = nullptr;
  ok(cudaMalloc(&logits, host.size() * sizeof(float)), "logits");
  ok(cudaMemcpy(logits, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice), "logits upload");
  const size_t ws_bytes = ops::cuda::sampling_workspace_bytes(max_rows, kVocab);
  void* ws = nullptr;
  ok(cudaMalloc(&ws, ws_bytes), "workspace");
  ops::cuda::SamplingRow* params = nullptr;
  ops::cuda::SamplingOutput* out = nullptr;
  ok(cudaMalloc(&params, max_rows * sizeof(ops::cuda::SamplingRow)), "params");
  ok(cudaMalloc(&out, max_rows * sizeof(ops::cuda::SamplingOutput)), "out");
  const SamplingCase cases[] = {{"greedy", 0.0, 0, 1.0, -1},
                                {"top_k 50 t0.7", 0.7, 50, 1.0, -1},
                                {"temp 1.0", 1.0, 0, 1.0, -1},
                                {"top_p 0.9 t1.0", 1.0, 0, 0.9, -1},
                                {"top_p 0.9 t1.0 logprobs 5", 1.0, 0, 0.9, 5},
                                {"top_p 0.9 t1.0 [passes 1-2 only]", 1.0, 0, 0.9, -1, true}};
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  for (const SamplingCase& c : cases)
    for (const int64_t rows : {int64_t{1}, int64_t{32}, int64_t{128}}) {
      std::vector<ops::cuda::SamplingRow> rp(static_cast<size_t>(rows));
      for (auto& r : rp) {
        r.flags = c.temperature == 0.0 ? ops::cuda::kSampleGreedy : 0u;
        r.inv_temperature = c.temperature == 0.0 ? 0.0f : static_cast<float>(1.0 / c.temperature);
        r.top_k = c.top_k;
        r.top_p = c.top_p;
        r.u = uniform(rng);
        if (c.logprobs >= 0) {
          r.flags |= ops::cuda::kSampleLogprobs;
          r.num_logprobs = c.logprobs;
        }
      }
      ok(cudaMemcpy(params, rp.data(), rp.size() * sizeof(rp[0]), cudaMemcpyHostToDevice), "params upload");
      ops::cuda::SamplingArgs a;
      a.logits = logits;
      a.rows = rows;
      a.vocab = kVocab;
      a.logits_stride = kVocab;
      a.params = params;
      a.out = out;
      a.full_path = !c.diagnostic && c.temperature != 0.0 && (c.top_k <= 0 || c.top_k > ops::cuda::kSamplingTopKFast);
      a.logprobs = c.logprobs >= 0;
      a.chunk_extras = a.logprobs || (c.temperature != 0.0 && c.top_k > 0 && c.top_k <= ops::cuda::kSamplingTopKFast);
      cudaError_t status = cudaSuccess;
      auto launch = [&] {
        const cudaError_t e = ops::cuda::sample_tokens(a, ws, ws_bytes, nullptr);
        if (e != cudaSuccess) status = e;
      };
      // Warm the clock up (the GPU idled while the host built the case).
      cudaEvent_t start, stop;
      cudaEventCreate(&start);
      cudaEventCreate(&stop);
      for (float busy_ms = 0; busy_ms < 50.0f;) {
        cudaEventRecord(start);
        for (int i = 0; i < 20; ++i) launch();
        cudaEventRecord(stop);
        cudaEventSynchronize(stop);
        float ms = 0;
        cudaEventElapsedTime(&ms, start, stop);
        busy_ms += ms;
      }
      cudaEventDestroy(start);
      cudaEventDestroy(stop);
      CaseResult r;
      char name[128];
      std::snprintf(name, sizeof name, "sample %s rows=%lld vocab=%lld", c.name, static_cast<long long>(rows),
                    static_cast<long long>(kVocab));
      r.name = name;
      r.microseconds = time_kernel_us(launch, iterations);
      r.bytes = static_cast<double>(rows) * kVocab * 4.0;
      r.note = status == cudaSuccess ? (a.full_path ? "passes 1-4" : "passes 1-2")
                                     : std::string("FAILED: ") + cudaGetErrorString(status);
      if (a.logprobs) r.note += " + rank";
      results.push_back(r);
      if (rows == 1) {  // the same with the L2 left warm: how much of the 1-row time is cold misses
        CaseResult warm = r;
        warm.name += " warm-L2";
        warm.microseconds = time_kernel_us(launch, iterations, false);
        results.push_back(warm);
      }
    }
  cudaFree(logits);
  cudaFree(ws);
  cudaFree(params);
  cudaFree(out);
  return results;
}

const bool registered = register_suite("sampling", sampling_suite);

}  // namespace
}  // namespace dsv4::kbench
