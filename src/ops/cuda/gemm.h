// Dense projections on the device through cuBLASLt (the library NVIDIA tunes for Hopper; no hand-written GEMM
// for the dense layers beyond the decode-row kernels): y [rows, out] = x [rows, in] · Wᵀ (+ beta · y), W
// row-major [out, in] as the checkpoint stores it. Three modes:
//   kF32     fp32 operands, fp32 compute (CUBLAS_COMPUTE_32F, no TF32): the exact twin of ops/cpu/linear.h;
//   kBf16    bf16 operands (x already converted), fp32 accumulation, fp32 output;
//   kF8E4M3  DeepSeek's FP8 linear (model_spec.md §3.2; linear_fp8 below): e4m3 W with fp32 128 × 128 block
//            scales, x quantized per row and 128 columns (ops/cuda/fp8_quantize.h), fp32 accumulation, fp32
//            or bf16 output. cuBLASLt's block-scaled kernels (CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F for
//            W, VEC128_32F for x) for prefill rows; ops/cuda/fp8_gemm.h's CUDA-core kernel for decode rows
//            and for the shapes cuBLASLt refuses (docs/kernels/fp8_gemm.md has the measured split).
// One Gemm per stream: it owns the Lt handle, a workspace and the chosen algorithm per shape (picked once per
// shape, gemm.cu says how, so steady-state calls do no host work beyond the launch and are CUDA-graph
// capturable). Above 64 rows a shape's plan serves a power-of-two bucket of row counts, so a new prompt length
// or MoE expert load costs no cuBLASLt heuristic query.
#pragma once
#include <cstdint>
#include <map>
#include <tuple>

#include <cuda_runtime.h>

namespace dsv4::ops::cuda {

enum class GemmDtype { kF32, kBf16, kF8E4M3 };

struct GemmWeight {
  const void* data = nullptr;  // device [out, row_stride] of dtype
  GemmDtype dtype = GemmDtype::kF32;
  int64_t out = 0, in = 0;
  int64_t row_stride = 0;  // elements between rows; 0 = in
  // kF8E4M3: device fp32 block scales [ceil(out/128), ceil(in/128)], row-major (the checkpoint's `.scale`
  // tensor converted from UE8M0 to fp32): W[o, i] = code[o, i] · scales[o / 128, i / 128].
  const float* scales = nullptr;
};

// The quantized activation of an FP8 linear, as ops/cuda/fp8_quantize.h writes it: e4m3 codes [rows, stride
// bytes] and fp32 scales [ceil(in/128), rows] (block-major, rows contiguous: cuBLASLt's VEC128 layout, scale
// stride = rows).
struct Fp8Activation {
  const uint8_t* codes = nullptr;
  const float* scales = nullptr;
  int64_t stride = 0;  // bytes between rows of the codes; 0 = in
};

// Which kernel an FP8 product runs: kAuto (cuBLASLt above kFp8SkinnyMaxRows rows when out and in are
// multiples of 128 and cuBLASLt has an algorithm, else ops/cuda/fp8_gemm.h), or forced (tests, dsv4_kbench;
// DSV4_FP8_GEMM= cublaslt|skinny sets the default). A forced kCublasLt throws where cuBLASLt refuses the
// shape.
enum class Fp8Backend { kAuto, kCublasLt, kSkinny };
inline constexpr int64_t kFp8SkinnyMaxRows = 8;

class Gemm {
 public:
  Gemm();
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  // y [rows, out] with row stride y_stride (0 = out) = x [rows, in] (dtype of w, row stride x_stride, 0 = in)
  // · Wᵀ + beta · y. Throws dsv4::Error on a cuBLAS failure or a shape no algorithm supports.
  void linear(const GemmWeight& w, const void* x, int64_t rows, float* y, cudaStream_t stream, float beta = 0.0f,
              int64_t x_stride = 0, int64_t y_stride = 0);

