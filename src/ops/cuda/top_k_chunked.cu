#include "ops/cuda/top_k_chunked.h"

#include <cstdint>

#include "ops/cuda/launch.cuh"
#include "ops/cuda/top_k.h"
#include "ops/cuda/top_k_keys.cuh"

namespace dsv4::ops::cuda {
namespace {

constexpr int kThreads = 1024;  // the merge CTA; chunk CTAs have 512 (k ≤ 512) or 1024 threads
constexpr int kWarpsPerCta = kThreads / 32;
constexpr int kPerThread = 16;
constexpr int kChunk = kThreads * kPerThread;          // 16,384 columns per chunk CTA for k > 512
static_assert(kTopKMaxColumns / kChunk * kTopKMaxK <= kChunk && kTopKMaxColumns / (kChunk / 2) * 512 <= kChunk,
              "the merge CTA holds every chunk's candidates");
constexpr int kCompositeBits = 56;                     // 32 bits of ordered score, 24 bits of inverted index
constexpr int kIndexBits = 24;

// Unique total order: higher score first, then lower index; a chosen candidate is one whose (key, inverted index)
// pair is at least the threshold's. Selecting the k largest pairs is exactly the twin's selection, with no tie
// left to chance. The index is inverted so that larger means lower.
struct Threshold {
  uint32_t key;
  uint32_t inverted_index;
};
__device__ __forceinline__ uint32_t inverted(int32_t index) {
  return (1u << kIndexBits) - 1u - static_cast<uint32_t>(index);
}
__device__ __forceinline__ bool chosen_by(const Threshold& t, uint32_t key, int32_t index) {
  return key != 0 && (key > t.key || (key == t.key && inverted(index) >= t.inverted_index));
}

struct SelectShared {
  uint32_t histogram[256];
  uint32_t warp_count[kWarpsPerCta];
  uint32_t warp_max[kWarpsPerCta];
  uint32_t warp_min[kWarpsPerCta];
  uint32_t found_bin, found_above, found_count, total;
};

// Radix select in one CTA over the kPerThread candidates of every thread (key 0 = none): the threshold of the
// min(k, candidates) best (key, inverted index) pairs. Starts below the bits every candidate shares (the common
// prefix of the largest and smallest key), takes 8 bits per pass — score bits, then index bits when scores tie —
// and stops as soon as the bin that crosses k holds exactly the number still needed. Index passes use 32-bit
// arithmetic only, so sixteen candidates per thread stay in registers at 1024 threads.
template <int kCtaThreads>
__device__ Threshold select_threshold(const uint32_t (&key)[kPerThread], const int32_t (&index)[kPerThread], int k,
                                      SelectShared& sh) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  uint32_t count = 0, kmax = 0, kmin = 0xffffffffu;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i)
    if (key[i] != 0) {
      ++count;
      kmax = max(kmax, key[i]);
      kmin = min(kmin, key[i]);
    }
  for (int offset = 16; offset > 0; offset /= 2) {
    count += __shfl_xor_sync(0xffffffffu, count, offset);
    kmax = max(kmax, __shfl_xor_sync(0xffffffffu, kmax, offset));
    kmin = min(kmin, __shfl_xor_sync(0xffffffffu, kmin, offset));
  }
  if (lane == 0) {
    sh.warp_count[warp] = count;
    sh.warp_max[warp] = kmax;
    sh.warp_min[warp] = kmin;
  }
  for (int i = threadIdx.x; i < 256; i += kCtaThreads) sh.histogram[i] = 0;
  __syncthreads();
  if (warp == 0) {
    const bool real = lane < kCtaThreads / 32;
    count = real ? sh.warp_count[lane] : 0;
    kmax = real ? sh.warp_max[lane] : 0;
    kmin = real ? sh.warp_min[lane] : 0xffffffffu;
    for (int offset = 16; offset > 0; offset /= 2) {
      count += __shfl_xor_sync(0xffffffffu, count, offset);
      kmax = max(kmax, __shfl_xor_sync(0xffffffffu, kmax, offset));
      kmin = min(kmin, __shfl_xor_sync(0xffffffffu, kmin, offset));
    }
    if (lane == 0) {
      sh.total = count;
      sh.found_bin = kmax;
      sh.found_above = kmin;
    }
  }
  __syncthreads();
  const uint32_t total = sh.total;
  if (total <= static_cast<uint32_t>(k)) return {1u, 0u};  // every candidate
  kmax = sh.found_bin;
  kmin = sh.found_above;
  int resolved = __clz(kmax ^ kmin);                  // leading key bits all candidates share (32: all equal)
  // the resolved top bits of the key, the rest zero (shifts by 32 are avoided: undefined in C++)
  const uint32_t key_prefix_mask = resolved == 32 ? 0xffffffffu : ~(0xffffffffu >> resolved);
  uint32_t key_prefix = kmax & key_prefix_mask;
  uint32_t index_prefix = 0;  // resolved − 32 top bits of the inverted index, in the low bits
  uint32_t need = static_cast<uint32_t>(k);
  __syncthreads();  // everyone has read the scalars before warp 0 overwrites them
  while (resolved < kCompositeBits) {
    const bool on_key = resolved < 32;
    const int bits = on_key ? min(8, 32 - resolved) : min(8, kCompositeBits - resolved);
    const uint32_t mask = (1u << bits) - 1u;
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      uint32_t digit = 0;
      bool match = false;
      if (key[i] != 0) {
        if (on_key) {
          match = resolved == 0 || ((key[i] ^ key_prefix) >> (32 - resolved)) == 0;
          digit = (key[i] >> (32 - resolved - bits)) & mask;
        } else {
          const int done = resolved - 32;
          const uint32_t inv = inverted(index[i]);
          match = key[i] == key_prefix && (done == 0 || (inv >> (kIndexBits - done)) == index_prefix);
          digit = (inv >> (kIndexBits - done - bits)) & mask;
        }
      }
      // Scores cluster in few bins (the first pass sees sign and exponent), and lanes adding to one shared
      // counter serialise: one atomic per distinct digit per warp instead (the first version, one per candidate,
      // took ~24 us on 2,048 candidates).
      if (__ballot_sync(0xffffffffu, match) == 0) continue;
      const uint32_t peers = __match_any_sync(0xffffffffu, match ? digit : 0xffffffffu);
      if (match && lane == __ffs(peers) - 1) atomicAdd(&sh.histogram[digit], static_cast<uint32_t>(__popc(peers)));
    }
    __syncthreads();
    if (warp == 0) {
      uint32_t mine[8], sum = 0;
#pragma unroll
      for (int b = 0; b < 8; ++b) {
        mine[b] = sh.histogram[8 * lane + b];
        sum += mine[b];
        sh.histogram[8 * lane + b] = 0;  // ready for the next pass
      }
      // candidates in the bins of higher lanes
      uint32_t above = sum;
      for (int offset = 1; offset < 32; offset *= 2) {
        const uint32_t v = __shfl_down_sync(0xffffffffu, above, offset);
        if (lane + offset < 32) above += v;
      }
      above -= sum;
      if (above < need && above + sum >= need) {
#pragma unroll
        for (int b = 7; b >= 0; --b) {
          if (above + mine[b] >= need) {
            sh.found_bin = 8 * lane + b;
            sh.found_above = above;
            sh.found_count = mine[b];
            break;
          }
          above += mine[b];
        }
      }
    }
    __syncthreads();
    const uint32_t bin = sh.found_bin, above = sh.found_above, in_bin = sh.found_count;
    __syncthreads();
    need -= above;
    if (on_key)
      key_prefix |= bin << (32 - resolved - bits);
    else
      index_prefix = (index_prefix << bits) | bin;
    resolved += bits;
    if (in_bin == need) break;  // the whole bin is taken
  }
  // Bits not resolved are zero: every candidate matching the prefix is at or above the threshold.
  if (resolved <= 32) return {key_prefix, 0u};
  return {key_prefix, index_prefix << (kCompositeBits - resolved)};
}

