#include "ops/cpu/rope.h"

#include <cmath>

namespace dsv4::ops::cpu {

void apply_rope(float* x, int64_t rows, int64_t row_stride, int64_t heads, int64_t head_dim,
                const int64_t* positions, const RopeTable& table, bool inverse) {
  const int64_t pairs = static_cast<int64_t>(table.inv_freq.size());
  const int64_t offset = head_dim - 2 * pairs;
  std::vector<float> cos_table(static_cast<size_t>(pairs)), sin_table(static_cast<size_t>(pairs));
  for (int64_t r = 0; r < rows; ++r) {
    const float position = static_cast<float>(positions[r]);
    for (int64_t i = 0; i < pairs; ++i) {
      const float angle = table.inv_freq[i] * position;  // fp32 product, as torch's inv_freq @ position_ids
      cos_table[i] = std::cos(angle) * table.attention_scaling;
      sin_table[i] = std::sin(angle) * table.attention_scaling * (inverse ? -1.0f : 1.0f);
    }
    for (int64_t h = 0; h < heads; ++h) {
      float* rope = x + r * row_stride + h * head_dim + offset;
      for (int64_t i = 0; i < pairs; ++i) {
        const float a = rope[2 * i], b = rope[2 * i + 1];
        rope[2 * i] = a * cos_table[i] - b * sin_table[i];
        rope[2 * i + 1] = b * cos_table[i] + a * sin_table[i];
      }
    }
  }
}

}  // namespace dsv4::ops::cpu
