#include "ops/cuda/sparse_attention.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "ops/cuda/device.h"
#include "ops/cuda/launch.cuh"
#include "ops/cuda/warpgroup_dispatch.h"
#include "ops/cuda/wgmma.cuh"

namespace dsv4::ops::cuda {
namespace {

constexpr int kThreads = 256;  // 8 warps
constexpr int kHeadsPerCta = 64;
constexpr int kTileKeys = 64;
constexpr float kLog2e = 1.4426950408889634f;

// Shared memory. Rows of 512 bf16 (1024 B, 64 chunks of 16 B) are stored with the chunk index XORed with
// (row mod 8), so the 8 row addresses of one ldmatrix hit 8 different bank groups; P rows (64 bf16, 8 chunks)
// likewise.
constexpr int kRowBytes = 2 * kKvHeadDim;
constexpr int kTileBytes = kTileKeys * kRowBytes;                                    // 65536
constexpr int kRawTileBytes = kTileKeys * (kKvFp8DataBytes + kKvFp8ScaleBytes);      // 37376
constexpr int kPBytes = kHeadsPerCta * kTileKeys * 2;                                 // 8192

template <KvEntryFormat kFormat>
struct SmemLayout {
  static constexpr bool kFp8 = kFormat == KvEntryFormat::kFp8;
  static constexpr int kKvStages = kFp8 ? 1 : 2;  // FP8: one bf16 tile, fed from two raw stages
  static constexpr int kQ = 0;
  static constexpr int kKv = kQ + kHeadsPerCta * kRowBytes;
  static constexpr int kRaw = kKv + kKvStages * kTileBytes;
  static constexpr int kP = kRaw + (kFp8 ? 2 * kRawTileBytes : 0);
  static constexpr int kRowMax = kP + kPBytes;                   // float [2][64]
  static constexpr int kRowSum = kRowMax + 2 * 64 * 4;           // float [2][64]
  static constexpr int kRowFinalMax = kRowSum + 2 * 64 * 4;      // float [64]
  static constexpr int kAlpha = kRowFinalMax + 64 * 4;           // float [64]
  static constexpr int kKeyData = kAlpha + 64 * 4;               // const uint8_t* [2][64]
  static constexpr int kKeyScales = kKeyData + 2 * 64 * 8;       // const uint8_t* [2][64]
  static constexpr int kBytes = kKeyScales + 2 * 64 * 8;
};
static_assert(SmemLayout<KvEntryFormat::kFp8>::kBytes <= 227 * 1024, "FP8 tile does not fit");
static_assert(SmemLayout<KvEntryFormat::kBf16>::kBytes <= 227 * 1024, "BF16 tiles do not fit");

__device__ __forceinline__ uint32_t row_offset(int row, int chunk) {
  return static_cast<uint32_t>(row * kRowBytes + ((chunk ^ (row & 7)) << 4));
}
__device__ __forceinline__ uint32_t p_offset(int row, int chunk) {
  return static_cast<uint32_t>(row * (kTileKeys * 2) + ((chunk ^ (row & 7)) << 4));
}

__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_8(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 8 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_one() { asm volatile("cp.async.wait_group 1;\n" ::); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}
// d = a·b + d, m16n8k16, bf16 operands, fp32 accumulators.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Two e4m3 bytes (low byte first) times a power-of-two scale, as a bf16 pair: exact (e4m3 → f16 → f32 are exact
// widenings, the scale multiply is exact, and a 4-bit significand fits bf16's 8).
__device__ __forceinline__ uint32_t dequant_pair(uint16_t pair, float scale) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair), __NV_E4M3);
  const float2 f = __half22float2(__half2(h));
  return pack_bf16(f.x * scale, f.y * scale);
}

// Inverse interleaved RoPE of one pair (ops/cpu/rope.cpp with inverse = true).
// The rotation's cosine and (negated) sine for `pair` at `position`.
__device__ __forceinline__ float2 inverse_rope_factors(const SparseAttentionParams& p, int pair, int position) {
  const float angle = p.rope_inv_freq[pair] * static_cast<float>(position);
  return make_float2(cosf(angle) * p.rope_attention_scaling, -sinf(angle) * p.rope_attention_scaling);
}
__device__ __forceinline__ void rotate_pair(float& a, float& b, float2 factors) {
  const float c = factors.x, s = factors.y;
  const float ra = a * c - b * s, rb = b * c + a * s;
  a = ra;
  b = rb;
}
__device__ __forceinline__ void inverse_rope_pair(float& a, float& b, const SparseAttentionParams& p, int pair,
                                                  int position) {
  rotate_pair(a, b, inverse_rope_factors(p, pair, position));
}

// What query token `token` reads (MODEL.md "Attention sublayer"): window positions max(0, t − W + 1) … t, then
// its compressed entries; key k of the concatenation lives at key_address(k).
struct QueryKeys {
  int64_t token = 0, table_row = 0;
  int position = 0, chunk_start = 0, window_keys = 0, num_keys = 0;
};
__device__ __forceinline__ QueryKeys query_keys(const SparseAttentionParams& p, int64_t token) {
  QueryKeys k;
  k.token = token;
  k.table_row = p.rows ? p.rows[token] : token;
  k.position = p.positions[token];
  k.chunk_start = p.chunk_starts ? p.chunk_starts[token] : INT_MAX;  // prefill: own chunk from p.chunk
  k.window_keys = static_cast<int>(k.position + 1 < p.window_size ? k.position + 1 : p.window_size);
  k.num_keys = k.window_keys + (p.compressed_lengths ? p.compressed_lengths[token] : 0);
  return k;
}
// The entry of key k (data nullptr: masked, or past the query's keys).
template <KvEntryFormat kFormat>
__device__ __forceinline__ KvEntryAddress key_address(const SparseAttentionParams& p, const QueryKeys& keys, int k) {
  KvEntryAddress address;
  if (k < keys.window_keys) {
    const int window_position = keys.position - keys.window_keys + 1 + k;
    address = keys.chunk_start <= window_position
                  ? kv_entry_address(p.chunk, kFormat, keys.table_row, window_position - keys.chunk_start)
                  : kv_entry_address(p.window, kFormat, keys.table_row, window_position);
  } else if (k < keys.num_keys) {
    const int32_t entry = p.compressed_indices[keys.token * p.compressed_stride + (k - keys.window_keys)];
    if (entry >= 0) address = kv_entry_address(p.compressed, kFormat, keys.table_row, entry);
  }
  return address;
}

// The key tiles split `split` of `splits` takes: [begin, end) of the query's ceil(num_keys / 64) tiles.
struct TileRange {
  int begin = 0, end = 0;
};
__device__ __forceinline__ TileRange split_tiles(int num_keys, int splits, int split) {
  const int num_tiles = (num_keys + kTileKeys - 1) / kTileKeys;
  const int per_split = (num_tiles + splits - 1) / splits;
  const int begin = min(num_tiles, split * per_split);
  return {begin, min(num_tiles, begin + per_split)};
}
// Threads 0..63 resolve key `tid` of `tile` into its slot's entry addresses (data nullptr: masked).
template <KvEntryFormat kFormat>
__device__ __forceinline__ void resolve_tile_keys(const SparseAttentionParams& p, const QueryKeys& keys, int tile,
                                                  int tid, const uint8_t** data, const uint8_t** scales) {
  if (tid >= kTileKeys) return;
  const KvEntryAddress address = key_address<kFormat>(p, keys, tile * kTileKeys + tid);
  data[tid] = address.data;
  scales[tid] = address.scales;
}

