// The random values of the dummy models (model/random_init.h), shared by the host generator and the device
// one (ops/cuda/random_fill.h) so both compute the same element from the same draws: SplitMix64, a tiny
// portable generator (std::normal_distribution differs between standard libraries). It is counter-based — each
// draw adds one constant to the state — so the generator k draws ahead is one multiply away, and element i of
// a tensor is a pure function of (the tensor's start state, i): a fill can start anywhere, on any thread.
//
// Every operation is IEEE round-to-nearest on both sides (the device's products and sums are written as
// __dmul_rn / __dadd_rn so nvcc cannot contract them into FMAs), except std::log / std::cos: glibc's and
// CUDA's differ by at most an ulp or two of a double, which changes the float result only when the double
// falls within those ulps of a float rounding boundary (about one element in 10^8).
#pragma once
#include <cmath>
#include <cstdint>

#include "core/host_device.h"

namespace dsv4 {

inline constexpr uint64_t kSplitMixIncrement = 0x9e3779b97f4a7c15ull;

struct SplitMix64 {
  uint64_t state;
  DSV4_HOST_DEVICE SplitMix64 ahead(uint64_t draws) const {  // mod 2^64, as next()
    return SplitMix64{state + draws * kSplitMixIncrement};
  }
  DSV4_HOST_DEVICE uint64_t next() {
    uint64_t z = (state += kSplitMixIncrement);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  DSV4_HOST_DEVICE double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  static constexpr uint64_t kDrawsPerNormal = 2;
  static constexpr uint64_t kDrawsPerUniform = 1;
  // Box-Muller: kDrawsPerNormal draws.
  DSV4_HOST_DEVICE double normal() {
    const double u1 = 1.0 - uniform(), u2 = uniform();
#if defined(__CUDA_ARCH__)
    return __dmul_rn(sqrt(__dmul_rn(-2.0, log(u1))), cos(__dmul_rn(kTwoPi, u2)));
#else
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(kTwoPi * u2);
#endif
  }
  static constexpr double kTwoPi = 2.0 * 3.14159265358979323846;  // 2 · M_PI, exact (a power-of-two product)
};

// How the elements of one random tensor are drawn: element i = offset + scale · (a normal, or a uniform in
// [0, 1)) of the generator `draws_per_element` · i draws after `start`, rounded once to fp32.
struct RandomFill {
  enum class Kind : uint8_t { kNormal, kUniform };
  Kind kind = Kind::kNormal;
  uint64_t start = 0;
  double offset = 0.0, scale = 1.0;

  DSV4_HOST_DEVICE uint64_t draws_per_element() const {
    return kind == Kind::kNormal ? SplitMix64::kDrawsPerNormal : SplitMix64::kDrawsPerUniform;
  }
  DSV4_HOST_DEVICE SplitMix64 generator_at(uint64_t index) const {
    return SplitMix64{start}.ahead(draws_per_element() * index);
  }
  // The element drawn by `generator` (positioned at the element, as generator_at gives it); advances it to the
  // next element.
  DSV4_HOST_DEVICE float draw(SplitMix64& generator) const {
    const double unit = kind == Kind::kNormal ? generator.normal() : generator.uniform();
#if defined(__CUDA_ARCH__)
    return static_cast<float>(__dadd_rn(offset, __dmul_rn(scale, unit)));
#else
    return static_cast<float>(offset + scale * unit);
#endif
  }
};

}  // namespace dsv4