// Appends this thread's chosen candidates at out_key/out_index[atomic slot]; *counter ends at the number chosen.
// The order is arbitrary; the set is exact.
__device__ __forceinline__ void compact(const uint32_t (&key)[kPerThread], const int32_t (&index)[kPerThread],
                                        const Threshold& threshold, uint32_t* counter, uint32_t* out_key,
                                        int32_t* out_index) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const bool take = chosen_by(threshold, key[i], index[i]);
    const uint32_t ballot = __ballot_sync(0xffffffffu, take);
    if (ballot == 0) continue;
    uint32_t base = 0;
    if (lane == __ffs(ballot) - 1) base = atomicAdd(counter, static_cast<uint32_t>(__popc(ballot)));
    base = __shfl_sync(0xffffffffu, base, __ffs(ballot) - 1);
    if (take) {
      const uint32_t slot = base + __popc(ballot & ((1u << lane) - 1u));
      if (out_key) out_key[slot] = key[i];
      out_index[slot] = index[i];
    }
  }
}

struct Workspace {
  uint32_t* keys;     // [rows, chunks, k]
  int32_t* indices;   // [rows, chunks, k]
  uint32_t* counts;   // [rows, chunks]
};

// Threads · 16 columns per CTA. 512 threads when k ≤ 512: two CTAs per SM then overlap one's loads with the
// other's passes.
template <int kCtaThreads>
__global__ void __launch_bounds__(kCtaThreads, 1024 / kCtaThreads) chunk_select_kernel(const TopKParams p,
                                                                                 Workspace ws, int chunks) {
  wait_for_prior_grid();
  allow_dependents();
  __shared__ SelectShared sh;
  __shared__ uint32_t counter;
  const int64_t row = blockIdx.y;
  const int chunk = blockIdx.x;
  int64_t length = p.columns;
  if (p.row_lengths) length = max(int64_t{0}, min(length, static_cast<int64_t>(p.row_lengths[row])));
  const float* scores = p.scores + row * p.row_stride;
  uint32_t key[kPerThread];
  int32_t index[kPerThread];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    index[i] = chunk * (kCtaThreads * kPerThread) + i * kCtaThreads + static_cast<int>(threadIdx.x);
    key[i] = index[i] < length ? ordered_key(__ldg(scores + index[i])) : 0;
  }
  if (threadIdx.x == 0) counter = 0;
  const Threshold threshold = select_threshold<kCtaThreads>(key, index, static_cast<int>(p.k), sh);
  const int64_t base = (row * chunks + chunk) * p.k;
  compact(key, index, threshold, &counter, ws.keys + base, ws.indices + base);
  __syncthreads();
  if (threadIdx.x == 0) ws.counts[row * chunks + chunk] = counter;
}