  // `batch` independent products in one launch (strided batched): product b uses W + b·w_batch_stride,
  // x + b·x_batch_stride and y + b·y_batch_stride (elements); the grouped output projection's G groups, and two
  // weights over one input (x_batch_stride 0). `y_dtype` kBf16 stores y rounded to bf16 (round to nearest even
  // from the fp32 accumulator, what f32_to_bf16 of the fp32 result gives): the next GEMM's operand directly.
  void linear_batched(const GemmWeight& w, int64_t batch, int64_t w_batch_stride, const void* x, int64_t x_stride,
                      int64_t x_batch_stride, int64_t rows, void* y, int64_t y_stride, int64_t y_batch_stride,
                      cudaStream_t stream, GemmDtype y_dtype = GemmDtype::kF32);

  // The FP8 linear (w.dtype kF8E4M3): y [rows, out] (row stride y_stride, 0 = out; fp32 or bf16 by y_dtype) =
  // Σ over 128-blocks of the e4m3 products times W's and x's block scales, fp32 accumulation.
  // Graph-capturable after the shape's first call. Throws dsv4::Error on a failure.
  void linear_fp8(const GemmWeight& w, const Fp8Activation& x, int64_t rows, void* y, cudaStream_t stream,
                  GemmDtype y_dtype = GemmDtype::kF32, int64_t y_stride = 0);
  // quantize_e4m3_rows of x (fp32 or bf16 by x_dtype, row stride x_stride elements, 0 = in) into this Gemm's
  // scratch, then linear_fp8: the whole FP8 linear of the reference from its bf16 / fp32 input. The scratch
  // grows at the first call of a larger shape (not during graph capture: that throws).
  void linear_fp8_quantize(const GemmWeight& w, const void* x, GemmDtype x_dtype, int64_t rows, void* y,
                           cudaStream_t stream, GemmDtype y_dtype = GemmDtype::kF32, int64_t x_stride = 0,
                           int64_t y_stride = 0);
  void set_fp8_backend(Fp8Backend backend) { fp8_backend_ = backend; }
  // bf16 products of <= kSkinnyMaxRows rows: ops/cuda/skinny_gemm.h (the default; DSV4_SKINNY_GEMM=0 sets
  // false) or cuBLASLt (tests and dsv4_kbench compare the two).
  void set_bf16_skinny(bool enabled) { bf16_skinny_ = enabled; }
  // Whether the FP8 plan of this shape runs cuBLASLt (false: ops/cuda/fp8_gemm.h); after its first call.
  bool fp8_uses_cublaslt(const GemmWeight& w, int64_t rows, GemmDtype y_dtype = GemmDtype::kF32,
                         int64_t x_stride = 0, int64_t y_stride = 0) const;

 private:
  struct Plan;
  // dtype, out, in, rows (plan_rows in gemm.cu: exact up to 64, a power-of-two bucket above), strides of
  // W / x / y, accumulate, batch, batch strides of W / x / y, output dtype, FP8 backend.
  using Key = std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool, int64_t, int64_t,
                         int64_t, int64_t, int, int>;
  // The plan of a shape, made (and its algorithm timed on these operands) at the shape's first call.
  Plan& plan(const Key& key, const void* w, const void* x, void* y, cudaStream_t stream);
  Plan& fp8_plan(const Key& key, const GemmWeight& w, const Fp8Activation& x);
  Key fp8_key(const GemmWeight& w, int64_t rows, GemmDtype y_dtype, int64_t x_stride, int64_t y_stride) const;
  // cublasLtMatmul of a bf16/fp32 plan on `rows` rows (y = x · Wᵀ + beta · y); throws on failure.
  void run_lt(Plan& p, int64_t rows, const void* w, const void* x, void* y, float beta, cudaStream_t stream,
              const char* what);

  void* handle_ = nullptr;  // cublasLtHandle_t
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::map<Key, Plan*> plans_;
  Fp8Backend fp8_backend_ = Fp8Backend::kAuto;
  bool bf16_skinny_ = true;
  uint8_t* fp8_codes_ = nullptr;  // linear_fp8_quantize's scratch
  float* fp8_scales_ = nullptr;
  size_t fp8_codes_bytes_ = 0, fp8_scales_count_ = 0;
};

}  // namespace dsv4::ops::cuda
