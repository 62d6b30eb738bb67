#include "ops/cuda/sampling.h"

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/host_device.h"
#include "ops/cuda/launch.cuh"

namespace dsv4::ops::cuda {
namespace {

using u64 = unsigned long long;  // the type CUDA's 64-bit atomics and shuffles take
using u32 = uint32_t;
static_assert(sizeof(u64) == 8, "64-bit");

constexpr int kChunk = 8192;        // logits per chunk CTA
constexpr int kChunkThreads = 512;  // chunk CTAs: 16 logits per thread in registers
constexpr int kPer = 16;
static_assert(kChunk == kChunkThreads * kPer, "chunk layout");
constexpr int kRowThreads = 1024;  // row CTAs
constexpr int kMaxChunks = static_cast<int>(kSamplingMaxVocab / kChunk);  // 32
constexpr int kListTotal = 4096;  // the chunks' top-k (or top-N) candidate lists together: one sort in pass 2
static_assert(kMaxChunks * kSamplingTopKFast <= kListTotal, "every chunk's list holds at least k");
constexpr int kBins = 1024;         // relative bins of (l_max - l), 1/32 nat each, the last one open
constexpr float kBinsPerNat = 32.0f;
constexpr int kSlotsPerChunk = 1024;  // per (row, chunk): the chunk's top-k list or its kBins histogram
static_assert(kSlotsPerChunk >= kBins && kSlotsPerChunk >= kSamplingTopKFast, "slots");
// Capacity of one chunk's candidate list.
__host__ __device__ inline int list_cap(int chunks) { return kListTotal / chunks < kSlotsPerChunk ? kListTotal / chunks : kSlotsPerChunk; }
constexpr int kGatherCap = 4096;    // tokens gathered and sorted in one row CTA
constexpr int kBatch = 16;          // logits per thread in flight in the row CTAs' passes over a whole row
constexpr int kRadixBits = 11;      // digits of the (logit, index) radix select over a large bin
constexpr int kRadixBins = 1 << kRadixBits;
constexpr int kIndexBits = 24;      // the index part of the (key, index) threshold of the chunk / merge selects
constexpr int kCompositeBits = 32 + kIndexBits;
constexpr int kWeightShift = 45;    // fixed-point weights: round(exp(l - l_max) * 2^45)

// 2^(j/64), j = 0..63, correctly rounded; ln2/64 split so that n * hi is exact for |n| < 2^12.
constexpr double kExp2TableHost[64] = {
    0x1.0000000000000p+0, 0x1.02c9a3e778061p+0, 0x1.059b0d3158574p+0, 0x1.0874518759bc8p+0, 0x1.0b5586cf9890fp+0,
    0x1.0e3ec32d3d1a2p+0, 0x1.11301d0125b51p+0, 0x1.1429aaea92de0p+0, 0x1.172b83c7d517bp+0, 0x1.1a35beb6fcb75p+0,
    0x1.1d4873168b9aap+0, 0x1.2063b88628cd6p+0, 0x1.2387a6e756238p+0, 0x1.26b4565e27cddp+0, 0x1.29e9df51fdee1p+0,
    0x1.2d285a6e4030bp+0, 0x1.306fe0a31b715p+0, 0x1.33c08b26416ffp+0, 0x1.371a7373aa9cbp+0, 0x1.3a7db34e59ff7p+0,
    0x1.3dea64c123422p+0, 0x1.4160a21f72e2ap+0, 0x1.44e086061892dp+0, 0x1.486a2b5c13cd0p+0, 0x1.4bfdad5362a27p+0,
    0x1.4f9b2769d2ca7p+0, 0x1.5342b569d4f82p+0, 0x1.56f4736b527dap+0, 0x1.5ab07dd485429p+0, 0x1.5e76f15ad2148p+0,
    0x1.6247eb03a5585p+0, 0x1.6623882552225p+0, 0x1.6a09e667f3bcdp+0, 0x1.6dfb23c651a2fp+0, 0x1.71f75e8ec5f74p+0,
    0x1.75feb564267c9p+0, 0x1.7a11473eb0187p+0, 0x1.7e2f336cf4e62p+0, 0x1.82589994cce13p+0, 0x1.868d99b4492edp+0,
    0x1.8ace5422aa0dbp+0, 0x1.8f1ae99157736p+0, 0x1.93737b0cdc5e5p+0, 0x1.97d829fde4e50p+0, 0x1.9c49182a3f090p+0,
    0x1.a0c667b5de565p+0, 0x1.a5503b23e255dp+0, 0x1.a9e6b5579fdbfp+0, 0x1.ae89f995ad3adp+0, 0x1.b33a2b84f15fbp+0,
    0x1.b7f76f2fb5e47p+0, 0x1.bcc1e904bc1d2p+0, 0x1.c199bdd85529cp+0, 0x1.c67f12e57d14bp+0, 0x1.cb720dcef9069p+0,
    0x1.d072d4a07897cp+0, 0x1.d5818dcfba487p+0, 0x1.da9e603db3285p+0, 0x1.dfc97337b9b5fp+0, 0x1.e502ee78b3ff6p+0,
    0x1.ea4afa2a490dap+0, 0x1.efa1bee615a27p+0, 0x1.f50765b6e4540p+0, 0x1.fa7c1819e90d8p+0};
__device__ const double kExp2TableDevice[64] = {
    0x1.0000000000000p+0, 0x1.02c9a3e778061p+0, 0x1.059b0d3158574p+0, 0x1.0874518759bc8p+0, 0x1.0b5586cf9890fp+0,
    0x1.0e3ec32d3d1a2p+0, 0x1.11301d0125b51p+0, 0x1.1429aaea92de0p+0, 0x1.172b83c7d517bp+0, 0x1.1a35beb6fcb75p+0,
    0x1.1d4873168b9aap+0, 0x1.2063b88628cd6p+0, 0x1.2387a6e756238p+0, 0x1.26b4565e27cddp+0, 0x1.29e9df51fdee1p+0,
    0x1.2d285a6e4030bp+0, 0x1.306fe0a31b715p+0, 0x1.33c08b26416ffp+0, 0x1.371a7373aa9cbp+0, 0x1.3a7db34e59ff7p+0,
    0x1.3dea64c123422p+0, 0x1.4160a21f72e2ap+0, 0x1.44e086061892dp+0, 0x1.486a2b5c13cd0p+0, 0x1.4bfdad5362a27p+0,
    0x1.4f9b2769d2ca7p+0, 0x1.5342b569d4f82p+0, 0x1.56f4736b527dap+0, 0x1.5ab07dd485429p+0, 0x1.5e76f15ad2148p+0,
    0x1.6247eb03a5585p+0, 0x1.6623882552225p+0, 0x1.6a09e667f3bcdp+0, 0x1.6dfb23c651a2fp+0, 0x1.71f75e8ec5f74p+0,
    0x1.75feb564267c9p+0, 0x1.7a11473eb0187p+0, 0x1.7e2f336cf4e62p+0, 0x1.82589994cce13p+0, 0x1.868d99b4492edp+0,
    0x1.8ace5422aa0dbp+0, 0x1.8f1ae99157736p+0, 0x1.93737b0cdc5e5p+0, 0x1.97d829fde4e50p+0, 0x1.9c49182a3f090p+0,
    0x1.a0c667b5de565p+0, 0x1.a5503b23e255dp+0, 0x1.a9e6b5579fdbfp+0, 0x1.ae89f995ad3adp+0, 0x1.b33a2b84f15fbp+0,
    0x1.b7f76f2fb5e47p+0, 0x1.bcc1e904bc1d2p+0, 0x1.c199bdd85529cp+0, 0x1.c67f12e57d14bp+0, 0x1.cb720dcef9069p+0,
    0x1.d072d4a07897cp+0, 0x1.d5818dcfba487p+0, 0x1.da9e603db3285p+0, 0x1.dfc97337b9b5fp+0, 0x1.e502ee78b3ff6p+0,
    0x1.ea4afa2a490dap+0, 0x1.efa1bee615a27p+0, 0x1.f50765b6e4540p+0, 0x1.fa7c1819e90d8p+0};
constexpr double kLn2Over64Hi = 0x1.62e42fefa3000p-7;
constexpr double kLn2Over64Lo = 0x1.3de6af278ece6p-48;
constexpr double k64OverLn2 = 0x1.71547652b82fep+6;

// IEEE double operations that the device compiler may not contract into FMAs (the host compiler does not).
#if defined(__CUDA_ARCH__)
#define SAMPLING_DMUL(a, b) __dmul_rn((a), (b))
#define SAMPLING_DADD(a, b) __dadd_rn((a), (b))
#else
#define SAMPLING_DMUL(a, b) ((a) * (b))
#define SAMPLING_DADD(a, b) ((a) + (b))
#endif

DSV4_HOST_DEVICE inline double pow2_int(int e) {  // 2^e for a normal exponent
  const uint64_t bits = static_cast<uint64_t>(e + 1023) << 52;
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(static_cast<long long>(bits));
#else
  double d;
  std::memcpy(&d, &bits, sizeof d);
  return d;
#endif
}

// round(exp(t - max) * 2^45): exp(d) = 2^q * 2^(j/64) * exp(r), d = (64 q + j) ln2/64 + r, |r| <= ln2/128, exp(r)
// by its degree-6 Taylor polynomial (truncation < 3e-20). The table comes from shared memory on the device.
DSV4_HOST_DEVICE inline u64 fixed_weight(float t, float max, const double* table) {
  const double d = SAMPLING_DADD(static_cast<double>(t), -static_cast<double>(max));
  if (!(d >= -33.0)) return 0;  // exp(-33) * 2^45 < 0.17; NaN too
  if (d >= 0.0) return u64{1} << kWeightShift;
  const double n = rint(SAMPLING_DMUL(d, k64OverLn2));  // in [-3048, 0]
  const int ni = static_cast<int>(n);
  double r = fma(-n, kLn2Over64Hi, d);
  r = fma(-n, kLn2Over64Lo, r);
  double p = fma(r, 1.0 / 720.0, 1.0 / 120.0);
  p = fma(r, p, 1.0 / 24.0);
  p = fma(r, p, 1.0 / 6.0);
  p = fma(r, p, 0.5);
  p = fma(r, p, 1.0);
  p = fma(r, p, 1.0);
  const int j = ni & 63, q = ni >> 6;  // ni = 64 q + j, 0 <= j < 64
  const double x = SAMPLING_DMUL(SAMPLING_DMUL(table[j], p), pow2_int(q + kWeightShift));
  return static_cast<u64>(SAMPLING_DADD(x, 0.5));
}

// ---- keys -----------------------------------------------------------------------------------------------------
// fp32 -> uint32 whose unsigned order is the float order, −0 folded onto +0 (the CPU compares them equal, then
// the lower index wins). t_key: 0 for −inf and NaN (never candidates). raw_key: −inf is a key (the CPU's top-N
// includes −inf tokens when the row has fewer finite ones), NaN is 0.
__device__ __forceinline__ u32 ordered_bits(float v) {
  if (v == 0.0f) v = 0.0f;
  const u32 bits = __float_as_uint(v);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}
__device__ __forceinline__ u32 t_key(float t) { return t > -INFINITY ? ordered_bits(t) : 0u; }
__device__ __forceinline__ u32 raw_key(float v) { return v == v ? ordered_bits(v) : 0u; }
__device__ __forceinline__ float key_float(u32 key) {
  return __uint_as_float((key & 0x80000000u) ? (key ^ 0x80000000u) : ~key);
}
// (key, index) in one 64-bit word whose descending order is descending logit, then ascending index.
__device__ __forceinline__ u64 composite(u32 key, int index) {
  return (static_cast<u64>(key) << 32) | (0xffffffffu - static_cast<u32>(index));
}
__device__ __forceinline__ int comp_index(u64 c) { return static_cast<int>(0xffffffffu - static_cast<u32>(c)); }
__device__ __forceinline__ u32 comp_key(u64 c) { return static_cast<u32>(c >> 32); }

// floor(u * w) for u in [0, 1) given with 53 bits: exact in 128 bits.
__device__ __forceinline__ u64 scale_by_u(double u, u64 w) {
  double us = u * 0x1p53;
  us = us < 0.0 ? 0.0 : (us > 0x1p53 - 1.0 ? 0x1p53 - 1.0 : us);
  const u64 m = static_cast<u64>(us);
  const u64 hi = __umul64hi(m, w), lo = m * w;
  return (hi << 11) | (lo >> 53);
}

__device__ __forceinline__ int rel_bin(float t, float max) {
  const float s = __fmul_rn(__fsub_rn(max, t), kBinsPerNat);
  return s < static_cast<float>(kBins - 1) ? static_cast<int>(s) : kBins - 1;
}

// ---- row classes ------------------------------------------------------------------------------------------------
__device__ __forceinline__ bool greedy_row(const SamplingRow& p) { return (p.flags & kSampleGreedy) != 0; }
__device__ __forceinline__ bool topk_row(const SamplingRow& p) {  // merged in pass 2
  return !greedy_row(p) && p.top_k > 0 && p.top_k <= kSamplingTopKFast;
}
__device__ __forceinline__ bool full_row(const SamplingRow& p) { return !greedy_row(p) && !topk_row(p); }
__device__ __forceinline__ bool penalised_row(const SamplingRow& p) {
  return (p.flags & (kSampleRepetition | kSampleFreqPres | kSampleMinTokens)) != 0;
}
// Rows pass 1's second kernel handles (the lean one takes the others: the argmax is all they need there).
__device__ __forceinline__ bool extras_row(const SamplingRow& p) {
  return penalised_row(p) || (p.flags & kSampleLogprobs) || topk_row(p);
}

// ---- workspace --------------------------------------------------------------------------------------------------
enum RowStage : int32_t { kStageDone = 0, kStageFinish = 1 };

struct RowState {
  float max = 0.0f;     // tempered maximum
  float floor = 0.0f;   // min_p floor (−inf when off)
  double lse = 0.0;     // raw log-sum-exp (logprob rows)
  u64 tau = 0;          // top_k > 512: composite of the k-th candidate (0: no cut)
  int32_t stage = kStageDone;
  int32_t pad = 0;
};

struct ChunkStat {
  float vmax;     // penalised maximum and its first index
  int32_t varg;
  float rmax;     // raw maximum (logprob rows)
  u32 topn_count;
  double rsum;    // sum of exp(raw - rmax)
  u64 wsum;       // pass 3, top_p = 1: the chunk's fixed-point weight
  u32 topk_count;
  u32 pad;
};

struct Workspace {
  RowState* rows;
  ChunkStat* stats;  // [rows, chunks]
  u64* topn;         // [rows, chunks, kSlotsPerChunk]: the chunks' raw top-N candidate lists
  u64* slots;        // [rows, chunks, kSlotsPerChunk]
  float* processed;  // [rows, vocab]
};

size_t align_up(size_t n) { return (n + 255) / 256 * 256; }

struct Layout {
  size_t rows, stats, topn, slots, processed, total;
};
Layout layout_of(int64_t rows, int64_t vocab) {
  const auto r = static_cast<size_t>(rows);
  const auto chunks = static_cast<size_t>((vocab + kChunk - 1) / kChunk);
  Layout l;
  l.rows = 0;
  l.stats = l.rows + align_up(r * sizeof(RowState));
  l.topn = l.stats + align_up(r * chunks * sizeof(ChunkStat));
  l.slots = l.topn + align_up(r * chunks * kSlotsPerChunk * sizeof(u64));
  l.processed = l.slots + align_up(r * chunks * kSlotsPerChunk * sizeof(u64));
  l.total = l.processed + align_up(r * static_cast<size_t>(vocab) * sizeof(float));
  return l;
}

// ---- block primitives -------------------------------------------------------------------------------------------
struct Scratch {
  float f[32];
  int32_t i[32];
  double d[32];
  u64 a[32];
  u64 b[32];
  u32 w[32];
};

__device__ __forceinline__ void take_better(float& v, int& i, float v2, int i2) {
  if (v2 > v || (v2 == v && i2 < i)) {
    v = v2;
    i = i2;
  }
}

// Block argmax (largest value, then lowest index), the result in every thread.
template <int kThreads>
__device__ void block_argmax(float& v, int& i, Scratch& s) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int o = 16; o > 0; o /= 2) take_better(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
  if (lane == 0) {
    s.f[warp] = v;
    s.i[warp] = i;
  }
  __syncthreads();
  if (warp == 0) {
    v = lane < kThreads / 32 ? s.f[lane] : -INFINITY;
    i = lane < kThreads / 32 ? s.i[lane] : INT_MAX;
    for (int o = 16; o > 0; o /= 2) take_better(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
    if (lane == 0) {
      s.f[0] = v;
      s.i[0] = i;
    }
  }
  __syncthreads();
  v = s.f[0];
  i = s.i[0];
  __syncthreads();
}

template <int kThreads>
__device__ float block_max(float v, Scratch& s) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (lane == 0) s.f[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kThreads / 32 ? s.f[lane] : -INFINITY;
    for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) s.f[0] = v;
  }
  __syncthreads();
  v = s.f[0];
  __syncthreads();
  return v;
}

