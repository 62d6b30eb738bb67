#include "ops/cpu/linear.h"

#include <cblas.h>

#include <algorithm>

#include "core/thread_pool.h"

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

namespace {

// y[o] for kOuts consecutive outputs of one row: per block, kOuts independent double sums in channel order (one
// accumulator per output keeps each sum sequential; the outputs interleave for instruction-level parallelism).
template <int kOuts>
void dot_f64_block(const float* x, int64_t in, const float* weight, int64_t k_block, float* y) {
  float total[kOuts] = {};
  for (int64_t begin = 0; begin < in; begin += k_block) {
    const int64_t end = std::min(in, begin + k_block);
    double sum[kOuts] = {};
    for (int64_t k = begin; k < end; ++k) {
      const double xk = x[k];
      for (int o = 0; o < kOuts; ++o) sum[o] += xk * static_cast<double>(weight[o * in + k]);
    }
    // The first block: 0 + partial is the partial (the reference's zero-initialised fp32 accumulator likewise).
    for (int o = 0; o < kOuts; ++o) total[o] += static_cast<float>(sum[o]);
  }
  for (int o = 0; o < kOuts; ++o) y[o] = total[o];
}

}  // namespace

void linear_f64_strided(const float* x, int64_t rows, int64_t in, int64_t x_stride, const float* weight, int64_t out,
                        float* y, int64_t y_stride, int64_t k_block) {
  if (rows == 0 || out == 0) return;
  if (k_block <= 0 || k_block > in) k_block = std::max<int64_t>(in, 1);
  constexpr int64_t kOuts = 4;
  const int64_t out_tiles = (out + kOuts - 1) / kOuts;
  // Work items: (row, tile of 4 outputs); a few thousand multiply-adds per item at the least.
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, kOuts * in));
  ThreadPool::global().parallel_for(rows * out_tiles, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / out_tiles, o = item % out_tiles * kOuts;
      const float* xr = x + r * x_stride;
      float* yr = y + r * y_stride + o;
      if (o + kOuts <= out) {
        dot_f64_block<kOuts>(xr, in, weight + o * in, k_block, yr);
      } else {
        for (int64_t j = o; j < out; ++j) dot_f64_block<1>(xr, in, weight + j * in, k_block, y + r * y_stride + j);
      }
    }
  }, grain);
}

void linear_f64(const float* x, int64_t rows, int64_t in, const float* weight, int64_t out, float* y,
                int64_t k_block) {
  linear_f64_strided(x, rows, in, in, weight, out, y, out, k_block);
}

}  // namespace dsv4::ops::cpu
