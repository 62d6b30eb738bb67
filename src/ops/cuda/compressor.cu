// The fused compressor step (ops/cuda/compressor.h).
//
// Which token values a window reads. Request r appends positions [s, e) (s = start, e = s + len); with m = ratio,
// w0 = s / m and i0 = s % m, the windows that close are x in [w0, e / m). Window x pools, per channel c < d, the
// tokens of window x-1 at channel c ("a" half; overlap and x >= 1 only) then the tokens of window x at channel
// (overlap ? d : 0) + c. A token at p >= s is a chunk row (kv, gate + ape[p % m]); a token at p < s is in the old
// state (ops/cpu/compressor.h): window w0's first i0 tokens in the current-window slots (overlap ? m : 0) + p % m,
// and window w0 - 1 (complete) in the previous-window slots p % m (overlap). So only x = w0 and, for overlap,
// x = w0 + 1 ever read the state ("head" windows); later windows read only chunk rows ("pure" windows).
//
// What the state must hold afterwards (the sequential CPU's result): current-window slot s holds the latest token
// p < e with p % m == s (rewritten only when that token is in the chunk); for overlap, when a window closed in
// the chunk, previous-window slot s holds token (e / m - 1)·m + s (from the chunk, or from the old current-window
// slot s when that token precedes the chunk). The only old values read are previous-window slots and
// current-window slots s < i0, so:
//   head task (one per request with tokens): pool the head windows; barrier; write the previous-window slots and
//     the current-window slots [i0, i0 + G); barrier; write the current-window slots s < i0 the chunk rewrites.
//   pure tasks: `wpt` pure windows each, from chunk rows only.
//   slot tasks: the remaining current-window slots s >= i0 (non-overlap with a large ratio: HCA's 128 slots),
//     G slots each; nobody reads them.
// No task reads what another task writes, so the tasks run in any order on any CTA (a grid-stride loop over a
// flat task list; every CTA rebuilds the per-request task prefix sums in shared memory from the small
// start/offset arrays).
//
// Threads: each thread owns a pair of adjacent channels (2j, 2j+1) of one window (float2 loads, the rope pair in
// registers); a group of ceil(d/2 / 32) warps makes one entry, and a 256-thread CTA holds 256 / group-size groups
// (1 for d = 512, 4 for the 128-channel index keys). Pooling keeps the CPU's order: max over the slots, the
// denominator as a running fp32 sum of exp(g - max), pooled += kv · (exp(g - max) / denominator), all with
// explicit _rn intrinsics (no FMA contraction); for up to 8 slots (CSA) the values sit in registers, for HCA's
// 128 the three passes re-read them (L1/L2). The norm's sum of squares is in double as the CPU's, reduced by a
// fixed tree (deterministic).
#include "ops/cuda/compressor.h"

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>

#include "cache/kv_entry_format.h"
#include "ops/cuda/bf16.cuh"
#include "ops/cuda/fp4_simulation.cuh"
#include "ops/cuda/fp8_simulation.cuh"
#include "ops/cuda/launch.cuh"

namespace dsv4::ops::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxCachedSlots = 8;  // CSA: 2·4 slots in registers
constexpr int kMaxRequests = 12000;  // (R + 1) ints of task prefix sums in shared memory, under 48 KB
constexpr int kDefaultMaxBlocks = 4096;

struct Kernel {
  CompressorStepParams p;
  int m, d, width, coff, pairs, tpg, wpg, groups, wpt, gslots;
  int64_t gate_offset;  // floats from kv_state to gate_state
  bool deepseek;        // kBf16DeepSeekMain / kBf16DeepSeekIndex: the reference's roundings around norm and RoPE
  float hadamard_scale;  // head_dim^-1/2 as the reference's Python float (double) rounded to fp32
};

struct Plan {
  int start, len, end, offset, row;
  int w0, i0, we;  // closed windows [w0, we)
  int head_hi;     // head windows [w0, head_hi)
  int pure_lo, pure_tasks;
  int n_nc, extra_tasks;  // current-window slots [i0, i0 + n_nc) are written; extra slot tasks beyond the head
  int tasks;
};