template <int kThreads>
__device__ double block_sum(double v, Scratch& s) {  // a fixed tree: bitwise repeatable
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (lane == 0) s.d[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kThreads / 32 ? s.d[lane] : 0.0;
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) s.d[0] = v;
  }
  __syncthreads();
  v = s.d[0];
  __syncthreads();
  return v;
}

template <int kThreads>
__device__ u64 block_sum(u64 v, Scratch& s) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (lane == 0) s.a[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kThreads / 32 ? s.a[lane] : 0;
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) s.a[0] = v;
  }
  __syncthreads();
  v = s.a[0];
  __syncthreads();
  return v;
}

// Block min and max of 64-bit values (every thread gets both).
template <int kThreads>
__device__ void block_min_max(u64& lo, u64& hi, Scratch& s) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int o = 16; o > 0; o /= 2) {
    lo = min(lo, static_cast<u64>(__shfl_xor_sync(0xffffffffu, lo, o)));
    hi = max(hi, static_cast<u64>(__shfl_xor_sync(0xffffffffu, hi, o)));
  }
  if (lane == 0) {
    s.a[warp] = lo;
    s.b[warp] = hi;
  }
  __syncthreads();
  if (warp == 0) {
    lo = lane < kThreads / 32 ? s.a[lane] : ~u64{0};
    hi = lane < kThreads / 32 ? s.b[lane] : 0;
    for (int o = 16; o > 0; o /= 2) {
      lo = min(lo, static_cast<u64>(__shfl_xor_sync(0xffffffffu, lo, o)));
      hi = max(hi, static_cast<u64>(__shfl_xor_sync(0xffffffffu, hi, o)));
    }
    if (lane == 0) {
      s.a[0] = lo;
      s.b[0] = hi;
    }
  }
  __syncthreads();
  lo = s.a[0];
  hi = s.b[0];
  __syncthreads();
}

