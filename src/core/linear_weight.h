// LinearWeight: the [out, in] matrix of a projection as the CPU backend keeps it in host memory — fp32, or in
// the encoding the checkpoint stores it in. The released V4 checkpoints are FP8 e4m3 with 128×128 UE8M0 block
// scales and MXFP4 routed experts (packed e2m1 pairs, one UE8M0 scale per 32; research/model_spec.md §2.1):
// kept as they are, V4-Flash's 149 GiB stay ≈149 GiB instead of the ≈1.1 TiB of an fp32 copy (issue 7, "kept
// quantized in memory"). The CPU linears (ops/cpu/linear.h) decode a panel of rows at a time; every decoded
// value is exact (e4m3 / e2m1 × a power of two), so the products and sums equal those over the dequantized
// matrix.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "core/weight_quantizer.h"

namespace dsv4 {

enum class WeightEncoding {
  kF32,      // a dense fp32 Tensor
  kF8E4M3,   // one e4m3 byte per element, one fp32 scale per row and 128 columns
  kFp4E2M1,  // two e2m1 nibbles per byte (the even column in the low nibble), one UE8M0 scale per row and 32
             // columns
  // Requantized routed experts (issue 7 item 5, research/perf_anchors.md §6.2: V4-Flash fits one H200 only
  // below ~4 bits/param). Per 32 columns one bf16 scale s and 32 codes packed little-endian into a bit
  // stream:
  kQ3G32,  // 3-bit codes c, value (c − 4)·s: levels −4 … 3, 12 bytes + 2 per group = 3.5 bits/param
  kQ2G32   // 2-bit codes c, value (c − 1.5)·s: levels ±0.5, ±1.5 (no zero), 8 + 2 bytes = 2.5 bits/param
};

class LinearWeight {
 public:
  static constexpr int64_t kFp8GroupColumns = 128;
  static constexpr int64_t kFp4GroupColumns = 32;

  LinearWeight() = default;
  // A dense fp32 [out, in] matrix.
  explicit LinearWeight(Tensor dense);
  // FP8 codes [out, in] and the checkpoint's block scales [ceil(out/128), ceil(in/128)] (multipliers: value =
  // e4m3(code) · scale). Scales are kept per row and 128 columns — each block's scale repeated over its rows,
  // 3 % of the codes' bytes — so that matrices concatenate by rows at any row count (w1 ‖ w3).
  static LinearWeight fp8_block_scaled(int64_t out, int64_t in, std::vector<uint8_t> codes,
                                       const std::vector<float>& block_scales);
  // Packed FP4 [out, in/2] bytes and one scale per row and 32 columns [out, ceil(in/32)]. MXFP4 scales are
  // UE8M0: each must be a power of two 2^-127 … 2^127, else dsv4::Error naming `name`.
  static LinearWeight fp4_group_scaled(int64_t out, int64_t in, std::vector<uint8_t> packed,
                                       const std::vector<float>& group_scales,
                                       const std::string& name = "weight");
  // This matrix in kQ3G32 or kQ2G32 (cols a multiple of 32, dsv4::Error otherwise): per group the bf16 scale
  // of least squared error among 16 candidates amax / k (k spanning the level range), each code the nearest
  // level. Rows are spread over ThreadPool::global().
  LinearWeight requantized(WeightEncoding target) const;
  // A kQ3G32 / kQ2G32 matrix from its codes [out, in / 32, 4·bits bytes] and bf16 scale bits [out, in / 32]
  // (what requantized() produces; dsv4::Error on sizes that do not match).
  static LinearWeight low_bit_grouped(WeightEncoding encoding, int64_t out, int64_t in, std::vector<uint8_t> codes,
                                      std::vector<uint16_t> scale_bits);
  // Bits per parameter of an encoding, scales included (kF32: 32).
  static double bits_per_parameter(WeightEncoding encoding);
  // A dense fp32 matrix in the released checkpoints' FP8 layout: per 128×128 block the UE8M0 scale
  // 2^ceil(log2(max(amax, 1e-4) / 448)), codes the e4m3 round-to-nearest-even of value / scale (exact: the
  // scale is a power of two). What --load-format dummy makes of a config that declares FP8 weights.
  static LinearWeight quantize_fp8_blocks(const Tensor& dense);
  // A dense fp32 matrix (cols a multiple of 32) in the released routed experts' MXFP4 layout: per row and 32
  // columns the UE8M0 scale 2^ceil(log2(max(amax, 6·2^-126) / 6)), codes the e2m1 round-to-nearest-even of
  // value / scale. What --load-format dummy makes of the routed experts of a config with expert_dtype "fp4".
  static LinearWeight quantize_mxfp4_groups(const Tensor& dense);
  // [top; bottom]: the same encoding and column count (dsv4::Error otherwise).
  static LinearWeight concat_rows(const LinearWeight& top, const LinearWeight& bottom);