// Asynchronous copies of a resolved tile (entry addresses `data`, `scales` per key) into shared memory; masked
// keys are zero-filled so that P·V sees zeros (`any` is a valid address the zero-fill never reads). BF16: each
// 16-byte chunk c of key k at stage + offset(k, c). FP8: the raw 576-byte rows, then the 8-byte scale groups.
template <typename Offset>
__device__ __forceinline__ void load_bf16_tile(uint32_t stage, const uint8_t* const* data, const void* any, int tid,
                                               Offset offset) {
#pragma unroll
  for (int i = 0; i < kTileKeys * 64 / kThreads; ++i) {
    const int u = tid + i * kThreads, key = u / 64, chunk = u % 64;
    const uint8_t* src = data[key];
    cp_async_16(stage + offset(key, chunk), src ? src + chunk * 16 : any, src != nullptr);
  }
}
// The CTA's 64 query heads (512 bf16 each, contiguous from q_token) into shared memory, chunk c of head h at
// stage + offset(h, c): the same 64 × 64 chunks as a bf16 key tile.
template <typename Offset>
__device__ __forceinline__ void load_query_heads(uint32_t stage, const uint16_t* q_token, int tid, Offset offset) {
#pragma unroll
  for (int i = 0; i < kHeadsPerCta * 64 / kThreads; ++i) {
    const int u = tid + i * kThreads, h = u / 64, chunk = u % 64;
    cp_async_16(stage + offset(h, chunk), q_token + h * kKvHeadDim + chunk * 8, true);
  }
}
__device__ __forceinline__ void load_fp8_raw_tile(uint32_t stage, const uint8_t* const* data,
                                                  const uint8_t* const* scales, const void* any, int tid) {
  constexpr int kChunks = kKvFp8DataBytes / 16;  // 36
#pragma unroll
  for (int i = 0; i < kTileKeys * kChunks / kThreads; ++i) {
    const int u = tid + i * kThreads, key = u / kChunks, chunk = u % kChunks;
    const uint8_t* src = data[key];
    cp_async_16(stage + key * kKvFp8DataBytes + chunk * 16, src ? src + chunk * 16 : any, src != nullptr);
  }
  if (tid < kTileKeys) {
    const uint8_t* src = scales[tid];
    cp_async_8(stage + kTileKeys * kKvFp8DataBytes + tid * kKvFp8ScaleBytes, src ? src : any, src != nullptr);
  }
}
// A raw FP8 tile → bf16 rows at tile_bf16 + offset(key, chunk): 64 keys × 56 no-rope chunks of 8 e4m3 → 8 bf16
// (one scale per 64 channels, so per 8 chunks), and the 64 × 8 rope chunks as they are. One 16-byte destination
// chunk per thread, so 8 consecutive lanes fill the 8 chunks of one 128-byte segment of a row: no bank conflict
// in either layout (two chunks per thread cost 4-7-way conflicts, ncu).
template <typename Offset>
__device__ __forceinline__ void dequantize_tile(const uint8_t* raw, uint8_t* tile_bf16, int tid, Offset offset) {
  constexpr int kNopeChunks = kKvNopeDim / 8;  // 56
#pragma unroll
  for (int i = 0; i < kTileKeys * kNopeChunks / kThreads; ++i) {
    const int u = tid + i * kThreads, key = u / kNopeChunks, chunk = u % kNopeChunks;
    const uint2 bytes = *reinterpret_cast<const uint2*>(raw + key * kKvFp8DataBytes + chunk * 8);
    const uint8_t scale_byte = raw[kTileKeys * kKvFp8DataBytes + key * kKvFp8ScaleBytes + chunk / 8];
    const float scale = __uint_as_float(static_cast<uint32_t>(scale_byte) << 23);
    uint4 v;
    v.x = dequant_pair(bytes.x & 0xffff, scale);
    v.y = dequant_pair(bytes.x >> 16, scale);
    v.z = dequant_pair(bytes.y & 0xffff, scale);
    v.w = dequant_pair(bytes.y >> 16, scale);
    *reinterpret_cast<uint4*>(tile_bf16 + offset(key, chunk)) = v;
  }
#pragma unroll
  for (int i = 0; i < kTileKeys * 8 / kThreads; ++i) {
    const int u = tid + i * kThreads, key = u / 8, chunk = u % 8;
    *reinterpret_cast<uint4*>(tile_bf16 + offset(key, kNopeChunks + chunk)) =
        *reinterpret_cast<const uint4*>(raw + key * kKvFp8DataBytes + kKvNopeDim + chunk * 16);
  }
}

