#include "ops/cuda/indexer_scores.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdlib>

#include "ops/cuda/bf16.cuh"
#include "ops/cuda/launch.cuh"
#include "ops/cuda/warpgroup_dispatch.h"
#include "ops/cuda/wgmma.cuh"

namespace dsv4::ops::cuda {
namespace {

constexpr int kHeads = 64;
constexpr int kHeadDim = 128;
constexpr int kWarps = 4;
constexpr int kWarpEntries = 32;                      // two m16 tiles
constexpr int kCtaEntries = kWarps * kWarpEntries;    // 128
constexpr int kQRowBytes = kHeadDim * 2 + 8;  // padded by 8 B: a warp's B loads (8 heads × 4 offsets) take 2 wavefronts

// The k dimension is permuted (the dot product does not care, A and B agree): in k-step s, the logical
// k {2t, 2t+1, 2t+8, 2t+9} of lane quad position t are physical channels 32t + 4s + {0, 1, 2, 3}. So a lane reads
// the contiguous channels [32t, 32t + 32) of its key rows, and one 8-byte shared load gives its B fragment.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two e4m3 bytes -> bf16x2, exactly: move sign, exponent and mantissa into bf16 position (the e4m3 exponent lands
// in the low bits of the bf16 exponent), then multiply by 2^(127 − 7) to rebias; e4m3 subnormals become bf16
// subnormals first and come out normal.
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint32_t word, uint32_t selector) {
  const uint32_t spread = __byte_perm(word, 0, selector);
  const uint32_t bits = (spread & 0x80008000u) | ((spread & 0x7f007f00u) >> 4);
  __nv_bfloat162 value = *reinterpret_cast<const __nv_bfloat162*>(&bits);
  const __nv_bfloat162 rebias = __floats2bfloat162_rn(0x1p120f, 0x1p120f);
  value = __hmul2(value, rebias);
  return *reinterpret_cast<const uint32_t*>(&value);
}

template <IndexKeyDtype kDtype>
struct KeyTile {
  // [m][h][words]: row 16m + 8h + g of the warp tile, the lane's 32 channels (32 B of e4m3 or 64 B of bf16).
  static constexpr int kVectors = kDtype == IndexKeyDtype::kFp8 ? 2 : 4;
  uint4 raw[2][2][kVectors];
  float scale;  // FP8: scale of the row this lane writes
};

struct WarpTile {
  int64_t entry0;
  int64_t run;        // byte offset of the layer's run in the block holding the tile
  int32_t in_block0;  // entry0 % entries_per_block
};

// Rows of a lane: row group m (16 rows from entry0 + kGroupStride·m, in one cache block since entries_per_block is
// a multiple of 32 and groups start 16-aligned), rows 8h + g of it; the lane's 32 channels [32t, 32t + 32).
template <IndexKeyDtype kDtype, int kGroupStride>
__device__ __forceinline__ void load_tile(const IndexerScoresParams& p, const unsigned char* __restrict__ pool,
                                          const int32_t* __restrict__ table, int64_t entry0, int64_t visible,
                                          int g, int t, KeyTile<kDtype>& tile) {
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int v = 0; v < KeyTile<kDtype>::kVectors; ++v) tile.raw[m][h][v] = make_uint4(0, 0, 0, 0);
  tile.scale = 0;
  if (entry0 >= visible) return;
  const int epb = p.keys.entries_per_block;
  constexpr int kRowBytes = kDtype == IndexKeyDtype::kFp8 ? kHeadDim : 2 * kHeadDim;
#pragma unroll
  for (int m = 0; m < 2; ++m) {
    const int64_t group0 = entry0 + kGroupStride * m;
    if (group0 >= visible) break;
    const int64_t run = p.keys.run_offset(table[group0 / epb]);
    const int in_block0 = static_cast<int>(group0 % epb);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = 8 * h + g;
      if (group0 + r < visible) {
        const uint4* src = reinterpret_cast<const uint4*>(pool + run + static_cast<int64_t>(in_block0 + r) * kRowBytes +
                                                          t * (kRowBytes / 4));
#pragma unroll
        for (int v = 0; v < KeyTile<kDtype>::kVectors; ++v) tile.raw[m][h][v] = __ldg(src + v);
      }
    }
    if constexpr (kDtype == IndexKeyDtype::kFp8) {
      // The scale of the row this lane writes: row group t >> 1, row 8·(t & 1) + g.
      const int r = 8 * (t & 1) + g;
      if (m == (t >> 1) && group0 + r < visible)
        tile.scale = __ldg(reinterpret_cast<const float*>(pool + run + static_cast<int64_t>(epb) * kHeadDim +
                                                          4 * static_cast<int64_t>(in_block0 + r)));
    }
  }
}

