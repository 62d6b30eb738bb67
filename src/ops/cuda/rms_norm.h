// RMSNorm on the device: the CUDA twin of ops/cpu/norm.h (same parameters, fp32).
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

namespace dsv4::ops::cuda {

struct RmsNormParams {
  int64_t rows = 0;
  int64_t dim = 0;
  float eps = 1e-6f;
};

// x, y: device pointers [rows, dim] (y == x allowed); weight: device [dim] or nullptr (unweighted).
// One block per row; the sum of squares is reduced in fp32 by a warp-shuffle tree.
cudaError_t rms_norm(const RmsNormParams& p, const float* x, const float* weight, float* y, cudaStream_t stream);

// The same, also writing y rounded to bf16 (round to nearest even) into y_bf16 [rows, dim]: the norm and the cast
// to the next GEMM's operand in one pass (the bf16 GPU model's sublayer inputs).
cudaError_t rms_norm_with_bf16(const RmsNormParams& p, const float* x, const float* weight, float* y,
                               uint16_t* y_bf16, cudaStream_t stream);

}  // namespace dsv4::ops::cuda
