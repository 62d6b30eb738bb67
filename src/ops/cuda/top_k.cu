#include "ops/cuda/top_k.h"

#include <cooperative_groups.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "ops/cuda/device.h"
#include "ops/cuda/launch.cuh"
#include "ops/cuda/top_k_chunked.h"
#include "ops/cuda/top_k_keys.cuh"

namespace dsv4::ops::cuda {
namespace {

namespace cg = cooperative_groups;

// The cluster path: one thread-block cluster per row (docs/kernels/indexer_topk.md "Top-k"). Its CTAs split the
// row, each loads its span of scores from global memory once, as order-preserving keys, into shared memory;
// every radix pass then reads shared memory only, and the CTAs add their histograms through distributed shared
// memory. One launch, no workspace. Used when the whole grid fits one wave (see top_k below).
constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxCluster = 8;                                  // the portable cluster size
constexpr int kMaxSpan = kTopKMaxColumns / kMaxCluster;         // 32,768 keys (128 KB) per CTA at most
constexpr int kMinSpan = 4096;                                  // below this a CTA has too little to do
constexpr int kSpanQuantum = kThreads;                          // spans are whole 32-key groups per warp
// The three passes take 11, 11 and 10 bits of the key.
__device__ __forceinline__ int digit_bits(int pass) { return pass < 2 ? 11 : 10; }
constexpr int kBins = 1 << 11;
static_assert(kBins == 2 * kThreads, "each thread owns two bins of the widest digit");
static_assert(kMaxSpan % kSpanQuantum == 0, "a full span is whole groups");

// The selection after the passes: a key is chosen when its top `resolved` bits exceed `prefix`, or equal it and
// fewer than `need` keys with that prefix sit at lower entries (so equal scores go to the lower entry, the
// twin's rule). resolved = 0 takes every valid key (a row with at most k of them).
// `floor`: keys below it take no part (the sampled path's threshold; 1 = every valid key).
struct Selection {
  uint32_t prefix = 0;
  int resolved = 0;
  uint32_t need = 0;
  uint32_t floor = 1;
};

__device__ __forceinline__ uint32_t top_bits(uint32_t key, int bits) { return bits == 0 ? 0u : key >> (32 - bits); }

struct alignas(16) Shared {
  uint32_t histogram[2][kBins];  // passes alternate buffers: one cluster barrier per pass
  uint64_t warp_sums[kWarps];
  uint32_t found_bin, found_above, found_count, total;
  uint32_t cta_above, cta_equal;              // this CTA's compaction counts, read by the cluster
  uint32_t before_above, before_equal;        // the counts of the CTAs of lower rank
  uint32_t all_above, all_equal;              // the row's totals
  uint32_t candidates;                        // sampled path: keys this CTA kept (may exceed the capacity)
  uint32_t row_candidates, overflow;          // sampled path: the cluster's sum, whether any CTA overflowed
};

// Inclusive scan of one value per thread across the CTA (thread order); all threads get the CTA total too.
// Count = uint32_t, or uint64_t for two 32-bit counts packed in one scan.
template <typename Count>
__device__ __forceinline__ Count block_inclusive_scan(Count value, Shared& sh, Count& total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int offset = 1; offset < 32; offset *= 2) {
    const Count v = __shfl_up_sync(0xffffffffu, value, offset);
    if (lane >= offset) value += v;
  }
  if (lane == 31) sh.warp_sums[warp] = value;
  __syncthreads();
  if (warp == 0) {
    Count w = static_cast<Count>(sh.warp_sums[lane]);
    for (int offset = 1; offset < 32; offset *= 2) {
      const Count v = __shfl_up_sync(0xffffffffu, w, offset);
      if (lane >= offset) w += v;
    }
    sh.warp_sums[lane] = w;
  }
  __syncthreads();
  total = static_cast<Count>(sh.warp_sums[kWarps - 1]);
  const Count result = value + (warp > 0 ? static_cast<Count>(sh.warp_sums[warp - 1]) : Count{0});
  __syncthreads();  // warp_sums may be reused by the caller's next scan
  return result;
}

// Thread t holds the counts of bins 2u (low) and 2u+1 (high) of owner u = kThreads-1-t, so a forward scan over t
// counts from the highest bin down. Finds the bin where that count reaches `need` (sh.found_*, valid when the
// returned total is at least `need`).
__device__ __forceinline__ int bin_owner() { return kThreads - 1 - static_cast<int>(threadIdx.x); }

__device__ uint32_t find_crossing_bin(uint32_t low, uint32_t high, uint32_t need, Shared& sh) {
  const int owner = bin_owner();
  uint32_t total;
  const uint32_t inclusive = block_inclusive_scan(low + high, sh, total);
  const uint32_t above = inclusive - low - high;  // keys in the bins above this thread's two
  if (above < need && above + high >= need) {
    sh.found_bin = 2 * owner + 1;
    sh.found_above = above;
    sh.found_count = high;
  } else if (above + high < need && above + high + low >= need) {
    sh.found_bin = 2 * owner;
    sh.found_above = above + high;
    sh.found_count = low;
  }
  __syncthreads();
  return total;
}

__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }

// A cluster of one CTA (the grid path, the sampled path at ≥ SMs rows, the cluster path's short rows) needs only
// CTA barriers and its own shared memory: barrier.cluster's release / acquire costs a memory fence each time
// (ncu: "membar" stalls in a one-CTA select), and a distributed-shared-memory load is slower than a local one.
__device__ __forceinline__ void cluster_barrier(cg::cluster_group& cluster, int ranks) {
  if (ranks == 1) {
    __syncthreads();
  } else {
    cluster.sync();
  }
}
template <typename T>
__device__ __forceinline__ T* rank_shared(cg::cluster_group& cluster, int ranks, T* local, int rank) {
  return ranks == 1 ? local : cluster.map_shared_rank(local, rank);
}
// The end of a cluster kernel: no CTA leaves while another may still read its shared memory.
__device__ __forceinline__ void cluster_exit(int ranks) {
  if (ranks == 1) return;
  cluster_arrive();
  cluster_wait();
}

// The cluster's histogram is complete (after a cluster barrier): every CTA sums it from all ranks and finds the
// bin where the count from the top crosses `need`, so all CTAs reach the same decision without a broadcast.
// Returns true once the selection is final.
__device__ bool resolve_digit(cg::cluster_group& cluster, int ranks, uint32_t* histogram, int bits, Selection& sel,
                              Shared& sh) {
  uint32_t low = 0, high = 0;
  for (int r = 0; r < ranks; ++r) {
    const uint32_t* remote = rank_shared(cluster, ranks, histogram, r);
    const uint2 pair = *reinterpret_cast<const uint2*>(remote + 2 * bin_owner());
    low += pair.x;
    high += pair.y;
  }
  const uint32_t total = find_crossing_bin(low, high, sel.need, sh);
  if (total < sel.need) {  // fewer valid keys than k (first pass only): take them all
    sel.need = total;
    return true;
  }
  sel.need -= sh.found_above;
  sel.prefix = (sel.prefix << bits) | sh.found_bin;
  sel.resolved += bits;
  const bool whole_bin = sh.found_count == sel.need;
  __syncthreads();  // found_* are rewritten by the next pass
  return whole_bin || sel.resolved == 32;
}