// Entry order by a bitmap over the row's columns (32 KB at 262,144): every chosen entry sets its bit, one
// block-wide scan of the per-thread popcounts gives each thread's first output slot, and each thread writes its
// words' set bits in ascending order. Four barriers, where a bitonic sort of the kTopKMaxK slots took 55 (most of
// this kernel's ~11 µs at decode).
constexpr int kBitmapWords = static_cast<int>(kTopKMaxColumns / 32);

__global__ void __launch_bounds__(kThreads, 1) merge_select_kernel(const TopKParams p, Workspace ws, int chunks) {
  wait_for_prior_grid();
  allow_dependents();
  __shared__ SelectShared sh;
  __shared__ uint32_t bitmap[kBitmapWords];
  __shared__ uint32_t warp_totals[kWarpsPerCta];
  const int64_t row = blockIdx.x;
  const int k = static_cast<int>(p.k);
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  const int64_t columns = p.columns;
  const int words = static_cast<int>((columns + 31) / 32);
  for (int i = threadIdx.x; i < words; i += kThreads) bitmap[i] = 0;
  uint32_t key[kPerThread];
  int32_t index[kPerThread];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int slot = i * kThreads + static_cast<int>(threadIdx.x);
    const int chunk = slot / k, within = slot % k;
    key[i] = 0;
    index[i] = 0;
    if (chunk < chunks && within < static_cast<int>(ws.counts[row * chunks + chunk])) {
      const int64_t at = (row * chunks + chunk) * p.k + within;
      key[i] = ws.keys[at];
      index[i] = ws.indices[at];
    }
  }
  // One chunk: its candidates are already the row's top-k (the chunk kernel selected them), no second select.
  const Threshold threshold = chunks == 1 ? Threshold{1u, 0u} : select_threshold<kThreads>(key, index, k, sh);
  __syncthreads();  // the bitmap is clear
