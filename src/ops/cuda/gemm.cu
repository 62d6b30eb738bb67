#include <cublasLt.h>

#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "core/error.h"
#include "ops/cuda/fp8_gemm.h"
#include "ops/cuda/fp8_quantize.h"
#include "ops/cuda/gemm.h"
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

// The row count a plan is made for. Up to kMaxTunedRows every count has its own plan (decode batches: a bounded
// set, each possibly timed); above, one plan per power-of-two bucket, its algorithm cuBLASLt's heuristic answer
// at the bucket's row count and the call's own rows described by call-local layouts. Without buckets every new
// prompt length, and in the host-grouped MoE every expert's row count, paid a heuristic query (~0.1 ms each,
// which made per-expert cuBLASLt 2.8× slower than the grouped kernel end to end, docs/PERF.md) and left a plan
// behind for good.
int64_t plan_rows(int64_t rows) {
  if (rows <= kMaxTunedRows) return rows;
  int64_t bucket = kMaxTunedRows;
  while (bucket < rows) bucket *= 2;
  return bucket;
}

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
bool skinny_enabled() {  // DSV4_SKINNY_GEMM=0: cuBLASLt for every shape (to measure ops/cuda/skinny_gemm's gain)
  static const bool enabled = switched("DSV4_SKINNY_GEMM", true);
  return enabled;
}

Fp8Backend default_fp8_backend() {  // DSV4_FP8_GEMM=cublaslt|skinny forces one kernel (to measure the split)
  const char* value = std::getenv("DSV4_FP8_GEMM");
  if (value == nullptr) return Fp8Backend::kAuto;
  if (std::string(value) == "cublaslt") return Fp8Backend::kCublasLt;
  if (std::string(value) == "skinny") return Fp8Backend::kSkinny;
  return Fp8Backend::kAuto;
}

int64_t ceil_blocks(int64_t n) { return (n + kFp8Block - 1) / kFp8Block; }

// cuBLASLt's heuristic: up to `count` algorithms for the product in `results`, best first; how many in `found`.
cublasStatus_t heuristic(cublasLtHandle_t lt, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t a,
                         cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c, size_t workspace_bytes, int count,
                         cublasLtMatmulHeuristicResult_t* results, int& found) {
  cublasLtMatmulPreference_t preference = nullptr;
  check(cublasLtMatmulPreferenceCreate(&preference), "preference");
  check(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                             &workspace_bytes, sizeof workspace_bytes),
        "preference workspace");
  found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(lt, op, a, b, c, c, preference, count, results, &found);
  cublasLtMatmulPreferenceDestroy(preference);
  return status;
}

// A strided batch of `count` matrices `stride` elements apart on `layout`.
void set_strided_batch(cublasLtMatrixLayout_t layout, int64_t count, int64_t stride, const char* what) {
  const int32_t count32 = static_cast<int32_t>(count);
  check(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count32, sizeof count32), what);
  check(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof stride),
        what);
}

}  // namespace

