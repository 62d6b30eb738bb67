#include "ops/cuda/moe_routing.h"

#include <algorithm>
#include <type_traits>

#include "ops/cuda/bf16.cuh"
#include "ops/cuda/launch.cuh"

namespace dsv4::ops::cuda {
namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kPerLane = static_cast<int>(kRouteMaxExperts / 32);
constexpr unsigned kFull = 0xffffffffu;

// (key, e) ranks before (best_key, best_e): the larger key, equal keys to the lower expert id.
__device__ __forceinline__ bool ranks_before(float key, int e, float best_key, int best_e) {
  return key > best_key || (key == best_key && e < best_e);
}

// One warp per token; expert e lives in lane e % 32, register e / 32.
template <RouterScoreFunc kFunc, bool kHash>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) route_kernel(const float* logits, const float* __restrict__ bias,
                                                                   const int32_t* __restrict__ tid2eid,
                                                                   const int32_t* __restrict__ token_ids,
                                                                   int32_t* __restrict__ chosen,
                                                                   float* __restrict__ weights, float* scores_out,
                                                                   int64_t tokens, int E, int K, float scaling) {
  wait_for_prior_grid();
  allow_dependents();
  __shared__ float warp_scores[kWarpsPerBlock][kRouteMaxExperts];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
  if (t >= tokens) return;  // the whole warp leaves together
  const float* row = logits + t * E;
  float sc[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int e = lane + 32 * j;
    sc[j] = e < E ? row[e] : 0.0f;
  }
  if constexpr (kFunc == RouterScoreFunc::kSqrtSoftplus) {
    // torch softplus (beta 1, threshold 20): x above the threshold passes through.
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) sc[j] = __fsqrt_rn(sc[j] > 20.0f ? sc[j] : log1pf(expf(sc[j])));
  } else if constexpr (kFunc == RouterScoreFunc::kSigmoid) {
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) sc[j] = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-sc[j])));
  } else {
    float max_logit = -INFINITY;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j)
      if (lane + 32 * j < E) max_logit = max_logit < sc[j] ? sc[j] : max_logit;
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) max_logit = fmaxf(max_logit, __shfl_xor_sync(kFull, max_logit, offset));
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j)
      if (lane + 32 * j < E) sum = __fadd_rn(sum, sc[j] = expf(__fsub_rn(sc[j], max_logit)));
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) sum = __fadd_rn(sum, __shfl_xor_sync(kFull, sum, offset));
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) sc[j] = __fdiv_rn(sc[j], sum);
  }
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int e = lane + 32 * j;
    if (e < E) {
      warp_scores[warp][e] = sc[j];
      if (scores_out) scores_out[t * E + e] = sc[j];
    }
  }
  __syncwarp();
  int mine = -1;  // lane i < K: the i-th chosen expert
  if constexpr (kHash) {
    if (lane < K) mine = tid2eid[static_cast<int64_t>(token_ids[t]) * K + lane];
  } else {
    float key[kPerLane];
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int e = lane + 32 * j;
      const float k = e < E ? __fadd_rn(sc[j], bias ? bias[e] : 0.0f) : -INFINITY;
      key[j] = k != k ? -INFINITY : k;  // NaN ranks as −inf
    }
    unsigned taken = 0;
    for (int i = 0; i < K; ++i) {
      float best_key = -INFINITY;
      int best_e = 0x7fffffff;
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        const int e = lane + 32 * j;
        if (e < E && !(taken & (1u << j)) && ranks_before(key[j], e, best_key, best_e)) {
          best_key = key[j];
          best_e = e;
        }
      }
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) {
        const float other_key = __shfl_xor_sync(kFull, best_key, offset);
        const int other_e = __shfl_xor_sync(kFull, best_e, offset);
        if (ranks_before(other_key, other_e, best_key, best_e)) {
          best_key = other_key;
          best_e = other_e;
        }
      }
      if (best_e % 32 == lane) taken |= 1u << (best_e / 32);
      if (lane == i) mine = best_e;
    }
  }
  const float score = mine >= 0 && mine < E ? warp_scores[warp][mine] : __int_as_float(0x7fc00000);
  float sum = 0.0f;  // in chosen order, as the twin
  for (int i = 0; i < K; ++i) sum = __fadd_rn(sum, __shfl_sync(kFull, score, i));
  if (lane < K) {
    chosen[t * K + lane] = mine;
    weights[t * K + lane] = __fmul_rn(__fdiv_rn(score, __fadd_rn(sum, 1e-20f)), scaling);
  }
}

template <RouterScoreFunc kFunc>
void launch_route(const RouteParams& p, const float* logits, const float* bias, const int32_t* tid2eid,
                  const int32_t* token_ids, int32_t* chosen, float* weights, float* scores_out, cudaStream_t stream) {
  const auto blocks = static_cast<unsigned>((p.tokens + kWarpsPerBlock - 1) / kWarpsPerBlock);
  const auto E = static_cast<int>(p.experts), K = static_cast<int>(p.top_k);
  if (tid2eid)
    launch_dependent(route_kernel<kFunc, true>, blocks, kWarpsPerBlock * 32, 0, stream, logits, bias, tid2eid,
                     token_ids, chosen, weights, scores_out, p.tokens, E, K, p.routed_scaling_factor);
  else
    launch_dependent(route_kernel<kFunc, false>, blocks, kWarpsPerBlock * 32, 0, stream, logits, bias,
                     tid2eid, token_ids, chosen, weights, scores_out, p.tokens, E, K,
                     p.routed_scaling_factor);
}

