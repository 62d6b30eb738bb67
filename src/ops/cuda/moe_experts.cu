#include "ops/cuda/moe_experts.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <cstring>

#include "core/linear_weight.h"
#include "ops/cuda/bf16.cuh"
#include "ops/cuda/fp8_quantize.h"
#include "ops/cuda/launch.cuh"

namespace dsv4::ops::cuda {
namespace {

// ---------------------------------------------------------------------------------------------------------------
// Workspace layout (shared by the size query and the call). Rows: the tokens·top_k routed rows sorted by expert
// (stable in (token, k) order), then the tokens rows of the shared expert (expert index E) in token order.
// ---------------------------------------------------------------------------------------------------------------

constexpr int kMaxExperts = 1023;  // E + 1 scan lanes in one 1024-thread CTA
constexpr int kPrepThreads = 1024;
constexpr int kPrepConvertBlocks = 264;

// Rows of one call: the routed (token, k) rows unless the call is the shared expert alone, the shared expert's
// token rows unless its output is added from elsewhere (MoeSharedExpert).
int64_t routed_rows(const MoeExpertsParams& p) { return p.shared == MoeSharedExpert::kOnly ? 0 : p.tokens * p.top_k; }
int64_t shared_rows(const MoeExpertsParams& p) { return p.shared == MoeSharedExpert::kAdded ? 0 : p.tokens; }

int64_t items_bound(const MoeExpertsParams& p, int64_t tile_rows) {
  // Σ_e ceil(n_e / R) over at most min(E, N·K) non-empty experts with Σ n_e = N·K is at most
  // floor(N·K / R) + min(E, N·K); the shared expert adds ceil(N / R).
  const int64_t routed = routed_rows(p);
  return routed / tile_rows + std::min(p.experts, routed) + (shared_rows(p) + tile_rows - 1) / tile_rows;
}

struct Layout {
  size_t offsets = 0, num_items = 0, items = 0, row_token = 0, row_expert = 0, slot_row = 0, xb = 0, h = 0, y = 0;
  size_t row_weight = 0;  // kDeepSeek: each row's routing weight (1 for the shared expert's)
  size_t total = 0;
};

Layout layout(const MoeExpertsParams& p) {
  const bool bf16 = p.dtype != MoeWeightDtype::kFp32;
  const auto routed = static_cast<size_t>(routed_rows(p));
  const size_t rows = routed + static_cast<size_t>(shared_rows(p));
  size_t at = 0;
  auto take = [&](size_t bytes) {
    const size_t here = at;
    at = (at + bytes + 255) / 256 * 256;
    return here;
  };
  Layout l;
  l.offsets = take(static_cast<size_t>(p.experts + 2) * 4);
  l.num_items = take(4);
  l.items = take(static_cast<size_t>(items_bound(p, 16)) * 8);  // 16-row tiles have the most items
  l.row_token = take(rows * 4);
  l.row_expert = take(rows * 4);
  l.slot_row = take(std::max<size_t>(routed, 1) * 4);
  l.xb = take(bf16 ? static_cast<size_t>(p.tokens * p.hidden) * 2 : 0);
  l.h = take(rows * static_cast<size_t>(p.intermediate) * (bf16 ? 2 : 4));
  l.y = take(rows * static_cast<size_t>(p.hidden) * 4);
  l.row_weight = take(p.deepseek ? rows * 4 : 0);
  l.total = at;
  return l;
}

__device__ __forceinline__ float swiglu(float gate, float up, float limit) {
  const float g = fminf(gate, limit);
  const float u = fminf(fmaxf(up, -limit), limit);
  return g / (1.0f + expf(-g)) * u;
}

// ---------------------------------------------------------------------------------------------------------------
// 1. prep: block 0 routes, blocks 1.. convert x to bf16.
// ---------------------------------------------------------------------------------------------------------------

struct PrepArgs {
  const int32_t* chosen;
  const float* x;
  uint16_t* xb;  // nullptr in fp32 mode
  int32_t* offsets;
  int32_t* num_items;
  int2* items;
  int32_t* row_token;
  int32_t* row_expert;
  int32_t* slot_row;
  const float* weights;  // kDeepSeek: the routing weights [tokens, top_k], copied to row_weight in row order
  float* row_weight;     // nullptr unless kDeepSeek
  int tokens, top_k, experts, tile_rows;  // top_k 0: no routed rows (the shared expert alone)
  int with_shared;                        // 0: no shared-expert rows (its output is added in the combine)
  int64_t x_elems;
};

// Exclusive scan of one int per thread over the 1024-thread block; `scratch` holds 33 ints.
__device__ int block_exclusive_scan(int value, int* scratch, int& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int inclusive = value;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int n = __shfl_up_sync(0xffffffffu, inclusive, o);
    if (lane >= o) inclusive += n;
  }
  __syncthreads();  // scratch free from any earlier use
  if (lane == 31) scratch[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    const int mine = scratch[lane];
    int sum = mine;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int n = __shfl_up_sync(0xffffffffu, sum, o);
      if (lane >= o) sum += n;
    }
    scratch[lane] = sum - mine;
    if (lane == 31) scratch[32] = sum;
  }
  __syncthreads();
  total = scratch[32];
  return scratch[warp] + inclusive - value;
}

__global__ void __launch_bounds__(kPrepThreads) moe_prep_kernel(const PrepArgs a) {
  wait_for_prior_grid();
  allow_dependents();
  const int tid = threadIdx.x;
  if (blockIdx.x > 0) {
    // x -> bf16, 4 elements per step (D % 8 == 0, x 16-byte aligned).
    const auto* x4 = reinterpret_cast<const float4*>(a.x);
    auto* out = reinterpret_cast<uint2*>(a.xb);
    const int64_t n4 = a.x_elems / 4;
    const int64_t stride = static_cast<int64_t>(gridDim.x - 1) * kPrepThreads;
    for (int64_t i = static_cast<int64_t>(blockIdx.x - 1) * kPrepThreads + tid; i < n4; i += stride) {
      const float4 v = x4[i];
      const __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
      out[i] = make_uint2(*reinterpret_cast<const uint32_t*>(&lo), *reinterpret_cast<const uint32_t*>(&hi));
    }
    return;
  }
  const int E = a.experts, K = a.top_k, N = a.tokens, R = a.tile_rows;
  const int routed = N * K;
  const int lane = tid & 31, warp = tid >> 5;
  extern __shared__ __align__(128) unsigned char dynamic_smem[];
  int* counts = reinterpret_cast<int*>(dynamic_smem);  // [E + 1]
  int* running = counts + E + 1;   // [E]
  int* offs = running + E;         // [E + 2]
  int* table = offs + E + 2;       // [32][E]: this chunk's rows of expert e in warp w
  __shared__ int scratch[33];
  for (int i = tid; i < E; i += kPrepThreads) counts[i] = running[i] = 0;
  for (int i = tid; i < 32 * E; i += kPrepThreads) table[i] = 0;
  if (tid == 0) counts[E] = a.with_shared ? N : 0;
  __syncthreads();
  for (int i = tid; i < routed; i += kPrepThreads) {
    const int e = a.chosen[i];
    if (e >= 0 && e < E) atomicAdd(&counts[e], 1);  // integer counts: order-independent
  }
  __syncthreads();
  // Offsets and work items per expert (thread e; the shared expert is e = E).
  const int count = tid <= E ? counts[tid] : 0;
  int rows_total = 0, items_total = 0;
  const int offset = block_exclusive_scan(count, scratch, rows_total);
  const int tiles = (count + R - 1) / R;
  const int item0 = block_exclusive_scan(tiles, scratch, items_total);
  if (tid <= E) {
    offs[tid] = offset;
    a.offsets[tid] = offset;
    for (int m = 0; m < tiles; ++m) a.items[item0 + m] = make_int2(tid, m);
  }
  if (tid == 0) {
    offs[E + 1] = rows_total;
    a.offsets[E + 1] = rows_total;
    *a.num_items = items_total;
  }
  __syncthreads();
  const int shared0 = offs[E];
  for (int t = tid; a.with_shared && t < N; t += kPrepThreads) {
    a.row_token[shared0 + t] = t;
    a.row_expert[shared0 + t] = E;
    if (a.row_weight) a.row_weight[shared0 + t] = 1.0f;
  }
  // Stable permutation, 1024 entries per chunk: rank within the warp by __match_any_sync, then the rows of the
  // same expert in earlier warps of the chunk (table), then the rows of earlier chunks (running).
  for (int base = 0; base < routed; base += kPrepThreads) {
    const int i = base + tid;
    int e = i < routed ? a.chosen[i] : -1;
    if (e >= E) e = -1;
    const bool valid = e >= 0;
    const unsigned same = __match_any_sync(0xffffffffu, e);
    const int rank = __popc(same & ((1u << lane) - 1u));
    const bool leader = rank == 0;
    if (valid && leader) table[warp * E + e] = __popc(same);
    __syncthreads();
    if (valid) {
      int before = 0;
      for (int w = 0; w < warp; ++w) before += table[w * E + e];
      const int pos = offs[e] + running[e] + before + rank;
      a.row_token[pos] = i / K;
      a.row_expert[pos] = e;
      a.slot_row[i] = pos;
      if (a.row_weight) a.row_weight[pos] = a.weights[i];
    } else if (i < routed) {
      a.slot_row[i] = -1;
    }
    __syncthreads();
    if (valid && leader) {
      atomicAdd(&running[e], __popc(same));
      table[warp * E + e] = 0;
    }
    __syncthreads();
  }
}

