// The main K=V entry formats of the paged cache as the device kernels read and write them (docs/cache.md,
// docs/kernels/attention.md), and the quantizer of docs/research/model_spec.md §3.3.
//
// One entry is the 512-channel shared K=V vector of one token (raw window) or one compressed window; its last 64
// channels carry RoPE. Two storage formats:
//   kBf16  512 bf16 = 1024 B per entry.
//   kFp8   FlashMLA's MODEL1 layout, 584 B per entry: 448 e4m3 no-rope channels, 64 bf16 rope channels
//          (576 data bytes), then 8 scale bytes: one UE8M0 exponent per 64 no-rope channels (7) and one zero pad.
// A physical block of a group holds `entries_per_block` entries of every layer of the group, layer-major
// (engine/paged_sequence_state.cpp); one layer's run of entries is a *region*. Inside an FP8 region all entries'
// 576-byte data come first, then all entries' 8-byte scale groups, and the region is padded up to a multiple of
// 576 B (FlashMLA's page rule), which keeps every data row and every region 16-byte aligned for vector loads.
//
// The quantizer (the reference's act_quant(kv[..., :448], block 64, ue8m0), model_spec.md §3.3): per block of 64
// no-rope channels, scale s = 2^ceil(log2(max(amax, 1e-4) / 448)), q = e4m3_rne(clamp(x / s, ±448)); the stored
// value is q·s, exactly representable in bf16, so a BF16 cache holding fake-quantized values and the FP8 cache
// give bit-identical keys. The rope channels are stored bf16 unchanged.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cache/index_key_format.h"
#include "core/dtype.h"

#include "core/host_device.h"