// The A fragments of k-step s for both m-tiles, from the raw key bytes.
template <IndexKeyDtype kDtype>
__device__ __forceinline__ void fragments_of_step(const KeyTile<kDtype>& tile, int s, uint32_t (&a)[2][4]) {
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if constexpr (kDtype == IndexKeyDtype::kFp8) {
        // word s of the row: channels 32t + 4s .. +3
        const uint4& vec = tile.raw[m][h][s / 4];
        const uint32_t word = (s % 4 == 0) ? vec.x : (s % 4 == 1) ? vec.y : (s % 4 == 2) ? vec.z : vec.w;
        a[m][h] = e4m3x2_to_bf16x2(word, 0x1404);      // channels +0, +1: logical k 2t, 2t+1
        a[m][2 + h] = e4m3x2_to_bf16x2(word, 0x3424);  // channels +2, +3: logical k 2t+8, 2t+9
      } else {
        // bf16 words 2s, 2s+1 of the row
        const uint4& vec = tile.raw[m][h][s / 2];
        a[m][h] = (s % 2 == 0) ? vec.x : vec.z;
        a[m][2 + h] = (s % 2 == 0) ? vec.y : vec.w;
      }
    }
}

// What a query token's CTA reads and writes: its request's block table, the visible entries (cached and causal,
// MODEL.md "Lightning indexer": min(entries, (position + 1) div ratio), clamped to the row), its row of scores.
struct TokenView {
  int64_t visible;
  const int32_t* table;
  float* out;
};

__device__ __forceinline__ TokenView token_view(const IndexerScoresParams& p, int64_t token) {
  const int32_t request = p.token_request[token];
  const int64_t entries = p.request_entries[request];
  const int64_t causal = (static_cast<int64_t>(p.token_position[token]) + 1) / p.compress_ratio;
  int64_t visible = entries < causal ? entries : causal;
  visible = visible < 0 ? 0 : visible > p.max_entries ? p.max_entries : visible;
  return {visible, p.block_tables + static_cast<int64_t>(request) * p.block_table_stride,
          p.scores + token * p.max_entries};
}

// The head weights of a lane's columns of the MMA tiles: heads 8j + 2t and 8j + 2t + 1 of n-tile j.
__device__ __forceinline__ void load_head_weights(const float* w_smem, int t, float (&w)[8][2]) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    w[j][0] = w_smem[8 * j + 2 * t];
    w[j][1] = w_smem[8 * j + 2 * t + 1];
  }
}

// kDeepSeek's term of one head (indexer_scores_bf16): bf16(w · relu(bf16(q·k))).
__device__ __forceinline__ float deepseek_term(float w, float dot) {
  return bf16_round(__fmul_rn(fmaxf(bf16_round(dot), 0.0f), w));
}

// part[m][h]: a lane's sums over its heads for its rows of group m, h; the quad (lanes sharing g) adds them up,
// then lane t writes the score of `row` (its part[t >> 1][t & 1]): the FP8 scale (positive, so it commutes with
// relu) applied, −inf past the visible entries.
template <IndexKeyDtype kDtype>
__device__ __forceinline__ void write_score(float (&part)[2][2], int t, int64_t row, const TokenView& view,
                                            int64_t max_entries, float scale, bool deepseek) {
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      part[m][h] += __shfl_xor_sync(0xffffffffu, part[m][h], 1);
      part[m][h] += __shfl_xor_sync(0xffffffffu, part[m][h], 2);
    }
  float mine = t == 0 ? part[0][0] : t == 1 ? part[0][1] : t == 2 ? part[1][0] : part[1][1];
  if (deepseek) mine = bf16_round(mine);  // kDeepSeek: the score is a bf16 tensor
  if (row < max_entries)
    view.out[row] = row < view.visible ? (kDtype == IndexKeyDtype::kFp8 ? mine * scale : mine) : -INFINITY;
}