// ---------------------------------------------------------------------------------------------------------------
// 2./3. bf16 grouped GEMM: C[rows of one work item, column tile] = A · Wᵀ, W [n, K] row-major (K contiguous).
// ---------------------------------------------------------------------------------------------------------------

template <int kWarpsM_, int kWarpsN_, int kMTiles_, int kNTiles_, int kStages_, int kMinBlocks_>
struct TileConfig {
  static constexpr int kWarpsM = kWarpsM_, kWarpsN = kWarpsN_, kMTiles = kMTiles_, kNTiles = kNTiles_;
  static constexpr int kStages = kStages_, kMinBlocks = kMinBlocks_;
  static constexpr int kThreads = kWarpsM * kWarpsN * 32;
  static constexpr int kBM = 16 * kMTiles * kWarpsM;  // rows of the work item
  static constexpr int kBN = 8 * kNTiles * kWarpsN;   // weight rows (output columns; gate+up pairs in gemm1)
  static constexpr int kBK = 64;                      // one 128-byte row of bf16 per stage
  static constexpr int kStageBytes = (kBM + kBN) * kBK * 2;
  static constexpr int kSmemBytes = kStageBytes * kStages;
  static constexpr int kAChunks = kBM * 8 / kThreads;
  static constexpr int kBChunks = kBN * 8 / kThreads;
  static_assert(kBM * 8 % kThreads == 0 && kBN * 8 % kThreads == 0, "whole 16-byte chunks per thread");
  static_assert(kNTiles % 2 == 0, "B fragments load two n8 tiles at a time; gate/up pairs");
};

// Decode: 16 rows, 64 weight rows per CTA, 4 warps side by side, 4 stages (40 KB: 5 CTAs per SM).
using SmallTiles = TileConfig<1, 4, 1, 2, 4, 4>;
// Mid batches: 64 × 64, warp tiles 32 × 32, 4 stages (64 KB: 3 CTAs per SM).
using MidTiles = TileConfig<2, 2, 2, 4, 4, 3>;
// Prefill: 128 × 128, warp tiles 64 × 32, 3 stages (96 KB: 2 CTAs per SM).
using LargeTiles = TileConfig<2, 4, 4, 4, 3, 2>;

struct GemmArgs {
  const uint16_t* a;            // gemm1: x in bf16 [tokens, K], gathered through row_token; gemm2: h [rows, K]
  const int32_t* row_token;     // gemm1 only
  const void* const* weights;   // [E] device pointers
  const void* shared_weight;    // expert E
  const void* const* scales;    // grouped formats: [E] device pointers to the routed experts' tile-major scales
  const int32_t* offsets;       // [E + 2]
  const int2* items;            // (expert, row tile)
  const int32_t* num_items;
  void* out;                    // gemm1: h bf16 [rows, N]; gemm2: y fp32 [rows, N]
  const float* row_weight;      // kDeepSeek: the rows' routing weights (gemm1's epilogue); nullptr otherwise
  int experts;
  int K;                        // reduction length (D, then I)
  int N;                        // output columns (I, then D)
  float limit;
};

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Shared-memory offset of 16-byte chunk `chunk` of 128-byte row `row`: chunks XOR-swizzled by row % 8, so the
// 8 rows an ldmatrix phase reads at one logical chunk hit 8 different bank groups.
__device__ __forceinline__ uint32_t swizzle(int row, int chunk) {
  return static_cast<uint32_t>(row * 128 + ((chunk ^ (row & 7)) << 4));
}

// Routed experts in a grouped low-bit format (MoeWeightDtype kMxfp4, kQ3G32, kQ2G32), decoded in the kernel.
// The device keeps each routed expert's codes k-tile-major in the mma's B-fragment order (moe_kernel_codes):
// per 64-wide k tile and weight row `kRowCodeBytes`, lane t (= lane % 4) of the fragment owning its own bytes
// — for each 32-wide scale group g (0, 1) the 8 value pairs i of its two k16 steps (pair i = inputs 8i + 2t,
// + 1: fragment register i % 2 of k16 step 2g + i / 2). So a lane reads its B fragments with one or two
// shared loads per n8 tile and k tile and turns each pair into a bf16x2 register with shifts, masks and one
// or two exact bf16 operations:
//   MXFP4: per lane 8 bytes (a u32 per group, pair i's nibbles at bits 12 − 4i and 28 − 4i). The nibble's
//     sign goes to bf16's sign bit, its 3 exponent/mantissa bits to the bottom of bf16's exponent
//     (e2m1 · 2^-126, exact with bf16 subnormals); one multiply by 2^(e − 1) applies the UE8M0 scale
//     2^(e − 127) and the 2^126 (exact for e ≤ 128, mxfp4_kernel_scales_supported).
//   Q3 (value (c − 4)·s, bf16 s): per lane 4 bytes of the codes' low 2 bits (group g pair i: bits 8g + 2i and
//     16 + 8g + 2i) and 2 bytes of their third bits (bits 4g + i and 8 + 4g + i); c is put into the mantissa
//     of 128 (bf16 0x4300 + c = 128 + c), 132 is subtracted (exact) and s multiplied (one rounding: the bf16
//     of (c − 4)·s, as the decode at upload).
//   Q2 (value (c − 1.5)·s): per lane 4 bytes as Q3's low bits; 128 + 2c − 131 = 2c − 3 (exact), times s / 2.
// No decoded tile, no table, no extra barrier: a shared-memory round trip per value was measured at 25 % of
// copy bandwidth. Per stage: the A tile, the codes (kBN · kRowCodeBytes), the scales (kBN · kRowScaleBytes,
// k-tile-major too: MXFP4 one UE8M0 byte per group, Q3 / Q2 one bf16 per group).
//
// Stages: a k tile's weight bytes are a quarter of bf16's (or less), so the memory-bound decode tiles get 3×
// the stages to keep as many bytes in flight; prefill tiles are bound by the mma and keep theirs.
enum class RoutedFormat { kBf16, kMxfp4, kQ3, kQ2 };