// Every CTA of both cluster kernels starts the same way: zero both histogram buffers, wait for the kernel that
// wrote the scores, then find its span of the row: entries [first, first + valid) (the row's length clamped to
// [0, columns]; entries at or past it are never read).
struct CtaSpan {
  int64_t first;
  int valid;
  const float* scores;  // the score of entry `first`
  bool vector_loads;    // `scores` is 16-byte aligned
};
// The row's valid entries: its length clamped to [0, columns], or every column without lengths.
__device__ __forceinline__ int64_t row_valid_entries(const TopKParams& p, int64_t row) {
  int64_t length = p.columns;
  if (p.row_lengths) length = max(int64_t{0}, min(length, static_cast<int64_t>(p.row_lengths[row])));
  return length;
}
__device__ __forceinline__ CtaSpan begin_row_cta(const TopKParams& p, Shared& sh, int64_t row, int rank, int span) {
  for (int i = threadIdx.x; i < 2 * kBins; i += kThreads) (&sh.histogram[0][0])[i] = 0;
  wait_for_prior_grid();  // the scores come from the previous kernel
  allow_dependents();
  const int64_t length = row_valid_entries(p, row);
  const int64_t first = static_cast<int64_t>(rank) * span;
  const int valid = static_cast<int>(max(int64_t{0}, min(static_cast<int64_t>(span), length - first)));
  const float* scores = p.scores + row * p.row_stride + first;
  return {first, valid, scores, (reinterpret_cast<uintptr_t>(scores) & 15) == 0};
}

// ---------------------------------------------------------------------------------------------------------------
// The sampled path (top_k's choice wherever a CTA's span is too long to keep whole; docs/kernels/indexer_topk.md):
// a cluster of C CTAs per row, C chosen so the grid fits one wave, reads its row from global memory once and keeps only the keys at or
// above a threshold T estimated from a 1-in-16 sample of the row, so shared memory holds a few thousand
// candidates instead of the row, and a row of 256K keys fits one CTA. Exactness does not rest on the estimate:
// if at least k keys of the row reach T, the k-th largest key does too, so every key the answer can take (ties at
// the k-th included) is a candidate and the radix select over the candidates gives the row's answer. When fewer
// than k keys reach T, or a CTA's candidates overflow its buffer (many ties at T), every CTA of the cluster
// reaches the same verdict and selects over its span in global memory instead (the fallback: exact, slower).
constexpr int kCandidateCapacity = 8192;  // keys (+ entries) per CTA of a sampled span: 64 KB of shared memory
constexpr int kSampleStride = 16;         // one 32-key line in 16 is sampled
constexpr int kSampleMargin = 2;          // T is the sample's (kSampleMargin · k / kSampleStride)-th key
// Clusters this wide find T by one 11-bit pass (T = the lower edge of the crossing bin: up to a few times more
// candidates, spread over ≥ 4 buffers) instead of two (22 bits), saving a cluster barrier.
constexpr int kOnePassSampleRanks = 4;
constexpr int kTileEntries = kThreads * 32;  // entries a CTA filters per round: 8 float4 per lane in flight
constexpr int kMaxSampleLinesPerWarp = kTopKMaxColumns / 32 / kSampleStride / kWarps;  // 16
static_assert(kTopKMaxColumns / kSampleStride <= 2 * kCandidateCapacity, "the sample fits the candidate buffers");

// Where the radix passes and the compaction read keys: candidates in shared memory (keys, with their entries; a
// sample has none) or, for the fallback, the span's scores in global memory (entry = first + position). One type
// with a uniform branch rather than a template per source: the kernel's code is fetched cold on every call, so one
// copy of each pass costs less than a second instantiation.
struct KeySource {
  const uint32_t* keys;    // shared-memory keys, or nullptr: read `scores`
  const int32_t* entries;  // their entries, or nullptr: key i is entry first + i
  const float* scores;
  int count;
  int32_t first;
  __device__ uint32_t key(int i) const { return keys != nullptr ? keys[i] : ordered_key(__ldg(scores + i)); }
  __device__ int32_t entry(int i) const { return entries != nullptr ? entries[i] : first + i; }
};

// Adds the digit below `sel.prefix` of every key matching it to this CTA's histogram, one key per thread per
// step; whole warps step together (the count is padded to 32), so ballots and __match_any_sync see full warps.
// Scores cluster in few bins (a pass sees sign, exponent and a few mantissa bits), and lanes adding to one shared
// counter serialise: one atomic per distinct digit per warp instead.
__device__ void histogram_pass_from(const KeySource& source, const Selection& sel, int bits, uint32_t* histogram) {
  const int lane = threadIdx.x % 32;
  const uint32_t mask = (1u << bits) - 1u;
  const int shift = 32 - sel.resolved - bits;
  const int padded = (source.count + 31) & ~31;
  for (int i = static_cast<int>(threadIdx.x); i < padded; i += kThreads) {
    const uint32_t key = i < source.count ? source.key(i) : 0u;
    const bool match = key >= sel.floor && top_bits(key, sel.resolved) == sel.prefix;
    if (__ballot_sync(0xffffffffu, match) == 0) continue;
    const uint32_t digit = (key >> shift) & mask;
    const uint32_t peers = __match_any_sync(0xffffffffu, match ? digit : 0xffffffffu);
    if (match && lane == __ffs(peers) - 1) atomicAdd(&histogram[digit], static_cast<uint32_t>(__popc(peers)));
  }
}

// Up to `max_passes` radix passes (11, 11, 10 bits) over the cluster's sources, stopping once resolved. The two
// histogram buffers alternate over every pass of the kernel (`passes_run` counts them): before a buffer is used a
// second time it is zeroed, which is safe because every CTA read it (resolve_digit) before the barrier of the
// pass in between.
__device__ void radix_select(const KeySource& source, cg::cluster_group& cluster, int ranks, Selection& sel, Shared& sh,
                             int& passes_run, int max_passes) {
#pragma unroll 1
  for (int pass = 0; pass < max_passes && sel.resolved < 32; ++pass) {
    const int bits = min(11, 32 - sel.resolved);
    uint32_t* histogram = sh.histogram[passes_run & 1];
    if (passes_run >= 2) {
      for (int i = threadIdx.x; i < kBins; i += kThreads) histogram[i] = 0;
      __syncthreads();
    }
    ++passes_run;
    histogram_pass_from(source, sel, bits, histogram);
    cluster_barrier(cluster, ranks);
    if (resolve_digit(cluster, ranks, histogram, bits, sel, sh)) return;
  }
}