struct Gemm::Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;  // b and c describe `rows` rows
  cublasLtMatmulAlgo_t algo{};
  // What the x and y layouts of a call with other rows need (layouts()).
  int64_t rows = 0, in = 0, out = 0, x_stride = 0, y_stride = 0, batch = 1, x_batch = 0, y_batch = 0;
  cudaDataType_t operand = CUDA_R_32F, output = CUDA_R_32F;
  // Calls whose rows the bucket's algorithm refused (CUBLAS_STATUS_NOT_SUPPORTED): their own heuristic answer.
  std::map<int64_t, cublasLtMatmulAlgo_t> exact_algos;

  void describe(int64_t plan_rows, int64_t in_features, int64_t out_features, int64_t x_row_stride,
                int64_t y_row_stride, int64_t batch_count, int64_t x_batch_stride, int64_t y_batch_stride,
                cudaDataType_t operand_type, cudaDataType_t output_type) {
    rows = plan_rows;
    in = in_features;
    out = out_features;
    x_stride = x_row_stride;
    y_stride = y_row_stride;
    batch = batch_count;
    x_batch = x_batch_stride;
    y_batch = y_batch_stride;
    operand = operand_type;
    output = output_type;
  }

  // x and y layouts for a call of `call_rows` rows into `scratch` (stack objects: cublasLtMatrixLayoutInit
  // allocates nothing, so a prefill call costs no host work beyond these stores and the launch); the plan's own
  // layouts when the rows are the plan's.
  struct CallLayouts {
    cublasLtMatrixLayoutOpaque_t b{}, c{};
  };
  std::pair<cublasLtMatrixLayout_t, cublasLtMatrixLayout_t> layouts(int64_t call_rows, CallLayouts& scratch) const {
    if (call_rows == rows) return {b, c};
    check(cublasLtMatrixLayoutInit(&scratch.b, operand, static_cast<uint64_t>(in), static_cast<uint64_t>(call_rows),
                                   x_stride),
          "layout x");
    check(cublasLtMatrixLayoutInit(&scratch.c, output, static_cast<uint64_t>(out), static_cast<uint64_t>(call_rows),
                                   y_stride),
          "layout y");
    if (batch > 1) {
      set_strided_batch(&scratch.b, batch, x_batch, "batch x");
      set_strided_batch(&scratch.c, batch, y_batch, "batch y");
    }
    return {&scratch.b, &scratch.c};
  }
  bool skinny = false;  // ops/cuda/skinny_gemm instead of cuBLASLt (bf16, <= 16 rows)
  bool skinny_f32 = false;  // skinny_gemm_f32 (fp32 weights of ≤ 4M elements, ≤ 8 rows)
  SkinnyGemmParams skinny_params;
  bool fp8_skinny = false;  // kF8E4M3: ops/cuda/fp8_gemm.h instead of cuBLASLt
  Fp8GemmParams fp8_params;
  ~Plan() {
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

Gemm::Gemm()
    : workspace_bytes_(kWorkspaceBytes), fp8_backend_(default_fp8_backend()), bf16_skinny_(skinny_enabled()) {
  cublasLtHandle_t handle = nullptr;
  check(cublasLtCreate(&handle), "create");
  handle_ = handle;
  if (cudaMalloc(&workspace_, workspace_bytes_) != cudaSuccess) throw Error("cannot allocate the cuBLASLt workspace");
}

Gemm::~Gemm() {
  for (auto& [key, plan] : plans_) delete plan;
  cudaFree(workspace_);
  cudaFree(fp8_codes_);
  cudaFree(fp8_scales_);
  cublasLtDestroy(static_cast<cublasLtHandle_t>(handle_));
}

// Row-major y = x·Wᵀ is column-major yᵀ [out, rows] = W [in, out]ᵀ · xᵀ [in, rows]: A = W transposed, B = x.
//
// The algorithm: bf16 decode products run ops/cuda/skinny_gemm where it measured at least cuBLASLt's speed
// (skinny_preferred), the rest cuBLASLt's first heuristic answer. With
// DSV4_GEMM_AUTOTUNE=1 (off by default, see autotune_enabled) the first call of each decode shape (rows <= 64: a
// bounded set, no prefill length stalls on timing) times up to kCandidates heuristic answers and the skinny kernel
// on its own operands and keeps the fastest, as TensorRT-LLM's GEMM plugin profiles its tactics. Never during
// CUDA-graph capture (nothing can be timed there) nor when accumulating into y (the runs would add up).
// Measured back to back on the H200 (docs/PERF.md "Decode GEMV"): up to 8 rows skinny_gemm matches cuBLASLt on
// the 64 MiB projections (0.95-1.05x) and beats it 1.3-2x on the 4-8 MiB ones (wq_a, wkv: cuBLASLt's split-K
// pays a reduction launch); at 9-16 rows its smaller batches in flight lose on the large matrices (0.6-0.8x).
namespace {
bool skinny_f32_enabled() {
  const char* value = std::getenv("DSV4_SKINNY_F32");
  return value != nullptr && std::string(value) == "1";
}

bool skinny_preferred(const SkinnyGemmParams& p) {
  const int64_t weight_bytes = 2 * p.out * p.in;
  return p.rows <= 8 || weight_bytes <= (int64_t{16} << 20);
}
}  // namespace

Gemm::Plan& Gemm::plan(const Key& key, const void* w, const void* x, void* y, cudaStream_t stream) {
  if (const auto it = plans_.find(key); it != plans_.end()) return *it->second;
  const auto [dtype, out, in, rows, w_stride, x_stride, y_stride, accumulate, batch, w_batch, x_batch,
              y_batch, y_dtype, fp8_backend] = key;
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
    set_strided_batch(plan->a, batch, w_batch, "batch W");
    set_strided_batch(plan->b, batch, x_batch, "batch x");
    set_strided_batch(plan->c, batch, y_batch, "batch y");
  }
  cublasLtMatmulHeuristicResult_t results[kCandidates]{};
  int found = 0;
  const auto lt = static_cast<cublasLtHandle_t>(handle_);
  const cublasStatus_t status =
      heuristic(lt, plan->op, plan->a, plan->b, plan->c, workspace_bytes_, kCandidates, results, found);
  if (status != CUBLAS_STATUS_SUCCESS || found == 0)
    throw Error("cuBLASLt has no algorithm for a " + std::string(operand == CUDA_R_16BF ? "bf16" : "fp32") + " [" +
                std::to_string(rows) + " x " + std::to_string(in) + "] x [" + std::to_string(in) + " x " +
                std::to_string(out) + "] product");
  plan->algo = results[0].algo;
  plan->describe(rows, in, out, x_stride, y_stride, batch, x_batch, y_batch, operand, output);
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
  sp.accumulate = accumulate;
  // fp32 weights of at most 4M elements at decode rows (the router): the one-kernel fp32 GEMV. Opt-in
  // (DSV4_SKINNY_F32=1) until it has run on a GPU (written 2026-12-06; its op test is CudaSkinnyGemm.Fp32*).
  plan->skinny_f32 = skinny_f32_enabled() && operand == CUDA_R_32F && output == CUDA_R_32F &&
                     out * in <= (int64_t{4} << 20) && skinny_gemm_f32_supported(sp, w, x);
  const bool skinny_candidate = operand == CUDA_R_16BF && skinny_gemm_supported(sp, w, x);
  // DSV4_SKINNY_GEMM=0 keeps cuBLASLt everywhere, DSV4_GEMM_AUTOTUNE=1 times the two.
  plan->skinny = skinny_candidate && skinny_preferred(sp);
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
        plan->skinny = cudaEventSynchronize(stop) == cudaSuccess &&
                       cudaEventElapsedTime(&ms, start, stop) == cudaSuccess && (!have_best || ms < best_ms);
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
  if (w.dtype == GemmDtype::kF8E4M3) throw Error("Gemm::linear: an FP8 weight goes through linear_fp8");
  const int64_t w_stride = w.row_stride ? w.row_stride : w.in;
  const Key key{static_cast<int>(w.dtype),
                w.out,
                w.in,
                plan_rows(rows),
                w_stride,
                x_stride ? x_stride : w.in,
                y_stride ? y_stride : w.out,
                beta != 0.0f,
                1,
                0,
                0,
                0,
                static_cast<int>(GemmDtype::kF32),
                0};
  Plan& p = plan(key, w.data, x, y, stream);
  if (bf16_skinny_ && p.skinny && (beta == 0.0f || beta == 1.0f) &&
      skinny_gemm(p.skinny_params, w.data, x, y, stream) == cudaSuccess)
    return;
  if (bf16_skinny_ && p.skinny_f32 && beta == 0.0f && rows == p.skinny_params.rows &&
      skinny_gemm_f32(p.skinny_params, static_cast<const float*>(w.data), static_cast<const float*>(x), y, stream) ==
          cudaSuccess)
    return;
  run_lt(p, rows, w.data, x, y, beta, stream, "matmul");
}