template <class C, RoutedFormat F>
struct GroupLayout {
  static constexpr int kRowCodeBytes = F == RoutedFormat::kMxfp4 ? 32 : F == RoutedFormat::kQ3 ? 24 : 16;
  static constexpr int kRowScaleBytes = F == RoutedFormat::kMxfp4 ? 2 : 4;
  static constexpr int kStages = C::kBM <= 16 ? 12 : C::kBM <= 64 ? 8 : C::kStages;
  static constexpr int kCodeBytes = C::kBN * kRowCodeBytes;
  static constexpr int kScaleBytes = C::kBN * kRowScaleBytes;
  static constexpr int kStageBytes = C::kBM * 128 + kCodeBytes + kScaleBytes;
  static constexpr int kSmemBytes = kStageBytes * kStages;
  // 16-byte chunks per stage, per 8 consecutive weight rows (contiguous in the k-tile-major layouts).
  static constexpr int kCodeChunksPer8 = kRowCodeBytes / 2, kScaleChunksPer8 = kRowScaleBytes / 2;
  static constexpr int kCodeChunks =
      (C::kBN / 8 * kCodeChunksPer8 + C::kThreads - 1) / C::kThreads;  // per thread
  static constexpr int kScaleChunks =
      C::kBN / 8 * kScaleChunksPer8;  // threads 0 .. kScaleChunks - 1, one each
  static_assert(kScaleChunks <= C::kThreads, "one scale chunk per thread");
};

template <class C, RoutedFormat F>
constexpr int kernel_smem_bytes() {
  return F != RoutedFormat::kBf16 && GroupLayout<C, F>::kSmemBytes > C::kSmemBytes
             ? GroupLayout<C, F>::kSmemBytes
             : C::kSmemBytes;
}

__device__ __forceinline__ uint32_t bits_of(__nv_bfloat162 v) {
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ __nv_bfloat162 bf16x2_of(uint32_t bits) {
  return *reinterpret_cast<const __nv_bfloat162*>(&bits);
}
// x shifted right by `shift` bits (left for a negative shift); a constant after unrolling.
__device__ __forceinline__ uint32_t shift_right(uint32_t x, int shift) {
  return shift >= 0 ? x >> shift : x << -shift;
}

// One scale group's 4 B-fragment registers (b0, b1 of its first k16 step, then of its second).
// MXFP4: `low` is the group's u32 of e2m1 pairs, `factor` 2^(e − 1).
template <RoutedFormat F, int kGroup>
__device__ __forceinline__ void decode_group(uint32_t low, uint32_t high, __nv_bfloat162 factor,
                                             uint32_t (&out)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (F == RoutedFormat::kMxfp4) {
      const uint32_t x = low << (4 * i);
      const uint32_t bits = (x & 0x80008000u) | ((x >> 6) & 0x01C001C0u);
      out[i] = bits_of(__hmul2(bf16x2_of(bits), factor));
    } else if constexpr (F == RoutedFormat::kQ3) {
      // low: the lane's low-2-bit word (both groups); high: its third bits, byte 0 at bits 0-7, byte 1 at
      // 16-23.
      uint32_t bits = 0x43004300u | (shift_right(low, 8 * kGroup + 2 * i) & 0x00030003u);
      bits |= shift_right(high, 4 * kGroup + i - 2) & 0x00040004u;
      const __nv_bfloat162 centered = __hsub2(bf16x2_of(bits), bf16x2_of(0x43044304u));  // − 132
      out[i] = bits_of(__hmul2(centered, factor));
    } else {  // kQ2
      const uint32_t bits = 0x43004300u | (shift_right(low, 8 * kGroup + 2 * i - 1) & 0x00060006u);
      const __nv_bfloat162 centered = __hsub2(bf16x2_of(bits), bf16x2_of(0x43034303u));  // − 131
      out[i] = bits_of(__hmul2(centered, factor));
    }
  }
}

__device__ __forceinline__ __nv_bfloat162 ue8m0_multiplier(uint32_t e) {
  const uint32_t bits = (e + 126) << 7;  // bf16 2^(e − 1)
  return bf16x2_of(bits | bits << 16);
}

// The output column of B slot s (a CTA weight row) and its row in W. gemm1 (kGateUp): the CTA's weight rows
// are 16-row groups of 8 gate rows j0 + 8q .. + 7 and the 8 matching up rows I + j0 + 8q ..; a warp's n8
// tiles 2p / 2p + 1 are then the gate and up of the same 8 columns. gemm2: plain columns.
template <class C, bool kGateUp>
__device__ __forceinline__ int slot_column(int s, int64_t& wrow, int N) {
  if constexpr (kGateUp) {
    const int col = blockIdx.x * (C::kBN / 2) + (s >> 4) * 8 + (s & 7);
    wrow = ((s & 15) >= 8 ? N : 0) + col;
    return col;
  } else {
    const int col = blockIdx.x * C::kBN + s;
    wrow = col;
    return col;
  }
}

// One CTA's tile: C[rows of one work item, column tile] = A · Wᵀ, W [n, K] row-major (K contiguous), W bf16
// or (F ≠ kBf16) a grouped low-bit format decoded per k tile; gemm1 writes h = silu(min(g, L)) · clamp(u, −L,
// L) in bf16, gemm2 y in fp32.
template <class C, bool kGateUp, RoutedFormat F>
__device__ __forceinline__ void gemm_tile(const GemmArgs& a, int expert, int row_begin, int rows,
                                          unsigned char* smem) {
  constexpr bool kGrouped = F != RoutedFormat::kBf16;
  using G = GroupLayout<C, F>;
  const void* W = expert < a.experts ? a.weights[expert] : a.shared_weight;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int warp_m = warp / C::kWarpsN, warp_n = warp % C::kWarpsN;
  const int chunk = tid & 7;
  constexpr int kRowStep = C::kThreads / 8;
  constexpr int kStageBytes = kGrouped ? G::kStageBytes : C::kStageBytes;
  constexpr int kStages = kGrouped ? G::kStages : C::kStages;
  const auto smem_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));

  const int k_tiles = (a.K + C::kBK - 1) / C::kBK;
  // This thread's 16-byte A chunks of each stage: fixed rows, fixed chunk column.
  const uint16_t* a_src[C::kAChunks];
  uint32_t a_dst[C::kAChunks];