// Grid (splits, heads / 64, tokens). CTA (split, g, i): token i, heads 64g … 64g+63, its share of the key tiles.
template <KvEntryFormat kFormat, bool kSplit>
__global__ void __launch_bounds__(kThreads, 1)
    sparse_attention_kernel(const SparseAttentionParams p, const uint16_t* __restrict__ q, uint16_t* __restrict__ out,
                            float* __restrict__ partial_o, float* __restrict__ partial_ml, int splits) {
  wait_for_prior_grid();
  allow_dependents();
  using L = SmemLayout<kFormat>;
  extern __shared__ __align__(128) uint8_t smem[];
  const uint32_t smem_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  float* row_max = reinterpret_cast<float*>(smem + L::kRowMax);
  float* row_sum = reinterpret_cast<float*>(smem + L::kRowSum);
  float* row_final_max = reinterpret_cast<float*>(smem + L::kRowFinalMax);
  float* alpha_of_row = reinterpret_cast<float*>(smem + L::kAlpha);
  const uint8_t** key_data = reinterpret_cast<const uint8_t**>(smem + L::kKeyData);
  const uint8_t** key_scales = reinterpret_cast<const uint8_t**>(smem + L::kKeyScales);

  const int split = blockIdx.x, head_group = blockIdx.y;
  const int64_t token = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const QueryKeys keys = query_keys(p, token);
  const int position = keys.position;
  const auto [tile_begin, tile_end] = split_tiles(keys.num_keys, splits, split);
  const uint16_t* q_token = q + (token * p.heads + int64_t{head_group} * kHeadsPerCta) * kKvHeadDim;

  auto resolve_tile = [&](int tile, int slot) {
    resolve_tile_keys<kFormat>(p, keys, tile, tid, key_data + slot * kTileKeys, key_scales + slot * kTileKeys);
  };
  auto load_tile = [&](int slot) {
    if constexpr (kFormat == KvEntryFormat::kBf16)
      load_bf16_tile(smem_base + L::kKv + slot * kTileBytes, key_data + slot * kTileKeys, q, tid, row_offset);
    else
      load_fp8_raw_tile(smem_base + L::kRaw + slot * kRawTileBytes, key_data + slot * kTileKeys,
                        key_scales + slot * kTileKeys, q, tid);
  };

  float acc[4][8][4];  // O rows (heads) 16·mt + …, dims 64·warp + 8·nt + …
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.0f;
  // S layout: warp (mw, nw) computes heads 16·mw … +15 against keys 32·nw … +31 of the tile.
  const int mw = warp & 3, nw = warp >> 2;
  const int row0 = 16 * mw + (lane >> 2), row1 = row0 + 8;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};  // log2 domain, rows row0 / row1
  const float scale_log2 = p.scale * kLog2e;

  if (tile_begin < tile_end) {
    resolve_tile(tile_begin, 0);
    load_query_heads(smem_base + L::kQ, q_token, tid, row_offset);
    __syncthreads();
    load_tile(0);
    cp_async_commit();
    for (int tile = tile_begin; tile < tile_end; ++tile) {
      const int slot = (tile - tile_begin) & 1;
      const bool has_next = tile + 1 < tile_end;
      if (has_next) resolve_tile(tile + 1, slot ^ 1);
      __syncthreads();  // next tile's addresses visible; the previous tile's readers are done with its stage
      if (has_next) load_tile(slot ^ 1);
      cp_async_commit();
      cp_async_wait_one();
      __syncthreads();  // this tile's bytes visible to every thread
      uint32_t kv_stage;
      if constexpr (kFormat == KvEntryFormat::kFp8) {
        const uint8_t* raw = smem + L::kRaw + slot * kRawTileBytes;
        uint8_t* tile_bf16 = smem + L::kKv;
        dequantize_tile(raw, tile_bf16, tid, row_offset);
        __syncthreads();
        kv_stage = smem_base + L::kKv;
      } else {
        kv_stage = smem_base + L::kKv + slot * kTileBytes;
      }

      // S = Q·Kᵀ for this warp's 16 heads × 32 keys over the 512 channels.
      float s[4][4];
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] = 0.0f;
#pragma unroll 4
      for (int ks = 0; ks < kKvHeadDim / 16; ++ks) {
        uint32_t a[4];
        ldmatrix_x4(a, smem_base + L::kQ + row_offset(16 * mw + (lane & 15), 2 * ks + (lane >> 4)));
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
          uint32_t b[4];
          const int key = 32 * nw + 16 * jj + (lane & 7) + ((lane >> 4) << 3);
          ldmatrix_x4(b, kv_stage + row_offset(key, 2 * ks + ((lane >> 3) & 1)));
          mma_bf16(s[2 * jj], a, b[0], b[1]);
          mma_bf16(s[2 * jj + 1], a, b[2], b[3]);
        }
      }
      // Online softmax (base 2): mask, tile row maxima shared between the two key halves, rescale, P → bf16.
      float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = 32 * nw + 8 * j + 2 * (lane & 3) + e;
          const bool valid = key_data[slot * kTileKeys + key] != nullptr;
          s[j][e] = valid ? s[j][e] * scale_log2 : -INFINITY;
          s[j][2 + e] = valid ? s[j][2 + e] * scale_log2 : -INFINITY;
          tile_max[0] = fmaxf(tile_max[0], s[j][e]);
          tile_max[1] = fmaxf(tile_max[1], s[j][2 + e]);
        }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
        tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
      }
      if ((lane & 3) == 0) {
        row_max[nw * 64 + row0] = tile_max[0];
        row_max[nw * 64 + row1] = tile_max[1];
      }
      __syncthreads();
      float shift[2], alpha[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = r == 0 ? row0 : row1;
        const float m_new = fmaxf(m_run[r], fmaxf(row_max[row], row_max[64 + row]));
        shift[r] = m_new == -INFINITY ? 0.0f : m_new;  // a row with no valid key yet keeps p = 0, not NaN
        alpha[r] = exp2f(m_run[r] - shift[r]);
        m_run[r] = m_new;
        l_run[r] *= alpha[r];
      }
      uint8_t* p_tile = smem + L::kP;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int key = 32 * nw + 8 * j + 2 * (lane & 3);
        const float p0 = exp2f(s[j][0] - shift[0]), p1 = exp2f(s[j][1] - shift[0]);
        const float p2 = exp2f(s[j][2] - shift[1]), p3 = exp2f(s[j][3] - shift[1]);
        l_run[0] += p0 + p1;
        l_run[1] += p2 + p3;
        *reinterpret_cast<uint32_t*>(p_tile + p_offset(row0, key >> 3) + (key & 7) * 2) = pack_bf16(p0, p1);
        *reinterpret_cast<uint32_t*>(p_tile + p_offset(row1, key >> 3) + (key & 7) * 2) = pack_bf16(p2, p3);
      }
      if (nw == 0 && (lane & 3) == 0) {
        alpha_of_row[row0] = alpha[0];
        alpha_of_row[row1] = alpha[1];
      }
      __syncthreads();

      // O = alpha·O + P·V: warp w owns channels 64·w … 64·w+63 of all 64 heads.
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
        const float a0 = alpha_of_row[16 * mt + (lane >> 2)], a1 = alpha_of_row[16 * mt + (lane >> 2) + 8];
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          acc[mt][nt][0] *= a0;
          acc[mt][nt][1] *= a0;
          acc[mt][nt][2] *= a1;
          acc[mt][nt][3] *= a1;
        }
      }
#pragma unroll
      for (int kk = 0; kk < kTileKeys / 16; ++kk) {
        uint32_t pa[4][4];
#pragma unroll
        for (int mt = 0; mt < 4; ++mt)
          ldmatrix_x4(pa[mt], smem_base + L::kP + p_offset(16 * mt + (lane & 15), 2 * kk + (lane >> 4)));
#pragma unroll
        for (int ntp = 0; ntp < 4; ++ntp) {
          uint32_t b[4];
          const int key = 16 * kk + (lane & 7) + (((lane >> 3) & 1) << 3);
          ldmatrix_x4_trans(b, kv_stage + row_offset(key, 8 * warp + 2 * ntp + (lane >> 4)));
#pragma unroll
          for (int mt = 0; mt < 4; ++mt) {
            mma_bf16(acc[mt][2 * ntp], pa[mt], b[0], b[1]);
            mma_bf16(acc[mt][2 * ntp + 1], pa[mt], b[2], b[3]);
          }
        }
      }
    }
  }

  // Row sums: over the 4 lanes of a row, then over the two key halves.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
  }
  if ((lane & 3) == 0) {
    row_sum[nw * 64 + row0] = l_run[0];
    row_sum[nw * 64 + row1] = l_run[1];
    if (nw == 0) {
      row_final_max[row0] = m_run[0];
      row_final_max[row1] = m_run[1];
    }
  }
  __syncthreads();