// Exclusive prefix of one value per thread in thread order; *total gets the sum.
template <int kThreads>
__device__ u64 block_exclusive_scan(u64 v, u64* total, Scratch& s) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  u64 x = v;
  for (int o = 1; o < 32; o *= 2) {
    const u64 y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) s.a[warp] = x;
  __syncthreads();
  if (warp == 0) {
    u64 w = lane < kThreads / 32 ? s.a[lane] : 0;
    for (int o = 1; o < 32; o *= 2) {
      const u64 y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += y;
    }
    s.b[lane] = w;
  }
  __syncthreads();
  const u64 before = (warp > 0 ? s.b[warp - 1] : 0) + x - v;
  if (total) *total = s.b[kThreads / 32 - 1];
  __syncthreads();
  return before;
}

// In-place inclusive prefix sums of a[0, n), n <= 4 * kThreads.
template <int kThreads>
__device__ void block_inclusive_scan(u64* a, int n, Scratch& s) {
  const int per = (n + kThreads - 1) / kThreads;
  const int first = threadIdx.x * per;
  u64 local = 0;
  for (int k = 0; k < per; ++k)
    if (first + k < n) local += a[first + k];
  u64 run = block_exclusive_scan<kThreads>(local, nullptr, s);
  for (int k = 0; k < per; ++k)
    if (first + k < n) {
      run += a[first + k];
      a[first + k] = run;
    }
  __syncthreads();
}

// Bitonic sort of a[0, n2), n2 a power of two, descending.
template <int kThreads>
__device__ void bitonic_sort_desc(u64* a, int n2) {
  for (int size = 2; size <= n2; size *= 2)
    for (int stride = size / 2; stride > 0; stride /= 2) {
      for (int i = threadIdx.x; i < n2; i += kThreads) {
        const int j = i ^ stride;
        if (j > i) {
          const bool descending = (i & size) == 0;
          const u64 x = a[i], y = a[j];
          if (descending ? x < y : x > y) {
            a[i] = y;
            a[j] = x;
          }
        }
      }
      __syncthreads();
    }
}

__device__ __forceinline__ int pow2_at_least(int n) {
  int p = 32;
  while (p < n) p *= 2;
  return p;
}

// The position of the first of a[0, n) (non-decreasing) above x, or -1; every thread gets it.
template <int kThreads>
__device__ int first_above(const u64* a, int n, u64 x, Scratch& s) {
  if (threadIdx.x == 0) s.i[0] = -1;
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += kThreads)
    if (a[i] > x && (i == 0 || a[i - 1] <= x)) s.i[0] = i;
  __syncthreads();
  const int at = s.i[0];
  __syncthreads();
  return at;
}

// ---- radix select of the k best (key, index) pairs among kPer per thread (ops/cuda/top_k.cu's algorithm) --------
struct Threshold {
  u32 key;
  u32 inverted_index;
};
__device__ __forceinline__ u32 inverted(int index) { return (1u << kIndexBits) - 1u - static_cast<u32>(index); }
__device__ __forceinline__ bool chosen_by(const Threshold& t, u32 key, int index) {
  return key != 0 && (key > t.key || (key == t.key && inverted(index) >= t.inverted_index));
}

struct SelectShared {
  u32 histogram[256];
  u32 warp_count[32], warp_max[32], warp_min[32];
  u32 found_bin, found_above, found_count, total;
  u32 counter;
  u32 bisect[2][32];
};

template <int kThreads, typename IndexOf>
__device__ Threshold select_threshold(const u32 (&key)[kPer], IndexOf index_of, int k, SelectShared& sh) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  u32 count = 0, kmax = 0, kmin = 0xffffffffu;
#pragma unroll
  for (int i = 0; i < kPer; ++i)
    if (key[i] != 0) {
      ++count;
      kmax = max(kmax, key[i]);
      kmin = min(kmin, key[i]);
    }
  for (int o = 16; o > 0; o /= 2) {
    count += __shfl_xor_sync(0xffffffffu, count, o);
    kmax = max(kmax, __shfl_xor_sync(0xffffffffu, kmax, o));
    kmin = min(kmin, __shfl_xor_sync(0xffffffffu, kmin, o));
  }
  if (lane == 0) {
    sh.warp_count[warp] = count;
    sh.warp_max[warp] = kmax;
    sh.warp_min[warp] = kmin;
  }
  for (int i = threadIdx.x; i < 256; i += kThreads) sh.histogram[i] = 0;
  __syncthreads();
  if (warp == 0) {
    const bool real = lane < kThreads / 32;
    count = real ? sh.warp_count[lane] : 0;
    kmax = real ? sh.warp_max[lane] : 0;
    kmin = real ? sh.warp_min[lane] : 0xffffffffu;
    for (int o = 16; o > 0; o /= 2) {
      count += __shfl_xor_sync(0xffffffffu, count, o);
      kmax = max(kmax, __shfl_xor_sync(0xffffffffu, kmax, o));
      kmin = min(kmin, __shfl_xor_sync(0xffffffffu, kmin, o));
    }
    if (lane == 0) {
      sh.total = count;
      sh.found_bin = kmax;
      sh.found_above = kmin;
    }
  }
  __syncthreads();
  const u32 total = sh.total;
  kmax = sh.found_bin;
  kmin = sh.found_above;
  __syncthreads();
  if (total <= static_cast<u32>(k)) return {1u, 0u};  // every candidate
  int resolved = __clz(kmax ^ kmin);
  const u32 key_prefix_mask = resolved == 32 ? 0xffffffffu : ~(0xffffffffu >> resolved);
  u32 key_prefix = kmax & key_prefix_mask;
  u32 index_prefix = 0;
  u32 need = static_cast<u32>(k);
  while (resolved < kCompositeBits) {
    const bool on_key = resolved < 32;
    const int bits = on_key ? min(8, 32 - resolved) : min(8, kCompositeBits - resolved);
    const u32 mask = (1u << bits) - 1u;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      u32 digit = 0;
      bool match = false;
      if (key[i] != 0) {
        if (on_key) {
          match = resolved == 0 || ((key[i] ^ key_prefix) >> (32 - resolved)) == 0;
          digit = (key[i] >> (32 - resolved - bits)) & mask;
        } else {
          const int done = resolved - 32;
          const u32 inv = inverted(index_of(i));
          match = key[i] == key_prefix && (done == 0 || (inv >> (kIndexBits - done)) == index_prefix);
          digit = (inv >> (kIndexBits - done - bits)) & mask;
        }
      }
      if (__ballot_sync(0xffffffffu, match) == 0) continue;
      const u32 peers = __match_any_sync(0xffffffffu, match ? digit : 0xffffffffu);
      if (match && lane == __ffs(peers) - 1) atomicAdd(&sh.histogram[digit], static_cast<u32>(__popc(peers)));
    }
    __syncthreads();
    if (warp == 0) {
      u32 mine[8], sum = 0;
#pragma unroll
      for (int b = 0; b < 8; ++b) {
        mine[b] = sh.histogram[8 * lane + b];
        sum += mine[b];
        sh.histogram[8 * lane + b] = 0;
      }
      u32 above = sum;
      for (int o = 1; o < 32; o *= 2) {
        const u32 v = __shfl_down_sync(0xffffffffu, above, o);
        if (lane + o < 32) above += v;
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
    const u32 bin = sh.found_bin, above = sh.found_above, in_bin = sh.found_count;
    __syncthreads();
    need -= above;
    if (on_key)
      key_prefix |= bin << (32 - resolved - bits);
    else
      index_prefix = (index_prefix << bits) | bin;
    resolved += bits;
    if (in_bin == need) break;
  }
  if (resolved <= 32) return {key_prefix, 0u};
  return {key_prefix, index_prefix << (kCompositeBits - resolved)};
}