#pragma unroll
  for (int j = 0; j < C::kAChunks; ++j) {
    const int r = tid / 8 + j * kRowStep;
    const uint16_t* src = nullptr;
    if (r < rows) {
      const int64_t arow = kGateUp ? static_cast<int64_t>(a.row_token[row_begin + r]) : row_begin + r;
      src = a.a + arow * a.K + chunk * 8;
    }
    a_src[j] = src;
    a_dst[j] = swizzle(r, chunk);
  }
  // B sources: bf16 16-byte chunks of whole rows, or (kGrouped) the code chunks of 8-row groups (contiguous
  // in the k-tile-major layout: base + (tile · weight rows + first row) · kRowCodeBytes) and the scale
  // chunks.
  const int weight_rows = kGateUp ? 2 * a.N : a.N;
  constexpr int kBSources = kGrouped ? G::kCodeChunks : C::kBChunks;
  const unsigned char* b_src[kBSources];
  uint32_t b_dst[kBSources];
  const unsigned char* scale_src = nullptr;
  const auto* W_bytes = static_cast<const unsigned char*>(W);
#pragma unroll
  for (int j = 0; j < kBSources; ++j) {
    int64_t wrow;
    if constexpr (kGrouped) {
      const int index = tid + j * C::kThreads;
      const int group = index / G::kCodeChunksPer8, part = index % G::kCodeChunksPer8;
      const bool in_tile = group < C::kBN / 8;
      const int col = in_tile ? slot_column<C, kGateUp>(group * 8, wrow, a.N) : a.N;
      b_src[j] = col < a.N ? W_bytes + wrow * G::kRowCodeBytes + part * 16 : nullptr;
      b_dst[j] = in_tile ? C::kBM * 128 + group * 8 * G::kRowCodeBytes + part * 16 : ~0u;
    } else {
      const int s = tid / 8 + j * kRowStep;
      const int col = slot_column<C, kGateUp>(s, wrow, a.N);
      b_src[j] = col < a.N ? W_bytes + (wrow * a.K + chunk * 8) * 2 : nullptr;
      b_dst[j] = C::kBM * 128 + swizzle(s, chunk);
    }
  }
  if constexpr (kGrouped) {
    if (tid < G::kScaleChunks) {
      int64_t wrow;
      const int group = tid / G::kScaleChunksPer8, part = tid % G::kScaleChunksPer8;
      const int col = slot_column<C, kGateUp>(group * 8, wrow, a.N);
      if (col < a.N)
        scale_src =
            static_cast<const unsigned char*>(a.scales[expert]) + wrow * G::kRowScaleBytes + part * 16;
    }
  }

  auto load_stage = [&](int slot, int kt) {
    const int k0 = kt * C::kBK;
    const uint32_t base = smem_base + slot * kStageBytes;
    const bool a_ok = k0 + chunk * 8 < a.K;
#pragma unroll
    for (int j = 0; j < C::kAChunks; ++j) {
      const bool ok = a_ok && a_src[j] != nullptr;
      cp_async16(base + a_dst[j], ok ? a_src[j] + k0 : a.a, ok);
    }
#pragma unroll
    for (int j = 0; j < kBSources; ++j) {
      bool ok;
      int64_t offset;
      if constexpr (kGrouped) {
        if (b_dst[j] == ~0u) continue;
        ok = b_src[j] != nullptr;  // whole k tiles (zero padded)
        offset = static_cast<int64_t>(kt) * weight_rows * G::kRowCodeBytes;
      } else {
        ok = a_ok && b_src[j] != nullptr;
        offset = int64_t{k0} * 2;
      }
      cp_async16(base + b_dst[j], ok ? b_src[j] + offset : W_bytes, ok);
    }
    if constexpr (kGrouped) {
      if (tid < G::kScaleChunks) {
        const bool ok = scale_src != nullptr;
        const int group = tid / G::kScaleChunksPer8, part = tid % G::kScaleChunksPer8;
        cp_async16(base + C::kBM * 128 + G::kCodeBytes + group * 8 * G::kRowScaleBytes + part * 16,
                   ok ? scale_src + static_cast<int64_t>(kt) * weight_rows * G::kRowScaleBytes : W_bytes, ok);
      }
    }
  };
  float acc[C::kMTiles][C::kNTiles][4];
#pragma unroll
  for (int mt = 0; mt < C::kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < C::kNTiles; ++nt)
#pragma unroll
      for (int v = 0; v < 4; ++v) acc[mt][nt][v] = 0.0f;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_tiles) load_stage(s, s);
    cp_async_commit();
  }
  // ldmatrix row/chunk of this lane: A x4 = rows 0-15 × k halves; B x4 = two n8 tiles × k halves.
  const int a_row = warp_m * C::kMTiles * 16 + (lane & 15);
  const int a_half = lane >> 4;
  const int b_row = warp_n * C::kNTiles * 8 + (lane >> 4) * 8 + (lane & 7);
  const int b_half = (lane >> 3) & 1;
  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // tile kt landed for every thread; slot (kt - 1) % kStages is free
    const int next = kt + kStages - 1;
    if (next < k_tiles) load_stage(next % kStages, next);
    cp_async_commit();
    const uint32_t As = smem_base + (kt % kStages) * kStageBytes;
    const uint32_t Bs = As + C::kBM * 128;
    // kGrouped: this lane's codes of both scale groups and their scales, per n8 tile (slot warp_n·kNTiles·8 +
    // 8·nt + lane / 4): `low` (MXFP4: group 0's word, Q: the low bits of both), `high` (MXFP4: group 1's
    // word, Q3: the third bits spread to bytes 0 and 2), factors per group.
    uint32_t code_low[C::kNTiles], code_high[C::kNTiles];
    __nv_bfloat162 factor[C::kNTiles][2];
    uint32_t group_b[C::kNTiles][4];
    if constexpr (kGrouped) {
      const unsigned char* stage = smem + (kt % kStages) * kStageBytes + C::kBM * 128;
      const int t = lane & 3;
#pragma unroll
      for (int nt = 0; nt < C::kNTiles; ++nt) {
        const int slot = warp_n * C::kNTiles * 8 + nt * 8 + (lane >> 2);
        const unsigned char* codes = stage + slot * G::kRowCodeBytes;
        const unsigned char* scales = stage + G::kCodeBytes + slot * G::kRowScaleBytes;
        if constexpr (F == RoutedFormat::kMxfp4) {
          const uint2 words = *reinterpret_cast<const uint2*>(codes + 8 * t);
          code_low[nt] = words.x;
          code_high[nt] = words.y;
          const uint32_t e = *reinterpret_cast<const uint16_t*>(scales);
          factor[nt][0] = ue8m0_multiplier(e & 0xff);
          factor[nt][1] = ue8m0_multiplier(e >> 8);
        } else {
          code_low[nt] = *reinterpret_cast<const uint32_t*>(codes + 4 * t);
          if constexpr (F == RoutedFormat::kQ3)
            code_high[nt] = __byte_perm(*reinterpret_cast<const uint16_t*>(codes + 16 + 2 * t), 0, 0x4140);
          else
            code_high[nt] = 0;
          const uint32_t pair = *reinterpret_cast<const uint32_t*>(scales);  // bf16 s of group 0, group 1
          const __nv_bfloat162 s01 = bf16x2_of(pair);
          // Q2's factor is s / 2 (exact for the normal scales grouped_kernel_scales_supported admits).
          const __nv_bfloat162 scaled = F == RoutedFormat::kQ2 ? __hmul2(s01, bf16x2_of(0x3F003F00u)) : s01;
          factor[nt][0] = __low2bfloat162(scaled);
          factor[nt][1] = __high2bfloat162(scaled);
        }
      }
    }
