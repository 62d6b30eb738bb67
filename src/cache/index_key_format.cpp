#include "cache/index_key_format.h"

#include <algorithm>
#include <cmath>

#include "core/dtype.h"

namespace dsv4 {

void write_index_keys_cpu(const IndexKeyPagedLayout& layout, const uint16_t* keys_bf16, const int64_t* slots,
                          int64_t count, std::byte* pool) {
  const int64_t d = layout.head_dim;
  for (int64_t i = 0; i < count; ++i) {
    const uint16_t* key = keys_bf16 + i * d;
    const auto block = static_cast<int32_t>(slots[i] / layout.entries_per_block);
    const auto e = static_cast<int32_t>(slots[i] % layout.entries_per_block);
    std::byte* values = pool + layout.value_offset(block, e);
    if (layout.dtype == IndexKeyDtype::kBf16) {
      std::memcpy(values, key, static_cast<size_t>(2 * d));
      continue;
    }
    float amax = 0;
    for (int64_t c = 0; c < d; ++c) amax = std::max(amax, std::fabs(bf16_to_f32(key[c])));
    const float scale = index_key_fp8_scale(amax);
    const float inverse = 1.0f / scale;  // exact: scale is a power of two
    for (int64_t c = 0; c < d; ++c) {
      const float v = std::clamp(bf16_to_f32(key[c]) * inverse, -kIndexKeyFp8Max, kIndexKeyFp8Max);
      values[c] = static_cast<std::byte>(f32_to_e4m3_rne(v));
    }
    std::memcpy(pool + layout.scale_offset(block, e), &scale, 4);
  }
}

void read_index_key_cpu(const IndexKeyPagedLayout& layout, const std::byte* pool, int32_t block_id, int32_t e,
                        float* out) {
  const std::byte* values = pool + layout.value_offset(block_id, e);
  if (layout.dtype == IndexKeyDtype::kBf16) {
    for (int32_t c = 0; c < layout.head_dim; ++c) {
      uint16_t bits;
      std::memcpy(&bits, values + 2 * c, 2);
      out[c] = bf16_to_f32(bits);
    }
    return;
  }
  float scale;
  std::memcpy(&scale, pool + layout.scale_offset(block_id, e), 4);
  for (int32_t c = 0; c < layout.head_dim; ++c) out[c] = f8e4m3_to_f32(static_cast<uint8_t>(values[c])) * scale;
}

}  // namespace dsv4