namespace dsv4 {

enum class KvEntryFormat : int32_t { kBf16 = 0, kFp8 = 1 };

inline constexpr int kKvHeadDim = 512;
inline constexpr int kKvRopeDim = 64;
inline constexpr int kKvNopeDim = kKvHeadDim - kKvRopeDim;  // 448
inline constexpr int kKvScaleBlock = 64;                    // no-rope channels per UE8M0 scale
inline constexpr int kKvNumScales = kKvNopeDim / kKvScaleBlock;  // 7
inline constexpr int kKvBf16EntryBytes = 2 * kKvHeadDim;          // 1024
inline constexpr int kKvFp8DataBytes = kKvNopeDim + 2 * kKvRopeDim;  // 576
inline constexpr int kKvFp8ScaleBytes = 8;                            // 7 scales + 1 pad
inline constexpr int kKvFp8EntryBytes = kKvFp8DataBytes + kKvFp8ScaleBytes;  // 584
inline constexpr int kKvFp8RegionAlign = 576;
inline constexpr float kE4m3Max = 448.0f;

// Bytes one entry occupies (without region padding).
DSV4_HOST_DEVICE constexpr int64_t kv_entry_bytes(KvEntryFormat format) {
  return format == KvEntryFormat::kFp8 ? kKvFp8EntryBytes : kKvBf16EntryBytes;
}
// Bytes of one layer's region of `entries` entries: BF16 entries·1024; FP8 entries·584 rounded up to 576.
DSV4_HOST_DEVICE constexpr int64_t kv_region_bytes(KvEntryFormat format, int64_t entries) {
  if (format == KvEntryFormat::kBf16) return entries * kKvBf16EntryBytes;
  return (entries * kKvFp8EntryBytes + kKvFp8RegionAlign - 1) / kKvFp8RegionAlign * kKvFp8RegionAlign;
}

// A group's view of the KV arena for one layer, with the block tables of the rows (requests) that use it.
// A block's bytes start at page·page_bytes + slot·block_bytes (cache/block_pool.h); the layer's region starts
// `region_offset` bytes into the block (layer index in the group · kv_region_bytes(format, entries_per_block)).
struct PagedKvPool {
  uint8_t* arena = nullptr;
  int64_t page_bytes = 0;
  int64_t blocks_per_page = 1;
  int64_t block_bytes = 0;
  int64_t region_offset = 0;
  int32_t entries_per_block = 0;
  const int32_t* block_table = nullptr;  // [rows, block_table_stride]: logical block -> block id, < 0 = none
  int64_t block_table_stride = 0;
};

// Addresses of one entry: `data` (BF16: 1024 B; FP8: 576 B of e4m3 + bf16 rope) and, for FP8, its 8 scale bytes.
struct KvEntryAddress {
  uint8_t* data = nullptr;
  uint8_t* scales = nullptr;
};

// Entry `entry` (logical index in the row's history or window) of table row `row`; data == nullptr when its
// block is not allocated.
DSV4_HOST_DEVICE inline KvEntryAddress kv_entry_address(const PagedKvPool& pool, KvEntryFormat format, int64_t row,
                                                        int64_t entry) {
  KvEntryAddress address;
  const int32_t block = pool.block_table[row * pool.block_table_stride + entry / pool.entries_per_block];
  if (block < 0) return address;
  const int64_t offset = entry % pool.entries_per_block;
  uint8_t* region = pool.arena + (block / pool.blocks_per_page) * pool.page_bytes +
                    (block % pool.blocks_per_page) * pool.block_bytes + pool.region_offset;
  if (format == KvEntryFormat::kBf16) {
    address.data = region + offset * kKvBf16EntryBytes;
  } else {
    address.data = region + offset * kKvFp8DataBytes;
    address.scales = region + int64_t{pool.entries_per_block} * kKvFp8DataBytes + offset * kKvFp8ScaleBytes;
  }
  return address;
}

// UE8M0 byte of the power-of-two scale 2^ceil(log2(max(amax, 1e-4) / 448)): ceil_log2(v) = exponent(v) − 127 +
// (mantissa(v) != 0) on v's fp32 bits, as the reference's fast_log2_ceil.
inline uint8_t kv_scale_byte(float amax) {
  const float ratio = std::max(amax, 1e-4f) / kE4m3Max;
  uint32_t bits;
  std::memcpy(&bits, &ratio, sizeof bits);
  const int exponent = static_cast<int>((bits >> 23) & 0xffu) - 127 + ((bits & 0x7fffffu) != 0 ? 1 : 0);
  return static_cast<uint8_t>(exponent + 127);
}

// f32_to_e4m3_rne (OCP E4M3 as torch.float8_e4m3fn, round to nearest even, saturating at ±448) is
// cache/index_key_format.h's, shared by both cache formats.

// One entry from 512 bf16 channels (already normed and rotated). FP8: the quantizer above; BF16: the channels as
// given, or their quantize-dequantize image when `fake_quantize_nope` (the reference's QAT simulation).
inline void kv_quantize_entry(KvEntryFormat format, const uint16_t* kv, KvEntryAddress out, bool fake_quantize_nope) {
  if (format == KvEntryFormat::kBf16 && !fake_quantize_nope) {
    std::memcpy(out.data, kv, kKvBf16EntryBytes);
    return;
  }
  uint16_t* bf16_out = reinterpret_cast<uint16_t*>(out.data);
  for (int b = 0; b < kKvNumScales; ++b) {
    float amax = 0.0f;
    for (int i = 0; i < kKvScaleBlock; ++i) amax = std::max(amax, std::fabs(bf16_to_f32(kv[b * kKvScaleBlock + i])));
    const uint8_t scale_byte = kv_scale_byte(amax);
    const int scale_exponent = static_cast<int>(scale_byte) - 127;
    for (int i = 0; i < kKvScaleBlock; ++i) {
      const int c = b * kKvScaleBlock + i;
      const float scaled = std::clamp(std::ldexp(bf16_to_f32(kv[c]), -scale_exponent), -kE4m3Max, kE4m3Max);
      const uint8_t code = f32_to_e4m3_rne(scaled);
      if (format == KvEntryFormat::kFp8) {
        out.data[c] = code;
      } else {
        bf16_out[c] = f32_to_bf16(std::ldexp(f8e4m3_to_f32(code), scale_exponent));
      }
    }
    if (format == KvEntryFormat::kFp8) out.scales[b] = scale_byte;
  }
  if (format == KvEntryFormat::kFp8) {
    out.scales[kKvNumScales] = 0;
    std::memcpy(out.data + kKvNopeDim, kv + kKvNopeDim, 2 * kKvRopeDim);
  } else {
    std::memcpy(bf16_out + kKvNopeDim, kv + kKvNopeDim, 2 * kKvRopeDim);
  }
}

// The 512 channels of a stored entry in fp32 (exact: every stored value is a bf16 or an e4m3 times 2^k).
inline void kv_dequantize_entry(KvEntryFormat format, KvEntryAddress entry, float* out) {
  if (format == KvEntryFormat::kBf16) {
    const uint16_t* values = reinterpret_cast<const uint16_t*>(entry.data);
    for (int c = 0; c < kKvHeadDim; ++c) out[c] = bf16_to_f32(values[c]);
    return;
  }
  for (int c = 0; c < kKvNopeDim; ++c)
    out[c] = std::ldexp(f8e4m3_to_f32(entry.data[c]), static_cast<int>(entry.scales[c / kKvScaleBlock]) - 127);
  uint16_t rope[kKvRopeDim];
  std::memcpy(rope, entry.data + kKvNopeDim, sizeof rope);
  for (int c = 0; c < kKvRopeDim; ++c) out[kKvNopeDim + c] = bf16_to_f32(rope[c]);
}

// Writes `tokens` K=V vectors into the pool: vector i becomes entry entry_indices[i] of table row rows[i]
// (rows == nullptr: row i). The CPU twin of the CUDA writer (cache/kv_entry_format_cuda.h).
struct KvWriteParams {
  int64_t tokens = 0;
  KvEntryFormat format = KvEntryFormat::kFp8;
  bool fake_quantize_nope = true;  // BF16 only: store the quantize-dequantize image (bit-exact to the reference)
  PagedKvPool pool;
  const int32_t* entry_indices = nullptr;  // [tokens]
  const int32_t* rows = nullptr;           // [tokens] or nullptr
  // The raw window's writer (entries indexed by position): with row_end set ([rows], the position after each
  // row's chunk), a vector whose entry index is below row_end[row] − window_size is not written — no later query
  // reads it, and the manager may not hold its block.
  const int32_t* row_end = nullptr;
  int64_t window_size = 0;
};

// Whether vector i of a KvWriteParams is written at all (the window rule above).
DSV4_HOST_DEVICE inline bool kv_write_wanted(const KvWriteParams& p, int64_t row, int64_t entry) {
  return p.row_end == nullptr || entry >= p.row_end[row] - p.window_size;
}

inline void write_kv_entries(const KvWriteParams& p, const uint16_t* kv) {
  for (int64_t i = 0; i < p.tokens; ++i) {
    const int64_t row = p.rows ? p.rows[i] : i;
    if (!kv_write_wanted(p, row, p.entry_indices[i])) continue;
    const KvEntryAddress address = kv_entry_address(p.pool, p.format, row, p.entry_indices[i]);
    if (address.data) kv_quantize_entry(p.format, kv + i * kKvHeadDim, address, p.fake_quantize_nope);
  }
}

}  // namespace dsv4