__device__ inline Plan make_plan(const Kernel& k, int r) {
  Plan q;
  q.start = k.p.start_positions[r];
  q.offset = k.p.token_offsets[r];
  q.len = k.p.token_offsets[r + 1] - q.offset;
  q.end = q.start + q.len;
  q.row = k.p.table_rows ? k.p.table_rows[r] : r;
  const int m = k.m;
  q.w0 = q.start / m;
  q.i0 = q.start % m;
  q.we = q.end / m;
  const int ceil_start = (q.start + m - 1) / m;
  const int first_pure = k.p.overlap ? (q.start == 0 ? 0 : ceil_start + 1) : ceil_start;
  q.head_hi = min(first_pure, q.we);
  q.pure_lo = first_pure;
  const int n_pure = max(0, q.we - first_pure);
  q.pure_tasks = (n_pure + k.wpt - 1) / k.wpt;
  q.n_nc = min(q.len, m - q.i0);
  q.extra_tasks = q.n_nc > k.gslots ? (q.n_nc - 1) / k.gslots : 0;
  q.tasks = q.len > 0 ? 1 + q.pure_tasks + q.extra_tasks : 0;
  return q;
}

__device__ inline float2 ld2(const float* p) { return *reinterpret_cast<const float2*>(p); }
__device__ inline void st2(float* p, float2 v) { *reinterpret_cast<float2*>(p) = v; }

// Token at absolute position p, channels [ch, ch + 2) of its row: a chunk row (gate + ape) or state slot `slot`.
// Branch-free (pointer selects, every load from a valid address) so that a caller's loads all issue before the
// first one is used: a branch per slot serialised the DRAM latency of every slot. `kvs` / `gts` must be valid
// pointers even when every token is in the chunk.
__device__ inline void load_token(const Kernel& k, const Plan& q, const float* kvs, const float* gts, int p, int ch,
                                  int slot, float2& kv, float2& g) {
  const bool chunk = p >= q.start;
  const int64_t chunk_at = (q.offset + static_cast<int64_t>(p - q.start)) * k.width + ch;
  const int64_t state_at = static_cast<int64_t>(slot) * k.width + ch;
  const float* kv_src = chunk ? k.p.kv + chunk_at : kvs + state_at;
  const float* g_src = chunk ? k.p.gate + chunk_at : gts + state_at;
  const float* bias_src = chunk ? k.p.ape + static_cast<int64_t>(p % k.m) * k.width + ch : g_src;  // unused
  kv = ld2(kv_src);
  const float2 raw = ld2(g_src), bias = ld2(bias_src);
  g = chunk ? make_float2(__fadd_rn(raw.x, bias.x), __fadd_rn(raw.y, bias.y)) : raw;
}

// Pooling slot i of window x (i < n): its position, channel and (for p < start) state slot.
__device__ inline void pool_slot(const Kernel& k, const Plan& q, int x, int n, int i, int c, int& p, int& ch,
                                 int& slot) {
  const int m = k.m;
  if (n > m && i < m) {  // the "a" half: window x - 1 at channel c
    p = (x - 1) * m + i;
    ch = c;
    slot = p >= q.w0 * m ? m + i : i;
  } else {
    const int b = i - (n - m);
    p = x * m + b;
    ch = (k.coff - 1) * k.d + c;
    slot = (k.coff - 1) * m + b;
  }
}