#pragma unroll
    for (int kk = 0; kk < C::kBK / 16; ++kk) {
      uint32_t b[C::kNTiles][2];
      if constexpr (kGrouped) {
        if (kk % 2 == 0) {
#pragma unroll
          for (int nt = 0; nt < C::kNTiles; ++nt) {
            if (kk == 0)
              decode_group<F, 0>(code_low[nt], code_high[nt], factor[nt][0], group_b[nt]);
            else if constexpr (F == RoutedFormat::kMxfp4)
              decode_group<F, 0>(code_high[nt], 0, factor[nt][1], group_b[nt]);  // group 1's own word
            else
              decode_group<F, 1>(code_low[nt], code_high[nt], factor[nt][1], group_b[nt]);
          }
        }
#pragma unroll
        for (int nt = 0; nt < C::kNTiles; ++nt) {
          b[nt][0] = group_b[nt][(kk % 2) * 2];
          b[nt][1] = group_b[nt][(kk % 2) * 2 + 1];
        }
      } else {
#pragma unroll
        for (int np = 0; np < C::kNTiles / 2; ++np) {
          uint32_t r[4];
          ldmatrix_x4(r, Bs + swizzle(b_row + np * 16, kk * 2 + b_half));
          b[2 * np][0] = r[0];
          b[2 * np][1] = r[1];
          b[2 * np + 1][0] = r[2];
          b[2 * np + 1][1] = r[3];
        }
      }
#pragma unroll
      for (int mt = 0; mt < C::kMTiles; ++mt) {
        uint32_t af[4];
        ldmatrix_x4(af, As + swizzle(a_row + mt * 16, kk * 2 + a_half));
#pragma unroll
        for (int nt = 0; nt < C::kNTiles; ++nt) mma_bf16(acc[mt][nt], af, b[nt][0], b[nt][1]);
      }
    }
  }
  cp_async_wait<0>();

  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mt = 0; mt < C::kMTiles; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = warp_m * C::kMTiles * 16 + mt * 16 + g + half * 8;
      if (r >= rows) continue;
      const int64_t out_row = row_begin + r;
      if constexpr (kGateUp) {
        auto* h = static_cast<uint16_t*>(a.out);
#pragma unroll
        for (int p = 0; p < C::kNTiles / 2; ++p) {
          const int col = blockIdx.x * (C::kBN / 2) + (warp_n * (C::kNTiles / 2) + p) * 8 + 2 * t;
          if (col >= a.N) continue;
          float g0 = acc[mt][2 * p][2 * half], u0 = acc[mt][2 * p + 1][2 * half];
          float g1 = acc[mt][2 * p][2 * half + 1], u1 = acc[mt][2 * p + 1][2 * half + 1];
          if (a.row_weight) {  // kDeepSeek: w1 / w3 return bf16 tensors
            g0 = bf16_round(g0);
            u0 = bf16_round(u0);
            g1 = bf16_round(g1);
            u1 = bf16_round(u1);
          }
          float v0 = swiglu(g0, u0, a.limit), v1 = swiglu(g1, u1, a.limit);
          if (a.row_weight) {  // kDeepSeek: the routing weight before w2, on the fp32 activation
            const float weight = a.row_weight[out_row];
            v0 = __fmul_rn(v0, weight);
            v1 = __fmul_rn(v1, weight);
          }
          const __nv_bfloat162 packed = __floats2bfloat162_rn(v0, v1);
          *reinterpret_cast<__nv_bfloat162*>(h + out_row * a.N + col) = packed;
        }
      } else {
        auto* y = static_cast<float*>(a.out);
#pragma unroll
        for (int nt = 0; nt < C::kNTiles; ++nt) {
          const int col = blockIdx.x * C::kBN + warp_n * C::kNTiles * 8 + nt * 8 + 2 * t;
          if (col >= a.N) continue;
          float2 value = make_float2(acc[mt][nt][2 * half], acc[mt][nt][2 * half + 1]);
          if (a.row_weight) value = make_float2(bf16_round(value.x), bf16_round(value.y));  // kDeepSeek: bf16 out
          *reinterpret_cast<float2*>(y + out_row * a.N + col) = value;
        }
      }
    }
}

// F ≠ kBf16: the routed experts' CTAs decode that format's tiles, the shared expert's (expert E) read bf16.
template <class C, bool kGateUp, RoutedFormat F>
__global__ void __launch_bounds__(C::kThreads, C::kMinBlocks) expert_gemm_kernel(const GemmArgs a) {
  wait_for_prior_grid();
  allow_dependents();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // bf16 mma.sync needs sm_80+; the host wrapper refuses to launch such a build
#else
  const int item = blockIdx.y;
  if (item >= *a.num_items) return;
  const int2 work = a.items[item];
  const int expert = work.x;
  const int row_begin = a.offsets[expert] + work.y * C::kBM;
  const int rows = min(C::kBM, a.offsets[expert + 1] - row_begin);
  extern __shared__ __align__(128) unsigned char dynamic_smem[];
  if constexpr (F != RoutedFormat::kBf16) {
    if (expert < a.experts) {
      gemm_tile<C, kGateUp, F>(a, expert, row_begin, rows, dynamic_smem);
      return;
    }
  }
  gemm_tile<C, kGateUp, RoutedFormat::kBf16>(a, expert, row_begin, rows, dynamic_smem);
#endif
}

// ---------------------------------------------------------------------------------------------------------------
// fp32 (exact) GEMMs: one warp per output dot product, lanes strided over k, a fixed shuffle tree.
// ---------------------------------------------------------------------------------------------------------------

struct Fp32Args {
  const float* x;
  const void* const* w13;
  const void* const* w2;
  const void* shared_w13;
  const void* shared_w2;
  const int32_t* offsets;
  const int32_t* row_token;
  const int32_t* row_expert;
  float* h;
  float* y;
  int experts, D, I;
  float limit;
};

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__global__ void gate_up_fp32_kernel(const Fp32Args a) {
  wait_for_prior_grid();
  allow_dependents();
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  const int64_t tasks = static_cast<int64_t>(a.offsets[a.experts + 1]) * a.I;
  for (int64_t task = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; task < tasks;
       task += warps) {
    const int64_t r = task / a.I, j = task % a.I;
    const int e = a.row_expert[r];
    const auto* W = static_cast<const float*>(e < a.experts ? a.w13[e] : a.shared_w13);
    const float* xr = a.x + static_cast<int64_t>(a.row_token[r]) * a.D;
    const float* wg = W + j * a.D;
    const float* wu = W + (a.I + j) * a.D;
    float g = 0.0f, u = 0.0f;
    for (int k = lane; k < a.D; k += 32) {
      g = fmaf(xr[k], wg[k], g);
      u = fmaf(xr[k], wu[k], u);
    }
    g = warp_sum(g);
    u = warp_sum(u);
    if (lane == 0) a.h[r * a.I + j] = swiglu(g, u, a.limit);
  }
}

