// LinearWeight's quantizers (core/linear_weight.h) that the routed experts need, on the device: for the
// GPU-drawn dummy weights (model/cuda/device_random_weights.h) and --expert-bits (device_expert_requantizer.h).
// The same arithmetic as the host's (core/weight_quantizer.h, one copy for both), so given the same fp32 matrix
// every code and scale is bitwise the host's. Outputs are in LinearWeight's layouts, ready for its factories
// (fp4_group_scaled, low_bit_grouped).
// A routed expert of V4-Flash (2048 × 4096) is 8.4M values; the host's requantization of one from MXFP4 to
// Q2G32 measured 0.76 s of a core, the whole model's 33K of them ~26 minutes on 16 cores.
// Each function returns cudaErrorInvalidValue on a shape its format cannot hold.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace dsv4::ops::cuda {

// dense [rows, cols] (cols % 32 == 0) → packed e2m1 [rows, cols / 2] and UE8M0 group scales [rows, cols / 32]
// as fp32 (LinearWeight::quantize_mxfp4_groups).
cudaError_t quantize_mxfp4_groups(const float* dense, int64_t rows, int64_t cols, uint8_t* packed, float* scales,
                                  cudaStream_t stream);

// The inverse of quantize_mxfp4_groups (exact: e2m1 × a power of two), as LinearWeight::dequantize_rows.
cudaError_t dequantize_mxfp4_groups(const uint8_t* packed, const float* scales, int64_t rows, int64_t cols,
                                    float* dense, cudaStream_t stream);

// dense [rows, cols] (cols % 32 == 0) → kQ3G32 (bits 3) or kQ2G32 (bits 2) codes [rows, cols / 32, 4·bits
// bytes] and bf16 scale bits [rows, cols / 32] (LinearWeight::requantized).
cudaError_t quantize_low_bit_groups(const float* dense, int64_t rows, int64_t cols, int bits, uint8_t* codes,
                                    uint16_t* scale_bits, cudaStream_t stream);

}  // namespace dsv4::ops::cuda