void Gemm::run_lt(Plan& p, int64_t rows, const void* w, const void* x, void* y, float beta, cudaStream_t stream,
                  const char* what) {
  Plan::CallLayouts scratch;
  const auto [b, c] = p.layouts(rows, scratch);
  const auto lt = static_cast<cublasLtHandle_t>(handle_);
  const float alpha = 1.0f;
  const auto exact = p.exact_algos.find(rows);
  const cublasLtMatmulAlgo_t* algo = exact != p.exact_algos.end() ? &exact->second : &p.algo;
  cublasStatus_t status =
      cublasLtMatmul(lt, p.op, &alpha, w, p.a, x, b, &beta, y, c, y, c, algo, workspace_, workspace_bytes_, stream);
  if (status == CUBLAS_STATUS_NOT_SUPPORTED && algo == &p.algo && rows != p.rows) {
    // The bucket's algorithm refuses this row count: it gets its own heuristic answer, once.
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t query = heuristic(lt, p.op, p.a, b, c, workspace_bytes_, 1, &result, found);
    if (query == CUBLAS_STATUS_SUCCESS && found > 0) {
      algo = &(p.exact_algos[rows] = result.algo);
      status = cublasLtMatmul(lt, p.op, &alpha, w, p.a, x, b, &beta, y, c, y, c, algo, workspace_, workspace_bytes_,
                              stream);
    }
  }
  check(status, what);
}