// Appends the chosen (key, index) pairs as composites at out[atomic slot]; returns the number chosen (all threads).
// `extra` filters further (min_p's floor in the merge).
template <int kThreads, typename IndexOf>
__device__ u32 compact_chosen(const u32 (&key)[kPer], IndexOf index_of, const Threshold& threshold, u32 key_floor,
                              u64* out, SelectShared& sh) {
  const int lane = threadIdx.x % 32;
  if (threadIdx.x == 0) sh.counter = 0;
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int index = index_of(i);
    const bool take = chosen_by(threshold, key[i], index) && key[i] >= key_floor;
    const u32 ballot = __ballot_sync(0xffffffffu, take);
    if (ballot == 0) continue;
    u32 base = 0;
    if (lane == __ffs(ballot) - 1) base = atomicAdd(&sh.counter, static_cast<u32>(__popc(ballot)));
    base = __shfl_sync(0xffffffffu, base, __ffs(ballot) - 1);
    if (take) out[base + __popc(ballot & ((1u << lane) - 1u))] = composite(key[i], index);
  }
  __syncthreads();
  const u32 n = sh.counter;
  __syncthreads();
  return n;
}

// A superset of the k best keys (0 = none) among kPer per thread: every key at or above a threshold whose count lies
// in [k, cap] (all of them when there are at most cap), appended to out as composites; the count, or -1 when no such
// threshold exists (ties or a cluster straddle the window: the caller takes the exact radix select). The threshold
// is bisected in value space (a few steps on smooth rows), in key space when the values do not split.
template <int kThreads, typename IndexOf>
__device__ int chunk_candidates(const u32 (&key)[kPer], IndexOf index_of, int k, int cap, u64* out, SelectShared& sh) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  u32 count = 0, kmax = 0, kmin = 0xffffffffu;
#pragma unroll
  for (int i = 0; i < kPer; ++i)
    if (key[i] != 0) {
      ++count;
      kmax = max(kmax, key[i]);
      kmin = min(kmin, key[i]);
    }
  count = __reduce_add_sync(0xffffffffu, count);
  kmax = __reduce_max_sync(0xffffffffu, kmax);
  kmin = __reduce_min_sync(0xffffffffu, kmin);
  if (lane == 0) {
    sh.warp_count[warp] = count;
    sh.warp_max[warp] = kmax;
    sh.warp_min[warp] = kmin;
  }
  __syncthreads();
  u32 total = 0;
  kmax = 0;
  kmin = 0xffffffffu;
  for (int w = 0; w < kThreads / 32; ++w) {
    total += sh.warp_count[w];
    kmax = max(kmax, sh.warp_max[w]);
    kmin = min(kmin, sh.warp_min[w]);
  }
  __syncthreads();
  u32 theta = 1;  // every candidate
  if (total > static_cast<u32>(cap)) {
    u32 lo = kmin, hi = kmax + 1;  // count(>= lo) > cap, count(>= hi) = 0 < k
    bool found = false;
    int buf = 0;
    for (int step = 0; step < 64 && !found; ++step) {
      const float flo = key_float(lo), fhi = key_float(hi);
      const float fm = 0.5f * flo + 0.5f * fhi;
      u32 mid = fm == fm ? ordered_bits(fm) : 0u;
      if (mid <= lo || mid >= hi) mid = lo + (hi - lo) / 2;
      if (mid <= lo) break;  // hi = lo + 1: the count jumps over the window
      u32 c = 0;
#pragma unroll
      for (int i = 0; i < kPer; ++i) c += key[i] >= mid;
      c = __reduce_add_sync(0xffffffffu, c);
      if (lane == 0) sh.bisect[buf][warp] = c;
      __syncthreads();
      c = 0;
      for (int w = 0; w < kThreads / 32; ++w) c += sh.bisect[buf][w];
      buf ^= 1;  // the other buffer next: nobody still reads it after this step's barrier
      if (c > static_cast<u32>(cap))
        lo = mid;
      else if (c < static_cast<u32>(k))
        hi = mid;
      else {
        theta = mid;
        found = true;
      }
    }
    if (!found) return -1;
  }
  return static_cast<int>(compact_chosen<kThreads>(key, index_of, Threshold{theta, 0u}, 0u, out, sh));
}

// The chunk's candidate list for its k best keys: the bisection's superset, else the exact top-k.
template <int kThreads, typename IndexOf>
__device__ u32 chunk_top(const u32 (&key)[kPer], IndexOf index_of, int k, int cap, u64* out, SelectShared& sh) {
  const int n = chunk_candidates<kThreads>(key, index_of, k, cap, out, sh);
  if (n >= 0) return static_cast<u32>(n);
  const Threshold th = select_threshold<kThreads>(key, index_of, k, sh);
  return compact_chosen<kThreads>(key, index_of, th, 0u, out, sh);
}

// ---- pass 1: chunks -----------------------------------------------------------------------------------------------
struct ChunkIndex {
  int first;
  __device__ int operator()(int i) const { return first + i * kChunkThreads; }
};

struct PenaltyShared {
  u32 output_count[kChunk];
  u32 seen[kChunk / 32];
  u32 stop[kChunk / 32];
};

// The lean kernel of pass 1: rows that only need the argmax here (greedy or sampled, no penalties, logprobs or
// top_k <= 128). 1024 threads x 8 logits in flight, few registers: two CTAs per SM.
constexpr int kLeanThreads = 1024;
constexpr int kLeanPer = kChunk / kLeanThreads;
__global__ void __launch_bounds__(kLeanThreads, 2) chunk_argmax_kernel(const SamplingArgs a, const Workspace ws, int chunks) {
  wait_for_prior_grid();
  allow_dependents();
  __shared__ Scratch scratch;
  const int row = blockIdx.y, chunk = blockIdx.x;
  const uint32_t flags = a.params[row].flags;
  const int32_t top_k = a.params[row].top_k;
  const bool topk = !(flags & kSampleGreedy) && top_k > 0 && top_k <= kSamplingTopKFast;
  if (topk || (flags & (kSampleRepetition | kSampleFreqPres | kSampleMinTokens | kSampleLogprobs))) return;
  const int vocab = static_cast<int>(a.vocab);
  const int first = chunk * kChunk + static_cast<int>(threadIdx.x);
  const float* logits = a.logits + static_cast<int64_t>(row) * a.logits_stride + first;
  const int left = vocab - first;  // this thread's i-th logit exists when i * kLeanThreads < left
  float val[kLeanPer];
#pragma unroll
  for (int i = 0; i < kLeanPer; ++i) val[i] = i * kLeanThreads < left ? __ldg(logits + i * kLeanThreads) : -INFINITY;
  float vmax = -INFINITY;
  int varg = INT_MAX;
#pragma unroll
  for (int i = 0; i < kLeanPer; ++i)
    if (i * kLeanThreads < left) take_better(vmax, varg, val[i], first + i * kLeanThreads);
  block_argmax<kLeanThreads>(vmax, varg, scratch);
  if (threadIdx.x == 0) {
    ChunkStat* stat = ws.stats + static_cast<int64_t>(row) * chunks + chunk;
    stat->vmax = vmax;
    stat->varg = varg;
    stat->topk_count = 0;
  }
}

