// Dense projections on the device through cuBLASLt (the library NVIDIA tunes for Hopper; no hand-written GEMM
// for the dense layers): y [rows, out] = x [rows, in] · Wᵀ (+ beta · y), W row-major [out, in] as the
// checkpoint stores it. Two modes, as the GPU model's numerics:
//   kF32   fp32 operands, fp32 compute (CUBLAS_COMPUTE_32F, no TF32): the exact twin of ops/cpu/linear.h;
//   kBf16  bf16 operands (x already converted), fp32 accumulation, fp32 output.
// One Gemm per stream: it owns the Lt handle, a workspace and the chosen algorithm per shape (picked once per
// shape by timing cuBLASLt's heuristic candidates, gemm.cu says why, so steady-state calls do no host work
// beyond the launch and are CUDA-graph capturable).
#pragma once
#include <cstdint>
#include <map>
#include <tuple>

#include <cuda_runtime.h>

namespace dsv4::ops::cuda {

enum class GemmDtype { kF32, kBf16 };

struct GemmWeight {
  const void* data = nullptr;  // device [out, row_stride] of dtype
  GemmDtype dtype = GemmDtype::kF32;
  int64_t out = 0, in = 0;
  int64_t row_stride = 0;  // elements between rows; 0 = in
};

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

 private:
  struct Plan;
  // dtype, out, in, rows, strides of W / x / y, accumulate, batch, batch strides of W / x / y, output dtype.
  using Key = std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool, int64_t, int64_t, int64_t,
                         int64_t, int>;
  // The plan of a shape, made (and its algorithm timed on these operands) at the shape's first call.
  const Plan& plan(const Key& key, const void* w, const void* x, void* y, cudaStream_t stream);

  void* handle_ = nullptr;  // cublasLtHandle_t
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::map<Key, Plan*> plans_;
};

}  // namespace dsv4::ops::cuda