// Entry-order compaction of the selection over a source (the cluster path's, for any source): warp w owns the
// contiguous positions [w·per_warp, (w+1)·per_warp); a chosen key's output slot is the "above" keys before it +
// min(need, the "equal" keys before it), counted by ballots, one block scan and the lower ranks' counts.
__device__ void compact_selection(const KeySource& source, const Selection& sel, cg::cluster_group& cluster, int ranks,
                                  int rank, Shared& sh, int32_t* out, int k, int32_t* row_length) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int per_warp = (source.count + kThreads - 1) / kThreads * 32;
  const int begin = warp * per_warp;
  const int end = min(source.count, begin + per_warp);
  const int groups = per_warp / 32;
  auto classify = [&](int i, bool& above, bool& equal) {
    const uint32_t key = i < end ? source.key(i) : 0u;
    const uint32_t top = top_bits(key, sel.resolved);
    above = key >= sel.floor && top > sel.prefix;
    equal = key >= sel.floor && top == sel.prefix;
  };
  uint32_t warp_above = 0, warp_equal = 0;
  for (int g = 0; g < groups; ++g) {
    bool above, equal;
    classify(begin + 32 * g + lane, above, equal);
    warp_above += __popc(__ballot_sync(0xffffffffu, above));
    warp_equal += __popc(__ballot_sync(0xffffffffu, equal));
  }
  uint64_t cta_packed;
  const uint64_t packed = lane == 0 ? (uint64_t{warp_above} << 32 | warp_equal) : uint64_t{0};
  const uint64_t inclusive = block_inclusive_scan(packed, sh, cta_packed);
  const uint64_t warp_before = __shfl_sync(0xffffffffu, inclusive - packed, 0);
  if (threadIdx.x == 0) {
    sh.cta_above = static_cast<uint32_t>(cta_packed >> 32);
    sh.cta_equal = static_cast<uint32_t>(cta_packed);
  }
  cluster_barrier(cluster, ranks);
  if (warp == 0) {
    uint32_t above = 0, equal = 0, before_above = 0, before_equal = 0;
    if (lane < ranks) {
      const Shared* remote = rank_shared(cluster, ranks, &sh, lane);
      above = remote->cta_above;
      equal = remote->cta_equal;
    }
    if (lane < rank) {
      before_above = above;
      before_equal = equal;
    }
    for (int offset = 16; offset > 0; offset /= 2) {
      above += __shfl_xor_sync(0xffffffffu, above, offset);
      equal += __shfl_xor_sync(0xffffffffu, equal, offset);
      before_above += __shfl_xor_sync(0xffffffffu, before_above, offset);
      before_equal += __shfl_xor_sync(0xffffffffu, before_equal, offset);
    }
    if (lane == 0) {
      sh.all_above = above;
      sh.all_equal = equal;
      sh.before_above = before_above;
      sh.before_equal = before_equal;
    }
  }
  __syncthreads();
  uint32_t running_above = sh.before_above + static_cast<uint32_t>(warp_before >> 32);
  uint32_t running_equal = sh.before_equal + static_cast<uint32_t>(warp_before);
  const uint32_t lower_lanes = (1u << lane) - 1u;
  for (int g = 0; g < groups; ++g) {
    const int i = begin + 32 * g + lane;
    bool above, equal;
    classify(i, above, equal);
    const uint32_t above_ballot = __ballot_sync(0xffffffffu, above);
    const uint32_t equal_ballot = __ballot_sync(0xffffffffu, equal);
    const uint32_t equal_before = running_equal + __popc(equal_ballot & lower_lanes);
    if (above || (equal && equal_before < sel.need)) {
      const uint32_t slot = running_above + __popc(above_ballot & lower_lanes) + min(sel.need, equal_before);
      out[slot] = source.entry(i);
    }
    running_above += __popc(above_ballot);
    running_equal += __popc(equal_ballot);
  }
  if (rank == 0) {
    const uint32_t chosen = sh.all_above + min(sel.need, sh.all_equal);
    for (int i = static_cast<int>(chosen) + static_cast<int>(threadIdx.x); i < k; i += kThreads) out[i] = -1;
    if (threadIdx.x == 0) *row_length = static_cast<int32_t>(chosen);
  }
}

// Loads 32 consecutive scores per lane group: lane l of warp w takes quads warp_first + 32u + l, u < 8 (coalesced
// 512-byte rows per instruction); entries at or past `valid` come back −inf.
__device__ __forceinline__ void load_tile(const float* scores, int warp_first_entry, int valid, bool vector_loads,
                                          float4 (&v)[8]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int u = 0; u < 8; ++u) {
    const int e = warp_first_entry + 4 * (32 * u + lane);
    v[u] = make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
    if (e + 3 < valid && vector_loads) {
      v[u] = __ldg(reinterpret_cast<const float4*>(scores + e));
    } else if (e < valid) {
      v[u].x = __ldg(scores + e);
      if (e + 1 < valid) v[u].y = __ldg(scores + e + 1);
      if (e + 2 < valid) v[u].z = __ldg(scores + e + 2);
      if (e + 3 < valid) v[u].w = __ldg(scores + e + 3);
    }
  }
}

// The float form of a key threshold: score >= key_threshold_score(T) exactly when ordered_key(score) >= T, for
// every score (−inf and NaN compare false; −0.0 compares as +0.0, as its key does), so the filter compares floats.
__device__ __forceinline__ float key_threshold_score(uint32_t threshold) {
  if (threshold <= 0x00800000u) return -FLT_MAX;  // at or below the key of −FLT_MAX: every finite score
  return __uint_as_float((threshold & 0x80000000u) ? (threshold & 0x7fffffffu) : ~threshold);
}

__global__ void __launch_bounds__(kThreads, 1) top_k_cluster_kernel(const TopKParams p, int span) {
  extern __shared__ uint4 dynamic_keys[];
  __shared__ Shared sh;
  cg::cluster_group cluster = cg::this_cluster();
  const int ranks = static_cast<int>(cluster.num_blocks());
  const int rank = static_cast<int>(cluster.block_rank());
  const int64_t row = blockIdx.y;
  const uint32_t* keys = reinterpret_cast<const uint32_t*>(dynamic_keys);
  const int quads = span / 4;

  // Load this CTA's span [first, first + span) as keys; entries at or past the row's length are not read.
  const CtaSpan here = begin_row_cta(p, sh, row, rank, span);
  const int64_t first = here.first;
  const int valid = here.valid;
  const float* scores = here.scores;
  const bool vector_loads = here.vector_loads;
  constexpr int kInFlight = 8;  // float4 loads per thread issued before any is used: the span in one round trip
  for (int base = 0; base < quads; base += kInFlight * kThreads) {
    float4 v[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int j = base + u * kThreads + static_cast<int>(threadIdx.x);
      v[u] = make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
      if (4 * j + 3 < valid && vector_loads) {
        v[u] = __ldg(reinterpret_cast<const float4*>(scores) + j);
      } else if (4 * j < valid) {
        v[u].x = __ldg(scores + 4 * j);
        if (4 * j + 1 < valid) v[u].y = __ldg(scores + 4 * j + 1);
        if (4 * j + 2 < valid) v[u].z = __ldg(scores + 4 * j + 2);
        if (4 * j + 3 < valid) v[u].w = __ldg(scores + 4 * j + 3);
      }
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int j = base + u * kThreads + static_cast<int>(threadIdx.x);
      if (j < quads) {
        const uint4 key = make_uint4(ordered_key(v[u].x), ordered_key(v[u].y), ordered_key(v[u].z),
                                     ordered_key(v[u].w));
        dynamic_keys[j] = key;
      }
    }
  }
  __syncthreads();  // the span's keys are in shared memory; the passes' own barriers order the remote reads

  // Radix passes over the keys in shared memory (11, 11, 10 bits, stopping once the crossing bin is taken whole),
  // then the entry-order compaction: the same steps as the sampled path's, over the whole span.
  Selection sel;
  sel.need = static_cast<uint32_t>(p.k);
  int passes_run = 0;
  const KeySource source{keys, nullptr, nullptr, span, static_cast<int32_t>(first)};
  radix_select(source, cluster, ranks, sel, sh, passes_run, 3);
  compact_selection(source, sel, cluster, ranks, rank, sh, p.indices + row * p.k, p.k, p.lengths + row);
  cluster_exit(ranks);  // done reading the other CTAs' shared memory; they may exit once everyone arrived
}