// The pooled (un-normed) channels (c, c + 1) of window x.
template <bool kCached>
__device__ float2 pool_window(const Kernel& k, const Plan& q, const float* kvs, const float* gts, int x, int c) {
  const int n = k.p.overlap && x >= 1 ? 2 * k.m : k.m;
  float2 out;
  if constexpr (kCached) {
    float2 kv[kMaxCachedSlots], g[kMaxCachedSlots];
#pragma unroll
    for (int i = 0; i < kMaxCachedSlots; ++i) {  // slots past n load slot n - 1 again (unused): no branch
      int p, ch, slot;
      pool_slot(k, q, x, n, min(i, n - 1), c, p, ch, slot);
      load_token(k, q, kvs, gts, p, ch, slot, kv[i], g[i]);
    }
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int i = 0; i < kMaxCachedSlots; ++i)
      if (i < n) {
        mx0 = fmaxf(mx0, g[i].x);
        mx1 = fmaxf(mx1, g[i].y);
      }
    float den0 = 0.0f, den1 = 0.0f;
#pragma unroll
    for (int i = 0; i < kMaxCachedSlots; ++i)
      if (i < n) {
        g[i].x = expf(__fsub_rn(g[i].x, mx0));
        g[i].y = expf(__fsub_rn(g[i].y, mx1));
        den0 = __fadd_rn(den0, g[i].x);
        den1 = __fadd_rn(den1, g[i].y);
      }
    float acc0 = 0.0f, acc1 = 0.0f;
#pragma unroll
    for (int i = 0; i < kMaxCachedSlots; ++i)
      if (i < n) {
        acc0 = __fadd_rn(acc0, __fmul_rn(kv[i].x, __fdiv_rn(g[i].x, den0)));
        acc1 = __fadd_rn(acc1, __fmul_rn(kv[i].y, __fdiv_rn(g[i].y, den1)));
      }
    out = make_float2(acc0, acc1);
  } else {
    // Batches of kBatch slots: all loads of a batch issue before their first use (latency-bound otherwise: one
    // CTA pools HCA's 128 slots).
    constexpr int kBatch = 16;
    float mx0 = -INFINITY, mx1 = -INFINITY;
    for (int i0 = 0; i0 < n; i0 += kBatch) {
      float2 g[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        int p, ch, slot;
        float2 kv;
        pool_slot(k, q, x, n, min(i0 + b, n - 1), c, p, ch, slot);
        load_token(k, q, kvs, gts, p, ch, slot, kv, g[b]);
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b)
        if (i0 + b < n) {
          mx0 = fmaxf(mx0, g[b].x);
          mx1 = fmaxf(mx1, g[b].y);
        }
    }
    float den0 = 0.0f, den1 = 0.0f;
    for (int i0 = 0; i0 < n; i0 += kBatch) {
      float2 g[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        int p, ch, slot;
        float2 kv;
        pool_slot(k, q, x, n, min(i0 + b, n - 1), c, p, ch, slot);
        load_token(k, q, kvs, gts, p, ch, slot, kv, g[b]);
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b)
        if (i0 + b < n) {
          den0 = __fadd_rn(den0, expf(__fsub_rn(g[b].x, mx0)));
          den1 = __fadd_rn(den1, expf(__fsub_rn(g[b].y, mx1)));
        }
    }
    float acc0 = 0.0f, acc1 = 0.0f;
    constexpr int kPoolBatch = kBatch;
    for (int i0 = 0; i0 < n; i0 += kPoolBatch) {
      float2 kv[kPoolBatch], g[kPoolBatch];
#pragma unroll
      for (int b = 0; b < kPoolBatch; ++b) {
        int p, ch, slot;
        pool_slot(k, q, x, n, min(i0 + b, n - 1), c, p, ch, slot);
        load_token(k, q, kvs, gts, p, ch, slot, kv[b], g[b]);
      }
#pragma unroll
      for (int b = 0; b < kPoolBatch; ++b)
        if (i0 + b < n) {
          acc0 = __fadd_rn(acc0, __fmul_rn(kv[b].x, __fdiv_rn(expf(__fsub_rn(g[b].x, mx0)), den0)));
          acc1 = __fadd_rn(acc1, __fmul_rn(kv[b].y, __fdiv_rn(expf(__fsub_rn(g[b].y, mx1)), den1)));
        }
    }
    out = make_float2(acc0, acc1);
  }
  return out;
}

// Sum / max over the threads of one group (its warps), in a fixed order. Every thread of the CTA must call it.
__device__ inline double group_sum(const Kernel& k, double v, double* red) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) red[warp] = v;
  __syncthreads();
  const int first = warp / k.wpg * k.wpg;
  double total = 0.0;
  for (int w = 0; w < k.wpg && first + w < kWarps; ++w) total += red[first + w];
  __syncthreads();
  return total;
}

__device__ inline float group_max(const Kernel& k, float v, float* red) {
  for (int offset = 16; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) red[warp] = v;
  __syncthreads();
  const int first = warp / k.wpg * k.wpg;
  float total = 0.0f;
  for (int w = 0; w < k.wpg && first + w < kWarps; ++w) total = fmaxf(total, red[first + w]);
  __syncthreads();
  return total;
}

// Start of block `block` of a view (nullptr for a negative id).
__device__ inline std::byte* block_base(const PagedGroupView& g, int32_t block) {
  if (block < 0) return nullptr;
  return g.arena + (block / g.max_blocks_per_page) * g.page_bytes + (block % g.max_blocks_per_page) * g.block_bytes;
}