  WeightEncoding encoding() const { return encoding_; }
  bool quantized() const { return encoding_ != WeightEncoding::kF32; }
  bool empty() const { return rows_ == 0 || cols_ == 0; }
  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }
  // Tensor-like: dim(0) = out, dim(1) = in.
  int64_t dim(size_t axis) const;
  std::vector<int64_t> shape() const { return {rows_, cols_}; }
  std::string shape_string() const;

  // The fp32 matrix of a kF32 weight (dsv4::Error for a quantized one).
  const Tensor& dense() const;
  Tensor& dense();
  // Rows [first_row, first_row + count) decoded to fp32 into out [count, cols].
  void dequantize_rows(int64_t first_row, int64_t count, float* out) const;
  // The whole matrix in fp32 (a copy for kF32).
  Tensor dequantized() const;
  // The stored codes (kF8E4M3: [rows, cols] e4m3 bytes, what an FP8 GEMM reads).
  const std::vector<uint8_t>& codes() const { return codes_; }
  // kFp4E2M1: the UE8M0 scale bytes [rows, cols / 32] (value = e2m1(code) · 2^(e − 127)).
  const std::vector<uint8_t>& fp4_exponents() const { return fp4_exponents_; }
  // kQ3G32 / kQ2G32: the bf16 scale bits [rows, cols / 32] (codes() holds the groups' bit streams).
  const std::vector<uint16_t>& group_scales() const { return group_scales_; }
  // Code i (0..31) of one kQ3G32 / kQ2G32 group's little-endian bit stream of 4·bits bytes.
  static int group_code(const uint8_t* group, int bits, int i) { return quantizer::group_code(group, bits, i); }
  // kF8E4M3: the checkpoint's block scales [ceil(rows/128), ceil(cols/128)] into `out`; false (out untouched)
  // when some 128-row block's rows do not share their scales (a w1 ‖ w3 stack at a row count off the blocks).
  bool fp8_block_scales(std::vector<float>& out) const;
  // Host bytes held: values plus scales.
  size_t storage_bytes() const;

 private:
  WeightEncoding encoding_ = WeightEncoding::kF32;
  int64_t rows_ = 0, cols_ = 0;
  Tensor dense_;                        // kF32
  std::vector<uint8_t> codes_;          // kF8E4M3 [rows, cols]; kFp4E2M1 [rows, cols / 2]
  std::vector<float> fp8_scales_;       // kF8E4M3 [rows, ceil(cols / 128)]
  std::vector<uint8_t> fp4_exponents_;  // kFp4E2M1 [rows, ceil(cols / 32)], UE8M0 bytes: 2^(e − 127)
  std::vector<uint16_t> group_scales_;  // kQ3G32 / kQ2G32 [rows, cols / 32], bf16 bits
  // (codes_ holds kQ3G32 [rows, cols / 32, 12] and kQ2G32 [rows, cols / 32, 8] bytes)
};

}  // namespace dsv4
