// Dense projections of the CPU backend: y = x · Wᵀ with W in the checkpoint's [out, in] layout (OpenBLAS).
#pragma once
#include <cstdint>

namespace dsv4::ops::cpu {

// x [rows, in] (row stride in), weight [out, in] -> y [rows, out]. beta = 1 accumulates into y.
void linear(const float* x, int64_t rows, int64_t in, const float* weight, int64_t out, float* y,
            float beta = 0.0f);

// Same with explicit row strides (for column slices of wider buffers).
void linear_strided(const float* x, int64_t rows, int64_t in, int64_t x_stride, const float* weight,
                    int64_t out, float* y, int64_t y_stride, float beta = 0.0f);

}  // namespace dsv4::ops::cpu
