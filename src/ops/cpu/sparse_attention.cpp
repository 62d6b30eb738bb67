#include "ops/cpu/sparse_attention.h"

#include <algorithm>
#include <vector>

#include "core/dtype.h"
#include "ops/cpu/attention.h"
#include "ops/cpu/rope.h"

namespace dsv4::ops::cpu {

void sparse_attention(const SparseAttentionParams& p, const uint16_t* q, uint16_t* out) {
  const int64_t H = p.heads, d = kKvHeadDim;
  RopeTable rope;
  rope.inv_freq.assign(p.rope_inv_freq, p.rope_inv_freq + kKvRopeDim / 2);
  rope.attention_scaling = p.rope_attention_scaling;
  const SinkAttentionParams ap{H, d, p.scale};
  std::vector<float> query(static_cast<size_t>(H * d)), attended(static_cast<size_t>(H * d)), key_values;
  std::vector<const float*> keys;
  for (int64_t i = 0; i < p.tokens; ++i) {
    const int64_t row = p.rows ? p.rows[i] : i, position = p.positions[i];
    std::vector<KvEntryAddress> addresses;
    for (int64_t pos = std::max<int64_t>(0, position - p.window_size + 1); pos <= position; ++pos)
      addresses.push_back(p.chunk_starts && pos >= p.chunk_starts[i]
                              ? kv_entry_address(p.chunk, p.format, row, pos - p.chunk_starts[i])
                              : kv_entry_address(p.window, p.format, row, pos));
    const int64_t selected = p.compressed_lengths ? p.compressed_lengths[i] : 0;
    for (int64_t k = 0; k < selected; ++k) {
      const int32_t entry = p.compressed_indices[i * p.compressed_stride + k];
      if (entry >= 0) addresses.push_back(kv_entry_address(p.compressed, p.format, row, entry));
    }
    key_values.resize(addresses.size() * d);
    keys.clear();
    for (size_t k = 0; k < addresses.size(); ++k) {
      if (addresses[k].data == nullptr) continue;  // an unallocated block holds no key
      kv_dequantize_entry(p.format, addresses[k], &key_values[k * d]);
      keys.push_back(&key_values[k * d]);
    }
    for (int64_t c = 0; c < H * d; ++c) query[c] = bf16_to_f32(q[i * H * d + c]);
    sink_attention(ap, query.data(), keys.data(), static_cast<int64_t>(keys.size()), p.sinks, attended.data());
    const int64_t position64 = position;
    apply_rope(attended.data(), 1, H * d, H, d, &position64, rope, /*inverse=*/true);
    for (int64_t c = 0; c < H * d; ++c) out[i * H * d + c] = f32_to_bf16(attended[c]);
  }
}

}  // namespace dsv4::ops::cpu