__device__ inline uint8_t to_e4m3(float v) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

// Stores channels (c, c + 1) of entry w (in history block id `block`). `valid`: the group has an entry this round
// (uniform over the group); `active`: this thread's pair exists. Called by every thread of the CTA (the FP8 index
// key reduces over the group).
__device__ void store_entry(const Kernel& k, const Plan& q, int w, int32_t block, bool valid, bool active, int c,
                            float y0, float y1, float* redf) {
  const PagedGroupView& h = k.p.history;
  std::byte* const base = valid ? block_base(h, block) : nullptr;
  const int e = w % h.entries_per_block;
  switch (k.p.format) {
    case CompressorEntryFormat::kF32: {
      if (base && active)
        st2(reinterpret_cast<float*>(base + (h.layer_index * h.entries_per_block + e) * h.entry_bytes) + c,
            make_float2(y0, y1));
      break;
    }
    case CompressorEntryFormat::kBf16: {
      if (base && active)
        reinterpret_cast<__nv_bfloat162*>(base + (h.layer_index * h.entries_per_block + e) * h.entry_bytes)[c / 2] =
            __floats2bfloat162_rn(y0, y1);
      break;
    }
    case CompressorEntryFormat::kFp8Main: {
      // head_dim 512, one group of 8 warps: warp b < 7 holds the no-rope block b of 64 channels, warp 7 the rope.
      if (!valid) break;
      const float x0 = bf16_round(y0), x1 = bf16_round(y1);
      const int scale_block = c / kKvScaleBlock;
      const int lane = threadIdx.x % 32;
      std::byte* region = base ? base + h.layer_index * kv_region_bytes(KvEntryFormat::kFp8, h.entries_per_block)
                               : nullptr;
      uint8_t* data = region ? reinterpret_cast<uint8_t*>(region) + e * kKvFp8DataBytes : nullptr;
      uint8_t* scales = region ? reinterpret_cast<uint8_t*>(region) + int64_t{h.entries_per_block} * kKvFp8DataBytes +
                                     e * kKvFp8ScaleBytes
                               : nullptr;
      if (scale_block < kKvNumScales) {
        float amax = fmaxf(fabsf(x0), fabsf(x1));
        for (int offset = 16; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
        const uint32_t bits = __float_as_uint(fmaxf(amax, 1e-4f) / kE4m3Max);
        const int exponent = static_cast<int>((bits >> 23) & 0xffu) - 127 + ((bits & 0x7fffffu) != 0 ? 1 : 0);
        const float inverse_scale = __uint_as_float(static_cast<uint32_t>(127 - exponent) << 23);
        const uint8_t q0 = to_e4m3(fminf(fmaxf(x0 * inverse_scale, -kE4m3Max), kE4m3Max));
        const uint8_t q1 = to_e4m3(fminf(fmaxf(x1 * inverse_scale, -kE4m3Max), kE4m3Max));
        if (data) {
          *reinterpret_cast<uint16_t*>(data + c) = static_cast<uint16_t>(q0 | (q1 << 8));
          if (lane == 0) scales[scale_block] = static_cast<uint8_t>(exponent + 127);
        }
      } else if (data) {
        *reinterpret_cast<__nv_bfloat162*>(data + kKvNopeDim + 2 * (c - kKvNopeDim)) = __floats2bfloat162_rn(x0, x1);
        if (lane == 0) scales[kKvNumScales] = 0;
      }
      break;
    }
    case CompressorEntryFormat::kBf16DeepSeekMain: {
      // The non-rope channels through e4m3 per 64 (ops::cpu::quantize_e4m3_blocks(entry, d − rope_dim, 64)): a
      // block of 64 channels is one warp's 32 pairs, since each group starts at a warp.
      float x0 = y0, x1 = y1;
      if (valid && c < k.d - k.p.rope_dim) {  // uniform over the warp: (d − rope_dim) % 64 == 0
        float amax = active ? fmaxf(fabsf(x0), fabsf(x1)) : 0.0f;
        for (int offset = 16; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
        // ue8m0_scale(amax, 448, 1e-4), then x = e4m3(clamp(x / s, ±448)) · s (s a power of two: both exact).
        const float scale = e4m3_block_scale(amax);
        x0 = e4m3_simulate(x0, scale);
        x1 = e4m3_simulate(x1, scale);
      }
      if (base && active)
        reinterpret_cast<__nv_bfloat162*>(base + (h.layer_index * h.entries_per_block + e) * h.entry_bytes)[c / 2] =
            __floats2bfloat162_rn(x0, x1);
      break;
    }
    case CompressorEntryFormat::kBf16DeepSeekIndex: {
      // Hadamard rotation over the group's d values (staged in shared memory; each output a ±1 sum in double,
      // exact for bf16 inputs, so equal to the CPU's butterflies), scaled, bf16; FP4 per 32 (16 lanes); bf16.
      __shared__ float rotated_in[kThreads * 2];
      const int group = threadIdx.x / k.tpg;
      float* values = rotated_in + group * k.tpg * 2;
      if (active) {
        values[c] = y0;
        values[c + 1] = y1;
      }
      __syncthreads();
      double sum0 = 0.0, sum1 = 0.0;
      if (active)
        for (int j = 0; j < k.d; ++j) {
          const double v = values[j];
          sum0 += (__popc(c & j) & 1) ? -v : v;
          sum1 += (__popc((c + 1) & j) & 1) ? -v : v;
        }
      __syncthreads();  // the next round's values
      float x0 = bf16_round(__fmul_rn(static_cast<float>(sum0), k.hadamard_scale));
      float x1 = bf16_round(__fmul_rn(static_cast<float>(sum1), k.hadamard_scale));
      float amax = active ? fmaxf(fabsf(x0), fabsf(x1)) : 0.0f;
      for (int offset = 1; offset < 16; offset *= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
      const float s = e2m1_block_scale(amax);
      x0 = bf16_round(__fmul_rn(e2m1_round(fminf(fmaxf(__fdiv_rn(x0, s), -6.0f), 6.0f)), s));
      x1 = bf16_round(__fmul_rn(e2m1_round(fminf(fmaxf(__fdiv_rn(x1, s), -6.0f), 6.0f)), s));
      if (base && active)
        reinterpret_cast<__nv_bfloat162*>(base + (h.layer_index * h.entries_per_block + e) * h.entry_bytes)[c / 2] =
            __floats2bfloat162_rn(x0, x1);
      break;
    }
    case CompressorEntryFormat::kFp8Index: {
      const float x0 = bf16_round(y0), x1 = bf16_round(y1);
      const float amax = group_max(k, active ? fmaxf(fabsf(x0), fabsf(x1)) : 0.0f, redf);
      if (!base || !active) break;
      const int d = k.d;
      std::byte* run = base + int64_t{h.layer_index} * h.entries_per_block * (d + 4);
      // index_key_fp8_scale: 2^ceil(log2(max(amax, 1e-4) / 448)) from the fp32 bits.
      const float ratio = (amax > 1e-4f ? amax : 1e-4f) / 448.0f;
      const uint32_t bits = __float_as_uint(ratio);
      const int exponent = static_cast<int>((bits >> 23) & 0xffu) - 127 + ((bits & 0x7fffffu) != 0 ? 1 : 0);
      const float scale = __uint_as_float(static_cast<uint32_t>(exponent + 127) << 23);
      const float inverse = 1.0f / scale;
      const uint8_t q0 = to_e4m3(fminf(fmaxf(x0 * inverse, -448.0f), 448.0f));
      const uint8_t q1 = to_e4m3(fminf(fmaxf(x1 * inverse, -448.0f), 448.0f));
      *reinterpret_cast<uint16_t*>(run + int64_t{e} * d + c) = static_cast<uint16_t>(q0 | (q1 << 8));
      if (c == 0) *reinterpret_cast<float*>(run + int64_t{h.entries_per_block} * d + 4 * e) = scale;
      break;
    }
  }
}

// Pools, norms, rotates and stores windows [x_first, x_first + count) of request q, one per group per round.
template <bool kCached>
__device__ void process_windows(const Kernel& k, const Plan& q, const float* kvs, const float* gts, int x_first,
                                int count, double* redd, float* redf) {
  const int group = threadIdx.x / k.tpg, j = threadIdx.x % k.tpg, c = 2 * j;
  const int rounds = (count + k.groups - 1) / k.groups;
  for (int round = 0; round < rounds; ++round) {
    const int index = round * k.groups + group;
    const bool valid = group < k.groups && index < count;
    const bool active = valid && j < k.pairs;
    const int x = x_first + index;
    const PagedGroupView& h = k.p.history;
    const int32_t block = valid ? h.block_table[q.row * h.block_table_stride + x / h.entries_per_block] : -1;  // early
    float2 v = make_float2(0.0f, 0.0f);
    if (active) v = pool_window<kCached>(k, q, kvs, gts, x, c);
    if (k.deepseek) v = make_float2(bf16_round(v.x), bf16_round(v.y));  // kv.to(bf16) before the norm (§7.1)
    // RMSNorm as ops::cpu::rms_norm: double sum of squares, fp32 scale, weight · (x · scale).
    const double sum = group_sum(k, active ? static_cast<double>(v.x) * v.x + static_cast<double>(v.y) * v.y : 0.0, redd);
    const float scale =
        __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(static_cast<float>(sum / static_cast<double>(k.d)), k.p.eps)));
    float y0 = 0.0f, y1 = 0.0f;
    if (active) {
      y0 = __fmul_rn(k.p.norm_weight[c], __fmul_rn(v.x, scale));
      y1 = __fmul_rn(k.p.norm_weight[c + 1], __fmul_rn(v.y, scale));
      if (k.deepseek) {
        y0 = bf16_round(y0);
        y1 = bf16_round(y1);
      }
      const int offset = k.d - k.p.rope_dim;
      if (c >= offset) {  // ops::cpu::apply_rope at position x·m
        const float angle = __fmul_rn(k.p.inv_freq[(c - offset) / 2], static_cast<float>(x * k.m));
        double sin_d, cos_d;
        sincos(static_cast<double>(angle), &sin_d, &cos_d);
        const float cos_t = __fmul_rn(static_cast<float>(cos_d), k.p.attention_scaling);
        const float sin_t = __fmul_rn(static_cast<float>(sin_d), k.p.attention_scaling);
        const float a = y0, b = y1;
        y0 = __fsub_rn(__fmul_rn(a, cos_t), __fmul_rn(b, sin_t));
        y1 = __fadd_rn(__fmul_rn(b, cos_t), __fmul_rn(a, sin_t));
      }
      if (k.deepseek) {
        y0 = bf16_round(y0);
        y1 = bf16_round(y1);
      }
    }
    store_entry(k, q, x, block, valid, active, c, y0, y1, redf);
  }
}

// The state copies load kCopyBatch elements per thread before storing any: a load -> store -> load chain (the
// compiler cannot reorder across possibly aliasing stores) paid one DRAM latency per element.
constexpr int kCopyBatch = 8;

// Current-window slots [s_lo, s_hi): slot s gets the latest chunk token p < end with p % m == s.
__device__ void write_current_slots(const Kernel& k, const Plan& q, float* kvs, float* gts, int s_lo, int s_hi) {
  const int half = k.width / 2;
  const int total = (s_hi - s_lo) * half;
  for (int base = 0; base < total; base += kThreads * kCopyBatch) {
    float2 kv[kCopyBatch], g[kCopyBatch];
    int64_t at[kCopyBatch];
#pragma unroll
    for (int b = 0; b < kCopyBatch; ++b) {
      const int idx = min(base + b * kThreads + static_cast<int>(threadIdx.x), total - 1);
      const int s = s_lo + idx / half, c = 2 * (idx % half);
      const int p = (q.end - 1 - s) / k.m * k.m + s;
      const int64_t row = q.offset + (p - q.start);
      at[b] = static_cast<int64_t>((k.coff - 1) * k.m + s) * k.width + c;
      kv[b] = ld2(k.p.kv + row * k.width + c);
      const float2 raw = ld2(k.p.gate + row * k.width + c);
      const float2 bias = ld2(k.p.ape + static_cast<int64_t>(s) * k.width + c);
      g[b] = make_float2(__fadd_rn(raw.x, bias.x), __fadd_rn(raw.y, bias.y));
    }
#pragma unroll
    for (int b = 0; b < kCopyBatch; ++b)
      if (base + b * kThreads + static_cast<int>(threadIdx.x) < total) {
        st2(kvs + at[b], kv[b]);
        st2(gts + at[b], g[b]);
      }
  }
}

// Overlap: previous-window slots = the last window closed in the chunk.
__device__ void write_previous_slots(const Kernel& k, const Plan& q, float* kvs, float* gts) {
  const int half = k.width / 2;
  const int total = k.m * half;
  const int last = q.we - 1;
  for (int base = 0; base < total; base += kThreads * kCopyBatch) {
    float2 kv[kCopyBatch], g[kCopyBatch];
    int64_t at[kCopyBatch];
#pragma unroll
    for (int b = 0; b < kCopyBatch; ++b) {
      const int idx = min(base + b * kThreads + static_cast<int>(threadIdx.x), total - 1);
      const int s = idx / half, c = 2 * (idx % half);
      load_token(k, q, kvs, gts, last * k.m + s, c, k.m + s, kv[b], g[b]);
      at[b] = static_cast<int64_t>(s) * k.width + c;
    }
#pragma unroll
    for (int b = 0; b < kCopyBatch; ++b)
      if (base + b * kThreads + static_cast<int>(threadIdx.x) < total) {
        st2(kvs + at[b], kv[b]);
        st2(gts + at[b], g[b]);
      }
  }
}

template <bool kCached>
__global__ void __launch_bounds__(kThreads) compressor_step_kernel(const Kernel k) {
  wait_for_prior_grid();
  allow_dependents();
  extern __shared__ int prefix[];  // [num_requests + 1]: first task of each request
  __shared__ double redd[kWarps];
  __shared__ float redf[kWarps];
  __shared__ int warp_totals[kWarps];
  const int R = k.p.num_requests;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (threadIdx.x == 0) prefix[0] = 0;
  int running = 0;
  for (int base = 0; base < R; base += kThreads) {
    const int r = base + threadIdx.x;
    const int count = r < R ? make_plan(k, r).tasks : 0;
    int inclusive = count;
    for (int offset = 1; offset < 32; offset *= 2) {
      const int other = __shfl_up_sync(0xffffffffu, inclusive, offset);
      if (lane >= offset) inclusive += other;
    }
    if (lane == 31) warp_totals[warp] = inclusive;
    __syncthreads();
    int before = 0, total = 0;
    for (int w = 0; w < kWarps; ++w) {
      before += w < warp ? warp_totals[w] : 0;
      total += warp_totals[w];
    }
    if (r < R) prefix[r + 1] = running + before + inclusive;
    running += total;
    __syncthreads();
  }
  const int tasks = prefix[R];
  for (int task = blockIdx.x; task < tasks; task += gridDim.x) {
    int lo = 0, hi = R;  // prefix[lo] <= task < prefix[hi]
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (prefix[mid] <= task) lo = mid; else hi = mid;
    }
    const Plan q = make_plan(k, lo);
    const int local = task - prefix[lo];
    float* kvs = nullptr;
    float* gts = nullptr;
    if (local == 0 || local > q.pure_tasks) {
      kvs = reinterpret_cast<float*>(paged_entry(k.p.state, q.row, 0));
      if (kvs == nullptr) continue;  // no state block: nothing to read or keep (uniform over the CTA)
      gts = kvs + k.gate_offset;
    }
    if (local == 0) {
      if (q.head_hi > q.w0) process_windows<kCached>(k, q, kvs, gts, q.w0, q.head_hi - q.w0, redd, redf);
      __syncthreads();  // the head windows read the old state
      if (k.p.overlap && q.we > q.w0) write_previous_slots(k, q, kvs, gts);
      write_current_slots(k, q, kvs, gts, q.i0, q.i0 + min(q.n_nc, k.gslots));
      __syncthreads();  // the previous-window slots read the old current-window slots s < i0
      const int rewritten = min(q.i0, q.end - (q.w0 + 1) * k.m);
      if (rewritten > 0) write_current_slots(k, q, kvs, gts, 0, rewritten);
      __syncthreads();
    } else if (local <= q.pure_tasks) {
      const int x_first = q.pure_lo + (local - 1) * k.wpt;
      // Pure windows read only chunk rows; the state pointers just need to be valid addresses (load_token).
      process_windows<kCached>(k, q, k.p.kv, k.p.gate, x_first, min(k.wpt, q.we - x_first), redd, redf);
    } else {
      const int s_lo = q.i0 + k.gslots * (local - q.pure_tasks);
      write_current_slots(k, q, kvs, gts, s_lo, min(q.i0 + q.n_nc, s_lo + k.gslots));
    }
  }
}

