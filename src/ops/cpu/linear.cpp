#include "ops/cpu/linear.h"

#include <cblas.h>

namespace dsv4::ops::cpu {

void linear_strided(const float* x, int64_t rows, int64_t in, int64_t x_stride, const float* weight,
                    int64_t out, float* y, int64_t y_stride, float beta) {
  if (rows == 0 || out == 0) return;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<blasint>(rows), static_cast<blasint>(out),
              static_cast<blasint>(in), 1.0f, x, static_cast<blasint>(x_stride), weight, static_cast<blasint>(in),
              beta, y, static_cast<blasint>(y_stride));
}

void linear(const float* x, int64_t rows, int64_t in, const float* weight, int64_t out, float* y, float beta) {
  linear_strided(x, rows, in, in, weight, out, y, out, beta);
}

}  // namespace dsv4::ops::cpu