template <IndexKeyDtype kDtype, int kMinBlocks>
__global__ void __launch_bounds__(kWarps * 32, kMinBlocks)
    indexer_scores_kernel(const IndexerScoresParams p, int tiles_per_cta) {
  wait_for_prior_grid();
  allow_dependents();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // bf16 mma.sync needs sm_80+; the host wrapper refuses to launch such a build (see below)
#else
  __shared__ __align__(16) unsigned char q_smem[kHeads * kQRowBytes];
  __shared__ float w_smem[kHeads];
  const int64_t token = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  const TokenView view = token_view(p, token);
  const int64_t visible = view.visible;
  const int32_t* table = view.table;
  const auto* pool = reinterpret_cast<const unsigned char*>(p.pool);
  const int64_t first_entry = static_cast<int64_t>(blockIdx.x) * tiles_per_cta * kCtaEntries;

  // q of the token -> shared memory (16 B per thread per step), head weights too.
  const uint4* q = reinterpret_cast<const uint4*>(p.q + token * kHeads * kHeadDim);
  for (int i = threadIdx.x; i < kHeads * kHeadDim / 8; i += kWarps * 32) {
    const int head = i / (kHeadDim / 8), chunk = i % (kHeadDim / 8);
    const uint4 v = __ldg(q + i);
    // the padded rows are only 8-byte aligned
    uint2* dst = reinterpret_cast<uint2*>(q_smem + head * kQRowBytes + chunk * 16);
    dst[0] = make_uint2(v.x, v.y);
    dst[1] = make_uint2(v.z, v.w);
  }
  if (threadIdx.x < kHeads) w_smem[threadIdx.x] = p.weights[token * kHeads + threadIdx.x] * p.softmax_scale;
  __syncthreads();
  float w[8][2];
  load_head_weights(w_smem, t, w);
  const unsigned char* q_lane = q_smem + g * kQRowBytes + t * 64;  // head g of n-tile 0, channel 32t

  KeyTile<kDtype> tile;
  load_tile<kDtype, 16>(p, pool, table, first_entry + warp * kWarpEntries, visible, g, t, tile);
  for (int it = 0; it < tiles_per_cta; ++it) {
    const int64_t entry0 = first_entry + static_cast<int64_t>(it) * kCtaEntries + warp * kWarpEntries;
    if (entry0 >= p.max_entries) break;
    const KeyTile<kDtype> current = tile;
    if (it + 1 < tiles_per_cta) load_tile<kDtype, 16>(p, pool, table, entry0 + kCtaEntries, visible, g, t, tile);

    float part[2][2] = {{0, 0}, {0, 0}};  // [m][h]: Σ over this lane's heads of w · relu(q · k), rows 16m + 8h + g
    if (entry0 < visible) {
      // k-steps outside, the 8 head tiles inside: 16 independent accumulator chains hide the mma latency (the
      // head-tile-outer order left 2 chains of 8 dependent mma and ran at ~240 TFLOP/s).
      float acc[2][8][4];
#pragma unroll
      for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[m][j][i] = 0.0f;
#pragma unroll
      for (int s = 0; s < 8; ++s) {
        uint32_t a[2][4];
        fragments_of_step<kDtype>(current, s, a);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const uint2 b = *reinterpret_cast<const uint2*>(q_lane + j * 8 * kQRowBytes + s * 8);
          mma_bf16(acc[0][j], a[0], b.x, b.y);
          mma_bf16(acc[1][j], a[1], b.x, b.y);
        }
      }
      if (p.deepseek_roundings) {
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int e = 0; e < 4; ++e) part[m][e / 2] += deepseek_term(w[j][e % 2], acc[m][j][e]);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int m = 0; m < 2; ++m) {
            part[m][0] += w[j][0] * fmaxf(acc[m][j][0], 0.0f) + w[j][1] * fmaxf(acc[m][j][1], 0.0f);
            part[m][1] += w[j][0] * fmaxf(acc[m][j][2], 0.0f) + w[j][1] * fmaxf(acc[m][j][3], 0.0f);
          }
      }
    }
    // Lane t writes row 16·(t>>1) + 8·(t&1) + g.
    write_score<kDtype>(part, t, entry0 + 16 * (t >> 1) + 8 * (t & 1) + g, view, p.max_entries, current.scale,
                        p.deepseek_roundings);
  }
