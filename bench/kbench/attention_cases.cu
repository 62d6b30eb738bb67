// kbench suite "attention": the sparse sink attention decode (ops/cuda/sparse_attention.h) on V4 layer shapes.
//   flash-csa  64 heads, window 128 + top-512 compressed entries (FP8 cache)
//   flash-hca  64 heads, window 128 + every compressed entry (context / 128)
//   pro-csa    128 heads, window 128 + top-1024
// at 8K / 128K / 1M context × batch 1 / 32 / 128 (one decode token per request), and an 8K-token prefill of one
// request (positions 0 … 8191, the window from the chunk, per-query picks; plus a SWA layer's). FLOPs: 2 · heads · (512 + 512)
// per key (Q·Kᵀ and P·V); bytes: every distinct entry read once (584 B FP8, 1024 B BF16) plus q, the output and
// the index lists. The L2 is flushed before every timed call (kbench.h), so the entries come from HBM.
#include <cstdio>
#include <string>
#include <vector>

#include "../../tests/ops/cuda/device_problem.h"
#include "kbench.h"
#include "ops/cuda/device.h"
#include "ops/cuda/sparse_attention.h"

namespace dsv4::kbench {
namespace {

struct AttentionCase {
  const char* layer;
  int64_t heads, ratio, top_k, context, batch;
  KvEntryFormat format;
  bool prefill = false;  // one request's `context` tokens from position 0 instead of `batch` decode tokens
};

// FlashMLA's own figures (perf_anchors.md §2.1): H800 SXM5, not an H200; shapes differ (V3.2: topk 2048, s_q 2).
const char* flashmla_note(const AttentionCase& c) {
  if (c.prefill) return "FlashMLA token-sparse prefill 640 TFLOP/s (H800)";
  if (c.batch == 1) return "FlashMLA dense decode 3000 GB/s (H800, mem-bound)";
  return "FlashMLA FP8 sparse decode 410 TFLOP/s (H800, b128 h128 topk2048)";
}

// The case's name without the split count the kernel picks (known only once the problem is built).
std::string case_stem(const AttentionCase& c) {
  char stem[128];
  const char* format = c.format == KvEntryFormat::kFp8 ? "fp8" : "bf16";
  if (c.prefill)
    std::snprintf(stem, sizeof stem, "%s %s prefill %lldK", c.layer, format, static_cast<long long>(c.context / 1024));
  else
    std::snprintf(stem, sizeof stem, "%s %s ctx=%lldK b=%lld", c.layer, format,
                  static_cast<long long>(c.context / 1024), static_cast<long long>(c.batch));
  return stem;
}

// --case: a decode case is asked for by its full name, split count included, or by its stem.
bool wanted(const AttentionCase& c, const Options& options) {
  if (options.cases.empty()) return true;
  const std::string stem = case_stem(c);
  for (const std::string& name : options.cases)
    if (name.rfind(stem, 0) == 0 && (name.size() == stem.size() || name[stem.size()] == ' ')) return true;
  return false;
}

CaseResult run_case(const AttentionCase& c, int iterations) {
  testing::AttentionProblemSpec spec;
  spec.heads = c.heads;
  spec.format = c.format;
  spec.ratio = c.ratio;
  spec.top_k = c.top_k;
  spec.compressed_entries_per_block = c.ratio == 128 ? 2 : 64;
  spec.layers_in_group = 1;
  spec.pick_span = 16384;  // top-k picks spread over 256 blocks per request: the bytes read are the same
  spec.keep_reference = false;
  spec.seed = static_cast<uint32_t>(c.context + c.batch);
  spec.positions.assign(static_cast<size_t>(c.batch), static_cast<int32_t>(c.context - 1));
  testing::AttentionProblem pr =
      c.prefill ? testing::make_prefill_problem(spec, 0, c.context) : testing::make_attention_problem(spec);
  testing::DeviceProblem dev(pr);
  ops::SparseAttentionParams p = dev.params(pr);
  const int sms = ops::cuda::list_devices().front().multiprocessors;
  dev.reserve_workspace(ops::cuda::sparse_attention_workspace_bytes(p, sms));
  auto launch = [&] {
    DSV4_CUDA_OK(ops::cuda::sparse_attention(p, dev.q, dev.out, dev.workspace, dev.workspace_bytes, nullptr));
  };
  // The GPU idles while the host builds the case (seconds) and its clock drops; keep it busy for ~100 ms of
  // back-to-back calls before timing, so the median is taken at the clock a serving loop runs at.
  cudaEvent_t start, stop;
  DSV4_CUDA_OK(cudaEventCreate(&start));
  DSV4_CUDA_OK(cudaEventCreate(&stop));
  for (float busy_ms = 0; busy_ms < 100.0f;) {
    DSV4_CUDA_OK(cudaEventRecord(start));
    for (int i = 0; i < 50; ++i) launch();
    DSV4_CUDA_OK(cudaEventRecord(stop));
    DSV4_CUDA_OK(cudaEventSynchronize(stop));
    float ms = 0;
    DSV4_CUDA_OK(cudaEventElapsedTime(&ms, start, stop));
    busy_ms += ms;
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  const double us = time_kernel_us(launch, iterations);
  int64_t keys = 0, picks = 0;
  for (int64_t t = 0; t < pr.tokens(); ++t) {
    keys += std::min<int64_t>(pr.positions[t] + 1, spec.window);
    for (int64_t k = 0; k < (c.ratio ? pr.lengths[t] : 0); ++k) {
      picks += 1;
      keys += pr.indices[t * pr.compressed_stride + k] >= 0;
    }
  }
  CaseResult r;
  r.name = case_stem(c);
  if (!c.prefill) r.name += " splits=" + std::to_string(ops::cuda::sparse_attention_splits(p, sms));
  r.microseconds = us;
  r.flops = 2.0 * static_cast<double>(c.heads) * (512 + 512) * static_cast<double>(keys);
  r.bytes = static_cast<double>(pr.unique_keys) * static_cast<double>(kv_entry_bytes(c.format)) +
            2.0 * static_cast<double>(pr.q.size()) * 2.0 + 4.0 * static_cast<double>(picks);
  r.note = flashmla_note(c);
  return r;
}

std::vector<CaseResult> attention_suite(const Ceilings&, const Options& options) {
  std::vector<CaseResult> results;
  if (ops::cuda::list_devices().empty()) return results;
  const int iterations = options.quick ? 5 : 30;
  std::vector<AttentionCase> cases;
  const std::vector<int64_t> contexts =
      options.quick ? std::vector<int64_t>{8192} : std::vector<int64_t>{8192, 131072, 1048576};
  for (const int64_t context : contexts)
    for (const int64_t batch : {1, 32, 128}) {
      cases.push_back({"flash-csa", 64, 4, 512, context, batch, KvEntryFormat::kFp8});
      cases.push_back({"flash-hca", 64, 128, 0, context, batch, KvEntryFormat::kFp8});
    }
  cases.push_back({"pro-csa", 128, 4, 1024, 131072, 32, KvEntryFormat::kFp8});
  cases.push_back({"flash-csa", 64, 4, 512, 131072, 128, KvEntryFormat::kBf16});
  cases.push_back({"flash-csa", 64, 4, 512, 131072, 1, KvEntryFormat::kBf16});
  // Prefill of one 8K request: the three layer kinds, the FP8 cache and (CSA) the BF16 one the runner defaults to.
  cases.push_back({"flash-swa", 64, 0, 0, 8192, 1, KvEntryFormat::kFp8, true});
  cases.push_back({"flash-csa", 64, 4, 512, 8192, 1, KvEntryFormat::kFp8, true});
  cases.push_back({"flash-hca", 64, 128, 0, 8192, 1, KvEntryFormat::kFp8, true});
  cases.push_back({"flash-swa", 64, 0, 0, 8192, 1, KvEntryFormat::kBf16, true});
  cases.push_back({"flash-csa", 64, 4, 512, 8192, 1, KvEntryFormat::kBf16, true});
  for (const AttentionCase& c : cases)
    if (wanted(c, options)) results.push_back(run_case(c, iterations));
  return results;
}

const bool registered = register_suite("attention", attention_suite);

}  // namespace
}  // namespace dsv4::kbench