#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = 16 * mt + (lane >> 2) + 8 * half;
      const int64_t head = int64_t{head_group} * kHeadsPerCta + row;
      const float m = row_final_max[row], l = row_sum[row] + row_sum[64 + row];
      if constexpr (kSplit) {
        float* o = partial_o + ((int64_t{split} * p.tokens + token) * p.heads + head) * kKvHeadDim;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          const int dim = 64 * warp + 8 * nt + 2 * (lane & 3);
          *reinterpret_cast<float2*>(o + dim) = make_float2(acc[mt][nt][2 * half], acc[mt][nt][2 * half + 1]);
        }
        if (warp == 0 && (lane & 3) == 0) {
          float* ml = partial_ml + ((int64_t{split} * p.tokens + token) * p.heads + head) * 2;
          ml[0] = m;
          ml[1] = l;
        }
      } else {
        // The sink joins the denominator only: o = Σ p v / (Σ p + 2^(sink·log2e − m)); no key → zeros.
        const float inverse = l > 0.0f ? 1.0f / (l + exp2f(p.sinks[head] * kLog2e - m)) : 0.0f;
        uint16_t* o = out + (token * p.heads + head) * kKvHeadDim;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          const int dim = 64 * warp + 8 * nt + 2 * (lane & 3);
          float a = acc[mt][nt][2 * half] * inverse, b = acc[mt][nt][2 * half + 1] * inverse;
          if (dim >= kKvNopeDim) inverse_rope_pair(a, b, p, (dim - kKvNopeDim) / 2, position);
          *reinterpret_cast<uint32_t*>(o + dim) = pack_bf16(a, b);
        }
      }
    }
}

// ---- The warpgroup-MMA kernel (sm_90a wgmma; the default, DSV4_ATTENTION_KERNEL=mma selects the one above) ----
//
// Same grid, threads, key tiles, softmax and epilogue semantics as sparse_attention_kernel; the arithmetic runs
// on wgmma, which reads Q and the key tile straight from shared memory and keeps no operand in registers:
//   - tiles are stored as 8 column blocks of 64 channels, each [64 rows][128 B] with the 16-byte chunks XORed
//     with row mod 8 (wgmma's 128-byte swizzle atoms), so one layout serves as K-major A (Q), K-major B (K for
//     S = Q·Kᵀ) and MN-major B (V for P·V);
//   - each of the two warpgroups computes the whole S = Q·Kᵀ of the tile (64 heads × 64 keys, 32 wgmma
//     m64n64k16), so it holds complete rows: the online softmax needs no shared-memory exchange or barrier;
//   - P stays in registers as the A operand of O += P·V, and warpgroup g accumulates channels 256·g … 256·g+255
//     (4 wgmma m64n256k16, 128 fp32 accumulators a thread).
// S is computed twice (1.5× the minimal FLOPs), which buys two barriers fewer per tile and no P round trip
// through shared memory.
namespace warpgroup_mma {

constexpr int kColumnBlockBytes = kTileKeys * 128;  // 8192: 64 rows × 64 channels of bf16

__device__ __forceinline__ uint32_t tile_offset(int row, int chunk) {
  return static_cast<uint32_t>((chunk >> 3) * kColumnBlockBytes + row * 128 + (((chunk & 7) ^ (row & 7)) << 4));
}

template <KvEntryFormat kFormat>
struct Smem {
  static constexpr bool kFp8 = kFormat == KvEntryFormat::kFp8;
  static constexpr int kKvStages = kFp8 ? 1 : 2;  // FP8: one bf16 tile, fed from two raw stages
  static constexpr int kQ = 0;
  static constexpr int kKv = kQ + kTileBytes;  // 64 heads: the same bytes as a tile
  static constexpr int kRaw = kKv + kKvStages * kTileBytes;
  // Key addresses of three tiles: the tile being multiplied, the one loading, and the one after, which the
  // resolving threads may write while a slower warp still reads the current tile's masks (no barrier between
  // the softmax and the next iteration's resolve).
  static constexpr int kAddressSlots = 3;
  static constexpr int kKeyData = kRaw + (kFp8 ? 2 * kRawTileBytes : 0);        // const uint8_t* [3][64]
  static constexpr int kKeyScales = kKeyData + kAddressSlots * kTileKeys * 8;  // const uint8_t* [3][64]
  static constexpr int kBytes = kKeyScales + kAddressSlots * kTileKeys * 8;
  static constexpr int kAllocation = kBytes + 1024;  // the base is rounded up to the 1024-byte atom alignment
};
static_assert(Smem<KvEntryFormat::kFp8>::kAllocation <= 227 * 1024, "FP8 tiles do not fit");
static_assert(Smem<KvEntryFormat::kBf16>::kAllocation <= 227 * 1024, "BF16 tiles do not fit");
// The epilogue stages 64 rows of fp32 partials (512 + 8 floats each) over Q and the tiles.
static_assert(kHeadsPerCta * (kKvHeadDim + 8) * 4 <= Smem<KvEntryFormat::kBf16>::kKeyData, "staging does not fit");
static_assert(kHeadsPerCta * (kKvHeadDim + 8) * 4 <= Smem<KvEntryFormat::kFp8>::kKeyData, "staging does not fit");

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The dynamic shared memory from its first 1024-byte boundary (the 128-byte swizzle atoms' alignment; the
// allocations reserve 1024 bytes for it); `shared_address` gets its shared-space address.
__device__ __forceinline__ uint8_t* aligned_dynamic_smem(uint32_t& shared_address) {
  extern __shared__ __align__(1024) uint8_t smem_unaligned[];
  const uint32_t unaligned_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem_unaligned));
  const uint32_t pad = (1024u - (unaligned_base & 1023u)) & 1023u;
  shared_address = unaligned_base + pad;
  return smem_unaligned + pad;
}

// S = Q·Kᵀ of one tile: 64 heads × 64 keys over 512 channels, 16 channels per wgmma (32 bytes into a 128-byte
// row); each warpgroup computes the whole of it.
__device__ __forceinline__ void tile_scores(float (&s)[32], uint32_t q_stage, uint32_t kv_stage) {
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < kKvHeadDim / 16; ++ks) {
    const uint32_t offset = (ks >> 2) * kColumnBlockBytes + (ks & 3) * 32;
    wgmma_m64n64k16_ss(s, smem_descriptor(q_stage + offset, 16, 1024), smem_descriptor(kv_stage + offset, 16, 1024),
                       ks > 0);
  }
  wgmma_commit();
  wgmma_wait<0>();
}