#endif
}

// ---- The warpgroup-MMA kernel (sm_90a wgmma; the default on a Hopper, DSV4_INDEXER_KERNEL=mma selects the one
// above) ----
//
// Same grid, 128-entry tiles, per-lane key loads, dequantization and epilogue as indexer_scores_kernel. The mma.sync
// kernel is issue-bound with FP8 keys (~260 TFLOP/s, half the copy bandwidth: docs/kernels/indexer_topk.md): 128
// mma per warp and tile. Here the CTA is one warpgroup and the tile two m64 row groups (entries 64m + 16·warp + …):
// each row group is 8 wgmma m64n64k16 with the dequantized keys as the A operand from registers (the m16n8k16 A
// fragments the mma.sync kernel builds) and q as the B operand from shared memory, 16 wgmma per tile in all. The k
// permutation of the fragments (channels 32t + 4s + … of lane t in k-step s) is applied to q once, when it is
// stored: its logical k of step s are the physical channels physical_channel(16s + kk).
namespace warpgroup_mma {

constexpr int kQBlockBytes = kHeads * 128;  // one 64-channel column block of q: 64 head rows × 128 B

__device__ __forceinline__ int physical_channel(int k) {
  const int step = k >> 4, kk = k & 15;
  return 32 * ((kk & 7) >> 1) + 4 * step + 2 * (kk >> 3) + (kk & 1);
}

// Four e4m3 bytes -> two f16x2 (bytes 0-1, bytes 2-3), exactly: one hardware conversion per pair (sm_89+), where
// the bf16 route of the mma.sync kernel takes five instructions. Every e4m3 value is an f16 value.
__device__ __forceinline__ void e4m3x4_to_f16x2x2(uint32_t word, uint32_t& low, uint32_t& high) {
  asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %2;\ncvt.rn.f16x2.e4m3x2 %0, lo;\ncvt.rn.f16x2.e4m3x2 %1, hi;\n}\n"
      : "=r"(low), "=r"(high)
      : "r"(word));
}

// The A fragments of k-step s for both row groups: FP8 keys as f16 (the q they meet is f16 too, see the kernel).
template <IndexKeyDtype kDtype>
__device__ __forceinline__ void wgmma_fragments_of_step(const KeyTile<kDtype>& tile, int s, uint32_t (&a)[2][4]) {
  if constexpr (kDtype == IndexKeyDtype::kFp8) {
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint4& vec = tile.raw[m][h][s / 4];
        const uint32_t word = (s % 4 == 0) ? vec.x : (s % 4 == 1) ? vec.y : (s % 4 == 2) ? vec.z : vec.w;
        e4m3x4_to_f16x2x2(word, a[m][h], a[m][2 + h]);  // channels +0, +1 | +2, +3: logical k 2t, 2t+1 | 2t+8, 2t+9
      }
  } else {
    fragments_of_step<kDtype>(tile, s, a);
  }
}

// 16-byte chunk `chunk` (logical k 8·chunk …) of head row `head` in the 128-byte-swizzled K-major layout.
__device__ __forceinline__ uint32_t q_offset(int head, int chunk) {
  return static_cast<uint32_t>((chunk >> 3) * kQBlockBytes + head * 128 + (((chunk & 7) ^ (head & 7)) << 4));
}

