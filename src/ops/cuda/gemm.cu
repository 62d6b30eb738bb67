#include "ops/cuda/gemm.h"

#include <cublasLt.h>

#include <cstdlib>
#include <memory>
#include <string>

#include "core/error.h"
#include "ops/cuda/skinny_gemm.h"

namespace dsv4::ops::cuda {
namespace {

void check(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw Error(std::string("cuBLASLt ") + what + " failed: status " + std::to_string(static_cast<int>(status)));
}

constexpr size_t kWorkspaceBytes = size_t{32} << 20;  // what cuBLASLt's Hopper kernels ask for at most
constexpr int kCandidates = 8;                        // heuristic answers timed per shape
constexpr int kTimedRuns = 5;
// Decode shapes: a bounded set; prefill keeps the heuristic (no stall per prompt length).
constexpr int64_t kMaxTunedRows = 64;

bool switched(const char* name, bool default_on) {
  const char* value = std::getenv(name);
  if (value == nullptr) return default_on;
  return std::string(value) != "0";
}
// Off by default: a timed choice can differ between two processes (or two models in one), and with it the
// rounding of every step, so two runs of the same seeded request would no longer agree bit for bit. Measured
// gain when on: 1.310 -> 1.271 ms per decode step at batch 1 on the 4-layer V4-Flash shape, none at batch 8
// (docs/PERF.md). DSV4_GEMM_AUTOTUNE=1 turns it on.
bool autotune_enabled() {
  static const bool enabled = switched("DSV4_GEMM_AUTOTUNE", false);
  return enabled;
}
bool skinny_enabled() {  // DSV4_SKINNY_GEMM=0: leave ops/cuda/skinny_gemm out of the timed candidates
  static const bool enabled = switched("DSV4_SKINNY_GEMM", true);
  return enabled;
}

}  // namespace

struct Gemm::Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool skinny =
      false;  // ops/cuda/skinny_gemm instead of cuBLASLt (bf16, few rows: the default, or timed faster)
  SkinnyGemmParams skinny_params;
  ~Plan() {
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

Gemm::Gemm() : workspace_bytes_(kWorkspaceBytes) {
  cublasLtHandle_t handle = nullptr;
  check(cublasLtCreate(&handle), "create");
  handle_ = handle;
  if (cudaMalloc(&workspace_, workspace_bytes_) != cudaSuccess) throw Error("cannot allocate the cuBLASLt workspace");
}

Gemm::~Gemm() {
  for (auto& [key, plan] : plans_) delete plan;
  cudaFree(workspace_);
  cublasLtDestroy(static_cast<cublasLtHandle_t>(handle_));
}

// Row-major y = x·Wᵀ is column-major yᵀ [out, rows] = W [in, out]ᵀ · xᵀ [in, rows]: A = W transposed, B = x.
//
// The algorithm: cuBLASLt's first heuristic answer, unless DSV4_GEMM_AUTOTUNE=1 (off by default, see
// autotune_enabled). At decode shapes that answer is often split-K with a separate reduction kernel (17 extra
// launches in a 4-layer decode step) streaming the weights at ~45 % of the copy bandwidth at one row, so with
// autotuning the first call of each decode shape (rows <= 64: a bounded set, no prefill length stalls on timing)
// times up to kCandidates heuristic answers and ops/cuda/skinny_gemm (bf16, <= 8 rows) on its own operands and
// keeps the fastest, as TensorRT-LLM's GEMM plugin profiles its tactics. Never during CUDA-graph capture (nothing
// can be timed there) nor when accumulating into y (the runs would add up).
const Gemm::Plan& Gemm::plan(const Key& key, const void* w, const void* x, void* y, cudaStream_t stream) {
  if (const auto it = plans_.find(key); it != plans_.end()) return *it->second;
  const auto [dtype, out, in, rows, w_stride, x_stride, y_stride, accumulate, batch, w_batch, x_batch, y_batch,
              y_dtype] = key;
  const cudaDataType_t operand = dtype == static_cast<int>(GemmDtype::kBf16) ? CUDA_R_16BF : CUDA_R_32F;
  const cudaDataType_t output = y_dtype == static_cast<int>(GemmDtype::kBf16) ? CUDA_R_16BF : CUDA_R_32F;
  auto plan = std::make_unique<Plan>();
  check(cublasLtMatmulDescCreate(&plan->op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "matmul desc");
  const cublasOperation_t transpose = CUBLAS_OP_T, none = CUBLAS_OP_N;
  check(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof transpose), "transa");
  check(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, &none, sizeof none), "transb");
  check(cublasLtMatrixLayoutCreate(&plan->a, operand, static_cast<uint64_t>(in), static_cast<uint64_t>(out), w_stride),
        "layout W");
  check(cublasLtMatrixLayoutCreate(&plan->b, operand, static_cast<uint64_t>(in), static_cast<uint64_t>(rows), x_stride),
        "layout x");
  check(cublasLtMatrixLayoutCreate(&plan->c, output, static_cast<uint64_t>(out), static_cast<uint64_t>(rows),
                                   y_stride),
        "layout y");
  if (batch > 1) {
    const int32_t count = static_cast<int32_t>(batch);
    auto strided = [&](cublasLtMatrixLayout_t layout, int64_t stride, const char* what) {
      check(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof count), what);
      check(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                             sizeof stride),
            what);
    };
    strided(plan->a, w_batch, "batch W");
    strided(plan->b, x_batch, "batch x");
    strided(plan->c, y_batch, "batch y");
  }
  cublasLtMatmulPreference_t preference = nullptr;
  check(cublasLtMatmulPreferenceCreate(&preference), "preference");
  check(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes_,
                                             sizeof workspace_bytes_),
        "preference workspace");
  cublasLtMatmulHeuristicResult_t results[kCandidates]{};
  int found = 0;
  const auto lt = static_cast<cublasLtHandle_t>(handle_);
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
      lt, plan->op, plan->a, plan->b, plan->c, plan->c, preference, kCandidates, results, &found);
  cublasLtMatmulPreferenceDestroy(preference);
  if (status != CUBLAS_STATUS_SUCCESS || found == 0)
    throw Error("cuBLASLt has no algorithm for a " + std::string(operand == CUDA_R_16BF ? "bf16" : "fp32") + " [" +
                std::to_string(rows) + " x " + std::to_string(in) + "] x [" + std::to_string(in) + " x " +
                std::to_string(out) + "] product");
  plan->algo = results[0].algo;
  SkinnyGemmParams& sp = plan->skinny_params;
  sp.rows = rows;
  sp.out = out;
  sp.in = in;
  sp.w_stride = w_stride;
  sp.x_stride = x_stride;
  sp.y_stride = y_stride;
  sp.batch = batch;
  sp.w_batch_stride = w_batch;
  sp.x_batch_stride = x_batch;
  sp.y_batch_stride = y_batch;
  sp.bf16_output = output == CUDA_R_16BF;
  const bool skinny_candidate =
      skinny_enabled() && operand == CUDA_R_16BF && !accumulate && skinny_gemm_supported(sp, w, x);
  // The skinny kernel only where it timed faster: it loses to cuBLASLt on some shapes (all-skinny measured 1.341 ms
  // at batch 1 and 2.755 ms at batch 8 against cuBLASLt's 1.310 / 1.787).
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  const bool can_time = autotune_enabled() && (found > 1 || skinny_candidate) && !accumulate &&
                        rows <= kMaxTunedRows && cudaStreamIsCapturing(stream, &capture) == cudaSuccess &&
                        capture == cudaStreamCaptureStatusNone;
  if (can_time) {
    cudaEvent_t start = nullptr, stop = nullptr;
    if (cudaEventCreate(&start) == cudaSuccess && cudaEventCreate(&stop) == cudaSuccess) {
      const float alpha = 1.0f, beta = 0.0f;
      // Timings are noisy: another answer replaces the heuristic's first only when it is 5 % faster, so the
      // choice (and with it the rounding of a step) rarely changes from one process to the next.
      float best_ms = 0.0f, first_ms = -1.0f;
      bool have_best = false;
      for (int i = 0; i < found; ++i) {
        auto run = [&] {
          return cublasLtMatmul(lt, plan->op, &alpha, w, plan->a, x, plan->b, &beta, y, plan->c, y, plan->c,
                                &results[i].algo, workspace_, workspace_bytes_, stream);
        };
        if (run() != CUBLAS_STATUS_SUCCESS) continue;  // a candidate that refuses these operands
        cudaEventRecord(start, stream);
        for (int r = 0; r < kTimedRuns; ++r) run();
        cudaEventRecord(stop, stream);
        float ms = 0.0f;
        if (cudaEventSynchronize(stop) != cudaSuccess ||
            cudaEventElapsedTime(&ms, start, stop) != cudaSuccess)
          continue;
        if (i == 0) first_ms = ms;
        if (!have_best || ms < best_ms) {
          best_ms = ms;
          have_best = true;
          plan->algo = results[i].algo;
        }
      }
      if (first_ms >= 0.0f && first_ms <= best_ms * 1.05f) plan->algo = results[0].algo;
      if (skinny_candidate && skinny_gemm(sp, w, x, y, stream) == cudaSuccess) {
        cudaEventRecord(start, stream);
        for (int r = 0; r < kTimedRuns; ++r) skinny_gemm(sp, w, x, y, stream);
        cudaEventRecord(stop, stream);
        float ms = 0.0f;
        if (cudaEventSynchronize(stop) == cudaSuccess &&
            cudaEventElapsedTime(&ms, start, stop) == cudaSuccess)
          plan->skinny = !have_best || ms < best_ms;
      }
    }
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
    cudaGetLastError();  // timing failures only cost the choice, never the call
  }
  return *(plans_[key] = plan.release());
}

