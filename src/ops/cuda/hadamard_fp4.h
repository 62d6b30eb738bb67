// DeepSeek's FP4 simulation of the lightning indexer's queries and keys on the device (research model_spec.md
// §3.5, §8; docs/numerics.md "What kDeepSeek replicates"): per row of `dim` values, in place,
//   x ← bf16(x);  x ← bf16(fp32(H_dim · x) · scale);  per `block` values: s = 2^ceil(log2(max(amax, 6·2^-126) / 6))
//   (UE8M0), x ← bf16(e2m1_round(clamp(x / s, ±6)) · s)
// with H the Sylvester Walsh–Hadamard matrix, its butterflies in double and rounded once (the oracle's exact
// accumulation) — the twin of ops/cpu/quantize.h hadamard_fp4 (kDeepSeek's indexer path on the CPU), bit for bit. A step towards `--numerics
// deepseek` on the GPU (issue 7): the CUDA model runs it on the indexer queries in that mode.
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

namespace dsv4::ops::cuda {

struct HadamardFp4Params {
  int64_t rows = 0;
  int64_t dim = 128;    // 64, 128 or 256 (the indexer's head dim is 128)
  int64_t block = 32;   // FP4 block: a multiple of dim / 32, at most dim
  float scale = 0.0f;   // the transform's scale: dim^-0.5 in the reference (rotate_activation)
};

// x: fp32 [rows, dim], device, in place. cudaErrorInvalidValue for shapes outside the above.
cudaError_t hadamard_fp4_rows(const HadamardFp4Params& p, float* x, cudaStream_t stream);

}  // namespace dsv4::ops::cuda