// The full kernel of pass 1 for every other row.
__global__ void __launch_bounds__(kChunkThreads, 2) chunk_pass_kernel(const SamplingArgs a, const Workspace ws, int chunks) {
  wait_for_prior_grid();
  allow_dependents();
  constexpr bool kExtras = true;
  __shared__ SelectShared sel;
  __shared__ Scratch scratch;
  const int row = blockIdx.y, chunk = blockIdx.x;
  const SamplingRow p = a.params[row];
  if (!extras_row(p)) return;
  const int vocab = static_cast<int>(a.vocab);
  const int base = chunk * kChunk;
  const float* logits = a.logits + static_cast<int64_t>(row) * a.logits_stride;
  const ChunkIndex index_of{base + static_cast<int>(threadIdx.x)};
  ChunkStat* stat = ws.stats + static_cast<int64_t>(row) * chunks + chunk;
  float val[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int idx = index_of(i);
    val[i] = idx < vocab ? __ldg(logits + idx) : -INFINITY;
  }
  u32 key[kPer];
  const int cap = list_cap(chunks);
  if (kExtras && (p.flags & kSampleLogprobs)) {  // the raw log-sum-exp pieces and top-N
    float m = -INFINITY;
#pragma unroll
    for (int i = 0; i < kPer; ++i) m = fmaxf(m, val[i]);
    m = block_max<kChunkThreads>(m, scratch);
    double sum = 0.0;
    if (m > -INFINITY) {
#pragma unroll
      for (int i = 0; i < kPer; ++i) sum += static_cast<double>(expf(val[i] - m));  // −inf and padding: 0
    }
    sum = block_sum<kChunkThreads>(sum, scratch);
    u32 count = 0;
    if (p.num_logprobs > 0) {
#pragma unroll
      for (int i = 0; i < kPer; ++i) key[i] = index_of(i) < vocab ? raw_key(val[i]) : 0u;
      count = chunk_top<kChunkThreads>(key, index_of, p.num_logprobs, cap,
                                       ws.topn + (static_cast<int64_t>(row) * chunks + chunk) * kSlotsPerChunk, sel);
    }
    if (threadIdx.x == 0) {
      stat->rmax = m;
      stat->rsum = sum;
      stat->topn_count = count;
    }
  }
  if (kExtras && penalised_row(p)) {  // steps 1-2, exactly as engine/sampler.cpp's apply_penalties
    __shared__ PenaltyShared pen;
    for (int i = threadIdx.x; i < kChunk; i += kChunkThreads) pen.output_count[i] = 0;
    for (int i = threadIdx.x; i < kChunk / 32; i += kChunkThreads) pen.seen[i] = pen.stop[i] = 0;
    __syncthreads();
    const bool repetition = p.flags & kSampleRepetition, freq_pres = p.flags & kSampleFreqPres;
    if (repetition || freq_pres)
      for (int j = p.history_begin + threadIdx.x; j < p.history_end; j += kChunkThreads) {
        const int t = a.history[j];
        if (t < base || t >= base + kChunk || t >= vocab) continue;
        const int off = t - base;
        if (repetition) atomicOr(&pen.seen[off / 32], 1u << (off % 32));
        if (freq_pres && j >= p.history_prompt_end) atomicAdd(&pen.output_count[off], 1u);
      }
    if (p.flags & kSampleMinTokens)
      for (int j = p.stop_begin + threadIdx.x; j < p.stop_end; j += kChunkThreads) {
        const int t = a.stop_ids[j];
        if (t < base || t >= base + kChunk || t >= vocab) continue;
        atomicOr(&pen.stop[(t - base) / 32], 1u << ((t - base) % 32));
      }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int off = i * kChunkThreads + static_cast<int>(threadIdx.x);
      float v = val[i];
      if ((pen.stop[off / 32] >> (off % 32)) & 1u) {
        v = -INFINITY;
      } else {
        if ((pen.seen[off / 32] >> (off % 32)) & 1u)
          v = v > 0.0f ? __fdiv_rn(v, p.repetition_penalty) : __fmul_rn(v, p.repetition_penalty);
        const u32 count = pen.output_count[off];
        if (count > 0)
          v = __fsub_rn(v, __double2float_rn(__dadd_rn(__dmul_rn(p.frequency_penalty, static_cast<double>(count)),
                                                        p.presence_penalty)));
      }
      if (index_of(i) < vocab) val[i] = v;
    }
  }
  float vmax = -INFINITY;
  int varg = INT_MAX;
#pragma unroll
  for (int i = 0; i < kPer; ++i)
    if (index_of(i) < vocab) take_better(vmax, varg, val[i], index_of(i));
  block_argmax<kChunkThreads>(vmax, varg, scratch);
  u32 topk_count = 0;
  if (kExtras && topk_row(p)) {  // a superset of this chunk's top-k of the tempered logits
#pragma unroll
    for (int i = 0; i < kPer; ++i) key[i] = index_of(i) < vocab ? t_key(__fmul_rn(val[i], p.inv_temperature)) : 0u;
    topk_count = chunk_top<kChunkThreads>(key, index_of, p.top_k, cap,
                                          ws.slots + (static_cast<int64_t>(row) * chunks + chunk) * kSlotsPerChunk, sel);
  } else if (kExtras && full_row(p) && penalised_row(p)) {  // later passes read the processed row
    float* out = ws.processed + static_cast<int64_t>(row) * vocab;
#pragma unroll
    for (int i = 0; i < kPer; ++i)
      if (index_of(i) < vocab) out[index_of(i)] = __fmul_rn(val[i], p.inv_temperature);
  }
  if (threadIdx.x == 0) {
    stat->vmax = vmax;
    stat->varg = varg;
    stat->topk_count = topk_count;
  }
}

// ---- row CTAs ------------------------------------------------------------------------------------------------------
struct RowShared {  // dynamic shared memory of the row kernel
  u64 cand[kGatherCap];
  u64 cum[kGatherCap];
  u64 radix_w[kRadixBins];
  u32 radix_c[kRadixBins];
  u64 bin_w[kBins];
  u64 bin_pre[kBins + 1];
  double table[64];
  u32 list_offset[kMaxChunks + 1];
  u32 counter;
  u32 pad;
};
constexpr size_t kRowSmem = sizeof(RowShared);

struct RowCtx {
  const float* raw;
  const float* processed;  // null: raw · inv_t
  float inv_t;
  int vocab;
  float max, floor;
  u64 tau;
  __device__ float t(int i) const { return processed ? processed[i] : __fmul_rn(__ldg(raw + i), inv_t); }
  __device__ float t_or_nan(int i) const { return i < vocab ? t(i) : NAN; }  // NaN: never a member
  // A candidate of steps 4-5: finite, at or above min_p's floor, within top_k's cut.
  __device__ bool member(float t, int i, u64& comp) const {
    const u32 key = t_key(t);
    if (key == 0 || !(t >= floor)) return false;
    comp = composite(key, i);
    return comp >= tau;
  }
};

// Which relative bins a gather takes (all when !use_bins).
struct BinSet {
  bool use_bins;
  int lo, hi, extra;
  __device__ bool has(int b) const { return !use_bins || (b >= lo && b <= hi) || b == extra; }
};

// Gathers the members in `bins` whose composite starts with `prefix` (its top `prefix_bits` bits) into sh.cand, at
// most kGatherCap of them; returns how many there are (possibly more), and their min / max composite if asked.
// The bin is tested first: it is two float operations and rejects most of the row.
__device__ int gather(const RowCtx& c, const BinSet& bins, u64 prefix, int prefix_bits, RowShared& sh, Scratch& s,
                      u64* lo_out, u64* hi_out) {
  const int lane = threadIdx.x % 32;
  if (threadIdx.x == 0) sh.counter = 0;
  __syncthreads();
  u64 lo = ~u64{0}, hi = 0;
  for (int start = 0; start < c.vocab; start += kRowThreads * kBatch) {
    float t[kBatch];  // the loads of a batch are in flight together (one at a time is latency-bound)
#pragma unroll
    for (int k = 0; k < kBatch; ++k) t[k] = c.t_or_nan(start + k * kRowThreads + static_cast<int>(threadIdx.x));
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int i = start + k * kRowThreads + static_cast<int>(threadIdx.x);
      u64 comp = 0;
      const bool take = (!bins.use_bins || bins.has(rel_bin(t[k], c.max))) && c.member(t[k], i, comp) &&
                        (prefix_bits == 0 || (comp >> (64 - prefix_bits)) == (prefix >> (64 - prefix_bits)));
      if (lo_out && take) {
        lo = min(lo, comp);
        hi = max(hi, comp);
      }
      const u32 ballot = __ballot_sync(0xffffffffu, take);
      if (ballot == 0) continue;
      u32 slot = 0;
      if (lane == __ffs(ballot) - 1) slot = atomicAdd(&sh.counter, static_cast<u32>(__popc(ballot)));
      slot = __shfl_sync(0xffffffffu, slot, __ffs(ballot) - 1) + __popc(ballot & ((1u << lane) - 1u));
      if (take && slot < kGatherCap) sh.cand[slot] = comp;
    }
  }
  __syncthreads();
  const int n = static_cast<int>(sh.counter);
  __syncthreads();
  if (lo_out) {
    block_min_max<kRowThreads>(lo, hi, s);
    *lo_out = lo;
    *hi_out = hi;
  }
  return n;
}

