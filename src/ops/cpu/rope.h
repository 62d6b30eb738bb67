// Interleaved partial RoPE (docs/MODEL.md "Notation"): the trailing `rope_dim` channels of each head rotate in
// pairs (2i, 2i+1) by angle pos · inv_freq[i]; the leading channels are untouched. Matches transformers
// `apply_rotary_pos_emb` of modeling_deepseek_v4 (cos/sin from fp32 inv_freq · pos, times attention_scaling).
#pragma once
#include <cstdint>
#include <vector>

namespace dsv4::ops::cpu {

struct RopeTable {
  std::vector<float> inv_freq;  // [rope_dim / 2]
  float attention_scaling = 1.0f;
  int64_t rope_dim() const { return static_cast<int64_t>(inv_freq.size()) * 2; }
};

// x [rows, heads, head_dim] with row stride `row_stride`; row r rotates at positions[r]. `inverse` rotates
// by −angle (the attention output's de-rotation, HF: apply_rotary_pos_emb(o, cos, −sin)).
void apply_rope(float* x, int64_t rows, int64_t row_stride, int64_t heads, int64_t head_dim,
                const int64_t* positions, const RopeTable& table, bool inverse = false);

}  // namespace dsv4::ops::cpu
