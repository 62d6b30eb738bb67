#include "ops/cuda/indexer_scores.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>

#include "ops/cuda/launch.cuh"

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

template <IndexKeyDtype kDtype>
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
  const int32_t block = table[entry0 / epb];
  const int64_t run = p.keys.run_offset(block);
  const int in_block0 = static_cast<int>(entry0 % epb);
  constexpr int kRowBytes = kDtype == IndexKeyDtype::kFp8 ? kHeadDim : 2 * kHeadDim;
#pragma unroll
  for (int m = 0; m < 2; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = 16 * m + 8 * h + g;
      if (entry0 + r < visible) {
        const uint4* src = reinterpret_cast<const uint4*>(pool + run + static_cast<int64_t>(in_block0 + r) * kRowBytes +
                                                          t * (kRowBytes / 4));
#pragma unroll
        for (int v = 0; v < KeyTile<kDtype>::kVectors; ++v) tile.raw[m][h][v] = __ldg(src + v);
      }
    }
  if constexpr (kDtype == IndexKeyDtype::kFp8) {
    const int r = 16 * (t >> 1) + 8 * (t & 1) + g;  // the row this lane writes
    if (entry0 + r < visible)
      tile.scale = __ldg(reinterpret_cast<const float*>(pool + run + static_cast<int64_t>(epb) * kHeadDim +
                                                        4 * static_cast<int64_t>(in_block0 + r)));
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
  const int32_t request = p.token_request[token];
  const int64_t entries = p.request_entries[request];
  const int64_t causal = (static_cast<int64_t>(p.token_position[token]) + 1) / p.compress_ratio;
  int64_t visible = entries < causal ? entries : causal;
  visible = visible < 0 ? 0 : visible > p.max_entries ? p.max_entries : visible;
  const int32_t* table = p.block_tables + static_cast<int64_t>(request) * p.block_table_stride;
  const auto* pool = reinterpret_cast<const unsigned char*>(p.pool);
  float* out = p.scores + token * p.max_entries;
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
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    w[j][0] = w_smem[8 * j + 2 * t];
    w[j][1] = w_smem[8 * j + 2 * t + 1];
  }
  const unsigned char* q_lane = q_smem + g * kQRowBytes + t * 64;  // head g of n-tile 0, channel 32t

  KeyTile<kDtype> tile;
  load_tile<kDtype>(p, pool, table, first_entry + warp * kWarpEntries, visible, g, t, tile);
  for (int it = 0; it < tiles_per_cta; ++it) {
    const int64_t entry0 = first_entry + static_cast<int64_t>(it) * kCtaEntries + warp * kWarpEntries;
    if (entry0 >= p.max_entries) break;
    const KeyTile<kDtype> current = tile;
    if (it + 1 < tiles_per_cta) load_tile<kDtype>(p, pool, table, entry0 + kCtaEntries, visible, g, t, tile);

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
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          part[m][0] += w[j][0] * fmaxf(acc[m][j][0], 0.0f) + w[j][1] * fmaxf(acc[m][j][1], 0.0f);
          part[m][1] += w[j][0] * fmaxf(acc[m][j][2], 0.0f) + w[j][1] * fmaxf(acc[m][j][3], 0.0f);
        }
    }
    const float scale = current.scale;
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        part[m][h] += __shfl_xor_sync(0xffffffffu, part[m][h], 1);
        part[m][h] += __shfl_xor_sync(0xffffffffu, part[m][h], 2);
      }
    // Lane t writes row 16·(t>>1) + 8·(t&1) + g; the FP8 scale is positive, so it commutes with relu.
    const float mine = t == 0 ? part[0][0] : t == 1 ? part[0][1] : t == 2 ? part[1][0] : part[1][1];
    const int64_t row = entry0 + 16 * (t >> 1) + 8 * (t & 1) + g;
    if (row < p.max_entries)
      out[row] = row < visible ? (kDtype == IndexKeyDtype::kFp8 ? mine * scale : mine) : -INFINITY;
  }
#endif
}

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
  // Enough CTAs for about two waves, each scoring several consecutive tiles so q is read from L2 once per tile run.
  const int64_t tiles = (p.max_entries + kCtaEntries - 1) / kCtaEntries;
  const int64_t resident = static_cast<int64_t>(multiprocessors()) * 3;
  const int64_t per_cta = std::max<int64_t>(1, std::min<int64_t>(32, tiles * p.num_tokens / (2 * resident)));
  const dim3 grid(static_cast<unsigned>((tiles + per_cta - 1) / per_cta), static_cast<unsigned>(p.num_tokens));
  if (p.keys.dtype == IndexKeyDtype::kFp8)
    launch_dependent(indexer_scores_kernel<IndexKeyDtype::kFp8, 3>, grid, kWarps * 32, 0, stream, p,
                     static_cast<int>(per_cta));
  else
    launch_dependent(indexer_scores_kernel<IndexKeyDtype::kBf16, 2>, grid, kWarps * 32, 0, stream, p,
                     static_cast<int>(per_cta));
  return cudaGetLastError();
}

}  // namespace dsv4::ops::cuda