void Gemm::linear(const GemmWeight& w, const void* x, int64_t rows, float* y, cudaStream_t stream, float beta,
                  int64_t x_stride, int64_t y_stride) {
  if (rows == 0 || w.out == 0) return;
  const int64_t w_stride = w.row_stride ? w.row_stride : w.in;
  const Key key{static_cast<int>(w.dtype), w.out, w.in, rows, w_stride, x_stride ? x_stride : w.in,
                y_stride ? y_stride : w.out, beta != 0.0f, 1, 0, 0, 0, static_cast<int>(GemmDtype::kF32)};
  const Plan& p = plan(key, w.data, x, y, stream);
  if (p.skinny && skinny_gemm(p.skinny_params, w.data, x, y, stream) == cudaSuccess) return;
  const float alpha = 1.0f;
  check(cublasLtMatmul(static_cast<cublasLtHandle_t>(handle_), p.op, &alpha, w.data, p.a, x, p.b, &beta, y, p.c, y,
                       p.c, &p.algo, workspace_, workspace_bytes_, stream),
        "matmul");
}

void Gemm::linear_batched(const GemmWeight& w, int64_t batch, int64_t w_batch_stride, const void* x,
                          int64_t x_stride, int64_t x_batch_stride, int64_t rows, void* y, int64_t y_stride,
                          int64_t y_batch_stride, cudaStream_t stream, GemmDtype y_dtype) {
  if (rows == 0 || w.out == 0 || batch == 0) return;
  const int64_t w_stride = w.row_stride ? w.row_stride : w.in;
  const Key key{static_cast<int>(w.dtype), w.out, w.in, rows, w_stride, x_stride ? x_stride : w.in,
                y_stride ? y_stride : w.out, false, batch, w_batch_stride, x_batch_stride, y_batch_stride,
                static_cast<int>(y_dtype)};
  const Plan& p = plan(key, w.data, x, y, stream);
  if (p.skinny && skinny_gemm(p.skinny_params, w.data, x, y, stream) == cudaSuccess) return;
  const float alpha = 1.0f, beta = 0.0f;
  check(cublasLtMatmul(static_cast<cublasLtHandle_t>(handle_), p.op, &alpha, w.data, p.a, x, p.b, &beta, y, p.c, y,
                       p.c, &p.algo, workspace_, workspace_bytes_, stream),
        "batched matmul");
}

}  // namespace dsv4::ops::cuda