// Sorts sh.cand[0, n) descending and puts the inclusive sums of their weights (fixed point, or 1 each when
// !weighted) in sh.cum.
__device__ void sort_and_sum(int n, bool weighted, float max, RowShared& sh, Scratch& s) {
  const int n2 = pow2_at_least(n);
  for (int i = n + static_cast<int>(threadIdx.x); i < n2; i += kRowThreads) sh.cand[i] = 0;
  __syncthreads();
  bitonic_sort_desc<kRowThreads>(sh.cand, n2);
  for (int i = threadIdx.x; i < n; i += kRowThreads)
    sh.cum[i] = weighted ? fixed_weight(key_float(comp_key(sh.cand[i])), max, sh.table) : 1;
  __syncthreads();
  block_inclusive_scan<kRowThreads>(sh.cum, n, s);
}

struct Selected {
  bool found;
  u64 comp;
  u64 cum;  // inclusive cumulative weight of the members down to it (descending order)
};

// The first member of `bins` in descending (logit, then lower index) order whose inclusive cumulative weight
// exceeds `target` — weights fixed point, or 1 each (then: the target+1-th member). Gathers when the members fit,
// else narrows them with an exact radix select over their composite, 11 bits a pass, first.
__device__ Selected select_desc(const RowCtx& c, const BinSet& bins, bool weighted, u64 target, RowShared& sh,
                                Scratch& s) {
  u64 lo = 0, hi = 0;
  int n = gather(c, bins, 0, 0, sh, s, &lo, &hi);
  u64 prefix = 0, above = 0;
  int prefix_bits = 0;
  if (n > kGatherCap) {
    prefix_bits = lo == hi ? 64 : __clzll(static_cast<long long>(lo ^ hi));
    prefix = prefix_bits == 0 ? 0 : (hi & (~u64{0} << (64 - prefix_bits)));
    while (n > kGatherCap && prefix_bits < 64) {
      const int bits = min(kRadixBits, 64 - prefix_bits);
      const int shift = 64 - prefix_bits - bits;
      const int nb = 1 << bits;
      for (int b = threadIdx.x; b < nb; b += kRowThreads) {
        sh.radix_w[b] = 0;
        sh.radix_c[b] = 0;
      }
      __syncthreads();
      for (int start = 0; start < c.vocab; start += kRowThreads * kBatch) {
        float t[kBatch];
#pragma unroll
        for (int k = 0; k < kBatch; ++k) t[k] = c.t_or_nan(start + k * kRowThreads + static_cast<int>(threadIdx.x));
#pragma unroll
        for (int k = 0; k < kBatch; ++k) {
          const int i = start + k * kRowThreads + static_cast<int>(threadIdx.x);
          u64 comp;
          if ((bins.use_bins && !bins.has(rel_bin(t[k], c.max))) || !c.member(t[k], i, comp)) continue;
          if (prefix_bits > 0 && (comp >> (64 - prefix_bits)) != (prefix >> (64 - prefix_bits))) continue;
          const int d = static_cast<int>((comp >> shift) & static_cast<u64>(nb - 1));
          atomicAdd(&sh.radix_c[d], 1u);
          atomicAdd(&sh.radix_w[d], weighted ? fixed_weight(t[k], c.max, sh.table) : u64{1});
        }
      }
      __syncthreads();
      // Descending digit order: exclusive sums from the top digit down; the digit the target falls in.
      const int per = (nb + kRowThreads - 1) / kRowThreads;  // consecutive descending positions per thread
      u64 local = 0;
      for (int k = 0; k < per; ++k) {
        const int pos = threadIdx.x * per + k;
        if (pos < nb) local += sh.radix_w[nb - 1 - pos];
      }
      u64 total = 0;
      u64 run = block_exclusive_scan<kRowThreads>(local, &total, s);
      if (threadIdx.x == 0) s.i[1] = -1;
      __syncthreads();
      for (int k = 0; k < per; ++k) {
        const int pos = threadIdx.x * per + k;
        if (pos >= nb) break;
        const int d = nb - 1 - pos;
        const u64 w = sh.radix_w[d];
        if (w > 0 && run <= target && target < run + w) {
          s.i[1] = d;
          s.a[1] = run;
        }
        run += w;
      }
      __syncthreads();
      const int d = s.i[1];
      const u64 before = s.a[1];
      __syncthreads();
      if (d < 0) return {false, 0, 0};  // the target is past every member
      target -= before;
      above += before;
      prefix |= static_cast<u64>(d) << shift;
      prefix_bits += bits;
      n = static_cast<int>(sh.radix_c[d]);
      __syncthreads();
      if (n <= kGatherCap) n = gather(c, bins, prefix, prefix_bits, sh, s, nullptr, nullptr);
    }
  }
  n = min(n, kGatherCap);
  sort_and_sum(n, weighted, c.max, sh, s);
  const int at = first_above<kRowThreads>(sh.cum, n, target, s);
  if (at < 0) return {false, 0, 0};
  return {true, sh.cand[at], above + sh.cum[at]};
}

__device__ void load_table(RowShared& sh) {
  for (int i = threadIdx.x; i < 64; i += kRowThreads) sh.table[i] = kExp2TableDevice[i];
  __syncthreads();
}

// Copies the chunks' candidate lists (list + c * kSlotsPerChunk, count(c) entries) into sh.cand and sorts them
// descending; returns how many (<= kListTotal).
template <typename CountOf>
__device__ int merge_lists(const u64* list, int chunks, CountOf count_of, RowShared& sh) {
  if (threadIdx.x == 0) {
    u32 total = 0;
    for (int c = 0; c < chunks; ++c) {
      sh.list_offset[c] = total;
      total += count_of(c);
    }
    sh.list_offset[chunks] = total;
  }
  __syncthreads();
  const int n = static_cast<int>(sh.list_offset[chunks]);
  for (int c = 0; c < chunks; ++c) {
    const int first = static_cast<int>(sh.list_offset[c]), m = static_cast<int>(sh.list_offset[c + 1]) - first;
    for (int w = threadIdx.x; w < m; w += kRowThreads) sh.cand[first + w] = list[static_cast<int64_t>(c) * kSlotsPerChunk + w];
  }
  const int n2 = pow2_at_least(n);
  for (int i = n + static_cast<int>(threadIdx.x); i < n2; i += kRowThreads) sh.cand[i] = 0;
  __syncthreads();
  bitonic_sort_desc<kRowThreads>(sh.cand, n2);
  return n;
}

__device__ void write_token(const SamplingArgs& a, const SamplingRow& p, int row, int token, double lse) {
  SamplingOutput& o = a.out[row];
  o.token = token;
  if ((p.flags & kSampleLogprobs) && token >= 0)
    o.logprob = static_cast<float>(static_cast<double>(a.logits[static_cast<int64_t>(row) * a.logits_stride + token]) - lse);
}