template <IndexKeyDtype kDtype, int kMinBlocks>
__global__ void __launch_bounds__(kWarps * 32, kMinBlocks)
    indexer_scores_wgmma_kernel(const IndexerScoresParams p, int tiles_per_token) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  wait_for_prior_grid();
  allow_dependents();
  __shared__ __align__(128) unsigned char q_buffer[2 * kQBlockBytes + 1024];  // aligned to 1024 below
  __shared__ __align__(16) uint32_t q_raw[kHeads * kHeadDim / 2];            // q as it comes, bf16 pairs
  __shared__ float w_smem[kHeads];
  __shared__ uint32_t warp_largest[kWarps];
  const uint32_t q_unaligned = static_cast<uint32_t>(__cvta_generic_to_shared(q_buffer));
  const uint32_t q_pad = (1024u - (q_unaligned & 1023u)) & 1023u;
  unsigned char* q_smem = q_buffer + q_pad;
  const uint32_t q_base = q_unaligned + q_pad;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane >> 2, t = lane & 3;
  const auto* pool = reinterpret_cast<const unsigned char*>(p.pool);

  // The CTA's share of the (token, tile) items, token-major, split evenly over a grid of one wave: every CTA
  // finishes at about the same time (a grid of fixed-length runs over several waves left the last wave part
  // empty: 2.6 waves took 3 at 32K × 128). A share that crosses tokens is scored as one run of tiles per token,
  // q staged at the start of each.
  // Items, tiles and entries fit 32 bits (65,535 tokens × 2,048 tiles); 32-bit counters keep the FP8 kernel
  // free of spills at 3 CTAs an SM.
  const int items = tiles_per_token * p.num_tokens;
  int item = static_cast<int>(static_cast<int64_t>(items) * blockIdx.x / gridDim.x);
  const int end = static_cast<int>(static_cast<int64_t>(items) * (blockIdx.x + 1) / gridDim.x);
  while (item < end) {
    const int token = item / tiles_per_token;
    const int run_end = min(end, (token + 1) * tiles_per_token);
    const int first_entry = (item - token * tiles_per_token) * kCtaEntries;
    const int run_tiles = run_end - item;
    item = run_end;
    const TokenView view = token_view(p, token);
    const int64_t visible = view.visible;
    const int32_t* table = view.table;

    // The first keys are in flight while q is staged and permuted.
    KeyTile<kDtype> tile;
    load_tile<kDtype, 64>(p, pool, table, first_entry + 16 * warp, visible, g, t, tile);
    __syncthreads();  // the previous run's reads of q and the weights are done (wgmma waited in every warp)
    const uint4* q = reinterpret_cast<const uint4*>(p.q + static_cast<int64_t>(token) * kHeads * kHeadDim);
    uint32_t largest = 0;  // FP8: max |q| of the token as bf16 magnitude bits (ordered like the values)
    for (int i = tid; i < kHeads * kHeadDim / 8; i += kWarps * 32) {
      const uint4 v = __ldg(q + i);
      reinterpret_cast<uint4*>(q_raw)[i] = v;
      if constexpr (kDtype == IndexKeyDtype::kFp8)
        largest = __vmaxu2(largest, __vmaxu2(__vmaxu2(v.x & 0x7fff7fffu, v.y & 0x7fff7fffu),
                                             __vmaxu2(v.z & 0x7fff7fffu, v.w & 0x7fff7fffu)));
    }
    // FP8 keys meet q as f16 (11 significant bits, bf16 has 8), scaled per token by 2^-e so that max |q| lands in
    // [2^14, 2^15): every element within 2^31 of the largest converts exactly, and 2^e goes into the head weights
    // (relu commutes with a positive scale). So the products are those of the bf16 q, as in the CPU twin.
    if constexpr (kDtype == IndexKeyDtype::kFp8) {
      largest = __reduce_max_sync(0xffffffffu, __vmaxu2(largest, largest >> 16) & 0xffffu);
      if (lane == 0) warp_largest[warp] = largest;
    }
    __syncthreads();
    int q_exponent = 0;
    if constexpr (kDtype == IndexKeyDtype::kFp8) {
      largest = max(max(warp_largest[0], warp_largest[1]), max(warp_largest[2], warp_largest[3]));
      if (largest != 0) q_exponent = min(60, max(-60, static_cast<int>(largest >> 7) - 127 - 14));
    }
    if (tid < kHeads)
      w_smem[tid] = p.weights[static_cast<int64_t>(token) * kHeads + tid] * p.softmax_scale *
                    __int_as_float((127 + q_exponent) << 23);
    const float q_scale = __int_as_float((127 - q_exponent) << 23);
    // Logical k pairs (2e, 2e + 1) of a chunk are physical neighbours (physical_channel keeps the low bit).
    for (int i = tid; i < kHeads * 16; i += kWarps * 32) {
      const int head = i >> 4, chunk = i & 15;
      uint32_t words[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        words[e] = q_raw[(head * kHeadDim + physical_channel(8 * chunk + 2 * e)) / 2];
        if constexpr (kDtype == IndexKeyDtype::kFp8) {
          const __half2 pair = __floats2half2_rn(__uint_as_float(words[e] << 16) * q_scale,
                                                 __uint_as_float(words[e] & 0xffff0000u) * q_scale);
          words[e] = *reinterpret_cast<const uint32_t*>(&pair);
        }
      }
      *reinterpret_cast<uint4*>(q_smem + q_offset(head, chunk)) = make_uint4(words[0], words[1], words[2], words[3]);
    }
    fence_proxy_async_shared();  // q's generic stores before wgmma's async-proxy reads
    __syncthreads();
    float w[8][2];
    load_head_weights(w_smem, t, w);

    for (int it = 0; it < run_tiles; ++it) {
      const int tile0 = first_entry + it * kCtaEntries;
      // Every fragment of the tile first (wgmma reads them asynchronously), then the next tile's loads go out
      // into the same registers: no second copy of the raw tile is live (3 CTAs an SM without spills).
      const bool any = tile0 < visible;  // uniform over the warpgroup, as wgmma needs
      uint32_t a[2][8][4];
      if (any) {
#pragma unroll
        for (int s = 0; s < 8; ++s) {
          uint32_t step[2][4];
          wgmma_fragments_of_step<kDtype>(tile, s, step);
#pragma unroll
          for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int i = 0; i < 4; ++i) a[m][s][i] = step[m][i];
        }
      }
      const float scale = tile.scale;
      if (it + 1 < run_tiles)
        load_tile<kDtype, 64>(p, pool, table, tile0 + kCtaEntries + 16 * warp, visible, g, t, tile);

      // [m][h]: Σ over this lane's heads of w · relu(k · q), rows 64m + 16·warp + 8h + g
      float part[2][2] = {{0, 0}, {0, 0}};
      if (any) {
        // One row group at a time (one accumulator tile live), so the kernel fits 3 CTAs an SM without spills.
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          float acc[32];
          wgmma_fence();
#pragma unroll
          for (int s = 0; s < 8; ++s) {
            const uint64_t q_step = smem_descriptor(q_base + (s >> 2) * kQBlockBytes + (s & 3) * 32, 16, 1024);
            if constexpr (kDtype == IndexKeyDtype::kFp8)
              wgmma_m64n64k16_rs_f16(acc, a[m][s], q_step, s > 0);
            else
              wgmma_m64n64k16_rs(acc, a[m][s], q_step, s > 0);
          }
          wgmma_commit();
          wgmma_wait<0>();
          // acc[4j + e]: entry row 16·warp + g + 8·(e / 2) of group m, head 8j + 2t + e % 2. Fused multiply-adds:
          // fewer instructions than the mma.sync kernel's sum of products (the issue rate is a limit here).
          if (p.deepseek_roundings) {
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
              for (int e = 0; e < 4; ++e) part[m][e / 2] += deepseek_term(w[j][e % 2], acc[4 * j + e]);
          } else {
#pragma unroll
            for (int j = 0; j < 8; ++j) {
              part[m][0] = fmaf(w[j][0], fmaxf(acc[4 * j], 0.0f), part[m][0]);
              part[m][0] = fmaf(w[j][1], fmaxf(acc[4 * j + 1], 0.0f), part[m][0]);
              part[m][1] = fmaf(w[j][0], fmaxf(acc[4 * j + 2], 0.0f), part[m][1]);
              part[m][1] = fmaf(w[j][1], fmaxf(acc[4 * j + 3], 0.0f), part[m][1]);
            }
          }
        }
      }
      // Lane t writes row 64·(t>>1) + 16·warp + 8·(t&1) + g.
      write_score<kDtype>(part, t, tile0 + 64 * (t >> 1) + 16 * warp + 8 * (t & 1) + g, view, p.max_entries, scale,
                          p.deepseek_roundings);
    }
  }