__global__ void down_fp32_kernel(const Fp32Args a) {
  wait_for_prior_grid();
  allow_dependents();
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  const int64_t tasks = static_cast<int64_t>(a.offsets[a.experts + 1]) * a.D;
  for (int64_t task = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; task < tasks;
       task += warps) {
    const int64_t r = task / a.D, c = task % a.D;
    const int e = a.row_expert[r];
    const auto* W = static_cast<const float*>(e < a.experts ? a.w2[e] : a.shared_w2);
    const float* hr = a.h + r * a.I;
    const float* wr = W + c * a.I;
    float acc = 0.0f;
    for (int k = lane; k < a.I; k += 32) acc = fmaf(hr[k], wr[k], acc);
    acc = warp_sum(acc);
    if (lane == 0) a.y[r * a.D + c] = acc;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// 4. combine: out[t] = Σ_k w[t, k] · y[row(t, k)] (k order) + y[shared row of t] (or + addend[t], the shared
// expert's output computed by a separate kSharedOnly call; top_k 0: that call, out[t] = y[shared row of t]).
// ---------------------------------------------------------------------------------------------------------------

// grid (tokens, column blocks of 256 float4): a decode token's 4096 columns spread over 4 CTAs, and each thread
// issues its top_k + 1 row loads before the first use (one CTA walking the experts one load at a time was ~10 µs
// of dependent L2 round trips per layer). The sum is the same fmaf chain in k order as before.
constexpr int kCombineThreads = 256;
constexpr int kCombineMaxTopK = 16;

__global__ void __launch_bounds__(kCombineThreads) combine_kernel(const float* __restrict__ y,
                                                                  const int32_t* __restrict__ slot_row,
                                                                  const float* __restrict__ weights,
                                                                  const int32_t* __restrict__ offsets,
                                                                  const float* __restrict__ addend,
                                                                  float* __restrict__ out, int top_k, int experts,
                                                                  int D) {
  wait_for_prior_grid();
  allow_dependents();
  const int64_t t = blockIdx.x;
  const int D4 = D / 4;
  const auto* y4 = reinterpret_cast<const float4*>(y);
  auto* out4 = reinterpret_cast<float4*>(out);
  __shared__ int32_t rows[kCombineMaxTopK + 1];
  __shared__ float row_weights[kCombineMaxTopK];
  if (threadIdx.x < top_k) {
    rows[threadIdx.x] = slot_row[t * top_k + threadIdx.x];
    row_weights[threadIdx.x] = weights ? weights[t * top_k + threadIdx.x] : 1.0f;  // nullptr: applied already
  }
  if (threadIdx.x == 0 && !addend) rows[top_k] = offsets[experts] + static_cast<int32_t>(t);  // the shared row
  __syncthreads();
  if (threadIdx.x == 0 && !weights) {
    // kDeepSeek (weights applied already): the reference adds a token's experts in expert order, and rows are laid
    // out expert by expert, so ascending rows are that order (an insertion sort of ≤ 16; −1 slots stay skipped).
    for (int k = 1; k < top_k; ++k)
      for (int i = k; i > 0 && rows[i - 1] > rows[i]; --i) {
        const int32_t swap = rows[i];
        rows[i] = rows[i - 1];
        rows[i - 1] = swap;
      }
  }
  __syncthreads();
  for (int c = blockIdx.y * kCombineThreads + threadIdx.x; c < D4; c += gridDim.y * kCombineThreads) {
    float4 v[kCombineMaxTopK + 1];
#pragma unroll
    for (int k = 0; k <= kCombineMaxTopK; ++k) {
      if (k == top_k && addend) v[k] = reinterpret_cast<const float4*>(addend)[t * D4 + c];
      else if (k <= top_k && rows[k] >= 0) v[k] = y4[static_cast<int64_t>(rows[k]) * D4 + c];
    }
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int k = 0; k < kCombineMaxTopK; ++k) {
      if (k >= top_k || rows[k] < 0) continue;
      const float w = row_weights[k];
      acc.x = fmaf(w, v[k].x, acc.x);
      acc.y = fmaf(w, v[k].y, acc.y);
      acc.z = fmaf(w, v[k].z, acc.z);
      acc.w = fmaf(w, v[k].w, acc.w);
    }
    // The shared expert's row sits at index top_k of v: read it through the same unrolled slot.
    float4 s = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int k = 0; k <= kCombineMaxTopK; ++k)
      if (k == top_k) s = v[k];
    if (top_k == 0) {
      acc = s;  // the shared expert alone: its row as is, for a later combine to add as the fused one would
    } else {
      acc.x += s.x;
      acc.y += s.y;
      acc.z += s.z;
      acc.w += s.w;
    }
    out4[t * D4 + c] = acc;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Host side.
// ---------------------------------------------------------------------------------------------------------------

bool has_tensor_core_build() {
  static const bool ok = [] {
    cudaFuncAttributes attributes{};
    if (cudaFuncGetAttributes(&attributes, expert_gemm_kernel<SmallTiles, true, RoutedFormat::kBf16>) !=
        cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return attributes.binaryVersion >= 80;
  }();
  return ok;
}

template <class Kernel>
cudaError_t allow_smem(Kernel kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
}

template <class C, RoutedFormat F>
cudaError_t run_bf16_gemms(const MoeExpertsParams& p, GemmArgs args, const uint16_t* xb, uint16_t* h,
                           float* y, const MoeExpertWeights& w, cudaStream_t stream) {
  const int64_t items = items_bound(p, C::kBM);
  if (items > 65535) return cudaErrorInvalidValue;
  constexpr int kSmem = kernel_smem_bytes<C, F>();
  cudaError_t status = allow_smem(expert_gemm_kernel<C, true, F>, kSmem);
  if (status == cudaSuccess) status = allow_smem(expert_gemm_kernel<C, false, F>, kSmem);
  if (status != cudaSuccess) return status;
  // gemm1: x · w13ᵀ -> SwiGLU -> h
  args.a = xb;
  args.weights = w.w13;
  args.scales = w.w13_scales;
  args.shared_weight = w.shared_w13;
  args.out = h;
  args.K = static_cast<int>(p.hidden);
  args.N = static_cast<int>(p.intermediate);
  const dim3 grid1(static_cast<unsigned>((p.intermediate + C::kBN / 2 - 1) / (C::kBN / 2)),
                   static_cast<unsigned>(items));
  launch_dependent(expert_gemm_kernel<C, true, F>, grid1, C::kThreads, kSmem, stream, args);
  if ((status = cudaGetLastError()) != cudaSuccess) return status;
  if (p.deepseek) {  // w2's input quantized per 128 (the reference's act_quant), in place on the bf16 h
    Fp8SimulateParams sim;
    sim.rows = routed_rows(p) + shared_rows(p);
    sim.cols = p.intermediate;
    sim.block = kFp8Block;
    sim.bf16 = true;
    if ((status = simulate_e4m3_blocks(sim, h, stream)) != cudaSuccess) return status;
  }
  // gemm2: h · w2ᵀ -> y
  args.a = h;
  args.weights = w.w2;
  args.scales = w.w2_scales;
  args.shared_weight = w.shared_w2;
  args.out = y;
  args.K = static_cast<int>(p.intermediate);
  args.N = static_cast<int>(p.hidden);
  const dim3 grid2(static_cast<unsigned>((p.hidden + C::kBN - 1) / C::kBN), static_cast<unsigned>(items));
  launch_dependent(expert_gemm_kernel<C, false, F>, grid2, C::kThreads, kSmem, stream, args);
  return cudaGetLastError();
}

template <RoutedFormat F>
cudaError_t run_tiled_gemms(int tile_rows, const MoeExpertsParams& p, const GemmArgs& args,
                            const uint16_t* xb, uint16_t* h, float* y, const MoeExpertWeights& w,
                            cudaStream_t stream) {
  return tile_rows == 16   ? run_bf16_gemms<SmallTiles, F>(p, args, xb, h, y, w, stream)
         : tile_rows == 64 ? run_bf16_gemms<MidTiles, F>(p, args, xb, h, y, w, stream)
                           : run_bf16_gemms<LargeTiles, F>(p, args, xb, h, y, w, stream);
}

}  // namespace

namespace {
int64_t k_tiles_of(int64_t cols) { return (cols + 63) / 64; }
int row_code_bytes(int bits) { return bits == 4 ? 32 : bits == 3 ? 24 : 16; }
}  // namespace

size_t moe_kernel_code_bytes(int bits, int64_t rows, int64_t cols) {
  return static_cast<size_t>(k_tiles_of(cols) * rows * row_code_bytes(bits));
}

std::vector<uint8_t> moe_kernel_codes(int bits, int64_t rows, int64_t cols, const uint8_t* codes) {
  const int64_t tiles = k_tiles_of(cols), groups = cols / 32;
  const int row_bytes = row_code_bytes(bits);
  std::vector<uint8_t> out(moe_kernel_code_bytes(bits, rows, cols), 0);
  // One row at a time: its codes unpacked into one byte each (zero past cols), read in order as stored —
  // MXFP4 nibbles (the even input low), Q3 / Q2 little-endian bit streams of 4·bits bytes per group of 32 —
  // then scattered into each k tile's slot. Row-major reads and no per-code branches: this pass runs over
  // every routed-expert code at load (V4-Flash: 277 B). One core of the CPU machine, 4096 × 4096 random codes:
  // MXFP4 / Q3 / Q2 24.2 / 16.8 / 12.8 ms, against 32.7 / 43.9 / 46.4 ms with per-code look-ups in tile order.
  std::vector<uint8_t> row_codes(static_cast<size_t>(tiles * 64));
  for (int64_t r = 0; r < rows; ++r) {
    std::fill(row_codes.begin(), row_codes.end(), uint8_t{0});
    if (bits == 4) {
      const uint8_t* packed = codes + r * cols / 2;
      for (int64_t k = 0; k < cols; k += 2) {
        row_codes[k] = packed[k / 2] & 15u;
        row_codes[k + 1] = packed[k / 2] >> 4;
      }
    } else if (bits == 2) {
      const uint8_t* stream = codes + r * groups * 8;  // 8 bytes of 4 codes per group
      for (int64_t k = 0; k < groups * 32; k += 4) {
        const uint8_t byte = stream[k / 4];
        row_codes[k] = byte & 3u;
        row_codes[k + 1] = (byte >> 2) & 3u;
        row_codes[k + 2] = (byte >> 4) & 3u;
        row_codes[k + 3] = byte >> 6;
      }
    } else {
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* group = codes + (r * groups + g) * 12;
        for (int i = 0; i < 32; i += 8) {  // 3 bytes hold 8 codes
          const uint32_t word = group[3 * i / 8] | uint32_t{group[3 * i / 8 + 1]} << 8 |
                                uint32_t{group[3 * i / 8 + 2]} << 16;
          for (int j = 0; j < 8; ++j) row_codes[g * 32 + i + j] = static_cast<uint8_t>((word >> (3 * j)) & 7u);
        }
      }
    }
    for (int64_t tile = 0; tile < tiles; ++tile) {
      uint8_t* row = out.data() + (tile * rows + r) * row_bytes;
      const uint8_t* tile_codes = row_codes.data() + tile * 64;
      for (int t = 0; t < 4; ++t) {
        uint32_t low = 0, high = 0;
        for (int g = 0; g < 2; ++g)
          for (int i = 0; i < 4; ++i) {
            // pair i of group g = inputs 8i + 2t, + 1 (fragment register i % 2 of k16 step 2g + i / 2)
            const int k = g * 32 + 8 * i + 2 * t;
            const uint32_t lo = tile_codes[k], hi = tile_codes[k + 1];
            if (bits == 4) {
              (g == 0 ? low : high) |= lo << (12 - 4 * i) | hi << (28 - 4 * i);
            } else {
              low |= (lo & 3) << (8 * g + 2 * i) | (hi & 3) << (16 + 8 * g + 2 * i);
              high |= (lo >> 2) << (4 * g + i) | (hi >> 2) << (8 + 4 * g + i);
            }
          }
        if (bits == 4) {
          std::memcpy(row + 8 * t, &low, 4);  // little-endian, as the kernel's 32-bit loads
          std::memcpy(row + 8 * t + 4, &high, 4);
        } else {
          std::memcpy(row + 4 * t, &low, 4);
          if (bits == 3) {
            const uint16_t plane = static_cast<uint16_t>(high);
            std::memcpy(row + 16 + 2 * t, &plane, 2);
          }
        }
      }
    }
  }
  return out;
}

bool mxfp4_kernel_scales_supported(size_t count, const uint8_t* exponents) {
  for (size_t i = 0; i < count; ++i)
    if (exponents[i] > 128) return false;
  return true;
}

bool grouped_kernel_scales_supported(size_t count, const uint16_t* scales) {
  for (size_t i = 0; i < count; ++i) {
    const uint32_t exponent = (scales[i] >> 7) & 0xff;
    if (scales[i] != 0 && (exponent < 8 || exponent == 0xff)) return false;  // below 2^-119, or inf / NaN
  }
  return true;
}

namespace {
// [rows, cols / 32] scales -> [ceil(cols / 64)][rows][2], element by element (UE8M0 bytes or bf16 bits).
template <class Scale>
std::vector<uint8_t> k_tile_major_scales(int64_t rows, int64_t cols, const Scale* row_major) {
  std::vector<uint8_t> tiled(static_cast<size_t>(k_tiles_of(cols) * rows * 2) * sizeof(Scale), 0);
  const int64_t groups = cols / 32;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g)
      std::memcpy(tiled.data() + (((g / 2) * rows + r) * 2 + g % 2) * sizeof(Scale), row_major + r * groups + g,
                  sizeof(Scale));
  return tiled;
}
}  // namespace

