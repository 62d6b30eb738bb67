// The activation quantizer of DeepSeek's FP8 linears on the device (model_spec.md §3.2,
// docs/kernels/fp8_gemm.md): x [rows, cols] (fp32 or bf16) → e4m3 codes [rows, cols] + one power-of-two fp32
// scale per row and 128 columns, bit-identical to ops::cpu::quantize_e4m3_blocks(row, cols, 128)
// (ops/cpu/quantize.h): per block s = 2^ceil(log2(max(amax, 1e-4) / 448)) (the ceil-log2 read off the fp32
// quotient's exponent and mantissa bits), code = e4m3_RNE(clamp(x / s, ±448)), and dequantized value code ·
// s; a shorter last block when cols is not a multiple of 128.
//
// Scale layout: scales[block · scale_stride + row] — block-major, rows contiguous (scale_stride ≥ rows; 0 =
// rows). That is cuBLASLt's CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F layout for the activation operand of
// ops/cuda/gemm.h (the same layout PyTorch's _scaled_mm checks for a 1x128 scale: shape [rows, K/128],
// strides [1, rows]), and what ops/cuda/fp8_gemm.h reads, so the quantizer's output feeds either GEMM
// unchanged.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace dsv4::ops::cuda {

inline constexpr int64_t kFp8Block =
    128;  // quantization block of activations (1 × 128) and weights (128 × 128)

struct Fp8QuantizeParams {
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t x_stride = 0;      // elements between rows of x; 0 = cols
  int64_t code_stride = 0;   // bytes between rows of the codes; 0 = cols
  int64_t scale_stride = 0;  // floats between the scale rows of consecutive 128-column blocks; 0 = rows
  bool bf16_input = false;   // x holds bf16 bits (uint16) instead of fp32
};

// ceil(cols / 128) × scale_stride floats.
inline int64_t fp8_activation_scale_count(int64_t rows, int64_t cols, int64_t scale_stride = 0) {
  return (cols + kFp8Block - 1) / kFp8Block * (scale_stride ? scale_stride : rows);
}

// One warp per (row, 128-column block), 4 values per lane; 16-byte loads and 4-byte stores where the shape
// and pointers allow. Launched with programmatic dependent launch (ops/cuda/launch.cuh).
// cudaErrorInvalidValue on a negative size or a stride smaller than the row.
cudaError_t quantize_e4m3_rows(const Fp8QuantizeParams& p, const void* x, uint8_t* codes, float* scales,
                               cudaStream_t stream);

// DeepSeek's FP8 simulation in place (Numerics::kDeepSeek, docs/numerics.md), the twin of
// ops::cpu::quantize_e4m3_blocks(row, cols, block) on each row: per `block` columns (a shorter last block) the
// UE8M0 scale as above and x ← e4m3_RNE(clamp(x / s, ±448)) · s, exact in fp32 and bf16. Where the reference
// quantizes and its consumer reads the dequantized values: the K=V vector's non-rope channels (block 64) and the
// experts' input (block 128) of a model whose cache or GEMMs are not FP8 themselves.
struct Fp8SimulateParams {
  int64_t rows = 0;
  int64_t cols = 0;        // the leading columns of each row that are quantized
  int64_t stride = 0;      // elements between rows; 0 = cols
  int64_t block = kFp8Block;  // 32, 64 or 128
  bool bf16 = false;       // x holds bf16 bits (uint16) instead of fp32
};
// One warp per (row, block). cudaErrorInvalidValue on a negative size, a stride under cols or another block.
cudaError_t simulate_e4m3_blocks(const Fp8SimulateParams& p, void* x, cudaStream_t stream);

}  // namespace dsv4::ops::cuda