// The online softmax (base 2) of one tile's scores over complete rows, then O += P·V over this warpgroup's 256
// channels. s[4j + e] is key 8j + 2·(lane % 4) + e % 2 of row lane/4 + 8·(e / 2); the 4 lanes of a quad hold a row
// between them. A key whose address in `tile_keys` is null is masked.
__device__ __forceinline__ void softmax_and_accumulate(float (&o)[128], float (&s)[32], float (&m_run)[2],
                                                       float (&l_run)[2], const uint8_t* const* tile_keys,
                                                       float scale_log2, uint32_t kv_stage, int group, int lane) {
  float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int key = 8 * j + 2 * (lane & 3) + e;
      const bool valid = tile_keys[key] != nullptr;
      s[4 * j + e] = valid ? s[4 * j + e] * scale_log2 : -INFINITY;
      s[4 * j + 2 + e] = valid ? s[4 * j + 2 + e] * scale_log2 : -INFINITY;
      tile_max[0] = fmaxf(tile_max[0], s[4 * j + e]);
      tile_max[1] = fmaxf(tile_max[1], s[4 * j + 2 + e]);
    }
  float shift[2], alpha[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
    tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
    const float m_new = fmaxf(m_run[r], tile_max[r]);
    shift[r] = m_new == -INFINITY ? 0.0f : m_new;  // a row with no valid key yet keeps p = 0, not NaN
    alpha[r] = exp2f(m_run[r] - shift[r]);
    m_run[r] = m_new;
    l_run[r] *= alpha[r];
  }
  uint32_t pa[4][4];  // P as the A operand, 16 keys per wgmma (the m16n8k16 A fragment of this warp's rows)
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float p0 = exp2f(s[4 * j] - shift[0]), p1 = exp2f(s[4 * j + 1] - shift[0]);
    const float p2 = exp2f(s[4 * j + 2] - shift[1]), p3 = exp2f(s[4 * j + 3] - shift[1]);
    l_run[0] += p0 + p1;
    l_run[1] += p2 + p3;
    pa[j >> 1][2 * (j & 1)] = pack_bf16(p0, p1);
    pa[j >> 1][2 * (j & 1) + 1] = pack_bf16(p2, p3);
  }
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    o[4 * j] *= alpha[0];
    o[4 * j + 1] *= alpha[0];
    o[4 * j + 2] *= alpha[1];
    o[4 * j + 3] *= alpha[1];
  }
  // O += P·V: keys 16·kk … (two 8-key groups, 1024 B apart) × this warpgroup's 256 channels (4 column blocks,
  // 8192 B apart).
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kTileKeys / 16; ++kk)
    wgmma_m64n256k16_rs_mn_major_b(
        o, pa[kk], smem_descriptor(kv_stage + 4 * group * kColumnBlockBytes + kk * 2048, kColumnBlockBytes, 1024), 1);
  wgmma_commit();
  wgmma_wait<0>();
}

// Completes this thread's two row sums over the 4 lanes of a quad (each warpgroup holds whole rows, so no
// exchange between the warpgroups).
__device__ __forceinline__ void reduce_row_sums(float (&l_run)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
  }
}

// The CTA's 64 staged bf16 rows of 512 channels (row r, channel c at staged + offset(r, c) bytes) to
// out_rows[r · 512 + c], in 16-byte coalesced copies.
template <typename Offset>
__device__ __forceinline__ void copy_out_rows(uint16_t* out_rows, const uint8_t* staged, int tid, Offset offset) {
#pragma unroll 4
  for (int i = tid; i < kHeadsPerCta * kKvHeadDim / 8; i += kThreads) {
    const int row = i / (kKvHeadDim / 8), column = 8 * (i % (kKvHeadDim / 8));
    *reinterpret_cast<uint4*>(out_rows + row * kKvHeadDim + column) =
        *reinterpret_cast<const uint4*>(staged + offset(row, column));
  }
}

// The finished rows of this thread (sink in the denominator, 1/l, inverse RoPE: factors(pair) gives the rotation
// of rope pair `pair`) as bf16 pairs into shared memory at staged + offset(row, dim) bytes; the row sums must
// already be complete (quad-reduced).
template <typename Offset, typename RopeFactors>
__device__ __forceinline__ void stage_finished_rows(const float (&o)[128], const float (&m_run)[2],
                                                    const float (&l_run)[2], const SparseAttentionParams& p,
                                                    int64_t first_head, RopeFactors factors, uint8_t* staged,
                                                    int group, int warp, int lane, Offset offset) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = 16 * (warp & 3) + (lane >> 2) + 8 * half;
    const float m = m_run[half], l = l_run[half];
    // The sink joins the denominator only: o = Σ p v / (Σ p + 2^(sink·log2e − m)); no key → zeros.
    const float inverse = l > 0.0f ? 1.0f / (l + exp2f(p.sinks[first_head + row] * kLog2e - m)) : 0.0f;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const int dim = 256 * group + 8 * j + 2 * (lane & 3);
      float a = o[4 * j + 2 * half] * inverse, b = o[4 * j + 2 * half + 1] * inverse;
      if (dim >= kKvNopeDim) rotate_pair(a, b, factors((dim - kKvNopeDim) / 2));
      *reinterpret_cast<uint32_t*>(staged + offset(row, dim)) = pack_bf16(a, b);
    }
  }
}
#endif

template <KvEntryFormat kFormat, bool kSplit>
__global__ void __launch_bounds__(kThreads, 1)
    sparse_attention_wgmma_kernel(const SparseAttentionParams p, const uint16_t* q, uint16_t* __restrict__ out,
                                  float* __restrict__ partial_o, float* __restrict__ partial_ml, int splits) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  wait_for_prior_grid();
  allow_dependents();
  using L = Smem<kFormat>;
  uint32_t smem_base;
  uint8_t* smem = aligned_dynamic_smem(smem_base);
  const uint8_t** key_data = reinterpret_cast<const uint8_t**>(smem + L::kKeyData);
  const uint8_t** key_scales = reinterpret_cast<const uint8_t**>(smem + L::kKeyScales);

  const int split = blockIdx.x, head_group = blockIdx.y;
  const int64_t token = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int group = warp >> 2;  // warpgroup: channels 256·group … of O
  const QueryKeys keys = query_keys(p, token);
  const int position = keys.position;
  const auto [tile_begin, tile_end] = split_tiles(keys.num_keys, splits, split);
  const uint16_t* q_token = q + (token * p.heads + int64_t{head_group} * kHeadsPerCta) * kKvHeadDim;

  auto resolve_tile = [&](int tile, int slot) {
    resolve_tile_keys<kFormat>(p, keys, tile, tid, key_data + slot * kTileKeys, key_scales + slot * kTileKeys);
  };
  // Stage `slot` (tile mod 2) from the addresses of `addresses` (tile mod 3).
  auto load_tile = [&](int slot, int addresses) {
    if constexpr (kFormat == KvEntryFormat::kBf16)
      load_bf16_tile(smem_base + L::kKv + slot * kTileBytes, key_data + addresses * kTileKeys, q, tid, tile_offset);
    else
      load_fp8_raw_tile(smem_base + L::kRaw + slot * kRawTileBytes, key_data + addresses * kTileKeys,
                        key_scales + addresses * kTileKeys, q, tid);
  };

  float o[128];  // O rows 16·(warp % 4) + lane/4 (+8), channels 256·group + 8j + 2·(lane % 4) (+1)
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.0f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};  // log2 domain, rows lane/4 and lane/4 + 8
  const float scale_log2 = p.scale * kLog2e;

  if (tile_begin < tile_end) {
    resolve_tile(tile_begin, 0);
    load_query_heads(smem_base + L::kQ, q_token, tid, tile_offset);
    __syncthreads();
    load_tile(0, 0);
    cp_async_commit();
    for (int tile = tile_begin; tile < tile_end; ++tile) {
      const int slot = (tile - tile_begin) & 1, addresses = (tile - tile_begin) % L::kAddressSlots;
      const int next_addresses = addresses + 1 == L::kAddressSlots ? 0 : addresses + 1;
      const bool has_next = tile + 1 < tile_end;
      if (has_next) resolve_tile(tile + 1, next_addresses);
      __syncthreads();  // next tile's addresses visible; every MMA of the previous tile has completed
      if (has_next) load_tile(slot ^ 1, next_addresses);
      cp_async_commit();
      cp_async_wait_one();
      uint32_t kv_stage;
      if constexpr (kFormat == KvEntryFormat::kFp8) {
        __syncthreads();  // this tile's raw bytes visible to every thread
        const uint8_t* raw = smem + L::kRaw + slot * kRawTileBytes;
        uint8_t* tile_bf16 = smem + L::kKv;
        dequantize_tile(raw, tile_bf16, tid, tile_offset);
        kv_stage = smem_base + L::kKv;
      } else {
        kv_stage = smem_base + L::kKv + slot * kTileBytes;
      }
      fence_proxy_async_shared();  // the tile (cp.async or dequantized) and Q, before wgmma reads them
      __syncthreads();

      float s[32];
      tile_scores(s, smem_base + L::kQ, kv_stage);
      softmax_and_accumulate(o, s, m_run, l_run, key_data + addresses * kTileKeys, scale_log2, kv_stage, group, lane);
    }
  }

  reduce_row_sums(l_run);
  // The output leaves through shared memory: straight from the accumulator layout a lane stores 4-8 bytes per
  // row, which the compiler split into 4-byte stores (16 of every 32 bytes of a sector used, 36 % excess
  // sectors, the partials' stores the main stall of a one-tile CTA: ncu, 2026-12-06). Staged rows are padded
  // by 8 words (32 B) so the 8 rows of one store land in different banks; then 16-byte coalesced copies.
  __syncthreads();  // every warp is past its last wgmma and its last read of Q and the tiles
  const int64_t first_head = int64_t{head_group} * kHeadsPerCta;
  if constexpr (kSplit) {
    constexpr int kStride = kKvHeadDim + 8;  // floats
    float* staged = reinterpret_cast<float*>(smem);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = 16 * (warp & 3) + (lane >> 2) + 8 * half;
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        const int dim = 256 * group + 8 * j + 2 * (lane & 3);
        *reinterpret_cast<float2*>(staged + row * kStride + dim) = make_float2(o[4 * j + 2 * half], o[4 * j + 2 * half + 1]);
      }
      if (group == 0 && (lane & 3) == 0) {
        float* ml = partial_ml + ((int64_t{split} * p.tokens + token) * p.heads + first_head + row) * 2;
        ml[0] = m_run[half];
        ml[1] = l_run[half];
      }
    }
    __syncthreads();
    float* base = partial_o + ((int64_t{split} * p.tokens + token) * p.heads + first_head) * kKvHeadDim;