#else
  __trap();  // not sm_90a code: use_warpgroup_mma (ops/cuda/warpgroup_dispatch.h) never launches it there
#endif
}

}  // namespace warpgroup_mma

int multiprocessors() {
  static const int count = [] {
    int device = 0, value = 0;
    if (cudaGetDevice(&device) != cudaSuccess || cudaDeviceGetAttribute(&value, cudaDevAttrMultiProcessorCount,
                                                                        device) != cudaSuccess)
      return 132;
    return value;
  }();
  return count;
}

// A build whose device code for this GPU is older than sm_80 has no bf16 mma (CMAKE_CUDA_ARCHITECTURES must name
// 90a for Hopper): refuse rather than trap.
bool has_tensor_core_build() {
  static const bool ok = [] {
    cudaFuncAttributes attributes{};
    if (cudaFuncGetAttributes(&attributes, indexer_scores_kernel<IndexKeyDtype::kFp8, 3>) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return attributes.binaryVersion >= 80;
  }();
  return ok;
}

}  // namespace

cudaError_t indexer_scores(const IndexerScoresParams& p, cudaStream_t stream) {
  if (!has_tensor_core_build()) return cudaErrorUnsupportedPtxVersion;
  if (p.heads != kHeads || p.keys.head_dim != kHeadDim || p.keys.entries_per_block % kWarpEntries != 0 ||
      p.compress_ratio <= 0)
    return cudaErrorInvalidValue;
  if (p.num_tokens == 0 || p.max_entries == 0) return cudaSuccess;
  if (p.num_tokens > 65535) return cudaErrorInvalidValue;
  // DSV4_INDEXER_KERNEL=mma runs the mma.sync kernel on a Hopper too.
  const bool wgmma = use_warpgroup_mma("DSV4_INDEXER_KERNEL");
  const bool fp8 = p.keys.dtype == IndexKeyDtype::kFp8;
  // Both kernels take (params, tiles): tiles per token for the wgmma kernel, tiles per CTA for the mma.sync one.
  auto kernel = wgmma ? (fp8 ? warpgroup_mma::indexer_scores_wgmma_kernel<IndexKeyDtype::kFp8, 3>
                             : warpgroup_mma::indexer_scores_wgmma_kernel<IndexKeyDtype::kBf16, 2>)
                      : (fp8 ? indexer_scores_kernel<IndexKeyDtype::kFp8, 3>
                             : indexer_scores_kernel<IndexKeyDtype::kBf16, 2>);
  static int resident_per_sm[2][2] = {};  // [wgmma][fp8], asked once per kernel
  int& per_sm = resident_per_sm[wgmma][fp8];
  if (per_sm == 0 && (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kWarps * 32, 0) != cudaSuccess ||
                      per_sm < 1)) {
    cudaGetLastError();
    per_sm = 2;
  }
  const int64_t tiles = (p.max_entries + kCtaEntries - 1) / kCtaEntries;
  const int64_t resident = static_cast<int64_t>(multiprocessors()) * per_sm;
  if (wgmma) {
    // The kernel counts items and entries of a token in 32 bits.
    if (tiles * p.num_tokens > INT32_MAX || tiles * kCtaEntries > INT32_MAX) return cudaErrorInvalidValue;
    // One wave, the (token, tile) items split evenly over it. DSV4_INDEXER_CTAS=N caps the grid (the tests use it
    // to make CTAs cross tokens at small shapes).
    int64_t ctas = std::min(tiles * p.num_tokens, resident);
    if (const char* cap = std::getenv("DSV4_INDEXER_CTAS"); cap != nullptr && std::atoll(cap) > 0)
      ctas = std::min(ctas, static_cast<int64_t>(std::atoll(cap)));
    launch_dependent(kernel, dim3(static_cast<unsigned>(ctas)), kWarps * 32, 0, stream, p, static_cast<int>(tiles));
    return cudaGetLastError();
  }
  // The mma.sync kernel: enough CTAs for about two waves, each scoring several consecutive tiles of one token so
  // q is read from L2 once per tile run.
  const int64_t per_cta = std::max<int64_t>(1, std::min<int64_t>(32, tiles * p.num_tokens / (2 * resident)));
  const dim3 grid(static_cast<unsigned>((tiles + per_cta - 1) / per_cta), static_cast<unsigned>(p.num_tokens));
  launch_dependent(kernel, grid, kWarps * 32, 0, stream, p, static_cast<int>(per_cta));
  return cudaGetLastError();
}

}  // namespace dsv4::ops::cuda
