// Dense projections of the CPU backend: y = x · Wᵀ with W in the checkpoint's [out, in] layout (OpenBLAS).
#pragma once
#include <cstdint>

#include "core/linear_weight.h"

namespace dsv4::ops::cpu {

// x [rows, in] (row stride in), weight [out, in] -> y [rows, out]. beta = 1 accumulates into y.
void linear(const float* x, int64_t rows, int64_t in, const float* weight, int64_t out, float* y,
            float beta = 0.0f);

// Same with explicit row strides (for column slices of wider buffers).
void linear_strided(const float* x, int64_t rows, int64_t in, int64_t x_stride, const float* weight,
                    int64_t out, float* y, int64_t y_stride, float beta = 0.0f);

// The GEMM of Numerics::kDeepSeek (docs/numerics.md "The oracle", "Canonical accumulation in kDeepSeek"): every dot
// product summed in double and rounded once to fp32, the value any fp32-accumulating kernel approximates, so the
// result does not depend on the row count (prefill vs decode), the BLAS or the device. fp32 × fp32 products are exact
// in double; so is the sum of FP8 × FP8 / FP8 × FP4 products over a block, so those come out correctly rounded.
// k_block > 0: the sum runs over consecutive k_block-wide blocks of the input channels, each block's double sum
// rounded to fp32 and the partials added in fp32 in block order (the FP8 GEMM kernel's 128-wide and the FP4 kernel's
// 32-wide partials, kernel_standin.fp8_gemm / fp4_gemm); 0 (or >= in): one block. Rows × outputs are spread over
// ThreadPool::global(). y is overwritten (no beta).
void linear_f64(const float* x, int64_t rows, int64_t in, const float* weight, int64_t out, float* y,
                int64_t k_block = 0);
void linear_f64_strided(const float* x, int64_t rows, int64_t in, int64_t x_stride, const float* weight, int64_t out,
                        float* y, int64_t y_stride, int64_t k_block = 0);

// The same products for a LinearWeight (core/linear_weight.h), rows [first_row, first_row + out_rows) of it
// (the strided forms; all rows for the others), input width w.cols(). A dense weight takes the paths above;
// an FP8 / FP4 one is decoded a few output rows at a time into scratch (exact values), so y equals the call
// on w.dequantized() — bitwise for linear_f64, whose sums do not depend on how outputs are split — without an
// fp32 copy of the matrix.
void linear(const float* x, int64_t rows, const LinearWeight& w, float* y, float beta = 0.0f);
void linear_strided(const float* x, int64_t rows, int64_t x_stride, const LinearWeight& w, int64_t first_row,
                    int64_t out_rows, float* y, int64_t y_stride, float beta = 0.0f);
void linear_f64(const float* x, int64_t rows, const LinearWeight& w, float* y, int64_t k_block = 0);
void linear_f64_strided(const float* x, int64_t rows, int64_t x_stride, const LinearWeight& w,
                        int64_t first_row, int64_t out_rows, float* y, int64_t y_stride, int64_t k_block = 0);

}  // namespace dsv4::ops::cpu