#pragma unroll 4
    for (int i = tid; i < kHeadsPerCta * kKvHeadDim / 4; i += kThreads) {
      const int row = i / (kKvHeadDim / 4), column = 4 * (i % (kKvHeadDim / 4));
      *reinterpret_cast<float4*>(base + row * kKvHeadDim + column) =
          *reinterpret_cast<const float4*>(staged + row * kStride + column);
    }
  } else {
    constexpr int kStride = kKvHeadDim + 8;  // bf16: rows 1,040 B apart, 4 banks on
    auto staged_offset = [](int row, int dim) { return (row * kStride + dim) * 2; };
    stage_finished_rows(
        o, m_run, l_run, p, first_head, [&](int pair) { return inverse_rope_factors(p, pair, position); }, smem,
        group, warp, lane, staged_offset);
    __syncthreads();
    copy_out_rows(out + (token * p.heads + first_head) * kKvHeadDim, smem, tid, staged_offset);
  }
#else
  __trap();  // not sm_90a code: use_warpgroup_mma (ops/cuda/warpgroup_dispatch.h) never launches it there
#endif
}

// ---- Prefill: persistent CTAs over (token, head group) items (unsplit) ----
//
// A prefill query reads few tiles (SWA 2, HCA 2-3, CSA ≤ 10), and one CTA a token on an SM it fills alone (198 KB
// of shared memory) leaves the SM idle while a CTA starts (metadata, block table, Q and the first tile from memory)
// and while it ends (the output through shared memory). Here each CTA walks the items blockIdx.x, + gridDim.x, …
// as one sequence of tiles, and the loads of the next item's first tile and Q go out while the current item
// finishes: its first tile into the free stage at the top of the current item's last tile, its Q once both
// warpgroups have computed that tile's S (P·V and the epilogue no longer read Q). The output is staged in the last
// tile's stage (rows of 1024 B, chunks XOR-swizzled by row), not over Q and the other stage, which are loading.
// FP8 keys land raw in the free raw stage and are dequantized into the one bf16 tile at their turn, as in the kernel
// above; the output is then staged in that bf16 tile. Same tiles, softmax, rounding and epilogue as
// sparse_attention_wgmma_kernel, so the output is bitwise its own.
template <KvEntryFormat kFormat>
struct PrefillSmem {
  static constexpr int kRopeFactors = Smem<kFormat>::kBytes;  // float2 [32]
  static constexpr int kAllocation = Smem<kFormat>::kAllocation + 256;
};
static_assert(PrefillSmem<KvEntryFormat::kBf16>::kAllocation <= 227 * 1024, "prefill shared memory does not fit");
static_assert(PrefillSmem<KvEntryFormat::kFp8>::kAllocation <= 227 * 1024, "prefill shared memory does not fit");