__global__ void __launch_bounds__(kThreads, 1)
    top_k_sampled_kernel(const TopKParams p, int span, int capacity, bool sample, bool force_fallback) {
  extern __shared__ uint4 dynamic_candidates[];
  __shared__ Shared sh;
  cg::cluster_group cluster = cg::this_cluster();
  const int ranks = static_cast<int>(cluster.num_blocks());
  const int rank = static_cast<int>(cluster.block_rank());
  const int64_t row = blockIdx.y;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  uint32_t* candidate_keys = reinterpret_cast<uint32_t*>(dynamic_candidates);
  int32_t* candidate_entries = reinterpret_cast<int32_t*>(candidate_keys + capacity);

  const CtaSpan here = begin_row_cta(p, sh, row, rank, span);
  const int64_t first = here.first;
  const int valid = here.valid;
  const float* scores = here.scores;
  const bool vector_loads = here.vector_loads;
  int passes_run = 0;

  // 1. The threshold. Spans that fit the buffer keep every valid key (T = 1). Otherwise the sample: line 16j of
  //    the span (32 keys) for every j, all of a warp's loads issued before any is used, kept as keys in the
  //    (still unused) candidate buffer; radix passes over the cluster's sample find the key with
  //    kSampleMargin · k / kSampleStride sample keys at or above it to 22 bits (11 in clusters of
  //    kOnePassSampleRanks or more), and T is that prefix's lower edge: about kSampleMargin · k keys of the row
  //    reach it (more with 11 bits). A sample with fewer valid keys gives T = 1.
  uint32_t threshold = 1;
  if (sample) {
    const int sample_lines = ((valid + 31) / 32 + kSampleStride - 1) / kSampleStride;
    float sampled[kMaxSampleLinesPerWarp];
#pragma unroll
    for (int t = 0; t < kMaxSampleLinesPerWarp; ++t) {
      const int line = warp + kWarps * t;
      const int e = line * kSampleStride * 32 + lane;
      sampled[t] = line < sample_lines && e < valid ? __ldg(scores + e) : -INFINITY;
    }
#pragma unroll
    for (int t = 0; t < kMaxSampleLinesPerWarp; ++t) {
      const int line = warp + kWarps * t;
      if (line < sample_lines) candidate_keys[line * 32 + lane] = ordered_key(sampled[t]);
    }
    __syncthreads();
    Selection estimate;
    estimate.need = static_cast<uint32_t>(max(int64_t{1}, kSampleMargin * p.k / kSampleStride));
    // No barrier needed before the passes: the first remote read of a histogram follows the pass's own cluster
    // barrier, by which every CTA has started and zeroed its histograms.
    radix_select(KeySource{candidate_keys, nullptr, nullptr, sample_lines * 32, 0}, cluster, ranks, estimate, sh,
                 passes_run, ranks >= kOnePassSampleRanks ? 1 : 2);
    if (estimate.resolved > 0) threshold = max(1u, estimate.prefix << (32 - estimate.resolved));
    __syncthreads();  // the sample's keys are read before the candidates overwrite them
  }

  // 2. One pass over the span keeps the keys ≥ T (compared as floats). Warp w streams its own contiguous
  //    w-th 1/32 of the span, 1,024 entries a round (eight float4 loads per lane in flight), and appends its kept
  //    keys, in entry order, to its own 1/32 of the candidate buffer: a ballot per component of each load places
  //    them, with no barrier in the loop. Then one block scan over the warps' counts and one move (all reads,
  //    a barrier, all writes) pack the regions in warp order, which is entry order. A warp whose keys overflow
  //    its region makes the CTA report an overflow (the fallback).
  // The first radix pass over the candidates is counted here, as each is kept (its 11-bit digit into this
  // histogram buffer), so the barrier that publishes the counts also completes that pass.
  uint32_t* first_histogram = sh.histogram[passes_run & 1];
  if (passes_run >= 2)
    for (int i = threadIdx.x; i < kBins; i += kThreads) first_histogram[i] = 0;
  __syncthreads();
  ++passes_run;
  const float threshold_score = key_threshold_score(threshold);
  const uint32_t lower_lanes = (1u << lane) - 1u;
  const int warp_span = span / kWarps;  // a multiple of 16 (spans are whole 512-key runs): float4-aligned
  const int warp_begin = warp * warp_span;
  const int warp_end = min(valid, warp_begin + warp_span);
  const uint32_t region = static_cast<uint32_t>(capacity / kWarps);
  uint32_t* region_keys = candidate_keys + warp * region;
  int32_t* region_entries = candidate_entries + warp * region;
  uint32_t warp_kept = 0;
  for (int round = warp_begin; round < warp_end; round += kTileEntries / kWarps) {
    float4 v[8];
    load_tile(scores, round, warp_end, vector_loads, v);
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      // Entry order inside a load: lane, then component; one ballot per component places every kept key.
      const bool keep[4] = {v[u].x >= threshold_score, v[u].y >= threshold_score, v[u].z >= threshold_score,
                            v[u].w >= threshold_score};
      uint32_t ballots[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) ballots[i] = __ballot_sync(0xffffffffu, keep[i]);
      if ((ballots[0] | ballots[1] | ballots[2] | ballots[3]) == 0) continue;
      uint32_t slot = warp_kept;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        slot += __popc(ballots[i] & lower_lanes);
        warp_kept += __popc(ballots[i]);
      }
      const int e = round + 4 * (32 * u + lane);
      const float values[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if (!keep[i]) continue;
        const uint32_t key = ordered_key(values[i]);
        atomicAdd(&first_histogram[key >> 21], 1u);
        if (slot < region) {
          region_keys[slot] = key;
          region_entries[slot] = static_cast<int32_t>(first) + e + i;
        }
        ++slot;
      }
    }
  }
  uint32_t kept;
  const uint32_t lane0 = lane == 0 ? warp_kept : 0u;
  const uint32_t inclusive = block_inclusive_scan(lane0, sh, kept);
  const bool region_overflow = __syncthreads_or(lane == 0 && warp_kept > region);
  if (!region_overflow) {
    // Pack: each warp moves its own kept keys (region positions [0, warp_kept)) to its first slot, the scan's
    // count of the warps before it (lanes other than 0 added nothing, so every lane's inclusive value is that slot
    // + warp_kept). Destinations never pass their sources but may land on another warp's unread ones: read all,
    // a barrier, then write. A region holds at most capacity / kWarps ≤ 256 keys: 8 per lane.
    constexpr int kMovesPerLane = kCandidateCapacity / kWarps / 32;
    const uint32_t first_slot = inclusive - warp_kept;
    uint32_t move_keys[kMovesPerLane];
    int32_t move_entries[kMovesPerLane];
#pragma unroll
    for (int t = 0; t < kMovesPerLane; ++t) {
      const uint32_t j = static_cast<uint32_t>(lane + 32 * t);
      if (j < warp_kept) {
        move_keys[t] = region_keys[j];
        move_entries[t] = region_entries[j];
      }
    }
    __syncthreads();
#pragma unroll
    for (int t = 0; t < kMovesPerLane; ++t) {
      const uint32_t j = static_cast<uint32_t>(lane + 32 * t);
      if (j < warp_kept) {
        candidate_keys[first_slot + j] = move_keys[t];
        candidate_entries[first_slot + j] = move_entries[t];
      }
    }
  }
  if (threadIdx.x == 0) sh.candidates = region_overflow ? static_cast<uint32_t>(capacity) + 1 : kept;
  cluster_barrier(cluster, ranks);  // every CTA's count is final
  if (warp == 0) {
    const uint32_t count = lane < ranks ? rank_shared(cluster, ranks, &sh, lane)->candidates : 0u;
    const uint32_t total = __reduce_add_sync(0xffffffffu, count);
    const bool overflow = __any_sync(0xffffffffu, count > static_cast<uint32_t>(capacity));
    if (lane == 0) {
      sh.row_candidates = total;
      sh.overflow = overflow;
    }
  }
  __syncthreads();
  const bool exact_on_candidates =
      !force_fallback && !sh.overflow && (sh.row_candidates >= static_cast<uint32_t>(p.k) || threshold == 1);

  // 3. Radix select and entry-order compaction, over the candidates or (fallback) over the span in global memory.
  int32_t* out = p.indices + row * p.k;
  Selection sel;
  sel.need = static_cast<uint32_t>(p.k);
  KeySource source{candidate_keys, candidate_entries, scores, static_cast<int>(kept), static_cast<int32_t>(first)};
  if (exact_on_candidates) {
    sel.floor = threshold;
    if (!resolve_digit(cluster, ranks, first_histogram, digit_bits(0), sel, sh))
      radix_select(source, cluster, ranks, sel, sh, passes_run, 2);
  } else {
    source.keys = nullptr;  // the span's scores in global memory, entry = first + position
    source.entries = nullptr;
    source.count = valid;
    radix_select(source, cluster, ranks, sel, sh, passes_run, 3);
  }
  compact_selection(source, sel, cluster, ranks, rank, sh, out, p.k, p.lengths + row);
  cluster_exit(ranks);  // done reading the other CTAs' shared memory; they may exit once everyone arrived
}