// Pass 2: combines the chunks; finishes greedy and top_k <= 512 rows, logprobs' top-N, and prepares the rest.
__global__ void __launch_bounds__(kRowThreads, 1) row_decide_kernel(const SamplingArgs a, const Workspace ws, int chunks) {
  wait_for_prior_grid();
  allow_dependents();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  RowShared& sh = *reinterpret_cast<RowShared*>(smem_raw);
  __shared__ Scratch s;
  const int row = blockIdx.x;
  const SamplingRow p = a.params[row];
  const ChunkStat* stats = ws.stats + static_cast<int64_t>(row) * chunks;
  const int vocab = static_cast<int>(a.vocab);
  load_table(sh);
  float vmax = -INFINITY;
  int varg = INT_MAX;
  if (threadIdx.x < chunks) {
    vmax = stats[threadIdx.x].vmax;
    varg = stats[threadIdx.x].varg;
  }
  block_argmax<kRowThreads>(vmax, varg, s);
  SamplingOutput& out = a.out[row];
  double lse = 0.0;
  const bool logprobs = p.flags & kSampleLogprobs;
  if (logprobs) {
    if (threadIdx.x == 0) {  // sequential over <= 32 chunks: repeatable
      float m = -INFINITY;
      for (int c = 0; c < chunks; ++c) m = fmaxf(m, stats[c].rmax);
      double sum = 0.0;
      for (int c = 0; c < chunks; ++c)
        if (stats[c].rmax > -INFINITY) sum += stats[c].rsum * exp(static_cast<double>(stats[c].rmax) - static_cast<double>(m));
      s.d[0] = static_cast<double>(m) + log(sum);
    }
    __syncthreads();
    lse = s.d[0];
    __syncthreads();
    const int n_top = min(p.num_logprobs, vocab);
    if (n_top > 0) {  // merge the chunks' top-N candidates
      merge_lists(ws.topn + static_cast<int64_t>(row) * chunks * kSlotsPerChunk, chunks,
                  [&](int c) { return stats[c].topn_count; }, sh);
      if (threadIdx.x < n_top) {
        const u64 v = sh.cand[threadIdx.x];
        out.top_ids[threadIdx.x] = comp_index(v);
        out.top_logprobs[threadIdx.x] = static_cast<float>(static_cast<double>(key_float(comp_key(v))) - lse);
      }
      __syncthreads();
    }
    if (threadIdx.x == 0) {
      out.num_top = n_top;
      out.rank = 1;
    }
  } else if (threadIdx.x == 0) {
    out.num_top = 0;
    out.rank = 0;
    out.logprob = 0.0f;
  }
  RowState& st = ws.rows[row];
  if (greedy_row(p)) {  // step 3
    if (threadIdx.x == 0) {
      write_token(a, p, row, varg, lse);
      st.stage = kStageDone;
    }
    return;
  }
  const float max = __fmul_rn(vmax, p.inv_temperature);  // = the max of the tempered row (rounding is monotone)
  if (!(max > -INFINITY)) {  // every token suppressed: the CPU returns argmax of an all −inf row, token 0
    if (threadIdx.x == 0) {
      write_token(a, p, row, 0, lse);
      st.stage = kStageDone;
    }
    return;
  }
  const float floor = (p.flags & kSampleMinP) ? __fadd_rn(max, p.log_min_p) : -INFINITY;  // step 4
  const u32 key_floor = floor > -INFINITY ? t_key(floor) : 1u;
  if (topk_row(p)) {  // steps 5-7 on the merged top-k
    const int total_listed = merge_lists(ws.slots + static_cast<int64_t>(row) * chunks * kSlotsPerChunk, chunks,
                                         [&](int c) { return stats[c].topk_count; }, sh);
    // The first k of the sorted lists are the row's top-k (each list holds its chunk's); min_p keeps a prefix.
    const int k = min(p.top_k, total_listed);
    if (threadIdx.x == 0) s.i[5] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < k; i += kRowThreads)
      if (comp_key(sh.cand[i]) >= key_floor && (i + 1 == k || comp_key(sh.cand[i + 1]) < key_floor)) s.i[5] = i + 1;
    __syncthreads();
    const int n = s.i[5];
    __syncthreads();
    int token = 0;
    if (p.top_p < 1.0) {  // descending order, top_p then the draw
      for (int i = threadIdx.x; i < n; i += kRowThreads) sh.cum[i] = fixed_weight(key_float(comp_key(sh.cand[i])), max, sh.table);
      __syncthreads();
      block_inclusive_scan<kRowThreads>(sh.cum, n, s);
      const u64 total = sh.cum[n - 1];
      double target = ceil(p.top_p * static_cast<double>(total));
      u64 tp = target < 1.0 ? 1 : static_cast<u64>(target);
      if (tp > total) tp = total;
      const int j = first_above<kRowThreads>(sh.cum, n, tp - 1, s);
      const int at = first_above<kRowThreads>(sh.cum, n, scale_by_u(p.u, sh.cum[j]), s);
      token = comp_index(sh.cand[at]);
    } else {  // ascending index order
      for (int i = threadIdx.x; i < n; i += kRowThreads) {
        const u64 v = sh.cand[i];
        sh.cand[i] = ~((static_cast<u64>(comp_index(v)) << 32) | comp_key(v));  // descending of ~ = ascending index
      }
      __syncthreads();
      const int n2 = pow2_at_least(n);
      for (int i = n + static_cast<int>(threadIdx.x); i < n2; i += kRowThreads) sh.cand[i] = 0;
      __syncthreads();
      bitonic_sort_desc<kRowThreads>(sh.cand, n2);
      for (int i = threadIdx.x; i < n; i += kRowThreads)
        sh.cum[i] = fixed_weight(key_float(static_cast<u32>(~sh.cand[i])), max, sh.table);
      __syncthreads();
      block_inclusive_scan<kRowThreads>(sh.cum, n, s);
      const int at = first_above<kRowThreads>(sh.cum, n, scale_by_u(p.u, sh.cum[n - 1]), s);
      token = static_cast<int>((~sh.cand[at]) >> 32);
    }
    if (threadIdx.x == 0) {
      write_token(a, p, row, token, lse);
      st.stage = kStageDone;
    }
    return;
  }
  // Full rows: pass 3 bins the candidates; top_k > 512 is cut here by a count radix select.
  RowCtx c{a.logits + static_cast<int64_t>(row) * a.logits_stride,
           penalised_row(p) ? ws.processed + static_cast<int64_t>(row) * vocab : nullptr,
           p.inv_temperature, vocab, max, floor, 0};
  u64 tau = 0;
  if (p.top_k > 0) {
    const Selected kth = select_desc(c, BinSet{false, 0, 0, -1}, false, static_cast<u64>(p.top_k) - 1, sh, s);
    if (kth.found) tau = kth.comp;
  }
  if (threadIdx.x == 0) {
    st.max = max;
    st.floor = floor;
    st.lse = lse;
    st.tau = tau;
    st.stage = kStageFinish;
    out.token = -1;
  }
}

// Pass 3: each candidate's fixed-point weight, binned (top_p < 1) or summed per chunk (top_p = 1).
__global__ void __launch_bounds__(kChunkThreads, 2) chunk_weight_kernel(const SamplingArgs a, const Workspace ws, int chunks) {
  wait_for_prior_grid();
  allow_dependents();
  __shared__ u64 hist[kBins];
  __shared__ double table[64];
  __shared__ Scratch s;
  const int row = blockIdx.y, chunk = blockIdx.x;
  const SamplingRow p = a.params[row];
  if (!full_row(p)) return;
  const RowState st = ws.rows[row];
  if (st.stage != kStageFinish) return;
  const int vocab = static_cast<int>(a.vocab);
  const RowCtx c{a.logits + static_cast<int64_t>(row) * a.logits_stride,
                 penalised_row(p) ? ws.processed + static_cast<int64_t>(row) * vocab : nullptr,
                 p.inv_temperature, vocab, st.max, st.floor, st.tau};
  for (int i = threadIdx.x; i < 64; i += kChunkThreads) table[i] = kExp2TableDevice[i];
  const bool binned = p.top_p < 1.0;
  if (binned)
    for (int b = threadIdx.x; b < kBins; b += kChunkThreads) hist[b] = 0;
  __syncthreads();
  u64 sum = 0;
  const int base = chunk * kChunk;
  float t[kPer];
#pragma unroll
  for (int k = 0; k < kPer; ++k) t[k] = c.t_or_nan(base + k * kChunkThreads + static_cast<int>(threadIdx.x));
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const int i = base + k * kChunkThreads + static_cast<int>(threadIdx.x);
    u64 comp;
    if (!c.member(t[k], i, comp)) continue;
    const u64 w = fixed_weight(t[k], c.max, table);
    if (w == 0) continue;
    if (binned)
      atomicAdd(&hist[rel_bin(t[k], c.max)], w);
    else
      sum += w;
  }
  if (binned) {
    __syncthreads();
    u64* out = ws.slots + (static_cast<int64_t>(row) * chunks + chunk) * kSlotsPerChunk;
    for (int b = threadIdx.x; b < kBins; b += kChunkThreads) out[b] = hist[b];
  } else {
    sum = block_sum<kChunkThreads>(sum, s);
    if (threadIdx.x == 0) ws.stats[static_cast<int64_t>(row) * chunks + chunk].wsum = sum;
  }
}