bool valid_params(const CompressorStepParams& p) {
  if (p.ratio < 1 || p.head_dim < 2 || p.head_dim > 512 || p.head_dim % 2 != 0) return false;
  if (p.rope_dim < 0 || p.rope_dim % 2 != 0 || p.rope_dim > p.head_dim) return false;
  if (p.num_requests < 0 || p.num_requests > kMaxRequests || p.num_tokens < 0) return false;
  const int64_t state_bytes = 2 * int64_t{p.state_slots()} * p.width() * 4;
  if (p.state.entry_bytes != state_bytes || p.state.entries_per_block < 1) return false;
  if (p.history.entries_per_block < 1) return false;
  switch (p.format) {
    case CompressorEntryFormat::kF32: return p.history.entry_bytes == 4 * int64_t{p.head_dim};
    case CompressorEntryFormat::kBf16: return p.history.entry_bytes == 2 * int64_t{p.head_dim};
    case CompressorEntryFormat::kFp8Main:
      return p.head_dim == kKvHeadDim && p.rope_dim == kKvRopeDim && p.history.entry_bytes == kKvFp8EntryBytes;
    case CompressorEntryFormat::kFp8Index:
      return p.head_dim % 4 == 0 && p.history.entry_bytes == int64_t{p.head_dim} + 4;
    case CompressorEntryFormat::kBf16DeepSeekMain:
      return (p.head_dim - p.rope_dim) % 64 == 0 && p.history.entry_bytes == 2 * int64_t{p.head_dim};
    case CompressorEntryFormat::kBf16DeepSeekIndex:
      return (p.head_dim == 64 || p.head_dim == 128 || p.head_dim == 256) &&
             p.history.entry_bytes == 2 * int64_t{p.head_dim};
  }
  return false;
}