void Gemm::linear_batched(const GemmWeight& w, int64_t batch, int64_t w_batch_stride, const void* x,
                          int64_t x_stride, int64_t x_batch_stride, int64_t rows, void* y, int64_t y_stride,
                          int64_t y_batch_stride, cudaStream_t stream, GemmDtype y_dtype) {
  if (rows == 0 || w.out == 0 || batch == 0) return;
  if (w.dtype == GemmDtype::kF8E4M3) throw Error("Gemm::linear_batched: no batched FP8 product");
  const int64_t w_stride = w.row_stride ? w.row_stride : w.in;
  const Key key{
      static_cast<int>(w.dtype),   w.out, w.in,  plan_rows(rows), w_stride,      x_stride ? x_stride : w.in,
      y_stride ? y_stride : w.out, false, batch, w_batch_stride, x_batch_stride, y_batch_stride,
      static_cast<int>(y_dtype),   0};
  Plan& p = plan(key, w.data, x, y, stream);
  if (bf16_skinny_ && p.skinny && skinny_gemm(p.skinny_params, w.data, x, y, stream) == cudaSuccess) return;
  run_lt(p, rows, w.data, x, y, 0.0f, stream, "batched matmul");
}

// ---- FP8 (DeepSeek's recipe, docs/kernels/fp8_gemm.md) ----
//
// cuBLASLt's block-scaled FP8 on Hopper: TN only (A = W [in, out] column-major transposed, B = x [in, rows]),
// both e4m3, CUBLAS_COMPUTE_32F; A's scales BLK128x128_32F in the checkpoint's [ceil(out/128), ceil(in/128)]
// row-major order, B's VEC128_32F as [ceil(in/128), rows] (block-major); fp32 or bf16 C = D. The scale
// pointers are attributes of the matmul descriptor, so they are set on the plan's descriptor before every
// call (a host-side store; graph capture records the launch with them).

Gemm::Key Gemm::fp8_key(const GemmWeight& w, int64_t rows, GemmDtype y_dtype, int64_t x_stride,
                        int64_t y_stride) const {
  return Key{static_cast<int>(GemmDtype::kF8E4M3),
             w.out,
             w.in,
             plan_rows(rows),
             w.row_stride ? w.row_stride : w.in,
             x_stride ? x_stride : w.in,
             y_stride ? y_stride : w.out,
             false,
             1,
             0,
             0,
             0,
             static_cast<int>(y_dtype),
             static_cast<int>(fp8_backend_)};
}

