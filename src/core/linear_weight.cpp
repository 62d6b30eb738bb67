#include "core/linear_weight.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/dtype.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "core/weight_quantizer.h"

namespace dsv4 {
namespace {

// FP4 e2m1 code -> value (research/model_spec.md §2.1: 0..7 = {0, 0.5, 1, 1.5, 2, 3, 4, 6}, 8..15 their
// negatives).
constexpr float kFp4Values[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                  -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// e4m3 code -> value for all 256 codes, built once (the decode loop is a table look-up).
struct E4m3Table {
  float values[256];
  E4m3Table() {
    for (int code = 0; code < 256; ++code) values[code] = f8e4m3_to_f32(static_cast<uint8_t>(code));
  }
};
const E4m3Table& e4m3_table() {
  static const E4m3Table table;
  return table;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

using quantizer::e2m1_code;
using quantizer::e4m3_code;
using quantizer::ue8m0_scale_for;
using GroupFormat = quantizer::LowBitFormat;

GroupFormat group_format(WeightEncoding encoding) {
  return encoding == WeightEncoding::kQ3G32 ? quantizer::kQ3Format : quantizer::kQ2Format;
}
bool grouped_low_bit(WeightEncoding encoding) {
  return encoding == WeightEncoding::kQ3G32 || encoding == WeightEncoding::kQ2G32;
}

int read_code(const uint8_t* group, int bits, int i) { return quantizer::group_code(group, bits, i); }

}  // namespace

LinearWeight::LinearWeight(Tensor dense) {
  DSV4_CHECK(dense.shape.size() == 2 || dense.empty(),
             "a linear weight is a 2-D [out, in] matrix, got " + dense.shape_string());
  if (dense.shape.size() == 2) {
    rows_ = dense.shape[0];
    cols_ = dense.shape[1];
  }
  dense_ = std::move(dense);
}

LinearWeight LinearWeight::fp8_block_scaled(int64_t out, int64_t in, std::vector<uint8_t> codes,
                                            const std::vector<float>& block_scales) {
  const int64_t block_rows = ceil_div(out, 128), block_cols = ceil_div(in, kFp8GroupColumns);
  DSV4_CHECK(out >= 0 && in >= 0 && static_cast<int64_t>(codes.size()) == out * in,
             "FP8 weight: " + std::to_string(codes.size()) + " codes for a [" + std::to_string(out) + ", " +
                 std::to_string(in) + "] matrix");
  DSV4_CHECK(static_cast<int64_t>(block_scales.size()) == block_rows * block_cols,
             "FP8 weight: " + std::to_string(block_scales.size()) + " block scales, expected " +
                 std::to_string(block_rows * block_cols));
  LinearWeight w;
  w.encoding_ = WeightEncoding::kF8E4M3;
  w.rows_ = out;
  w.cols_ = in;
  w.codes_ = std::move(codes);
  w.fp8_scales_.resize(static_cast<size_t>(out * block_cols));
  for (int64_t r = 0; r < out; ++r)
    for (int64_t b = 0; b < block_cols; ++b)
      w.fp8_scales_[r * block_cols + b] = block_scales[(r / 128) * block_cols + b];
  return w;
}

LinearWeight LinearWeight::fp4_group_scaled(int64_t out, int64_t in, std::vector<uint8_t> packed,
                                            const std::vector<float>& group_scales, const std::string& name) {
  const int64_t groups = ceil_div(in, kFp4GroupColumns);
  DSV4_CHECK(in % 2 == 0 && out >= 0 && static_cast<int64_t>(packed.size()) == out * in / 2,
             name + ": " + std::to_string(packed.size()) + " packed FP4 bytes for a [" + std::to_string(out) +
                 ", " + std::to_string(in) + "] matrix (two elements per byte, an even column count)");
  DSV4_CHECK(static_cast<int64_t>(group_scales.size()) == out * groups,
             name + ": " + std::to_string(group_scales.size()) + " FP4 scales, expected " +
                 std::to_string(out * groups));
  LinearWeight w;
  w.encoding_ = WeightEncoding::kFp4E2M1;
  w.rows_ = out;
  w.cols_ = in;
  w.codes_ = std::move(packed);
  w.fp4_exponents_.resize(group_scales.size());
  for (size_t i = 0; i < group_scales.size(); ++i) {
    int exponent = 0;
    const float mantissa =
        std::frexp(group_scales[i], &exponent);  // scale = 0.5 · 2^exponent for a power of two
    const int biased = exponent - 1 + 127;
    if (mantissa != 0.5f || biased < 0 || biased > 254)
      throw Error(name + ": FP4 scale " + std::to_string(i) + " = " + std::to_string(group_scales[i]) +
                  " is not a UE8M0 power of two (2^-127 ... 2^127)");
    w.fp4_exponents_[i] = static_cast<uint8_t>(biased);
  }
  return w;
}

LinearWeight LinearWeight::low_bit_grouped(WeightEncoding encoding, int64_t out, int64_t in,
                                           std::vector<uint8_t> codes, std::vector<uint16_t> scale_bits) {
  DSV4_CHECK(grouped_low_bit(encoding), "low_bit_grouped(): the encoding must be kQ3G32 or kQ2G32");
  DSV4_CHECK(out >= 0 && in >= 0 && in % 32 == 0,
             "a grouped low-bit weight of [" + std::to_string(out) + ", " + std::to_string(in) +
                 "] (columns must be a multiple of 32)");
  const GroupFormat format = group_format(encoding);
  const int64_t groups = out * (in / 32);
  DSV4_CHECK(static_cast<int64_t>(codes.size()) == groups * format.group_bytes() &&
                 static_cast<int64_t>(scale_bits.size()) == groups,
             "a grouped low-bit weight of [" + std::to_string(out) + ", " + std::to_string(in) + "]: " +
                 std::to_string(codes.size()) + " code bytes and " + std::to_string(scale_bits.size()) +
                 " scales, expected " + std::to_string(groups * format.group_bytes()) + " and " +
                 std::to_string(groups));
  LinearWeight w;
  w.encoding_ = encoding;
  w.rows_ = out;
  w.cols_ = in;
  w.codes_ = std::move(codes);
  w.group_scales_ = std::move(scale_bits);
  return w;
}

LinearWeight LinearWeight::concat_rows(const LinearWeight& top, const LinearWeight& bottom) {
  DSV4_CHECK(top.encoding_ == bottom.encoding_ && top.cols_ == bottom.cols_,
             "cannot stack a " + top.shape_string() + " and a " + bottom.shape_string() +
                 " weight of different encodings or widths");
  LinearWeight w;
  w.encoding_ = top.encoding_;
  w.rows_ = top.rows_ + bottom.rows_;
  w.cols_ = top.cols_;
  auto append = [](auto& out, const auto& a, const auto& b) {
    out.reserve(a.size() + b.size());
    out.insert(out.end(), a.begin(), a.end());
    out.insert(out.end(), b.begin(), b.end());
  };
  if (w.encoding_ == WeightEncoding::kF32) {
    w.dense_.shape = {w.rows_, w.cols_};
    append(w.dense_.data, top.dense_.data, bottom.dense_.data);
  }
  append(w.codes_, top.codes_, bottom.codes_);
  append(w.fp8_scales_, top.fp8_scales_, bottom.fp8_scales_);
  append(w.fp4_exponents_, top.fp4_exponents_, bottom.fp4_exponents_);
  append(w.group_scales_, top.group_scales_, bottom.group_scales_);
  return w;
}

int64_t LinearWeight::dim(size_t axis) const {
  DSV4_CHECK(axis < 2, "a linear weight has 2 dimensions, asked for " + std::to_string(axis));
  return axis == 0 ? rows_ : cols_;
}

std::string LinearWeight::shape_string() const {
  return "[" + std::to_string(rows_) + ", " + std::to_string(cols_) + "]";
}

const Tensor& LinearWeight::dense() const {
  DSV4_CHECK(encoding_ == WeightEncoding::kF32,
             "an FP8/FP4 weight " + shape_string() + " has no fp32 matrix");
  return dense_;
}

Tensor& LinearWeight::dense() {
  DSV4_CHECK(encoding_ == WeightEncoding::kF32,
             "an FP8/FP4 weight " + shape_string() + " has no fp32 matrix");
  return dense_;
}

void LinearWeight::dequantize_rows(int64_t first_row, int64_t count, float* out) const {
  DSV4_CHECK(first_row >= 0 && count >= 0 && first_row + count <= rows_,
             "rows [" + std::to_string(first_row) + ", " + std::to_string(first_row + count) + ") of a " +
                 shape_string() + " weight");
  const int64_t cols = cols_;
  switch (encoding_) {
    case WeightEncoding::kF32:
      std::copy(dense_.data.begin() + first_row * cols, dense_.data.begin() + (first_row + count) * cols,
                out);
      return;
    case WeightEncoding::kF8E4M3: {
      const float* table = e4m3_table().values;
      const int64_t groups = ceil_div(cols, kFp8GroupColumns);
      for (int64_t r = 0; r < count; ++r) {
        const uint8_t* codes = &codes_[(first_row + r) * cols];
        const float* scales = &fp8_scales_[(first_row + r) * groups];
        float* row = out + r * cols;
        for (int64_t c = 0; c < cols; ++c) row[c] = table[codes[c]] * scales[c / kFp8GroupColumns];
      }
      return;
    }
    case WeightEncoding::kFp4E2M1: {
      const int64_t groups = ceil_div(cols, kFp4GroupColumns);
      for (int64_t r = 0; r < count; ++r) {
        const uint8_t* packed = &codes_[(first_row + r) * (cols / 2)];
        const uint8_t* exponents = &fp4_exponents_[(first_row + r) * groups];
        float* row = out + r * cols;
        for (int64_t c = 0; c < cols; c += 2) {
          const float scale = std::ldexp(1.0f, static_cast<int>(exponents[c / kFp4GroupColumns]) - 127);
          const uint8_t byte = packed[c / 2];
          row[c] = kFp4Values[byte & 0xf] * scale;
          row[c + 1] = kFp4Values[byte >> 4] * scale;  // c is even and 32 | group width: same group as c
        }
      }
      return;
    }
    case WeightEncoding::kQ3G32:
    case WeightEncoding::kQ2G32: {
      const GroupFormat format = group_format(encoding_);
      const int64_t groups = cols / 32;
      for (int64_t r = 0; r < count; ++r)
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t index = (first_row + r) * groups + g;
          const float scale = bf16_to_f32(group_scales_[index]);
          const uint8_t* group = &codes_[index * format.group_bytes()];
          float* values = out + r * cols + g * 32;
          for (int i = 0; i < 32; ++i)
            values[i] = (static_cast<float>(read_code(group, format.bits, i)) - format.offset) * scale;
        }
      return;
    }
  }
}

LinearWeight LinearWeight::requantized(WeightEncoding target) const {
  DSV4_CHECK(grouped_low_bit(target), "requantized(): the target must be kQ3G32 or kQ2G32");
  DSV4_CHECK(cols_ % 32 == 0, "cannot requantize a " + shape_string() + " weight in groups of 32 columns");
  const GroupFormat format = group_format(target);
  const int64_t groups = cols_ / 32;
  LinearWeight w;
  w.encoding_ = target;
  w.rows_ = rows_;
  w.cols_ = cols_;
  w.codes_.resize(static_cast<size_t>(rows_ * groups * format.group_bytes()));
  w.group_scales_.resize(static_cast<size_t>(rows_ * groups));
  ThreadPool::global().parallel_for(
      rows_,
      [&](int64_t begin, int64_t end) {
        std::vector<float> row(static_cast<size_t>(cols_));
        for (int64_t r = begin; r < end; ++r) {
          dequantize_rows(r, 1, row.data());
          for (int64_t g = 0; g < groups; ++g)
            quantizer::quantize_low_bit_group(&row[g * 32], format, &w.group_scales_[r * groups + g],
                           &w.codes_[(r * groups + g) * format.group_bytes()]);
        }
      },
      std::max<int64_t>(1, 4096 / std::max<int64_t>(cols_ / 32, 1)));
  return w;
}

bool LinearWeight::fp8_block_scales(std::vector<float>& out) const {
  if (encoding_ != WeightEncoding::kF8E4M3) return false;
  const int64_t groups = ceil_div(cols_, kFp8GroupColumns), block_rows = ceil_div(rows_, 128);
  for (int64_t r = 0; r < rows_; ++r)
    for (int64_t g = 0; g < groups; ++g)
      if (fp8_scales_[r * groups + g] != fp8_scales_[(r / 128 * 128) * groups + g]) return false;
  out.resize(static_cast<size_t>(block_rows * groups));
  for (int64_t b = 0; b < block_rows; ++b)
    for (int64_t g = 0; g < groups; ++g) out[b * groups + g] = fp8_scales_[(b * 128) * groups + g];
  return true;
}

LinearWeight LinearWeight::quantize_mxfp4_groups(const Tensor& dense) {
  DSV4_CHECK(
      dense.shape.size() == 2 && dense.shape[1] % kFp4GroupColumns == 0,
      "MXFP4 quantization of a " + dense.shape_string() + " tensor (columns must be a multiple of 32)");
  const int64_t rows = dense.shape[0], cols = dense.shape[1], groups = cols / kFp4GroupColumns;
  std::vector<float> scales(static_cast<size_t>(rows * groups));
  std::vector<uint8_t> packed(static_cast<size_t>(rows * cols / 2), 0);
  ThreadPool::global().parallel_for(
      rows,
      [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r)
          for (int64_t g = 0; g < groups; ++g) {
            scales[static_cast<size_t>(r * groups + g)] = quantizer::quantize_mxfp4_group(
                dense.ptr() + r * cols + g * kFp4GroupColumns, packed.data() + (r * cols + g * kFp4GroupColumns) / 2);
          }
      },
      16);
  return fp4_group_scaled(rows, cols, std::move(packed), scales);
}

LinearWeight LinearWeight::quantize_fp8_blocks(const Tensor& dense) {
  DSV4_CHECK(dense.shape.size() == 2, "FP8 block quantization of a " + dense.shape_string() + " tensor");
  const int64_t rows = dense.shape[0], cols = dense.shape[1];
  const int64_t block_rows = ceil_div(rows, 128), block_cols = ceil_div(cols, 128);
  std::vector<float> scales(static_cast<size_t>(block_rows * block_cols));
  std::vector<uint8_t> codes(static_cast<size_t>(rows * cols));
  ThreadPool::global().parallel_for(block_rows * block_cols, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const int64_t r0 = block / block_cols * 128, c0 = block % block_cols * 128;
      const int64_t r1 = std::min(rows, r0 + 128), c1 = std::min(cols, c0 + 128);
      float amax = quantizer::kFp8AmaxFloor;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(dense.data[r * cols + c]));
      const float scale = ue8m0_scale_for(amax, 448.0f);
      scales[block] = scale;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) codes[r * cols + c] = e4m3_code(dense.data[r * cols + c] / scale);
    }
  });
  return fp8_block_scaled(rows, cols, std::move(codes), scales);
}

double LinearWeight::bits_per_parameter(WeightEncoding encoding) {
  switch (encoding) {
    case WeightEncoding::kF32:
      return 32.0;
    case WeightEncoding::kF8E4M3:
      return 8.0;  // + one fp32 scale per 128×128 block as stored
    case WeightEncoding::kFp4E2M1:
      return 4.25;
    case WeightEncoding::kQ3G32:
      return 3.5;
    case WeightEncoding::kQ2G32:
      return 2.5;
  }
  return 0.0;
}

Tensor LinearWeight::dequantized() const {
  if (encoding_ == WeightEncoding::kF32) return dense_;
  Tensor out({rows_, cols_});
  dequantize_rows(0, rows_, out.ptr());
  return out;
}

size_t LinearWeight::storage_bytes() const {
  return dense_.data.size() * sizeof(float) + codes_.size() + fp8_scales_.size() * sizeof(float) +
         fp4_exponents_.size() + group_scales_.size() * sizeof(uint16_t);
}

}  // namespace dsv4
