// The cos/sin table of a RoPE rotation in shared memory: the one copy rope.cu and head_norm_rope.cu share, so
// both rotate by exactly the CPU's angles (ops/cpu/rope.h).
#pragma once
#include <cuda_runtime.h>

namespace dsv4::ops::cuda {

// cos_table[i] = cos(fp32(inv_freq[i] · position)) · scaling, sin_table[i] = sin(…) · scaling · sin_sign for
// i < pairs, filled by the block's threads (stride `threads`); the caller synchronises before reading. The precise
// sincosf (not __sinf): positions up to 1M give large fp32 angles.
__device__ __forceinline__ void fill_rope_table(const float* __restrict__ inv_freq, float position, int pairs,
                                                float attention_scaling, float sin_sign, int threads,
                                                float* cos_table, float* sin_table) {
  for (int i = threadIdx.x; i < pairs; i += threads) {
    const float angle = __fmul_rn(inv_freq[i], position);  // fp32 product, as torch's inv_freq @ position_ids
    float s, c;
    sincosf(angle, &s, &c);
    cos_table[i] = __fmul_rn(c, attention_scaling);
    sin_table[i] = __fmul_rn(__fmul_rn(s, attention_scaling), sin_sign);
  }
}

}  // namespace dsv4::ops::cuda
