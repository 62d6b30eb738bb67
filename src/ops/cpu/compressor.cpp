#include "ops/cpu/compressor.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "ops/cpu/norm.h"
#include "ops/cpu/quantize.h"

namespace dsv4::ops::cpu {

bool compressor_append(const CompressorParams& p, float* kv_state, float* gate_state, const float* kv,
                       const float* gate, const float* ape, int64_t position, float* entry) {
  const int64_t m = p.ratio, d = p.head_dim, width = p.width();
  const int64_t in_window = position % m;
  const int64_t slot = (p.overlap ? m : 0) + in_window;
  std::memcpy(kv_state + slot * width, kv, static_cast<size_t>(width) * sizeof(float));
  for (int64_t c = 0; c < width; ++c) gate_state[slot * width + c] = gate[c] + ape[in_window * width + c];
  if (in_window != m - 1) return false;

  const int64_t window = position / m;
  // Slots that take part, and the channel offset each reads: overlap reads the previous window's "a" half
  // (channels [0, d)) in slots [0, m) and this window's "b" half (channels [d, 2d)) in slots [m, 2m).
  const int64_t first_slot = p.overlap && window == 0 ? m : 0;
  const int64_t last_slot = p.overlap ? 2 * m : m;
  for (int64_t c = 0; c < d; ++c) {
    auto channel = [&](int64_t s) { return s * width + c + (p.overlap && s >= m ? d : 0); };
    float max_gate = -INFINITY;
    for (int64_t s = first_slot; s < last_slot; ++s) max_gate = std::max(max_gate, gate_state[channel(s)]);
    float denominator = 0, pooled = 0;
    for (int64_t s = first_slot; s < last_slot; ++s) denominator += std::exp(gate_state[channel(s)] - max_gate);
    for (int64_t s = first_slot; s < last_slot; ++s)
      pooled += kv_state[channel(s)] * (std::exp(gate_state[channel(s)] - max_gate) / denominator);
    entry[c] = pooled;
  }
  if (p.overlap) {  // this window becomes the previous one
    std::memcpy(kv_state, kv_state + m * width, static_cast<size_t>(m * width) * sizeof(float));
    std::memcpy(gate_state, gate_state + m * width, static_cast<size_t>(m * width) * sizeof(float));
  }
  return true;
}

void finish_entry_deepseek(float* entry, int64_t head_dim, const float* norm_weight, float eps,
                           int64_t entry_position, const RopeTable& rope, bool index_key) {
  round_to_bf16(entry, head_dim);  // kv.to(bf16) before the norm (§7.1)
  rms_norm(entry, 1, head_dim, head_dim, norm_weight, eps, entry);
  round_to_bf16(entry, head_dim);
  apply_rope(entry, 1, head_dim, 1, head_dim, &entry_position, rope);
  round_to_bf16(entry, head_dim);
  if (!index_key) {
    quantize_e4m3_blocks(entry, head_dim - rope.rope_dim(), 64);  // FP8 simulation, one UE8M0 scale per 64 (§3.3)
  } else {
    // rotate_activation's scale n ** -0.5 (a Python float, double, applied to an fp32 tensor), FP4 per 32 (§3.5, §8).
    hadamard_fp4(entry, head_dim, static_cast<float>(std::pow(static_cast<double>(head_dim), -0.5)), 32);
  }
  round_to_bf16(entry, head_dim);
}

}  // namespace dsv4::ops::cpu