struct LaunchShape {
  int cluster;  // CTAs per row
  int span;     // keys per CTA
};

// DSV4_TOPK_CLUSTER=16 allows Hopper's non-portable 16-CTA clusters (half the keys per CTA); 8 by default.
int max_cluster() {
  static const int value = [] {
    const char* text = std::getenv("DSV4_TOPK_CLUSTER");
    return text != nullptr && std::atoi(text) == 16 ? 16 : kMaxCluster;
  }();
  return value;
}

LaunchShape launch_shape(int64_t columns) {
  const int64_t wanted = (columns + kMinSpan - 1) / kMinSpan;
  const int cluster = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(max_cluster(), wanted)));
  int64_t span = (columns + cluster - 1) / cluster;
  span = std::max<int64_t>(kSpanQuantum, (span + kSpanQuantum - 1) / kSpanQuantum * kSpanQuantum);
  return {cluster, static_cast<int>(span)};
}

// The sampled path's shape: as many CTAs per row as fit one wave beside the other rows (1 once rows ≥ SMs), at
// most the cluster limit, no span under kMinSpan; spans are whole 512-key runs, so every CTA's sample lines sit at
// the same offsets of the row.
LaunchShape sampled_launch_shape_for(int64_t columns, int64_t cluster) {
  constexpr int64_t kQuantum = 32 * kSampleStride;
  int64_t span = (columns + cluster - 1) / cluster;
  span = std::max<int64_t>(kQuantum, (span + kQuantum - 1) / kQuantum * kQuantum);
  return {static_cast<int>(cluster), static_cast<int>(span)};
}

LaunchShape sampled_launch_shape(int64_t rows, int64_t columns, int multiprocessors) {
  const int64_t by_wave = std::max<int64_t>(1, multiprocessors / rows);
  const int64_t by_span = (columns + kMinSpan - 1) / kMinSpan;
  return sampled_launch_shape_for(columns, std::max<int64_t>(1, std::min<int64_t>({max_cluster(), by_wave, by_span})));
}

bool env_is(const char* name, const char* value) {
  const char* text = std::getenv(name);
  return text != nullptr && std::strcmp(text, value) == 0;
}

// Launches a top-k kernel of kThreads-thread CTAs in clusters of `cluster` along x (1 for the grid path, whose radix
// machinery still addresses its histograms through the cluster), with programmatic dependent launch when enabled.
// The dynamic shared-memory limit and the non-portable cluster size are set per call (host-side attributes, per
// device, allowed during graph capture).
template <typename... Params, typename... Args>
cudaError_t launch_clusters(void (*kernel)(Params...), int cluster, dim3 grid, size_t shared_bytes,
                            int max_shared_bytes, cudaStream_t stream, Args... args) {
  const cudaError_t configured =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, max_shared_bytes);
  if (configured != cudaSuccess) return configured;
  if (cluster > kMaxCluster) {
    const cudaError_t allowed = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    if (allowed != cudaSuccess) return allowed;
  }
  cudaLaunchAttribute attributes[2] = {};
  attributes[0].id = cudaLaunchAttributeClusterDimension;
  attributes[0].val.clusterDim.x = static_cast<unsigned>(cluster);
  attributes[0].val.clusterDim.y = 1;
  attributes[0].val.clusterDim.z = 1;
  attributes[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attributes[1].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  config.attrs = attributes;
  config.numAttrs = programmatic_launch_enabled() ? 2 : 1;
  return cudaLaunchKernelEx(&config, kernel, args...);
}

// One cluster of `shape.cluster` CTAs per row, one row per grid row.
dim3 row_cluster_grid(const LaunchShape& shape, int64_t rows) {
  return dim3(static_cast<unsigned>(shape.cluster), static_cast<unsigned>(rows));
}

