#include "ops/cuda/paged_attention.h"

#include <cfloat>

#include "ops/cuda/bf16.cuh"
#include "ops/cuda/launch.cuh"

namespace dsv4::ops::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kMaxPerLane = 16;  // head_dim ≤ 512

__device__ __forceinline__ float load_value(const std::byte* entry, bool bf16, int index) {
  if (bf16) return bf16_bits_to_f32(reinterpret_cast<const uint16_t*>(entry)[index]);
  return reinterpret_cast<const float*>(entry)[index];
}

__device__ __forceinline__ float warp_sum(float value) {
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

// Key j of query token t (the window's num_window first, then the compressed ones), or nullptr when it holds
// none; `bf16` says how its values are stored.
struct KeyList {
  int64_t row, first, num_window, total, chunk_start, chunk_offset;
};
__device__ __forceinline__ KeyList key_list(const PagedSinkAttentionParams& p, int64_t t) {
  KeyList k;
  const int64_t position = p.positions[t];
  k.row = p.token_row[t];
  k.chunk_start = p.chunk_start[k.row];
  k.chunk_offset = p.chunk_offset[k.row];
  k.first = position - p.window_size + 1 > 0 ? position - p.window_size + 1 : 0;
  k.num_window = position - k.first + 1;
  int64_t num_compressed = 0;
  if (p.dense_ratio > 0) num_compressed = (position + 1) / p.dense_ratio;
  else if (p.compressed_lengths) num_compressed = p.compressed_lengths[t];
  k.total = k.num_window + num_compressed;
  return k;
}
__device__ __forceinline__ const std::byte* key_entry(const PagedSinkAttentionParams& p, const KeyList& k, int64_t t,
                                                       int64_t j, bool& bf16) {
  bf16 = p.bf16_entries;
  if (j < k.num_window) {
    const int64_t key_position = k.first + j;
    if (key_position >= k.chunk_start) {
      bf16 = false;
      return reinterpret_cast<const std::byte*>(p.chunk_kv + (k.chunk_offset + key_position - k.chunk_start) * p.head_dim);
    }
    return paged_entry(p.window, k.row, key_position);
  }
  const int64_t slot = j - k.num_window;
  const int64_t index = p.dense_ratio > 0 ? slot : p.compressed_indices[t * p.compressed_stride + slot];
  if (index < 0) return nullptr;
  return paged_entry(p.compressed, k.row, index);  // nullptr for an unallocated block (never in a valid step)
}

// One CTA per (token, head); each warp runs an online softmax over every 4th key, then the warps merge.
// deepseek_softmax: the max over every key first (a pass of dot products), then the fixed-max accumulation.
__global__ void paged_sink_attention_kernel(PagedSinkAttentionParams p) {
  wait_for_prior_grid();
  allow_dependents();
  const int64_t t = blockIdx.x, h = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int per_lane = static_cast<int>((p.head_dim + 31) / 32);
  const float* q = p.q + (t * p.heads + h) * p.head_dim;
  float qv[kMaxPerLane], acc[kMaxPerLane];
  for (int i = 0; i < per_lane; ++i) {
    qv[i] = lane + 32 * i < p.head_dim ? q[lane + 32 * i] : 0.0f;
    acc[i] = 0.0f;
  }
  const KeyList keys = key_list(p, t);
  const int64_t total = keys.total;
  float running_max = -FLT_MAX, running_sum = 0.0f;
  __shared__ float logit_max[kWarps];
  if (p.deepseek_softmax) {
    for (int64_t j = warp; j < total; j += kWarps) {
      bool bf16 = false;
      const std::byte* entry = key_entry(p, keys, t, j, bf16);
      if (entry == nullptr) continue;
      float dot = 0.0f;
      for (int i = 0; i < per_lane; ++i)
        if (lane + 32 * i < p.head_dim) dot += qv[i] * load_value(entry, bf16, lane + 32 * i);
      running_max = fmaxf(running_max, warp_sum(dot) * p.scale);
    }
    if (lane == 0) logit_max[warp] = running_max;
    __syncthreads();
    for (int w = 0; w < kWarps; ++w) running_max = fmaxf(running_max, logit_max[w]);  // every warp: the CTA's max
  }
  for (int64_t j = warp; j < total; j += kWarps) {
    bool bf16 = false;
    const std::byte* entry = key_entry(p, keys, t, j, bf16);
    if (entry == nullptr) continue;
    float kv[kMaxPerLane], dot = 0.0f;
    for (int i = 0; i < per_lane; ++i) {
      kv[i] = lane + 32 * i < p.head_dim ? load_value(entry, bf16, lane + 32 * i) : 0.0f;
      dot += qv[i] * kv[i];
    }
    const float logit = warp_sum(dot) * p.scale;
    if (p.deepseek_softmax) {  // the max is final: no rescaling; P·V takes p in bf16
      const float weight = expf(logit - running_max);
      running_sum += weight;
      const float rounded = bf16_round(weight);
      for (int i = 0; i < per_lane; ++i) acc[i] += rounded * kv[i];
      continue;
    }
    const float new_max = fmaxf(running_max, logit);
    const float correction = expf(running_max - new_max), weight = expf(logit - new_max);
    running_sum = running_sum * correction + weight;
    for (int i = 0; i < per_lane; ++i) acc[i] = acc[i] * correction + weight * kv[i];
    running_max = new_max;
  }
  __shared__ float warp_max[kWarps], warp_total[kWarps];
  __shared__ float warp_acc[kWarps][32 * kMaxPerLane];
  if (lane == 0) {
    warp_max[warp] = running_max;
    warp_total[warp] = running_sum;
  }
  for (int i = 0; i < per_lane; ++i)
    if (lane + 32 * i < p.head_dim) warp_acc[warp][lane + 32 * i] = acc[i];
  __syncthreads();
  float* out = p.out + (t * p.heads + h) * p.head_dim;
  if (total == 0) {  // the sink is the only mass: zero output (ops/cpu/attention.h)
    for (int64_t i = threadIdx.x; i < p.head_dim; i += blockDim.x) out[i] = 0.0f;
    return;
  }
  // kDeepSeek: the logits' max alone (every warp holds it), the sink only in the denominator.
  float global_max = p.deepseek_softmax ? warp_max[0] : p.sinks[h];
  for (int w = 0; w < kWarps; ++w) global_max = fmaxf(global_max, warp_max[w]);
  float denominator = expf(p.sinks[h] - global_max), factor[kWarps];
  for (int w = 0; w < kWarps; ++w) {
    factor[w] = warp_total[w] > 0.0f ? expf(warp_max[w] - global_max) : 0.0f;
    denominator += warp_total[w] * factor[w];
  }
  for (int64_t i = threadIdx.x; i < p.head_dim; i += blockDim.x) {
    float value = 0.0f;
    for (int w = 0; w < kWarps; ++w) value += warp_acc[w][i] * factor[w];
    out[i] = p.deepseek_softmax ? bf16_round(value / denominator) : value / denominator;
  }
}

// One CTA per (token, 32 entries): q of the token in shared memory, one warp per entry at a time.
constexpr int kIndexerEntriesPerCta = 32;
__global__ void paged_indexer_scores_kernel(PagedIndexerScoresParams p) {
  wait_for_prior_grid();
  allow_dependents();
  extern __shared__ float q_shared[];
  const int64_t t = blockIdx.x;
  const int64_t q_size = p.heads * p.head_dim;
  for (int64_t i = threadIdx.x; i < q_size; i += blockDim.x) q_shared[i] = p.q[t * q_size + i];
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int per_lane = static_cast<int>((p.head_dim + 31) / 32);
  const int64_t position = p.positions[t], row = p.token_row[t];
  const int64_t visible = (position + 1) / p.ratio;
  const float* weights = p.weights + t * p.heads;
  for (int64_t e = blockIdx.y * kIndexerEntriesPerCta + warp; e < (blockIdx.y + 1) * kIndexerEntriesPerCta &&
                                                              e < p.max_entries;
       e += kWarps) {
    float score = -INFINITY;
    if (e < visible) {
      const std::byte* key = paged_entry(p.keys, row, e);
      float k[8];
      for (int i = 0; i < per_lane; ++i)
        k[i] = lane + 32 * i < p.head_dim ? load_value(key, p.bf16_keys, lane + 32 * i) : 0.0f;
      score = 0.0f;
      for (int64_t h = 0; h < p.heads; ++h) {
        float dot = 0.0f;
        for (int i = 0; i < per_lane; ++i)
          if (lane + 32 * i < p.head_dim) dot += q_shared[h * p.head_dim + lane + 32 * i] * k[i];
        dot = warp_sum(dot);
        if (p.deepseek_roundings) {
          score = __fadd_rn(score, bf16_round(__fmul_rn(fmaxf(bf16_round(dot), 0.0f), weights[h])));
        } else {
          score += fmaxf(dot, 0.0f) * p.softmax_scale * weights[h];
        }
      }
      if (p.deepseek_roundings) score = bf16_round(score);
    }
    if (lane == 0) p.scores[t * p.max_entries + e] = score;
  }
}

__global__ void dense_entry_indices_kernel(const int32_t* positions, int64_t ratio, int64_t stride, int32_t* indices,
                                           int32_t* lengths) {
  wait_for_prior_grid();
  allow_dependents();
  const int64_t t = blockIdx.x;
  const int64_t visible = (positions[t] + 1) / ratio;
  for (int64_t j = threadIdx.x; j < stride; j += blockDim.x)
    indices[t * stride + j] = j < visible ? static_cast<int32_t>(j) : -1;
  if (threadIdx.x == 0) lengths[t] = static_cast<int32_t>(visible < stride ? visible : stride);
}

__global__ void write_window_kernel(WindowWriteParams p) {
  wait_for_prior_grid();
  allow_dependents();
  const int64_t t = blockIdx.x;
  const int64_t position = p.positions[t], row = p.token_row[t];
  if (position < p.row_end[row] - p.window_size) return;
  std::byte* entry = paged_entry(p.window, row, position);
  if (entry == nullptr) return;
  const float* kv = p.kv + t * p.head_dim;
  for (int64_t i = threadIdx.x; i < p.head_dim; i += blockDim.x) {
    if (p.bf16_entries) {
      reinterpret_cast<uint16_t*>(entry)[i] = f32_to_bf16_bits(kv[i]);
    } else {
      reinterpret_cast<float*>(entry)[i] = kv[i];
    }
  }
}

}  // namespace

