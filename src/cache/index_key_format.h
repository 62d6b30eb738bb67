// The lightning-indexer key entries of the c4_index cache group as the device stores them (docs/cache.md,
// docs/kernels/indexer_topk.md), and where one entry lives in the paged pool.
//
// A physical block of the group holds `entries_per_block` entries of every layer of the group, layer after layer
// (the group's layer order). Inside one layer's run of entries:
//   kBf16: entries_per_block × head_dim bf16, entry after entry (2·head_dim bytes each);
//   kFp8:  entries_per_block × head_dim e4m3 values, entry after entry, then entries_per_block fp32 scales
//          (head_dim + 4 bytes per entry: 132 B for head_dim 128, DeepGEMM's fp8_paged_mqa_logits layout). The
//          values of every entry start 16-byte aligned, so a kernel reads an entry with wide loads.
// The quantizer is model_spec.md §3.3's act_quant with one block over the whole key: scale =
// 2^ceil(log2(max(amax, 1e-4) / 448)), value = e4m3_rne(clamp(x / scale, ±448)); dequantized x = value · scale.
//
// This header is shared by C++20 host code and the C++17 CUDA sources: it depends on nothing else.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "core/host_device.h"

namespace dsv4 {

enum class IndexKeyDtype : int32_t { kBf16, kFp8 };

inline constexpr float kIndexKeyFp8Max = 448.0f;       // largest finite e4m3 value
inline constexpr float kIndexKeyAmaxFloor = 1e-4f;     // act_quant's floor on the block amax (§3.3)

// Bytes of one entry (one layer, one compressed position).
DSV4_HOST_DEVICE inline int64_t index_key_entry_bytes(IndexKeyDtype dtype, int64_t head_dim) {
  return dtype == IndexKeyDtype::kFp8 ? head_dim + 4 : 2 * head_dim;
}

// Addressing of one layer's index keys in the pool: block ids are global, id = page · max_blocks_per_page + slot,
// and a block starts at page · page_bytes + slot · block_bytes (cache/block_pool.h).
struct IndexKeyPagedLayout {
  IndexKeyDtype dtype = IndexKeyDtype::kFp8;
  int32_t head_dim = 128;
  int32_t entries_per_block = 64;
  int32_t layer_slot = 0;          // this layer's position among the group's layers
  int64_t block_bytes = 0;         // whole block: entry_bytes · entries_per_block · layers of the group
  int64_t page_bytes = 0;
  int64_t max_blocks_per_page = 1;

  DSV4_HOST_DEVICE int64_t entry_bytes() const { return index_key_entry_bytes(dtype, head_dim); }
  // Start of this layer's run of entries inside block `block_id`.
  DSV4_HOST_DEVICE int64_t run_offset(int32_t block_id) const {
    const int64_t page = block_id / max_blocks_per_page, slot = block_id % max_blocks_per_page;
    return page * page_bytes + slot * block_bytes + static_cast<int64_t>(layer_slot) * entries_per_block * entry_bytes();
  }
  // Byte offsets of entry `e` (0 ≤ e < entries_per_block) of the run: its values and (FP8) its scale.
  DSV4_HOST_DEVICE int64_t value_offset(int32_t block_id, int32_t e) const {
    return run_offset(block_id) + static_cast<int64_t>(e) * (dtype == IndexKeyDtype::kFp8 ? head_dim : 2 * head_dim);
  }
  DSV4_HOST_DEVICE int64_t scale_offset(int32_t block_id, int32_t e) const {
    return run_offset(block_id) + static_cast<int64_t>(entries_per_block) * head_dim + 4 * static_cast<int64_t>(e);
  }
};

// float -> e4m3 (OCP FN, finite only) with round-to-nearest-even after saturating to ±448, as
// __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3) and torch's .to(float8_e4m3fn) on clamped input.
DSV4_HOST_DEVICE inline uint8_t f32_to_e4m3_rne(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return static_cast<uint8_t>(sign | 0x7f);  // NaN stays NaN
  if (magnitude >= 0x43e00000u) return static_cast<uint8_t>(sign | 0x7e);  // ≥ 448 (and inf) saturate
  if (magnitude < 0x3c800000u) {
    // Below 2^-6, the smallest normal: subnormals are multiples of 2^-9, so round |x| · 2^9 to an integer (RNE).
    float scaled;
    uint32_t abs_bits = magnitude;
    std::memcpy(&scaled, &abs_bits, 4);
    scaled *= 512.0f;  // exact: a power of two, no overflow
    // Round to nearest even by hand (no rint in device-neutral code).
    const uint32_t whole = static_cast<uint32_t>(scaled);
    const float fraction = scaled - static_cast<float>(whole);
    uint32_t rounded = whole + ((fraction > 0.5f || (fraction == 0.5f && (whole & 1u))) ? 1u : 0u);
    return static_cast<uint8_t>(sign | rounded);  // rounded == 8 is 2^-6, the smallest normal's encoding
  }
  // Normal: keep 3 mantissa bits, round the 20 dropped bits to nearest even, then rebias 127 -> 7.
  const uint32_t dropped = magnitude & 0xfffffu;
  uint32_t kept = magnitude >> 20;  // exponent(8) | mantissa(3)
  if (dropped > 0x80000u || (dropped == 0x80000u && (kept & 1u))) ++kept;
  const uint32_t encoded = kept - (120u << 3);
  return static_cast<uint8_t>(sign | (encoded > 0x7eu ? 0x7eu : encoded));
}

// The act_quant scale of one key: 2^ceil(log2(max(amax, 1e-4) / 448)), computed on the bits as the reference's
// fast_log2_ceil does (exponent − 127 + (mantissa ≠ 0)).
DSV4_HOST_DEVICE inline float index_key_fp8_scale(float amax) {
  const float ratio = (amax > kIndexKeyAmaxFloor ? amax : kIndexKeyAmaxFloor) / kIndexKeyFp8Max;
  uint32_t bits;
  std::memcpy(&bits, &ratio, 4);
  const int32_t exponent = static_cast<int32_t>((bits >> 23) & 0xffu) - 127 + ((bits & 0x7fffffu) != 0 ? 1 : 0);
  const uint32_t scale_bits = static_cast<uint32_t>(exponent + 127) << 23;
  float scale;
  std::memcpy(&scale, &scale_bits, 4);
  return scale;
}

// Host reference of the writer kernel: quantize (FP8) or copy (BF16) `count` keys, given as bf16 bits
// [count, head_dim], into the pool at the global entry slots `slots[i]` = block_id · entries_per_block + e.
void write_index_keys_cpu(const IndexKeyPagedLayout& layout, const uint16_t* keys_bf16, const int64_t* slots,
                          int64_t count, std::byte* pool);
// Reads entry `e` of block `block_id` back as fp32 (value · scale for FP8).
void read_index_key_cpu(const IndexKeyPagedLayout& layout, const std::byte* pool, int32_t block_id, int32_t e,
                        float* out);

}  // namespace dsv4
