// The softmax-gated token compressor of CSA/HCA layers and of the lightning indexer (docs/MODEL.md
// "Compressors"; transformers DeepseekV4{HCA,CSA}Compressor / DeepseekV4Indexer), in streaming form: tokens
// enter one at a time into a bounded state and an entry is emitted whenever a window of `ratio` tokens closes,
// so any split of a sequence into chunks produces the same entries.
//
// State layout (per sequence and compressor, fp32, the layout of DeepSeek's reference `kv_state/score_state`):
//   kv_state, gate_state: [state_slots, width] with width = coff·head_dim, state_slots = coff·ratio,
//   coff = 2 when overlapping (CSA), else 1. Gates are stored with the position bias (`ape`) already added.
//   Overlap: slots [0, ratio) hold the previous complete window, slots [ratio, 2·ratio) the current one.
// Entry w (tokens [w·ratio, (w+1)·ratio)) pools per channel c with one softmax over
//   non-overlap: the window's tokens at channel c;
//   overlap: the previous window's tokens at channel c (the "a" half; absent for w = 0) and the window's
//            tokens at channel head_dim + c (the "b" half).
#pragma once
#include <cstdint>

#include "ops/cpu/rope.h"

namespace dsv4::ops::cpu {

struct CompressorParams {
  int64_t ratio = 4;
  int64_t head_dim = 0;  // entry width d
  bool overlap = false;
  int64_t coff() const { return overlap ? 2 : 1; }
  int64_t width() const { return coff() * head_dim; }
  int64_t state_slots() const { return coff() * ratio; }
};

// Adds the token at `position` (its projections kv [width] and gate [width]; ape [ratio, width]) to the state.
// If it closes a window, writes the pooled (un-normalised, un-rotated) entry [head_dim] to `entry` and returns
// true; the entry's index is position / ratio.
bool compressor_append(const CompressorParams& p, float* kv_state, float* gate_state, const float* kv,
                       const float* gate, const float* ape, int64_t position, float* entry);

// Numerics::kDeepSeek's finishing of a pooled entry [head_dim] in place (model.py Compressor.forward; research
// model_spec.md §7.1, §3.3, §3.5; docs/numerics.md): bf16, RMSNorm with `norm_weight`, bf16, RoPE at the window's
// first position `entry_position`, bf16; then a main entry's non-rope channels through e4m3 per 64 (the FP8
// cache's simulation), or an index key through the Hadamard rotation (scale head_dim^-1/2, evaluated in double)
// and FP4 per 32 between bf16 roundings; bf16 last. The twin of the device compressor's kBf16DeepSeekMain /
// kBf16DeepSeekIndex formats (ops/cuda/compressor.h).
void finish_entry_deepseek(float* entry, int64_t head_dim, const float* norm_weight, float eps,
                           int64_t entry_position, const RopeTable& rope, bool index_key);

}  // namespace dsv4::ops::cpu