cudaError_t launch_sampled(const TopKParams& p, const LaunchShape& shape, cudaStream_t stream) {
  // A span that fits the buffer keeps all its keys, so its buffer is the span; a sampled span gets the full
  // buffer, which also holds its sample (span / 16 keys) while the threshold is found.
  const bool sample = shape.span > kCandidateCapacity;
  const int capacity = sample ? kCandidateCapacity : shape.span;
  // DSV4_TOPK_FALLBACK=1 (tests): every row takes the exact fallback over global memory. Read on every call.
  const bool force_fallback = env_is("DSV4_TOPK_FALLBACK", "1");
  return launch_clusters(top_k_sampled_kernel, shape.cluster, row_cluster_grid(shape, p.rows),
                         static_cast<size_t>(capacity) * 2 * sizeof(uint32_t),
                         kCandidateCapacity * 2 * static_cast<int>(sizeof(uint32_t)), stream, p, shape.span,
                         capacity, sample, force_fallback);
}

// ---------------------------------------------------------------------------------------------------------------
// The grid path (docs/kernels/indexer_topk.md "Grid path"): for a few long rows, where one cluster of 8 CTAs per
// row leaves most of the GPU idle and its chain of cluster barriers sets the time (27 µs at 256K × 1, H100), the
// row is split over up to all SMs and the work is cut in two launches with no inter-CTA barrier inside either:
// 1. top_k_grid_filter_kernel, `ctas` CTAs a row, each owning a span of ≤ 8,192 keys: every CTA reads the same
//    sample of the row (≤ 2,048 keys, L2-resident after the first CTA) and radix-selects the same threshold T from
//    it on its own (the same integers, so the same T everywhere, with no broadcast), reads its span (its loads
//    issued together with the sample's), and writes its keys ≥ T, in entry order, with their entries and count,
//    to its own region of the workspace;
// 2. top_k_grid_select_kernel, one CTA a row (programmatic launch, so it is resident before the filter drains):
//    gathers the CTAs' candidates in CTA order (= entry order) into shared memory, radix-selects over them and
//    compacts, as the cluster path does with a cluster of one. Exactness as in the sampled path: if at least k keys
//    reach T, every key the answer can take is a candidate; otherwise (or when they exceed the buffer) the CTA
//    selects over the row in global memory (exact, slow, and with the margin below a far tail).
constexpr int kGridMaxSpan = 8 * kThreads;    // keys of one filter CTA: eight per thread
constexpr int kGridMaxCtas = 256;             // filter CTAs a row
// Sampled keys of a row at most (32-key lines, evenly strided): every filter CTA radix-selects over the whole
// sample, so it is kept small (8,192 took 1,430 instructions a warp in the filter, ncu).
constexpr int kGridSampleKeys = 2048;
constexpr int kGridSampleLinesPerWarp = kGridSampleKeys / 32 / kWarps;
// T is the sample key with `grid_sample_keys_above(k, …)` sample keys at or above it, so about margin · k keys of
// the row reach it: margin 4 at k 512 (16 sample keys of 2,048 at 256K columns), 3 at k ≥ 1,024 (24 sample keys),
// and never fewer than 16 sample keys (small k). Fewer than k candidates (the fallback) then needs a Gamma(16)
// draw under 4 (p ≈ 1e-6) at k 512 or a Gamma(24) draw under 8 (p ≈ 4e-6) at k 1,024; more than the 8,192 the
// select holds, Gamma(16) over 64 or Gamma(24) over 64 (far tails). Margin 3 at k 1,024 leaves the select 3,072
// candidates instead of 4,096: shorter passes and compaction.
__device__ __forceinline__ uint32_t grid_sample_keys_above(int64_t k, int sample_count, int valid) {
  const int64_t margin = k >= 1024 ? 3 : 4;
  return static_cast<uint32_t>(max(int64_t{16}, (margin * k * sample_count + valid - 1) / max(1, valid)));
}
constexpr int kGridCapacity = 8192;           // candidates the select holds (keys + entries: 64 KB)
constexpr int64_t kGridMaxRows = 8;           // rows a launch covers (more are launched in blocks: forced only)
// top_k takes the grid path by itself for rows this few and this long (DSV4_TOPK_PATH=grid forces it anywhere):
// measured at 256K × 1 and × 4 (docs/PERF.md "Top-k: the grid path"). More rows were timed only with its first
// version (launched in blocks of 8 rows: 181 µs at 256K × 32 against 59 sampled), so they keep the other paths.
constexpr int64_t kGridAutoMaxRows = 4;
constexpr int64_t kGridAutoMinColumns = 65536;
constexpr int kGridHeaderWords = kGridMaxCtas + 4;  // counts[kGridMaxCtas], threshold, padding

struct GridShape {
  int ctas;  // filter CTAs a row
  int span;  // keys a filter CTA owns, a multiple of kThreads
};

// Words of one row's workspace (rows of a launch are numbered from its first): the header, then keys and entries
// of every CTA's region (ctas · span < columns + span ≤ columns + kGridMaxSpan).
__host__ __device__ inline int64_t grid_row_words(int64_t columns) {
  return kGridHeaderWords + 2 * (columns + kGridMaxSpan);
}

// As many CTAs a row as fill one wave beside the other rows, each span whole thread-rounds, at most kGridMaxSpan.
GridShape grid_shape(int64_t rows, int64_t columns, int multiprocessors) {
  const int64_t by_wave =
      std::clamp<int64_t>(multiprocessors / std::max<int64_t>(1, rows), 1, kGridMaxCtas);
  int64_t span = (std::max<int64_t>(1, columns) + by_wave - 1) / by_wave;
  span = std::clamp<int64_t>((span + kThreads - 1) / kThreads * kThreads, kThreads, kGridMaxSpan);
  const int64_t ctas = std::max<int64_t>(1, (columns + span - 1) / span);  // ≤ by_wave, or ≤ 32 at kGridMaxSpan
  return {static_cast<int>(ctas), static_cast<int>(span)};
}

struct GridRow {
  uint32_t* counts;     // [kGridMaxCtas]
  uint32_t* threshold;  // [1]
  uint32_t* keys;       // region of CTA c at c · span
  int32_t* entries;
};
__device__ __forceinline__ GridRow grid_row(void* workspace, int64_t row, int64_t columns) {
  uint32_t* base = static_cast<uint32_t*>(workspace) + row * grid_row_words(columns);
  uint32_t* keys = base + kGridHeaderWords;
  return {base, base + kGridMaxCtas, keys, reinterpret_cast<int32_t*>(keys + columns + kGridMaxSpan)};
}

