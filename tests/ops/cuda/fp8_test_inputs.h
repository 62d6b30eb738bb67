// Inputs of the e4m3 block quantizers' tests (ops/cuda/fp8_quantize.h): random activations, edge rows, and a
// bitwise comparison; shared by fp8_gemm_test.cpp and fp8_simulate_test.cpp.
#pragma once
#include <cmath>
#include <cstring>
#include <cstdint>
#include <random>
#include <vector>

namespace dsv4::testing {

inline bool same_bits(float a, float b) {
  if (std::isnan(a) && std::isnan(b)) return true;
  uint32_t ua, ub;
  std::memcpy(&ua, &a, 4);
  std::memcpy(&ub, &b, 4);
  return ua == ub;
}

// Activations: normal values with a per-row magnitude from 1e-3 to 1e3 (rows of very different scales, as a
// residual stream has), a few outliers.
inline std::vector<float> random_activations(int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> log_scale(-3.0f, 3.0f);
  std::vector<float> x(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    const float scale = std::pow(10.0f, log_scale(rng));
    for (int64_t c = 0; c < cols; ++c) {
      float v = normal(rng) * scale;
      if (rng() % 97 == 0) v *= 30.0f;
      if (v == 0.0f) v = scale;
      x[r * cols + c] = v;
    }
  }
  return x;
}

// Six rows of `cols` edge values for quantization blocks of `block` columns: tiny values (amax under the 1e-4
// floor), huge values, exact e4m3 rounding ties after scaling (odd multiples of half a quantum, both signs; the
// block's amax 448, scale 1), values that saturate just above 448 · s, subnormal e4m3 codes, powers of two.
inline std::vector<float> fp8_edge_values(int64_t cols, int64_t block) {
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(6 * cols));
  for (int64_t c = 0; c < cols; ++c) {
    x[0 * cols + c] = u(rng) * 1e-6f + (c % 2 ? 3e-7f : -3e-7f);
    x[1 * cols + c] = u(rng) * 1e30f + 1e25f;
    const float grid = std::ldexp(1.0f, static_cast<int>(c % 8)) * (1.0f + static_cast<float>(c % 7) / 8.0f);
    const float tie = grid + std::ldexp(1.0f, static_cast<int>(c % 8) - 4);
    x[2 * cols + c] = c % block == 0 ? 448.0f : (c % 3 ? tie : -tie);
    x[3 * cols + c] = c % block == 1 ? 1.0f : u(rng) * 0.01f;  // mostly e4m3 subnormals after scaling
    x[4 * cols + c] = u(rng) * 447.9f + (c % block == 5 ? 460.0f : 0.0f);
    x[5 * cols + c] = (c % 2 ? 1.0f : -1.0f) * std::ldexp(1.0f, static_cast<int>(c % 40) - 20);
  }
  return x;
}

}  // namespace dsv4::testing