Gemm::Plan& Gemm::fp8_plan(const Key& key, const GemmWeight& w, const Fp8Activation& x) {
  if (const auto it = plans_.find(key); it != plans_.end()) return *it->second;
  const auto [dtype, out, in, rows, w_stride, x_stride, y_stride, accumulate, batch, w_batch, x_batch,
              y_batch, y_dtype, backend_value] = key;
  const auto backend = static_cast<Fp8Backend>(backend_value);
  auto plan = std::make_unique<Plan>();
  Fp8GemmParams& fp = plan->fp8_params;
  fp.rows = rows;
  fp.out = out;
  fp.in = in;
  fp.w_stride = w_stride;
  fp.x_stride = x_stride;
  fp.y_stride = y_stride;
  fp.w_scale_stride = ceil_blocks(in);
  fp.x_scale_stride = rows;
  fp.bf16_output = y_dtype == static_cast<int>(GemmDtype::kBf16);
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  // cuBLASLt's FP8 kernels need 16-byte aligned operands and leading dimensions; kAuto further keeps to whole
  // 128-blocks (every FP8 linear of V4) and to more rows than the decode kernel serves best.
  const bool lt_shape = in % 16 == 0 && w_stride % 16 == 0 && x_stride % 16 == 0 && aligned(w.data) &&
                        aligned(x.codes) && aligned(w.scales) && aligned(x.scales);
  // kAuto's split (measured, docs/kernels/fp8_gemm.md): cuBLASLt's block-scaled kernels take ~16 us at any
  // row count on a small weight, where fp8_gemm's tensor-core kernel streams it in ~8 us up to 64 rows; on
  // the 32 MB weights cuBLASLt wins from 16 rows.
  const bool decode_rows = rows <= kFp8SkinnyMaxRows || (rows <= 64 && out * in <= (int64_t{8} << 20));
  // cuBLASLt reads BLK128x128 weight scales with the row of K-blocks padded to a multiple of 4 (torchao and
  // PyTorch pad theirs so); ours are the checkpoint's, unpadded. Every V4 linear has a multiple of 4 K-blocks
  // (K = 1024, 1536, 4096, 7168, 8192); K = 256 read the next row's scales and past the end — NaN logits on the
  // V4-shaped test model (session 27).
  const bool lt_scales = ceil_blocks(in) % 4 == 0;
  if (backend == Fp8Backend::kCublasLt && !lt_scales)
    throw Error("cuBLASLt's block-scaled FP8 needs a multiple of 4 K-blocks of weight scales; [" +
                std::to_string(rows) + " x " + std::to_string(in) + "] x [" + std::to_string(in) + " x " +
                std::to_string(out) + "] has " + std::to_string(ceil_blocks(in)));
  const bool try_lt =
      backend == Fp8Backend::kCublasLt || (backend == Fp8Backend::kAuto && lt_shape && lt_scales && !decode_rows &&
                                           out % kFp8Block == 0 && in % kFp8Block == 0);
  plan->fp8_skinny = true;
  if (try_lt) {
    const cudaDataType_t output = fp.bf16_output ? CUDA_R_16BF : CUDA_R_32F;
    check(cublasLtMatmulDescCreate(&plan->op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "fp8 matmul desc");
    const cublasOperation_t transpose = CUBLAS_OP_T, none = CUBLAS_OP_N;
    check(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof transpose),
          "transa");
    check(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, &none, sizeof none),
          "transb");
    const int32_t a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F,
                  b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    check(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a_mode, sizeof a_mode),
          "A scale mode");
    check(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &b_mode, sizeof b_mode),
          "B scale mode");
    const void* a_scale = w.scales;
    const void* b_scale = x.scales;
    check(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scale,
                                         sizeof a_scale),
          "A scale pointer");
    check(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale,
                                         sizeof b_scale),
          "B scale pointer");
    plan->describe(rows, in, out, x_stride, y_stride, 1, 0, 0, CUDA_R_8F_E4M3, output);
    check(cublasLtMatrixLayoutCreate(&plan->a, CUDA_R_8F_E4M3, static_cast<uint64_t>(in),
                                     static_cast<uint64_t>(out), w_stride),
          "fp8 layout W");
    check(cublasLtMatrixLayoutCreate(&plan->b, CUDA_R_8F_E4M3, static_cast<uint64_t>(in),
                                     static_cast<uint64_t>(rows), x_stride),
          "fp8 layout x");
    check(cublasLtMatrixLayoutCreate(&plan->c, output, static_cast<uint64_t>(out),
                                     static_cast<uint64_t>(rows), y_stride),
          "fp8 layout y");
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t status = heuristic(static_cast<cublasLtHandle_t>(handle_), plan->op, plan->a, plan->b,
                                            plan->c, workspace_bytes_, 1, &result, found);
    if (status == CUBLAS_STATUS_SUCCESS && found > 0) {
      plan->algo = result.algo;
      plan->fp8_skinny = false;
    } else if (backend == Fp8Backend::kCublasLt) {
      throw Error("cuBLASLt has no block-scaled FP8 algorithm for [" + std::to_string(rows) + " x " +
                  std::to_string(in) + "] x [" + std::to_string(in) + " x " + std::to_string(out) +
                  "] (status " + std::to_string(static_cast<int>(status)) + ")");
    }
  }
  return *(plans_[key] = plan.release());
}

bool Gemm::fp8_uses_cublaslt(const GemmWeight& w, int64_t rows, GemmDtype y_dtype, int64_t x_stride,
                             int64_t y_stride) const {
  const auto it = plans_.find(fp8_key(w, rows, y_dtype, x_stride, y_stride));
  return it != plans_.end() && !it->second->fp8_skinny;
}