__global__ void __launch_bounds__(kThreads, 1)
    top_k_grid_filter_kernel(const TopKParams p, int64_t first_row, int span, void* workspace) {
  extern __shared__ uint4 dynamic_sample[];
  __shared__ Shared sh;
  __shared__ uint32_t kept_before[8][kWarps];  // the scan of kept keys in (load, warp) order: entry order
  cg::cluster_group cluster = cg::this_cluster();
  const int64_t row = first_row + blockIdx.y;
  const int cta = static_cast<int>(blockIdx.x);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  uint32_t* sample_keys = reinterpret_cast<uint32_t*>(dynamic_sample);

  for (int i = threadIdx.x; i < 2 * kBins; i += kThreads) (&sh.histogram[0][0])[i] = 0;
  wait_for_prior_grid();  // the scores come from the previous kernel
  allow_dependents();     // the select kernel may become resident; it waits for this grid to complete
  const int32_t* row_length = p.row_lengths ? p.row_lengths + row : nullptr;
  const int32_t length_read = row_length ? __ldg(row_length) : 0;
  const float* row_scores = p.scores + row * p.row_stride;
  const int first = cta * span;
  const int columns = static_cast<int>(p.columns);

  // The sample: 32-key lines every `line_stride` lines of the row (all CTAs read the same lines), and this CTA's
  // span, position i·kThreads + t for thread t (each load a coalesced 128 B a warp), all loads in flight at once.
  // The positions follow from `columns`, not from the row's length, so the loads go out together with the
  // length's instead of one round trip after it (every position < columns is inside the scores); entries at or
  // past the length are masked once it arrives.
  const int lines = (columns + 31) / 32;
  const int line_stride = max(1, (lines * 32 + kGridSampleKeys - 1) / kGridSampleKeys);
  const int sample_lines = (lines + line_stride - 1) / line_stride;  // ≤ kGridSampleLinesPerWarp a warp
  float sampled[kGridSampleLinesPerWarp], own[8];
#pragma unroll
  for (int t = 0; t < kGridSampleLinesPerWarp; ++t) {
    const int line = warp + kWarps * t;
    const int e = line * line_stride * 32 + lane;
    sampled[t] = line < sample_lines && e < columns ? __ldg(row_scores + e) : -INFINITY;
  }
  const int per_thread = span / kThreads;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int e = first + i * kThreads + static_cast<int>(threadIdx.x);
    own[i] = i < per_thread && e < columns ? __ldg(row_scores + e) : -INFINITY;
  }
  const int valid = row_length ? max(0, min(columns, static_cast<int>(length_read))) : columns;
#pragma unroll
  for (int t = 0; t < kGridSampleLinesPerWarp; ++t) {
    const int line = warp + kWarps * t;
    if (line < sample_lines)
      sample_keys[line * 32 + lane] = line * line_stride * 32 + lane < valid ? ordered_key(sampled[t]) : 0u;
  }
#pragma unroll
  for (int i = 0; i < 8; ++i)
    if (first + i * kThreads + static_cast<int>(threadIdx.x) >= valid) own[i] = -INFINITY;
  int sample_count = 0;  // sampled positions inside the row's length (the same in every thread)
  for (int line = 0; line < sample_lines; ++line) sample_count += max(0, min(32, valid - line * line_stride * 32));
  __syncthreads();

  // T: the sample key with grid_sample_keys_above sample keys at or above it, to 22 bits. A row read whole by its
  // sample (≤ 2,048 keys) or too short for the margin keeps every valid key (T = 1).
  uint32_t threshold = 1;
  if (line_stride > 1) {
    Selection estimate;
    estimate.need = grid_sample_keys_above(p.k, sample_count, valid);
    int passes_run = 0;
    if (estimate.need < static_cast<uint32_t>(sample_count)) {
      radix_select(KeySource{sample_keys, nullptr, nullptr, sample_lines * 32, 0}, cluster, 1, estimate, sh,
                   passes_run, 2);
      if (estimate.resolved > 0) threshold = max(1u, estimate.prefix << (32 - estimate.resolved));
    }
  }

  // Keep the span's keys ≥ T in entry order: for load i, warp w, lane l the entry is first + i·kThreads + 32w + l,
  // so the (i, w) ballot counts scanned in that order give each warp's first slot.
  const float threshold_score = key_threshold_score(threshold);
  uint32_t ballots[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    ballots[i] = __ballot_sync(0xffffffffu, i < per_thread && own[i] >= threshold_score);
    if (lane == 0) kept_before[i][warp] = __popc(ballots[i]);
  }
  __syncthreads();
  if (warp == 0) {  // exclusive scan over the per_thread · kWarps counts, load-major: lane l holds warp l's count
    uint32_t running = 0;
    for (int i = 0; i < per_thread; ++i) {
      const uint32_t count = kept_before[i][lane];
      uint32_t inclusive = count;
      for (int offset = 1; offset < 32; offset *= 2) {
        const uint32_t v = __shfl_up_sync(0xffffffffu, inclusive, offset);
        if (lane >= offset) inclusive += v;
      }
      kept_before[i][lane] = running + inclusive - count;
      running += __shfl_sync(0xffffffffu, inclusive, 31);
    }
    if (lane == 0) sh.candidates = running;
  }
  __syncthreads();
  const GridRow out = grid_row(workspace, blockIdx.y, p.columns);
  const uint32_t lower_lanes = (1u << lane) - 1u;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    if (!(ballots[i] >> lane & 1u)) continue;
    const uint32_t slot = kept_before[i][warp] + __popc(ballots[i] & lower_lanes);
    out.keys[first + slot] = ordered_key(own[i]);
    out.entries[first + slot] = first + i * kThreads + static_cast<int>(threadIdx.x);
  }
  if (threadIdx.x == 0) {
    out.counts[cta] = sh.candidates;
    if (cta == 0) *out.threshold = threshold;
  }
}

__global__ void __launch_bounds__(kThreads, 1)
    top_k_grid_select_kernel(const TopKParams p, int64_t first_row, int ctas, int span, const void* workspace,
                             bool force_fallback) {
  extern __shared__ uint4 dynamic_candidates[];
  __shared__ Shared sh;
  __shared__ uint32_t offsets[kGridMaxCtas + 1];  // the first candidate slot of each filter CTA, then the total
  cg::cluster_group cluster = cg::this_cluster();
  const int64_t row = first_row + blockIdx.y;
  uint32_t* candidate_keys = reinterpret_cast<uint32_t*>(dynamic_candidates);
  int32_t* candidate_entries = reinterpret_cast<int32_t*>(candidate_keys + kGridCapacity);

  for (int i = threadIdx.x; i < 2 * kBins; i += kThreads) (&sh.histogram[0][0])[i] = 0;
  wait_for_prior_grid();  // the filter's candidates
  allow_dependents();
  const int64_t length = row_valid_entries(p, row);
  const GridRow in = grid_row(const_cast<void*>(workspace), blockIdx.y, p.columns);
  const uint32_t threshold = *in.threshold;
  const uint32_t count = static_cast<int>(threadIdx.x) < ctas ? in.counts[threadIdx.x] : 0u;
  uint32_t total;
  const uint32_t inclusive = block_inclusive_scan(count, sh, total);
  if (static_cast<int>(threadIdx.x) < ctas) offsets[threadIdx.x] = inclusive - count;
  if (threadIdx.x == 0) offsets[ctas] = total;
  const bool exact_on_candidates = !force_fallback && total <= static_cast<uint32_t>(kGridCapacity) &&
                                   (total >= static_cast<uint32_t>(p.k) || threshold == 1);
  __syncthreads();

  Selection sel;
  sel.need = static_cast<uint32_t>(p.k);
  KeySource source{candidate_keys, candidate_entries, p.scores + row * p.row_stride, static_cast<int>(total), 0};
  if (exact_on_candidates) {
    // Slot j of the gathered list belongs to the CTA whose offsets bracket it (a binary search in shared
    // memory); a thread's ≤ 8 loads are issued together.
    constexpr int kPerThread = kGridCapacity / kThreads;
    uint32_t keys[kPerThread];
    int32_t entries[kPerThread];
#pragma unroll
    for (int t = 0; t < kPerThread; ++t) {
      const int j = t * kThreads + static_cast<int>(threadIdx.x);
      if (j >= static_cast<int>(total)) continue;
      int low = 0, high = ctas;  // offsets[low] ≤ j < offsets[high]
      while (high - low > 1) {
        const int mid = (low + high) / 2;
        if (offsets[mid] <= static_cast<uint32_t>(j)) low = mid; else high = mid;
      }
      const int64_t at = static_cast<int64_t>(low) * span + (j - static_cast<int>(offsets[low]));
      keys[t] = in.keys[at];
      entries[t] = in.entries[at];
    }
#pragma unroll
    for (int t = 0; t < kPerThread; ++t) {
      const int j = t * kThreads + static_cast<int>(threadIdx.x);
      if (j >= static_cast<int>(total)) continue;
      candidate_keys[j] = keys[t];
      candidate_entries[j] = entries[t];
    }
    __syncthreads();
    sel.floor = threshold;
  } else {
    source.keys = nullptr;  // the row's scores in global memory, entry = position
    source.entries = nullptr;
    source.count = static_cast<int>(length);
  }
  int passes_run = 0;
  radix_select(source, cluster, 1, sel, sh, passes_run, 3);
  compact_selection(source, sel, cluster, 1, 0, sh, p.indices + row * p.k, p.k, p.lengths + row);
}

