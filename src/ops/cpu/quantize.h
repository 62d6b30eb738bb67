// The quantizers of DeepSeek's own inference recipe (docs/numerics.md; research model_spec.md §3.2, §3.3, §3.5),
// as small pure functions on fp32 values: every result is the dequantized value, i.e. what the reference computes
// with after its quantize -> dequantize round trip. Power-of-two (UE8M0) scales make x / s and q · s exact.
#pragma once
#include <cstdint>

namespace dsv4::ops::cpu {

inline constexpr float kE4m3Max = 448.0f;  // largest finite OCP e4m3 value
inline constexpr float kE2m1Max = 6.0f;    // largest e2m1 value

// x rounded to the e4m3 grid: round-to-nearest-even, saturating to ±448 (torch.float8_e4m3fn cast of a value
// that the quantizer has clamped to ±448 first). NaN stays NaN.
float e4m3_round(float x);
// x rounded to the e2m1 grid {0, 0.5, 1, 1.5, 2, 3, 4, 6} (and negatives): round-to-nearest-even, saturating to ±6.
float e2m1_round(float x);

// The UE8M0 block scale 2^ceil(log2(max(amax, min_amax) / max_code)), the ceil-log2 taken on the exponent bits of
// the fp32 quotient (model_spec.md §3.2: exponent − 127 + (mantissa ≠ 0)).
float ue8m0_scale(float amax, float max_code, float min_amax);

// In place, for each of the `n / block` consecutive blocks of x (a shorter last block when n is
// not a multiple of block): s = ue8m0_scale(amax,
// 448, 1e-4), x = e4m3_round(clamp(x / s, ±448)) · s. Block 128: activation of an FP8/FP4 linear (§3.2);
// block 64: the FP8 simulation of the KV entries' non-rope channels (§3.3).
void quantize_e4m3_blocks(float* x, int64_t n, int64_t block);
// In place, blocks of `block` (32 in the reference): s = ue8m0_scale(amax, 6, 6·2^-126),
// x = e2m1_round(clamp(x / s, ±6)) · s. The indexer's FP4 simulation (§3.3, §8).
void quantize_e2m1_blocks(float* x, int64_t n, int64_t block);

// In place, x ← fp32(H_n · x) · scale with H_n the Sylvester (natural-order) Walsh–Hadamard matrix, n a power of two
// (fast_hadamard_transform's hadamard_transform; the reference uses scale n^-0.5, §3.5). Butterflies in double,
// rounded once to fp32 before the fp32 scaling (the oracle's exact accumulation, docs/numerics.md).
void hadamard_transform(float* x, int64_t n, float scale);

// In place, DeepSeek's FP4 simulation of one indexer query or key of n values (§3.5, §8; rotate_activation then
// fp4 act_quant): x ← bf16(x); x ← bf16(fp32(H_n · x) · scale); per `block`: quantize_e2m1_blocks; bf16. The twin
// of ops/cuda/hadamard_fp4.h.
void hadamard_fp4(float* x, int64_t n, float scale, int64_t block);

// In place, every value rounded to the nearest bf16 (ties to even): where the reference holds a bf16 tensor.
void round_to_bf16(float* x, int64_t n);

}  // namespace dsv4::ops::cpu