#pragma unroll
  for (int i = 0; i < kPerThread; ++i)
    if (chosen_by(threshold, key[i], index[i])) atomicOr(&bitmap[index[i] >> 5], 1u << (index[i] & 31));
  __syncthreads();
  // Thread t owns words [t·per, (t+1)·per): its count, then an exclusive scan across the CTA.
  const int per = (words + kThreads - 1) / kThreads;
  const int first = static_cast<int>(threadIdx.x) * per, last = min(words, first + per);
  uint32_t mine = 0;
  for (int w = first; w < last; ++w) mine += __popc(bitmap[w]);
  uint32_t inclusive = mine;
  for (int offset = 1; offset < 32; offset *= 2) {
    const uint32_t v = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += v;
  }
  if (lane == 31) warp_totals[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    uint32_t total = lane < kWarpsPerCta ? warp_totals[lane] : 0;
    for (int offset = 1; offset < 32; offset *= 2) {
      const uint32_t v = __shfl_up_sync(0xffffffffu, total, offset);
      if (lane >= offset) total += v;
    }
    if (lane < kWarpsPerCta) warp_totals[lane] = total;  // inclusive over warps
  }
  __syncthreads();
  uint32_t slot = (warp > 0 ? warp_totals[warp - 1] : 0) + inclusive - mine;
  const uint32_t n = warp_totals[kWarpsPerCta - 1];
  int32_t* out = p.indices + row * p.k;
  for (int w = first; w < last; ++w)
    for (uint32_t bits = bitmap[w]; bits != 0; bits &= bits - 1) out[slot++] = w * 32 + __ffs(bits) - 1;
  for (int i = static_cast<int>(n) + static_cast<int>(threadIdx.x); i < k; i += kThreads) out[i] = -1;
  if (threadIdx.x == 0) p.lengths[row] = static_cast<int32_t>(n);
}

int chunk_columns(int64_t k) { return k <= 512 ? kChunk / 2 : kChunk; }
int chunks_of(int64_t columns, int64_t k) {
  return columns == 0 ? 1 : static_cast<int>((columns + chunk_columns(k) - 1) / chunk_columns(k));
}

}  // namespace

size_t chunked_top_k_workspace_bytes(int64_t rows, int64_t columns, int64_t k) {
  const auto slots = static_cast<size_t>(rows) * static_cast<size_t>(chunks_of(columns, k));
  return slots * static_cast<size_t>(k) * 8 + slots * 4 + 64;
}

cudaError_t chunked_top_k(const TopKParams& p, void* workspace, cudaStream_t stream) {
  const int chunks = chunks_of(p.columns, p.k);
  const auto slots = static_cast<size_t>(p.rows) * static_cast<size_t>(chunks);
  Workspace ws;
  ws.keys = static_cast<uint32_t*>(workspace);
  ws.indices = reinterpret_cast<int32_t*>(ws.keys + slots * p.k);
  ws.counts = reinterpret_cast<uint32_t*>(ws.indices + slots * p.k);
  const dim3 grid(chunks, static_cast<unsigned>(p.rows));
  if (p.k <= 512)
    launch_dependent(chunk_select_kernel<kThreads / 2>, grid, kThreads / 2, 0, stream, p, ws, chunks);
  else
    launch_dependent(chunk_select_kernel<kThreads>, grid, kThreads, 0, stream, p, ws, chunks);
  launch_dependent(merge_select_kernel, static_cast<unsigned>(p.rows), kThreads, 0, stream, p, ws, chunks);
  return cudaGetLastError();
}

}  // namespace dsv4::ops::cuda
