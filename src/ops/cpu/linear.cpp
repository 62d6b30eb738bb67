#include "ops/cpu/linear.h"

#include <cblas.h>

#include <algorithm>
#include <vector>

#include "core/error.h"
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

namespace {

void check_row_range(const LinearWeight& w, int64_t first_row, int64_t out_rows) {
  DSV4_CHECK(first_row >= 0 && out_rows >= 0 && first_row + out_rows <= w.rows(),
             "rows [" + std::to_string(first_row) + ", " + std::to_string(first_row + out_rows) + ") of a " +
                 w.shape_string() + " weight");
}

// Output rows decoded per panel of the fp32 path: ~4 MB of scratch, enough rows for sgemm to run at speed.
int64_t panel_rows(int64_t in) {
  return std::max<int64_t>(16, (int64_t{1} << 20) / std::max<int64_t>(in, 1));
}

}  // namespace

void linear_strided(const float* x, int64_t rows, int64_t x_stride, const LinearWeight& w, int64_t first_row,
                    int64_t out_rows, float* y, int64_t y_stride, float beta) {
  check_row_range(w, first_row, out_rows);
  const int64_t in = w.cols();
  if (!w.quantized()) {
    linear_strided(x, rows, in, x_stride, w.dense().ptr() + first_row * in, out_rows, y, y_stride, beta);
    return;
  }
  if (rows == 0 || out_rows == 0) return;
  const int64_t panel = std::min(out_rows, panel_rows(in));
  std::vector<float> decoded(static_cast<size_t>(panel * in));
  for (int64_t begin = 0; begin < out_rows; begin += panel) {
    const int64_t count = std::min(panel, out_rows - begin);
    // Decoding is ~1 table look-up per weight against `rows` multiply-adds: spread it too, or decode
    // dominates.
    ThreadPool::global().parallel_for(count, [&](int64_t first, int64_t last) {
      w.dequantize_rows(first_row + begin + first, last - first, decoded.data() + first * in);
    });
    linear_strided(x, rows, in, x_stride, decoded.data(), count, y + begin, y_stride, beta);
  }
}

void linear(const float* x, int64_t rows, const LinearWeight& w, float* y, float beta) {
  linear_strided(x, rows, w.cols(), w, 0, w.rows(), y, w.rows(), beta);
}

void linear_f64_strided(const float* x, int64_t rows, int64_t x_stride, const LinearWeight& w,
                        int64_t first_row, int64_t out_rows, float* y, int64_t y_stride, int64_t k_block) {
  check_row_range(w, first_row, out_rows);
  const int64_t in = w.cols();
  if (!w.quantized()) {
    linear_f64_strided(x, rows, in, x_stride, w.dense().ptr() + first_row * in, out_rows, y, y_stride,
                       k_block);
    return;
  }
  if (rows == 0 || out_rows == 0) return;
  if (k_block <= 0 || k_block > in) k_block = std::max<int64_t>(in, 1);
  // One work item per 4 output rows: decode them once into the worker's scratch, then every input row against
  // them with the dense path's dot_f64_block, so each output's sum is the dense path's, term for term.
  constexpr int64_t kOuts = 4;
  const int64_t out_tiles = (out_rows + kOuts - 1) / kOuts;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, kOuts * in * rows));
  ThreadPool::global().parallel_for(
      out_tiles,
      [&](int64_t begin, int64_t end) {
        std::vector<float> decoded(static_cast<size_t>(kOuts * in));
        for (int64_t tile = begin; tile < end; ++tile) {
          const int64_t o = tile * kOuts, count = std::min(kOuts, out_rows - o);
          w.dequantize_rows(first_row + o, count, decoded.data());
          for (int64_t r = 0; r < rows; ++r) {
            const float* xr = x + r * x_stride;
            float* yr = y + r * y_stride + o;
            if (count == kOuts) {
              dot_f64_block<kOuts>(xr, in, decoded.data(), k_block, yr);
            } else {
              for (int64_t j = 0; j < count; ++j)
                dot_f64_block<1>(xr, in, decoded.data() + j * in, k_block, yr + j);
            }
          }
        }
      },
      grain);
}

void linear_f64(const float* x, int64_t rows, const LinearWeight& w, float* y, int64_t k_block) {
  linear_f64_strided(x, rows, w.cols(), w, 0, w.rows(), y, w.rows(), k_block);
}

}  // namespace dsv4::ops::cpu