template <KvEntryFormat kFormat>
__global__ void __launch_bounds__(kThreads, 1)
    sparse_attention_prefill_kernel(const SparseAttentionParams p, const uint16_t* q, uint16_t* __restrict__ out,
                                    int items) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  wait_for_prior_grid();
  allow_dependents();
  using L = Smem<kFormat>;
  constexpr bool kFp8 = kFormat == KvEntryFormat::kFp8;
  uint32_t smem_base;
  uint8_t* smem = aligned_dynamic_smem(smem_base);
  const uint8_t** key_data = reinterpret_cast<const uint8_t**>(smem + L::kKeyData);
  const uint8_t** key_scales = reinterpret_cast<const uint8_t**>(smem + L::kKeyScales);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int group = warp >> 2;
  const int head_groups = static_cast<int>(p.heads / kHeadsPerCta);

  int item = blockIdx.x;
  if (item >= items) return;
  // Few values stay live across the tiles (the wgmma kernel above runs at 255 registers): the item and its tile
  // count; a resolving thread re-reads the rest of the item's metadata (L1 hits), and the epilogue's RoPE factors
  // wait in shared memory (below).
  auto q_of = [&](int of_item) {
    return q + (int64_t{of_item / head_groups} * p.heads + (of_item % head_groups) * kHeadsPerCta) * kKvHeadDim;
  };
  auto resolve = [&](int of_item, int tile, int slot) {
    if (tid < kTileKeys)
      resolve_tile_keys<kFormat>(p, query_keys(p, of_item / head_groups), tile, tid, key_data + slot * kTileKeys,
                                 key_scales + slot * kTileKeys);
  };
  // Addresses that depend only on the thread would be computed once, before the loop, and held across it (ptxas:
  // 120-340 bytes of spills); an opaque copy of the thread index keeps them where they are used.
  auto opaque_tid = [&] {
    int value = tid;
    asm volatile("" : "+r"(value));
    return value;
  };
  // Stage `slot` (bf16 tile or raw FP8 stage) from the addresses of slot `addresses`.
  auto load_tile = [&](int slot, int addresses) {
    if constexpr (kFp8)
      load_fp8_raw_tile(smem_base + L::kRaw + slot * kRawTileBytes, key_data + addresses * kTileKeys,
                        key_scales + addresses * kTileKeys, q, opaque_tid());
    else
      load_bf16_tile(smem_base + L::kKv + slot * kTileBytes, key_data + addresses * kTileKeys, q, opaque_tid(),
                     tile_offset);
  };
  // The item's inverse-RoPE factors, made once where the registers are free (sincos beside the 128 accumulators
  // of the epilogue spilled): written at the item's start, read by its epilogue, rewritten only after the
  // epilogue's barrier.
  float2* rope_factors = reinterpret_cast<float2*>(smem + PrefillSmem<kFormat>::kRopeFactors);
  int tiles;
  auto start_item = [&] {
    const QueryKeys keys = query_keys(p, item / head_groups);
    tiles = (keys.num_keys + kTileKeys - 1) / kTileKeys;
    if (tid < kKvRopeDim / 2) rope_factors[tid] = inverse_rope_factors(p, tid, keys.position);
  };
  start_item();
  int tile = 0;
  // seq counts this CTA's tiles: stage seq & 1, key-address slot seq % 3 (three, as in the kernel above).
  int seq = 0;
  resolve(item, 0, 0);
  load_query_heads(smem_base + L::kQ, q_of(item), tid, tile_offset);
  __syncthreads();
  load_tile(0, 0);
  cp_async_commit();

  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.0f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};
  const float scale_log2 = p.scale * kLog2e;
  for (;;) {
    const int slot = seq & 1, addresses = seq % L::kAddressSlots;
    const int next_addresses = addresses + 1 == L::kAddressSlots ? 0 : addresses + 1;
    const bool last_tile = tile + 1 >= tiles;
    const int next_item = item + static_cast<int>(gridDim.x);
    // The sequence's next tile: this item's next one, or the next item's first.
    const bool has_next = !last_tile || next_item < items;
    if (has_next) resolve(last_tile ? next_item : item, last_tile ? 0 : tile + 1, next_addresses);
    __syncthreads();  // next tile's addresses visible; every MMA of the previous tile has completed
    if (has_next) load_tile(slot ^ 1, next_addresses);
    cp_async_commit();
    cp_async_wait_one();  // this tile (and, at an item's first tile, its Q)
    uint32_t kv_stage = smem_base + L::kKv + slot * kTileBytes;
    if constexpr (kFp8) {
      __syncthreads();  // this tile's raw bytes visible to every thread
      dequantize_tile(smem + L::kRaw + slot * kRawTileBytes, smem + L::kKv, opaque_tid(), tile_offset);
      kv_stage = smem_base + L::kKv;
    }
    fence_proxy_async_shared();
    __syncthreads();

    float s[32];
    tile_scores(s, smem_base + L::kQ, kv_stage);
    softmax_and_accumulate(o, s, m_run, l_run, key_data + addresses * kTileKeys, scale_log2, kv_stage, group, lane);
    ++seq;
    if (!last_tile) {
      ++tile;
      continue;
    }

    // The item's epilogue, staged in this tile's bf16 stage: rows of 1024 B, 16-byte chunks XORed with row mod 8.
    reduce_row_sums(l_run);
    __syncthreads();  // every warp's S and P·V are complete: Q and the stage are free
    if (next_item < items) {
      load_query_heads(smem_base + L::kQ, q_of(next_item), tid, tile_offset);
      cp_async_commit();
    }
    uint8_t* staged = smem + L::kKv + (kFp8 ? 0 : slot * kTileBytes);
    auto staged_offset = [](int row, int dim) {
      return row * 1024 + ((((dim >> 3) & ~7) | (((dim >> 3) ^ row) & 7)) << 4) + (dim & 7) * 2;
    };
    const int64_t first_head = int64_t{item % head_groups} * kHeadsPerCta;
    stage_finished_rows(
        o, m_run, l_run, p, first_head, [&](int pair) { return rope_factors[pair]; }, staged, group, warp,
        opaque_tid() & 31, staged_offset);
    __syncthreads();
    copy_out_rows(out + (int64_t{item / head_groups} * p.heads + first_head) * kKvHeadDim, staged, tid,
                  staged_offset);
    if (next_item >= items) break;
    item = next_item;
    start_item();
    tile = 0;
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.0f;
    m_run[0] = m_run[1] = -INFINITY;
    l_run[0] = l_run[1] = 0.0f;
  }
#else
  __trap();  // not sm_90a code: use_warpgroup_mma (ops/cuda/warpgroup_dispatch.h) never launches it there
#endif
}

}  // namespace warpgroup_mma

// Merges the splits of one (token, head): m = max m_s, l = Σ 2^(m_s − m) l_s, O = Σ 2^(m_s − m) O_s, then the
// sink, the inverse RoPE and the bf16 store. 128 threads × 4 channels.
__global__ void __launch_bounds__(128) sparse_attention_combine_kernel(const SparseAttentionParams p,
                                                                       const float* __restrict__ partial_o,
                                                                       const float* __restrict__ partial_ml,
                                                                       uint16_t* __restrict__ out, int splits) {
  wait_for_prior_grid();
  allow_dependents();
  const int64_t head = blockIdx.x, token = blockIdx.y;
  const int dim = 4 * threadIdx.x;
  // The splits are read kBatch at a time, every load of a batch issued before any is used: one L2 round trip a
  // batch (a split a round trip before: ~2·splits + 1 of them, the most of this kernel's time at decode).
  constexpr int kBatch = 8;
  auto split_index = [&](int s) { return (int64_t{s} * p.tokens + token) * p.heads + head; };
  float m = -INFINITY;
  for (int first = 0; first < splits; first += kBatch) {
    float split_max[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u)
      split_max[u] = first + u < splits ? partial_ml[split_index(first + u) * 2] : -INFINITY;
#pragma unroll
    for (int u = 0; u < kBatch; ++u) m = fmaxf(m, split_max[u]);
  }
  float4 o = make_float4(0, 0, 0, 0);
  float l = 0.0f;
  if (m != -INFINITY) {
    for (int first = 0; first < splits; first += kBatch) {
      float split_max[kBatch], split_sum[kBatch];
      float4 part[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        if (first + u >= splits) continue;
        const int64_t index = split_index(first + u);
        split_max[u] = partial_ml[index * 2];
        split_sum[u] = partial_ml[index * 2 + 1];
        part[u] = *reinterpret_cast<const float4*>(partial_o + index * kKvHeadDim + dim);
      }
      // In split order, as before: the same sums bit for bit.
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        if (first + u >= splits) continue;
        const float weight = exp2f(split_max[u] - m);  // a split with no key: 2^(−inf) = 0 (its o, loaded, is not used)
        if (weight == 0.0f) continue;
        l += weight * split_sum[u];
        o.x += weight * part[u].x;
        o.y += weight * part[u].y;
        o.z += weight * part[u].z;
        o.w += weight * part[u].w;
      }
    }
  }
  const float inverse = l > 0.0f ? 1.0f / (l + exp2f(p.sinks[head] * kLog2e - m)) : 0.0f;
  float v[4] = {o.x * inverse, o.y * inverse, o.z * inverse, o.w * inverse};
  if (dim >= kKvNopeDim) {
    const int position = p.positions[token];
    inverse_rope_pair(v[0], v[1], p, (dim - kKvNopeDim) / 2, position);
    inverse_rope_pair(v[2], v[3], p, (dim - kKvNopeDim) / 2 + 1, position);
  }
  uint2 packed;
  packed.x = pack_bf16(v[0], v[1]);
  packed.y = pack_bf16(v[2], v[3]);
  *reinterpret_cast<uint2*>(out + (token * p.heads + head) * kKvHeadDim + dim) = packed;
}