size_t mxfp4_tile_scale_bytes(int64_t rows, int64_t cols) { return static_cast<size_t>(k_tiles_of(cols) * rows * 2); }

std::vector<uint8_t> mxfp4_tile_scales(int64_t rows, int64_t cols, const uint8_t* row_major_exponents) {
  return k_tile_major_scales(rows, cols, row_major_exponents);
}

size_t grouped_tile_scale_bytes(int64_t rows, int64_t cols) {
  return static_cast<size_t>(k_tiles_of(cols) * rows * 4);
}

std::vector<uint8_t> grouped_tile_scales(int64_t rows, int64_t cols, const uint16_t* row_major_scales) {
  return k_tile_major_scales(rows, cols, row_major_scales);
}

size_t moe_experts_workspace_bytes(const MoeExpertsParams& p) {
  if (p.tokens <= 0 || p.top_k <= 0 || p.experts <= 0) return 256;
  return layout(p).total;
}

cudaError_t moe_experts(const MoeExpertsParams& p, const MoeExpertWeights& w, const float* x,
                        const int32_t* chosen, const float* weights, float* out, void* workspace,
                        size_t workspace_bytes, cudaStream_t stream, const float* shared_out,
                        cudaEvent_t shared_ready) {
  const bool shared_only = p.shared == MoeSharedExpert::kOnly, shared_added = p.shared == MoeSharedExpert::kAdded;
  if (p.tokens < 0 || p.top_k <= 0 || p.top_k > kCombineMaxTopK || p.experts <= 0 || p.experts > kMaxExperts ||
      p.hidden <= 0 || p.intermediate <= 0 || p.hidden % 8 != 0 || p.intermediate % 8 != 0)
    return cudaErrorInvalidValue;
  if (p.tokens == 0) return cudaSuccess;
  const int64_t rows = routed_rows(p) + shared_rows(p);
  // Row indices and column counts are int32 on the device (addresses are int64).
  if (rows >= (int64_t{1} << 31) || p.hidden >= (int64_t{1} << 30) || p.intermediate >= (int64_t{1} << 30))
    return cudaErrorInvalidValue;
  if (!x || !out || !workspace) return cudaErrorInvalidValue;
  if (!shared_only && (!chosen || !weights || !w.w13 || !w.w2)) return cudaErrorInvalidValue;
  if (!shared_added && (!w.shared_w13 || !w.shared_w2)) return cudaErrorInvalidValue;
  if (shared_added != (shared_out != nullptr) || (shared_out && reinterpret_cast<uintptr_t>(shared_out) % 16))
    return cudaErrorInvalidValue;
  if (reinterpret_cast<uintptr_t>(x) % 16 || reinterpret_cast<uintptr_t>(out) % 16 ||
      reinterpret_cast<uintptr_t>(workspace) % 256)
    return cudaErrorInvalidValue;
  const Layout l = layout(p);
  if (workspace_bytes < l.total) return cudaErrorInvalidValue;
  const bool bf16 = p.dtype != MoeWeightDtype::kFp32;
  if (p.deepseek && !bf16) return cudaErrorInvalidValue;  // the recipe's roundings are the bf16 kernels'
  const bool grouped = p.dtype == MoeWeightDtype::kMxfp4 || p.dtype == MoeWeightDtype::kQ3G32 ||
                       p.dtype == MoeWeightDtype::kQ2G32;
  if (grouped && (p.hidden % 32 != 0 || p.intermediate % 32 != 0 || !w.w13_scales || !w.w2_scales))
    return cudaErrorInvalidValue;
  int tile_rows = p.tile_rows;
  if (tile_rows == 0) {
    // Measured on the H200 (docs/PERF.md "MoE experts"): 16-row tiles win while experts get few rows (V4-Flash
    // b32 / b128: 99 / 98 % of copy bandwidth against 94 / 93 % with 64), 64 once they get dozens (E 16 b128:
    // 71 % against 44 %), 128 × 128 for prefill (4096 tokens: 6.4 ms against 7.7 ms with 64).
    const double rows_per_expert = static_cast<double>(p.tokens * p.top_k) / static_cast<double>(p.experts);
    tile_rows = p.tokens > 256 ? 128 : (p.tokens <= 16 || rows_per_expert <= 8.0) ? 16 : 64;
  }
  if (tile_rows != 16 && tile_rows != 64 && tile_rows != 128) return cudaErrorInvalidValue;
  if (bf16 && !has_tensor_core_build()) return cudaErrorUnsupportedPtxVersion;

  auto* base = static_cast<unsigned char*>(workspace);
  auto* offsets = reinterpret_cast<int32_t*>(base + l.offsets);
  auto* num_items = reinterpret_cast<int32_t*>(base + l.num_items);
  auto* items = reinterpret_cast<int2*>(base + l.items);
  auto* row_token = reinterpret_cast<int32_t*>(base + l.row_token);
  auto* row_expert = reinterpret_cast<int32_t*>(base + l.row_expert);
  auto* slot_row = reinterpret_cast<int32_t*>(base + l.slot_row);
  auto* xb = bf16 ? reinterpret_cast<uint16_t*>(base + l.xb) : nullptr;
  void* h = base + l.h;
  auto* y = reinterpret_cast<float*>(base + l.y);

  auto* row_weight = p.deepseek ? reinterpret_cast<float*>(base + l.row_weight) : nullptr;
  PrepArgs prep{chosen,    x,          xb,
                offsets,   num_items,  items,
                row_token, row_expert, slot_row,
                weights,   row_weight,
                static_cast<int>(p.tokens), shared_only ? 0 : static_cast<int>(p.top_k), static_cast<int>(p.experts),
                bf16 ? tile_rows : 16, shared_added ? 0 : 1, p.tokens * p.hidden};
  const size_t prep_smem = static_cast<size_t>(35 * p.experts + 3) * 4;
  cudaError_t status = allow_smem(moe_prep_kernel, prep_smem);
  if (status != cudaSuccess) return status;
  const int64_t convert_blocks =
      bf16 ? std::min<int64_t>(kPrepConvertBlocks, (p.tokens * p.hidden / 4 + kPrepThreads - 1) / kPrepThreads) : 0;
  launch_dependent(moe_prep_kernel, static_cast<unsigned>(1 + convert_blocks), kPrepThreads, prep_smem,
                   stream, prep);
  if ((status = cudaGetLastError()) != cudaSuccess) return status;

  if (bf16) {
    GemmArgs args{};
    args.row_token = row_token;
    args.offsets = offsets;
    args.items = items;
    args.num_items = num_items;
    args.experts = static_cast<int>(p.experts);
    args.limit = p.swiglu_limit;
    args.row_weight = row_weight;
    auto* hb = static_cast<uint16_t*>(h);
    switch (p.dtype) {
      case MoeWeightDtype::kMxfp4:
        status = run_tiled_gemms<RoutedFormat::kMxfp4>(tile_rows, p, args, xb, hb, y, w, stream);
        break;
      case MoeWeightDtype::kQ3G32:
        status = run_tiled_gemms<RoutedFormat::kQ3>(tile_rows, p, args, xb, hb, y, w, stream);
        break;
      case MoeWeightDtype::kQ2G32:
        status = run_tiled_gemms<RoutedFormat::kQ2>(tile_rows, p, args, xb, hb, y, w, stream);
        break;
      default:
        status = run_tiled_gemms<RoutedFormat::kBf16>(tile_rows, p, args, xb, hb, y, w, stream);
    }
    if (status != cudaSuccess) return status;
  } else {
    Fp32Args args{x,        w.w13,     w.w2,       w.shared_w13,          w.shared_w2,
                  offsets,  row_token, row_expert, static_cast<float*>(h), y,
                  static_cast<int>(p.experts), static_cast<int>(p.hidden), static_cast<int>(p.intermediate),
                  p.swiglu_limit};
    constexpr int kThreads = 256;
    const auto blocks = [&](int64_t tasks) {
      return static_cast<unsigned>(std::clamp<int64_t>((tasks + kThreads / 32 - 1) / (kThreads / 32), 1, 16384));
    };
    launch_dependent(gate_up_fp32_kernel, blocks(rows * p.intermediate), kThreads, 0, stream, args);
    if ((status = cudaGetLastError()) != cudaSuccess) return status;
    launch_dependent(down_fp32_kernel, blocks(rows * p.hidden), kThreads, 0, stream, args);
    if ((status = cudaGetLastError()) != cudaSuccess) return status;
  }
  const int64_t column_blocks = (p.hidden / 4 + kCombineThreads - 1) / kCombineThreads;
  // The shared expert's output, computed on another stream, is waited for here only: its GEMMs overlap every
  // kernel of this call but the combine.
  if (shared_ready && (status = cudaStreamWaitEvent(stream, shared_ready, 0)) != cudaSuccess) return status;
  launch_dependent(
      combine_kernel,
      dim3(static_cast<unsigned>(p.tokens), static_cast<unsigned>(std::min<int64_t>(column_blocks, 64))),
      kCombineThreads, 0, stream, y, slot_row, p.deepseek ? nullptr : weights, offsets, shared_out, out,
      shared_only ? 0 : static_cast<int>(p.top_k), static_cast<int>(p.experts), static_cast<int>(p.hidden));
  return cudaGetLastError();
}

}  // namespace dsv4::ops::cuda
