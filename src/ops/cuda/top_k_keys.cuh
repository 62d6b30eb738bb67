// The order-preserving key of an indexer score, shared by the two top-k paths (top_k.cu, top_k_chunked.cu).
#pragma once
#include <cstdint>

namespace dsv4::ops::cuda {

// fp32 -> uint32 whose unsigned order is the float order; 0 marks "not a candidate" (−inf, NaN, masked). −0.0 is
// folded onto +0.0 because the CPU twin compares them equal (then the lower index wins). The smallest finite
// score, −FLT_MAX, maps to 0x00800000, so 0 is never a real key.
__device__ __forceinline__ uint32_t ordered_key(float score) {
  if (!(score > -INFINITY)) return 0;  // −inf and NaN
  if (score == 0.0f) score = 0.0f;
  const uint32_t bits = __float_as_uint(score);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

}  // namespace dsv4::ops::cuda