template <KvEntryFormat kFormat, bool kSplit>
cudaError_t launch(const SparseAttentionParams& p, const uint16_t* q, uint16_t* out, float* partial_o,
                   float* partial_ml, int splits, cudaStream_t stream) {
  // DSV4_ATTENTION_KERNEL=mma runs the mma.sync kernel on a Hopper too.
  const bool wgmma = use_warpgroup_mma("DSV4_ATTENTION_KERNEL");
  auto kernel = wgmma ? warpgroup_mma::sparse_attention_wgmma_kernel<kFormat, kSplit>
                      : sparse_attention_kernel<kFormat, kSplit>;
  const int smem_bytes = wgmma ? warpgroup_mma::Smem<kFormat>::kAllocation : SmemLayout<kFormat>::kBytes;
  static const cudaError_t attribute = cudaFuncSetAttribute(sparse_attention_kernel<kFormat, kSplit>,
                                                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                            SmemLayout<kFormat>::kBytes);
  static const cudaError_t wgmma_attribute = cudaFuncSetAttribute(
      warpgroup_mma::sparse_attention_wgmma_kernel<kFormat, kSplit>, cudaFuncAttributeMaxDynamicSharedMemorySize,
      warpgroup_mma::Smem<kFormat>::kAllocation);
  if (attribute != cudaSuccess) return attribute;
  if (wgmma_attribute != cudaSuccess) return wgmma_attribute;
  const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(p.heads / kHeadsPerCta),
                  static_cast<unsigned>(p.tokens));
  launch_dependent(kernel, grid, kThreads, smem_bytes, stream, p, q, out, partial_o, partial_ml, splits);
  return cudaGetLastError();
}

template <KvEntryFormat kFormat>
cudaError_t launch_prefill(const SparseAttentionParams& p, const uint16_t* q, uint16_t* out, int multiprocessors,
                           cudaStream_t stream) {
  const int64_t items = p.tokens * (p.heads / kHeadsPerCta);
  constexpr int kShared = warpgroup_mma::PrefillSmem<kFormat>::kAllocation;
  static const cudaError_t attribute = cudaFuncSetAttribute(warpgroup_mma::sparse_attention_prefill_kernel<kFormat>,
                                                            cudaFuncAttributeMaxDynamicSharedMemorySize, kShared);
  if (attribute != cudaSuccess) return attribute;
  launch_dependent(warpgroup_mma::sparse_attention_prefill_kernel<kFormat>,
                   dim3(static_cast<unsigned>(std::min<int64_t>(items, multiprocessors))), kThreads, kShared, stream,
                   p, q, out, static_cast<int>(items));
  return cudaGetLastError();
}

// The persistent prefill kernel where it pays: one split, more (token, head group) items than two waves of the
// GPU, sm_90a code on a Hopper; BF16 and FP8 keys (measured: docs/PERF.md "A persistent prefill attention
// kernel" and "FP8 keys through the persistent prefill kernel"). DSV4_ATTENTION_PREFILL=0 keeps one CTA an item.
bool use_prefill_kernel(const SparseAttentionParams& p, int multiprocessors) {
  if (p.tokens * (p.heads / kHeadsPerCta) <= 2 * int64_t{multiprocessors}) return false;
  const char* choice = std::getenv("DSV4_ATTENTION_PREFILL");
  if (choice != nullptr && std::strcmp(choice, "0") == 0) return false;
  return use_warpgroup_mma("DSV4_ATTENTION_KERNEL");
}

}  // namespace

int64_t sparse_attention_splits(const SparseAttentionParams& p, int multiprocessors) {
  const int64_t max_keys = p.window_size + (p.compressed_lengths ? p.compressed_stride : 0);
  const int64_t max_tiles = std::max<int64_t>(1, (max_keys + kTileKeys - 1) / kTileKeys);
  if (p.num_splits > 0) return std::min(p.num_splits, max_tiles);
  const int64_t ctas = std::max<int64_t>(1, p.tokens * (p.heads / kHeadsPerCta));
  return std::clamp<int64_t>((multiprocessors + ctas - 1) / ctas, 1, max_tiles);
}

size_t sparse_attention_workspace_bytes(const SparseAttentionParams& p, int multiprocessors) {
  const int64_t splits = sparse_attention_splits(p, multiprocessors);
  if (splits <= 1) return 0;
  return static_cast<size_t>(splits * p.tokens * p.heads) * (kKvHeadDim + 2) * sizeof(float);
}

cudaError_t sparse_attention(const SparseAttentionParams& p, const uint16_t* q, uint16_t* out, void* workspace,
                             size_t workspace_bytes, cudaStream_t stream) {
  if (p.tokens == 0) return cudaSuccess;
  if (p.heads <= 0 || p.heads % kHeadsPerCta != 0 || p.tokens > 65535) return cudaErrorInvalidValue;
  const int multiprocessors = std::max(current_device_multiprocessors(), 1);
  const int splits = static_cast<int>(sparse_attention_splits(p, multiprocessors));
  const bool fp8 = p.format == KvEntryFormat::kFp8;
  if (splits == 1 && use_prefill_kernel(p, multiprocessors)) {
    return fp8 ? launch_prefill<KvEntryFormat::kFp8>(p, q, out, multiprocessors, stream)
               : launch_prefill<KvEntryFormat::kBf16>(p, q, out, multiprocessors, stream);
  }
  if (splits == 1) {
    return fp8 ? launch<KvEntryFormat::kFp8, false>(p, q, out, nullptr, nullptr, 1, stream)
               : launch<KvEntryFormat::kBf16, false>(p, q, out, nullptr, nullptr, 1, stream);
  }
  if (workspace == nullptr || workspace_bytes < sparse_attention_workspace_bytes(p, multiprocessors))
    return cudaErrorInvalidValue;
  float* partial_o = static_cast<float*>(workspace);
  float* partial_ml = partial_o + static_cast<int64_t>(splits) * p.tokens * p.heads * kKvHeadDim;
  const cudaError_t status = fp8 ? launch<KvEntryFormat::kFp8, true>(p, q, out, partial_o, partial_ml, splits, stream)
                                 : launch<KvEntryFormat::kBf16, true>(p, q, out, partial_o, partial_ml, splits, stream);
  if (status != cudaSuccess) return status;
  launch_dependent(sparse_attention_combine_kernel,
                   dim3(static_cast<unsigned>(p.heads), static_cast<unsigned>(p.tokens)), 128, 0, stream, p,
                   partial_o, partial_ml, out, splits);
  return cudaGetLastError();
}

}  // namespace dsv4::ops::cuda