constexpr int kSwigluThreads = 256;

__device__ __forceinline__ float swiglu(float gate, float up, float limit) {
  const float g = limit < gate ? limit : gate;                            // std::min(gate, limit)
  const float u = up < -limit ? -limit : (limit < up ? limit : up);     // std::clamp(up, −limit, limit)
  return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
}

// grid (rows, column blocks). Out = float, or uint16_t for bf16 bits (f32_to_bf16 of the fp32 result).
template <bool kVec4, typename Out>
__global__ void __launch_bounds__(kSwigluThreads) swiglu_kernel(const float* __restrict__ gate_up,
                                                                Out* __restrict__ out, int64_t inter, float limit) {
  wait_for_prior_grid();
  allow_dependents();
  const int64_t r = blockIdx.x;
  const float* gate = gate_up + r * 2 * inter;
  const float* up = gate + inter;
  Out* o = out + r * inter;
  const int64_t stride = int64_t{gridDim.y} * kSwigluThreads;
  if constexpr (kVec4) {
    for (int64_t c = blockIdx.y * int64_t{kSwigluThreads} + threadIdx.x; c < inter / 4; c += stride) {
      const float4 g = reinterpret_cast<const float4*>(gate)[c], u = reinterpret_cast<const float4*>(up)[c];
      const float4 v =
          make_float4(swiglu(g.x, u.x, limit), swiglu(g.y, u.y, limit), swiglu(g.z, u.z, limit), swiglu(g.w, u.w, limit));
      if constexpr (std::is_same_v<Out, float>) {
        reinterpret_cast<float4*>(o)[c] = v;
      } else {
        auto pair = [](float lo, float hi) {
          return static_cast<uint32_t>(f32_to_bf16_bits(lo)) | static_cast<uint32_t>(f32_to_bf16_bits(hi)) << 16;
        };
        reinterpret_cast<uint2*>(o)[c] = make_uint2(pair(v.x, v.y), pair(v.z, v.w));
      }
    }
  } else {
    for (int64_t c = blockIdx.y * int64_t{kSwigluThreads} + threadIdx.x; c < inter; c += stride) {
      const float v = swiglu(gate[c], up[c], limit);
      if constexpr (std::is_same_v<Out, float>) o[c] = v;
      else o[c] = f32_to_bf16_bits(v);
    }
  }
}

template <typename Out>
cudaError_t launch_swiglu(const SwigluParams& p, const float* gate_up, Out* out, cudaStream_t stream) {
  if (p.rows < 0 || p.inter < 0 || p.rows > 0x7fffffff) return cudaErrorInvalidValue;
  if (p.rows == 0 || p.inter == 0) return cudaSuccess;
  const bool vec4 = p.inter % 4 == 0 && reinterpret_cast<uintptr_t>(gate_up) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(out) % (4 * sizeof(Out)) == 0;
  const int64_t n = vec4 ? p.inter / 4 : p.inter;
  const dim3 grid(static_cast<unsigned>(p.rows),
                  static_cast<unsigned>(std::min<int64_t>((n + kSwigluThreads - 1) / kSwigluThreads, 65535)));
  if (vec4)
    launch_dependent(swiglu_kernel<true, Out>, grid, kSwigluThreads, 0, stream, gate_up, out, p.inter, p.limit);
  else
    launch_dependent(swiglu_kernel<false, Out>, grid, kSwigluThreads, 0, stream, gate_up, out, p.inter, p.limit);
  return cudaGetLastError();
}

}  // namespace

cudaError_t route(const RouteParams& p, const float* logits, const float* bias, const int32_t* tid2eid,
                  const int32_t* token_ids, int32_t* chosen, float* weights, float* scores_out,
                  cudaStream_t stream) {
  if (p.tokens < 0 || p.experts < 1 || p.experts > kRouteMaxExperts || p.top_k < 1 || p.top_k > kRouteMaxTopK ||
      p.top_k > p.experts || (tid2eid && !token_ids) || p.tokens > 0x7fffffff)
    return cudaErrorInvalidValue;
  if (p.tokens == 0) return cudaSuccess;
  switch (p.func) {
    case RouterScoreFunc::kSqrtSoftplus:
      launch_route<RouterScoreFunc::kSqrtSoftplus>(p, logits, bias, tid2eid, token_ids, chosen, weights, scores_out, stream);
      break;
    case RouterScoreFunc::kSoftmax:
      launch_route<RouterScoreFunc::kSoftmax>(p, logits, bias, tid2eid, token_ids, chosen, weights, scores_out, stream);
      break;
    case RouterScoreFunc::kSigmoid:
      launch_route<RouterScoreFunc::kSigmoid>(p, logits, bias, tid2eid, token_ids, chosen, weights, scores_out, stream);
      break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t swiglu_clamped(const SwigluParams& p, const float* gate_up, float* out, cudaStream_t stream) {
  return launch_swiglu(p, gate_up, out, stream);
}

cudaError_t swiglu_clamped_bf16(const SwigluParams& p, const float* gate_up, uint16_t* out, cudaStream_t stream) {
  return launch_swiglu(p, gate_up, out, stream);
}

}  // namespace dsv4::ops::cuda
