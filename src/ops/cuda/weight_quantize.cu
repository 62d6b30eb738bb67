#include "ops/cuda/weight_quantize.h"

#include "core/weight_quantizer.h"

namespace dsv4::ops::cuda {
namespace {

constexpr int kThreads = 256;

unsigned blocks_for(int64_t items) { return static_cast<unsigned>((items + kThreads - 1) / kThreads); }

__global__ void quantize_mxfp4_groups_kernel(const float* dense, int64_t groups, uint8_t* packed, float* scales) {
  const int64_t group = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (group >= groups) return;
  float values[32];
  for (int i = 0; i < 32; ++i) values[i] = dense[group * 32 + i];
  scales[group] = quantizer::quantize_mxfp4_group(values, packed + group * 16);
}

__global__ void dequantize_mxfp4_groups_kernel(const uint8_t* packed, const float* scales, int64_t pairs,
                                               float* dense) {
  const int64_t pair = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (pair >= pairs) return;
  const float scale = scales[pair / 16];  // 16 bytes (32 values) per group
  const uint8_t byte = packed[pair];
  auto value = [](int code) {
    const float magnitude = quantizer::e2m1_magnitude(code & 7);
    return code & 8 ? -magnitude : magnitude;
  };
  dense[2 * pair] = value(byte & 0xf) * scale;
  dense[2 * pair + 1] = value(byte >> 4) * scale;
}

__global__ void quantize_low_bit_groups_kernel(const float* dense, int64_t groups, quantizer::LowBitFormat format,
                                               uint8_t* codes, uint16_t* scale_bits) {
  const int64_t group = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (group >= groups) return;
  float values[32];
  for (int i = 0; i < 32; ++i) values[i] = dense[group * 32 + i];
  uint8_t bytes[12];
  quantizer::quantize_low_bit_group(values, format, scale_bits + group, bytes);
  for (int b = 0; b < format.group_bytes(); ++b) codes[group * format.group_bytes() + b] = bytes[b];
}

bool valid_grouped(int64_t rows, int64_t cols) { return rows >= 0 && cols >= 0 && cols % 32 == 0; }

}  // namespace

cudaError_t quantize_mxfp4_groups(const float* dense, int64_t rows, int64_t cols, uint8_t* packed, float* scales,
                                  cudaStream_t stream) {
  if (!valid_grouped(rows, cols)) return cudaErrorInvalidValue;
  const int64_t groups = rows * (cols / 32);
  if (groups == 0) return cudaSuccess;
  quantize_mxfp4_groups_kernel<<<blocks_for(groups), kThreads, 0, stream>>>(dense, groups, packed, scales);
  return cudaGetLastError();
}

cudaError_t dequantize_mxfp4_groups(const uint8_t* packed, const float* scales, int64_t rows, int64_t cols,
                                    float* dense, cudaStream_t stream) {
  if (!valid_grouped(rows, cols)) return cudaErrorInvalidValue;
  const int64_t pairs = rows * cols / 2;
  if (pairs == 0) return cudaSuccess;
  dequantize_mxfp4_groups_kernel<<<blocks_for(pairs), kThreads, 0, stream>>>(packed, scales, pairs, dense);
  return cudaGetLastError();
}

cudaError_t quantize_low_bit_groups(const float* dense, int64_t rows, int64_t cols, int bits, uint8_t* codes,
                                    uint16_t* scale_bits, cudaStream_t stream) {
  if (!valid_grouped(rows, cols) || (bits != 2 && bits != 3)) return cudaErrorInvalidValue;
  const int64_t groups = rows * (cols / 32);
  if (groups == 0) return cudaSuccess;
  const quantizer::LowBitFormat format = bits == 3 ? quantizer::kQ3Format : quantizer::kQ2Format;
  quantize_low_bit_groups_kernel<<<blocks_for(groups), kThreads, 0, stream>>>(dense, groups, format, codes,
                                                                            scale_bits);
  return cudaGetLastError();
}

}  // namespace dsv4::ops::cuda