// Pass 4: top_p's boundary and the draw for full rows.
__global__ void __launch_bounds__(kRowThreads, 1) row_finish_kernel(const SamplingArgs a, const Workspace ws, int chunks) {
  wait_for_prior_grid();
  allow_dependents();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  RowShared& sh = *reinterpret_cast<RowShared*>(smem_raw);
  __shared__ Scratch s;
  const int row = blockIdx.x;
  const SamplingRow p = a.params[row];
  if (!full_row(p)) return;
  const RowState st = ws.rows[row];
  if (st.stage != kStageFinish) return;
  load_table(sh);
  const int vocab = static_cast<int>(a.vocab);
  const RowCtx c{a.logits + static_cast<int64_t>(row) * a.logits_stride,
                 penalised_row(p) ? ws.processed + static_cast<int64_t>(row) * vocab : nullptr,
                 p.inv_temperature, vocab, st.max, st.floor, st.tau};
  int token = -1;
  if (p.top_p >= 1.0) {  // ascending index order: the chunk the draw falls in, then the token within it
    if (threadIdx.x == 0) {
      u64 total = 0;
      for (int k = 0; k < chunks; ++k) total += ws.stats[static_cast<int64_t>(row) * chunks + k].wsum;
      const u64 target = scale_by_u(p.u, total);
      u64 before = 0;
      int at = chunks - 1;
      for (int k = 0; k < chunks; ++k) {
        const u64 w = ws.stats[static_cast<int64_t>(row) * chunks + k].wsum;
        if (target < before + w) {
          at = k;
          break;
        }
        before += w;
      }
      s.i[2] = at;
      s.a[2] = target - before;
    }
    __syncthreads();
    const int at = s.i[2];
    const u64 target = s.a[2];
    __syncthreads();
    constexpr int kEach = kChunk / kRowThreads;  // 8 consecutive tokens per thread
    u64 w[kEach], local = 0;
    const int first = at * kChunk + static_cast<int>(threadIdx.x) * kEach;
#pragma unroll
    for (int e = 0; e < kEach; ++e) {
      w[e] = 0;
      const int i = first + e;
      u64 comp;
      if (i < vocab) {
        const float t = c.t(i);
        if (c.member(t, i, comp)) w[e] = fixed_weight(t, c.max, sh.table);
      }
      local += w[e];
    }
    u64 run = block_exclusive_scan<kRowThreads>(local, nullptr, s);
    if (threadIdx.x == 0) s.i[3] = -1;
    __syncthreads();
    if (run <= target && target < run + local) {
#pragma unroll
      for (int e = 0; e < kEach; ++e) {
        run += w[e];
        if (target < run) {
          s.i[3] = first + e;
          break;
        }
      }
    }
    __syncthreads();
    token = s.i[3];
  } else {
    // The bins' weights (summed over the chunks) and their exclusive prefix, bin 0 the highest logits.
    u64 w = 0;
    for (int k = 0; k < chunks; ++k) w += ws.slots[(static_cast<int64_t>(row) * chunks + k) * kSlotsPerChunk + threadIdx.x];
    u64 total = 0;
    const u64 pre = block_exclusive_scan<kRowThreads>(w, &total, s);
    sh.bin_w[threadIdx.x] = w;
    sh.bin_pre[threadIdx.x] = pre;
    if (threadIdx.x == 0) sh.bin_pre[kBins] = total;
    __syncthreads();
    static_assert(kBins == kRowThreads, "one bin per thread");
    auto bin_of = [&](u64 x) {  // the bin whose cumulative range holds x
      if (threadIdx.x == 0) s.i[4] = kBins - 1;
      __syncthreads();
      const int b = threadIdx.x;
      if (sh.bin_w[b] > 0 && sh.bin_pre[b] <= x && x < sh.bin_pre[b] + sh.bin_w[b]) s.i[4] = b;
      __syncthreads();
      const int found = s.i[4];
      __syncthreads();
      return found;
    };
    double target = ceil(p.top_p * static_cast<double>(total));
    u64 tp = target < 1.0 ? 1 : static_cast<u64>(target);
    if (tp > total) tp = total;
    const int b_top = bin_of(tp - 1);  // top_p's boundary: the first token whose inclusive sum reaches tp
    const u64 w_max = sh.bin_pre[b_top] + sh.bin_w[b_top];
    const int b_lo = bin_of(scale_by_u(p.u, tp)), b_hi = bin_of(scale_by_u(p.u, w_max));  // where the draw can fall
    const int n = gather(c, BinSet{true, b_lo, b_hi, b_top}, 0, 0, sh, s, nullptr, nullptr);
    if (n <= kGatherCap) {  // every token of those bins sorted: the CPU's walk, from the bins' offsets
      sort_and_sum(n, true, c.max, sh, s);
      const u64 base_low = sh.bin_pre[b_lo];
      const u64 base_high = sh.bin_pre[b_top] - (sh.bin_pre[b_hi + 1] - sh.bin_pre[b_lo]);
      for (int i = threadIdx.x; i < n; i += kRowThreads) {
        const int b = rel_bin(key_float(comp_key(sh.cand[i])), c.max);
        sh.cum[i] += b <= b_hi ? base_low : base_high;
      }
      __syncthreads();
      const int j = first_above<kRowThreads>(sh.cum, n, tp - 1, s);
      const int at = j < 0 ? -1 : first_above<kRowThreads>(sh.cum, n, scale_by_u(p.u, sh.cum[j]), s);
      token = at < 0 ? -1 : comp_index(sh.cand[at]);
    } else {  // a bin too large to sort: radix-narrowed selects, one for the boundary and one for the draw
      const Selected boundary =
          select_desc(c, BinSet{true, b_top, b_top, -1}, true, tp - 1 - sh.bin_pre[b_top], sh, s);
      if (boundary.found) {
        const u64 x = scale_by_u(p.u, sh.bin_pre[b_top] + boundary.cum);
        const int b = bin_of(x);
        const Selected drawn = select_desc(c, BinSet{true, b, b, -1}, true, x - sh.bin_pre[b], sh, s);
        if (drawn.found) token = comp_index(drawn.comp);
      }
    }
  }
  if (threadIdx.x == 0) write_token(a, p, row, token, st.lse);
}

// Pass 5: the sampled token's rank among the raw logits.
__global__ void __launch_bounds__(kChunkThreads) rank_kernel(const SamplingArgs a, int chunks) {
  wait_for_prior_grid();
  allow_dependents();
  __shared__ Scratch s;
  const int row = blockIdx.y, chunk = blockIdx.x;
  const SamplingRow p = a.params[row];
  if (!(p.flags & kSampleLogprobs)) return;
  const int token = a.out[row].token;
  if (token < 0) return;
  const float* logits = a.logits + static_cast<int64_t>(row) * a.logits_stride;
  const float mine = logits[token];
  const int vocab = static_cast<int>(a.vocab);
  u64 count = 0;
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const int i = chunk * kChunk + k * kChunkThreads + static_cast<int>(threadIdx.x);
    if (i < vocab) count += __ldg(logits + i) > mine;
  }
  count = block_sum<kChunkThreads>(count, s);
  if (threadIdx.x == 0 && count > 0) atomicAdd(&a.out[row].rank, static_cast<int>(count));
}

}  // namespace

uint64_t sampling_fixed_weight(float t, float max) { return fixed_weight(t, max, kExp2TableHost); }

size_t sampling_workspace_bytes(int64_t rows, int64_t vocab) {
  if (rows <= 0 || vocab <= 0) return 256;
  return layout_of(rows, vocab).total;
}

cudaError_t sample_tokens(const SamplingArgs& a, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (a.rows < 0 || a.rows > kSamplingMaxRows || a.vocab <= 0 || a.vocab > kSamplingMaxVocab ||
      a.logits_stride < a.vocab)
    return cudaErrorInvalidValue;
  if (a.rows == 0) return cudaSuccess;
  if (!a.logits || !a.params || !a.out || !workspace) return cudaErrorInvalidValue;
  const Layout l = layout_of(a.rows, a.vocab);
  if (workspace_bytes < l.total) return cudaErrorInvalidValue;
  static const cudaError_t attributes = [] {
    cudaError_t e = cudaFuncSetAttribute(row_decide_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(kRowSmem));
    if (e == cudaSuccess)
      e = cudaFuncSetAttribute(row_finish_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(kRowSmem));
    return e;
  }();
  if (attributes != cudaSuccess) return attributes;
  auto* bytes = static_cast<unsigned char*>(workspace);
  Workspace ws;
  ws.rows = reinterpret_cast<RowState*>(bytes + l.rows);
  ws.stats = reinterpret_cast<ChunkStat*>(bytes + l.stats);
  ws.topn = reinterpret_cast<u64*>(bytes + l.topn);
  ws.slots = reinterpret_cast<u64*>(bytes + l.slots);
  ws.processed = reinterpret_cast<float*>(bytes + l.processed);
  const int chunks = static_cast<int>((a.vocab + kChunk - 1) / kChunk);
  const dim3 chunk_grid(chunks, static_cast<unsigned>(a.rows));
  const unsigned rows = static_cast<unsigned>(a.rows);
  launch_dependent(chunk_argmax_kernel, chunk_grid, kLeanThreads, 0, stream, a, ws, chunks);
  if (a.chunk_extras)
    launch_dependent(chunk_pass_kernel, chunk_grid, kChunkThreads, 0, stream, a, ws, chunks);
  launch_dependent(row_decide_kernel, rows, kRowThreads, kRowSmem, stream, a, ws, chunks);
  if (a.full_path) {
    launch_dependent(chunk_weight_kernel, chunk_grid, kChunkThreads, 0, stream, a, ws, chunks);
    launch_dependent(row_finish_kernel, rows, kRowThreads, kRowSmem, stream, a, ws, chunks);
  }
  if (a.logprobs) launch_dependent(rank_kernel, chunk_grid, kChunkThreads, 0, stream, a, chunks);
  return cudaGetLastError();
}

}  // namespace dsv4::ops::cuda