cudaError_t paged_sink_attention(const PagedSinkAttentionParams& p, cudaStream_t stream) {
  if (p.tokens == 0) return cudaSuccess;
  if (p.head_dim > 32 * kMaxPerLane) return cudaErrorInvalidValue;
  launch_dependent(paged_sink_attention_kernel,
                   dim3(static_cast<unsigned>(p.tokens), static_cast<unsigned>(p.heads)), 32 * kWarps, 0,
                   stream, p);
  return cudaGetLastError();
}

cudaError_t paged_indexer_scores(const PagedIndexerScoresParams& p, cudaStream_t stream) {
  if (p.tokens == 0 || p.max_entries == 0) return cudaSuccess;
  if (p.head_dim > 256 || p.heads * p.head_dim > 8192) return cudaErrorInvalidValue;
  const auto chunks = static_cast<unsigned>((p.max_entries + kIndexerEntriesPerCta - 1) / kIndexerEntriesPerCta);
  const size_t shared = static_cast<size_t>(p.heads * p.head_dim) * sizeof(float);
  launch_dependent(paged_indexer_scores_kernel, dim3(static_cast<unsigned>(p.tokens), chunks), 32 * kWarps,
                   shared, stream, p);
  return cudaGetLastError();
}

cudaError_t dense_entry_indices(int64_t tokens, const int32_t* positions, int64_t ratio, int64_t stride,
                                int32_t* indices, int32_t* lengths, cudaStream_t stream) {
  if (tokens == 0) return cudaSuccess;
  launch_dependent(dense_entry_indices_kernel, static_cast<unsigned>(tokens), 256, 0, stream, positions,
                   ratio, stride, indices, lengths);
  return cudaGetLastError();
}

cudaError_t write_window(const WindowWriteParams& p, cudaStream_t stream) {
  if (p.tokens == 0) return cudaSuccess;
  launch_dependent(write_window_kernel, static_cast<unsigned>(p.tokens), 128, 0, stream, p);
  return cudaGetLastError();
}

}  // namespace dsv4::ops::cuda