Kernel make_kernel(const CompressorStepParams& p) {
  Kernel k;
  k.p = p;
  k.m = p.ratio;
  k.d = p.head_dim;
  k.width = p.width();
  k.coff = p.coff();
  k.pairs = p.head_dim / 2;
  k.tpg = (k.pairs + 31) / 32 * 32;
  k.wpg = k.tpg / 32;
  k.groups = kThreads / k.tpg;
  // Several windows per pure task when they are small (CSA: 4 windows of 8 slots), one for HCA.
  k.wpt = k.groups * std::max(1, 16 / (k.m * k.groups));
  // State slots per slot task: all of them for CSA (the head does it), 64 KB of kv + gate for HCA.
  k.gslots = p.overlap ? k.m : std::max(1, std::min(k.m, 8192 / k.width));
  k.gate_offset = int64_t{p.state_slots()} * k.width;
  k.deepseek = p.format == CompressorEntryFormat::kBf16DeepSeekMain || p.format == CompressorEntryFormat::kBf16DeepSeekIndex;
  k.hadamard_scale = static_cast<float>(std::pow(static_cast<double>(p.head_dim), -0.5));
  return k;
}

int grid_blocks(const Kernel& k) {
  const int64_t R = k.p.num_requests, T = k.p.num_tokens, m = k.m;
  // Upper estimate of the task count (the loop covers any shortfall): heads, pure windows, slot tasks.
  int64_t bound = std::min(R, T) + (T / m + k.wpt - 1) / k.wpt + std::min(R, T / m) +
                  (k.p.overlap ? 0 : T / k.gslots) + 1;
  const int64_t cap = k.p.max_blocks > 0 ? k.p.max_blocks : kDefaultMaxBlocks;
  return static_cast<int>(std::max<int64_t>(1, std::min(bound, cap)));
}

}  // namespace

int compressor_step_blocks(const CompressorStepParams& p) { return grid_blocks(make_kernel(p)); }

cudaError_t compressor_step(const CompressorStepParams& p, cudaStream_t stream) {
  if (!valid_params(p)) return cudaErrorInvalidValue;
  if (p.num_requests == 0 || p.num_tokens == 0) return cudaSuccess;
  const Kernel k = make_kernel(p);
  const size_t shared = (static_cast<size_t>(p.num_requests) + 1) * sizeof(int);
  const int blocks = grid_blocks(k);
  if (p.state_slots() <= kMaxCachedSlots) {
    launch_dependent(compressor_step_kernel<true>, blocks, kThreads, shared, stream, k);
  } else {
    launch_dependent(compressor_step_kernel<false>, blocks, kThreads, shared, stream, k);
  }
  return cudaGetLastError();
}

}  // namespace dsv4::ops::cuda