size_t grid_workspace_bytes(int64_t rows, int64_t columns) {
  return static_cast<size_t>(std::min(rows, kGridMaxRows)) * static_cast<size_t>(grid_row_words(columns)) * 4;
}

cudaError_t launch_grid(const TopKParams& p, int multiprocessors, void* workspace, cudaStream_t stream) {
  const bool force_fallback = env_is("DSV4_TOPK_FALLBACK", "1");
  for (int64_t first_row = 0; first_row < p.rows; first_row += kGridMaxRows) {
    const int64_t rows = std::min(kGridMaxRows, p.rows - first_row);
    const GridShape shape = grid_shape(rows, p.columns, multiprocessors);
    // The filter, then the select launched programmatically behind it (resident before the filter drains).
    constexpr int kFilterShared = kGridSampleKeys * sizeof(uint32_t);
    constexpr int kSelectShared = kGridCapacity * 2 * sizeof(uint32_t);
    cudaError_t status = launch_clusters(top_k_grid_filter_kernel, 1,
                                         dim3(static_cast<unsigned>(shape.ctas), static_cast<unsigned>(rows)),
                                         kFilterShared, kFilterShared, stream, p, first_row, shape.span, workspace);
    if (status != cudaSuccess) return status;
    status = launch_clusters(top_k_grid_select_kernel, 1, dim3(1, static_cast<unsigned>(rows)), kSelectShared,
                             kSelectShared, stream, p, first_row, shape.ctas, shape.span,
                             static_cast<const void*>(workspace), force_fallback);
    if (status != cudaSuccess) return status;
  }
  return cudaSuccess;
}

}  // namespace

size_t top_k_workspace_bytes(int64_t rows, int64_t columns, int64_t k) {
  // The cluster and sampled paths need none; the grid path's rows are launched in blocks of kGridMaxRows.
  return std::max(chunked_top_k_workspace_bytes(rows, columns, k), grid_workspace_bytes(rows, columns));
}

cudaError_t top_k(const TopKParams& p, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (p.k <= 0 || p.k > kTopKMaxK || p.columns > kTopKMaxColumns || p.columns < 0 || p.rows > 65535 ||
      p.row_stride < p.columns)
    return cudaErrorInvalidValue;
  if (p.rows == 0) return cudaSuccess;
  if (workspace_bytes < top_k_workspace_bytes(p.rows, p.columns, p.k)) return cudaErrorInvalidValue;
  // Four paths (docs/kernels/indexer_topk.md), measured side by side (H200, docs/PERF.md "Top-k"):
  // - the grid path for ≤ 4 rows of ≥ 64K columns (H100, session 28): 19.8 µs against 26.1-26.8 (sampled) at
  //   256K × 1, 22.5 against 31.0-31.7 at 256K × 4; at 32K × 1 its first version was slower than the cluster path
  //   (27.7 against 19.0 µs), so shorter rows keep the paths below;
  // - the sampled path wherever its span is sampled (rows long enough for one: 32K × ≥ 64, 256K × any): 27.8 µs
  //   against 46.3 (cluster) at 256K × 1, 49.6 against 221.5 (chunked) at 256K × 64, 28.5 against 73.0 at 32K × 128;
  // - else the cluster path while rows × CTAs fit one wave: 10.9 against 15.1 (sampled) at 2K × 1, 17.0 against
  //   21.6 at 32K × 1;
  // - else the sampled path narrowed to fewer CTAs a row, so its spans sample (32K × 17–63);
  // - else the chunked path.
  const int multiprocessors = current_device_multiprocessors();
  if (multiprocessors == 0) return cudaGetLastError();
  // DSV4_TOPK_PATH=cluster|chunked|sampled|grid forces one path whatever the shape (to time them side by side at every
  // shape); read per call.
  const char* forced = std::getenv("DSV4_TOPK_PATH");
  const std::string_view path = forced != nullptr ? forced : "";
  const bool automatic =
      path != "sampled" && path != "cluster" && path != "chunked" && path != "grid";  // unknown names too
  if (path == "grid" || (automatic && p.rows <= kGridAutoMaxRows && p.columns >= kGridAutoMinColumns))
    return launch_grid(p, multiprocessors, workspace, stream);
  const LaunchShape sampled = sampled_launch_shape(p.rows, p.columns, multiprocessors);
  if (path == "sampled" || (automatic && sampled.span > kCandidateCapacity)) return launch_sampled(p, sampled, stream);
  const LaunchShape shape = launch_shape(p.columns);
  const bool cluster_fits_a_wave = p.rows * shape.cluster <= multiprocessors;
  if (automatic && !cluster_fits_a_wave) {
    // Rows that neither sample at one wave's width nor fit the cluster path's wave (32K × 17–63): fewer CTAs per
    // row, so each span is long enough to sample, beat the chunked path (29 µs at 32K × 64 with 2 CTAs a row
    // against 40 µs at 32K × 32 chunked, H100).
    const LaunchShape narrower = sampled_launch_shape_for(p.columns, std::min<int64_t>(
        sampled.cluster, std::max<int64_t>(1, (p.columns - 1) / kCandidateCapacity)));
    if (narrower.span > kCandidateCapacity) return launch_sampled(p, narrower, stream);
  }
  if (path == "chunked" || (automatic && !cluster_fits_a_wave)) return chunked_top_k(p, workspace, stream);
  return launch_clusters(top_k_cluster_kernel, shape.cluster, row_cluster_grid(shape, p.rows),
                         static_cast<size_t>(shape.span) * sizeof(uint32_t), kMaxSpan * static_cast<int>(sizeof(uint32_t)),
                         stream, p, shape.span);
}

}  // namespace dsv4::ops::cuda