void Gemm::linear_fp8(const GemmWeight& w, const Fp8Activation& x, int64_t rows, void* y, cudaStream_t stream,
                      GemmDtype y_dtype, int64_t y_stride) {
  if (rows == 0 || w.out == 0) return;
  if (w.dtype != GemmDtype::kF8E4M3 || w.scales == nullptr || x.codes == nullptr || x.scales == nullptr)
    throw Error("Gemm::linear_fp8 needs an FP8 weight with scales and a quantized activation");
  if (y_dtype == GemmDtype::kF8E4M3) throw Error("Gemm::linear_fp8: FP8 output is not supported");
  Plan& p = fp8_plan(fp8_key(w, rows, y_dtype, x.stride, y_stride), w, x);
  if (!p.fp8_skinny) {
    const void* a_scale = w.scales;
    const void* b_scale = x.scales;
    check(
        cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scale, sizeof a_scale),
        "A scale pointer");
    check(
        cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale, sizeof b_scale),
        "B scale pointer");
    Plan::CallLayouts scratch;
    const auto [b, c] = p.layouts(rows, scratch);
    const float alpha = 1.0f, beta = 0.0f;
    const cublasStatus_t status =
        cublasLtMatmul(static_cast<cublasLtHandle_t>(handle_), p.op, &alpha, w.data, p.a, x.codes, b, &beta,
                       y, c, y, c, &p.algo, workspace_, workspace_bytes_, stream);
    if (status == CUBLAS_STATUS_SUCCESS) return;
    if (status != CUBLAS_STATUS_NOT_SUPPORTED || fp8_backend_ == Fp8Backend::kCublasLt)
      check(status, "fp8 matmul");
    // kAuto: an algorithm that refuses these operands at run time; the CUDA-core kernel from now (for the whole
    // bucket of rows)
    p.fp8_skinny = true;
  }
  Fp8GemmParams params = p.fp8_params;  // the plan's are for its bucket of rows
  params.rows = rows;
  params.x_scale_stride = rows;
  const cudaError_t status = fp8_skinny_gemm(params, static_cast<const uint8_t*>(w.data), w.scales, x.codes,
                                             x.scales, y, stream);
  if (status != cudaSuccess)
    throw Error(std::string("fp8_skinny_gemm failed: ") + cudaGetErrorString(status));
}

void Gemm::linear_fp8_quantize(const GemmWeight& w, const void* x, GemmDtype x_dtype, int64_t rows, void* y,
                               cudaStream_t stream, GemmDtype y_dtype, int64_t x_stride, int64_t y_stride) {
  if (rows == 0 || w.out == 0) return;
  if (x_dtype != GemmDtype::kF32 && x_dtype != GemmDtype::kBf16)
    throw Error("Gemm::linear_fp8_quantize: the input is fp32 or bf16");
  const int64_t code_stride =
      (w.in + 15) / 16 * 16;  // 16-byte rows: cuBLASLt's and the vector kernel's alignment
  const size_t code_bytes = static_cast<size_t>(rows * code_stride);
  const size_t scale_count = static_cast<size_t>(fp8_activation_scale_count(rows, w.in));
  if (code_bytes > fp8_codes_bytes_ || scale_count > fp8_scales_count_) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess || capture != cudaStreamCaptureStatusNone)
      throw Error("Gemm::linear_fp8_quantize: the FP8 scratch must grow outside graph capture");
    if (cudaStreamSynchronize(stream) != cudaSuccess) throw Error("Gemm::linear_fp8_quantize: stream failed");
    if (code_bytes > fp8_codes_bytes_) {
      cudaFree(fp8_codes_);
      fp8_codes_ = nullptr;
      if (cudaMalloc(&fp8_codes_, code_bytes) != cudaSuccess)
        throw Error("cannot allocate the FP8 activation codes");
      fp8_codes_bytes_ = code_bytes;
    }
    if (scale_count > fp8_scales_count_) {
      cudaFree(fp8_scales_);
      fp8_scales_ = nullptr;
      if (cudaMalloc(&fp8_scales_, scale_count * sizeof(float)) != cudaSuccess)
        throw Error("cannot allocate the FP8 activation scales");
      fp8_scales_count_ = scale_count;
    }
  }
  Fp8QuantizeParams q;
  q.rows = rows;
  q.cols = w.in;
  q.x_stride = x_stride;
  q.code_stride = code_stride;
  q.bf16_input = x_dtype == GemmDtype::kBf16;
  const cudaError_t status = quantize_e4m3_rows(q, x, fp8_codes_, fp8_scales_, stream);
  if (status != cudaSuccess)
    throw Error(std::string("quantize_e4m3_rows failed: ") + cudaGetErrorString(status));
  linear_fp8(w, Fp8Activation{fp8_codes_, fp8_scales_, code_stride}, rows, y, stream, y_dtype, y_stride);
}

}  // namespace dsv4::ops::cuda
